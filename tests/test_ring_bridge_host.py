"""A bridged ring's bridge line played by a rank (client/ringbridge.py), without a fabric.

Two nodes of a group [0 | 1], one rank each, on loopback: the real ``BridgeHost`` of node 0
against node 1 played either by another ``BridgeHost`` or by the test itself on the raw
connection, so that node 1 can send what a broken or hostile peer would.  Results are checked
against NumPy; every bad input must fail the ring with a message naming the node, or be
dropped, never hang.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from commd.client.errors import CommdError
from commd.client.fastring import available
from commd.client.ringbridge import BridgeHost, form_mesh, gather_rounds, gather_sent, listen
from commd.memory.arena import Segment
from commd.memory.ringbridge import bridge_state, group_token, host_notice, notice_address
from commd.protocol import fabric as wire
from commd.protocol import fastring as fr
from commd.protocol import schema as s

pytestmark = pytest.mark.skipif(not available(), reason="exchange rings need x86-64 Linux")

TOKEN = group_token("a job secret", "g")
LINES = 2  # one rank and the bridge


#: A rank's bridge's large slots, as the daemon sizes them for a group of one rank on each of 2 nodes.
LARGE = fr.bridged_large_bytes(1, 2)


def _region(large: int = fr.SLOT_BYTES) -> Segment:
    size = fr.region_bytes(LINES, fr.DEPTH, fr.SLOT_BYTES, fr.LARGE_DEPTH, large)
    region = Segment.create(0, "commd-ring-test", size)
    region.array[:8].view("u8")[0] = fr.MAGIC
    region.array[8:36].view("u4")[:] = (fr.VERSION, LINES, fr.DEPTH, fr.SLOT_BYTES, fr.LARGE_DEPTH, large, 1)
    return region


def _post(region: Segment, k: int, values: np.ndarray, index: int, large: int = fr.SLOT_BYTES) -> None:
    """What the rank of line 0 writes for ring op k (protocol/fastring.py), then its ``posted``;
    past one entry, in large slot (k - 1) mod 2 (the rank's large ops alternate, one per op here)."""

    words = region.array.view("i8")
    words[fr.CONTROL_OFFSET // 8 + fr.PID] = os.getpid()
    h = fr.entry_offset(LINES, fr.DEPTH, fr.SLOT_BYTES, k, 0) // 8
    where = 0 if values.nbytes <= fr.SLOT_BYTES else 1 + (k - 1) % fr.LARGE_DEPTH
    at = (h * 8 + fr.ENTRY_HEADER_BYTES if where == 0
          else fr.large_slot_offset(LINES, fr.DEPTH, fr.SLOT_BYTES, large, where - 1, 0))
    region.array[at: at + values.nbytes] = values.view(np.uint8)
    words[h: h + 6] = (k, fr.DTYPES.index(values.dtype.name), fr.REDUCE_OPS.index("sum"), values.size, where, index)
    words[fr.CONTROL_OFFSET // 8 + fr.POSTED] = k


def _result(region: Segment, k: int, count: int, large: int = fr.SLOT_BYTES) -> np.ndarray:
    at = fr.entry_offset(LINES, fr.DEPTH, fr.SLOT_BYTES, k, 1) + fr.ENTRY_HEADER_BYTES
    where = region.array[at - fr.ENTRY_HEADER_BYTES:][:64].view("i8")[fr.WHERE]
    if where:
        at = fr.large_slot_offset(LINES, fr.DEPTH, fr.SLOT_BYTES, large, int(where) - 1, 1)
    return region.array[at: at + 8 * count].view(np.float64).copy()


def _until(what: Callable[[], Any], limit: float = 10.0) -> Any:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"not within {limit} s")


def _mesh(token_of_node_1: str = TOKEN) -> tuple[dict[int, socket.socket], dict[int, socket.socket]]:
    """Node 0's and node 1's connections, made by ``form_mesh`` on both sides."""
    listener = listen("127.0.0.1")
    endpoint = ("127.0.0.1", listener.getsockname()[1])
    got: dict[int, Any] = {}

    def node1() -> None:
        try:
            got[1] = form_mesh("g", 1, listen("127.0.0.1"), {0: endpoint}, token_of_node_1, 5.0)
        except CommdError as exc:
            got[1] = exc

    thread = threading.Thread(target=node1)
    thread.start()
    try:
        got[0] = form_mesh("g", 0, listener, {1: ("127.0.0.1", 1)}, TOKEN, 2.0)
    except CommdError as exc:
        got[0] = exc
    thread.join(10)
    return got[0], got[1]


def _daemon_pid(node: int) -> int:
    """A live process to stand for node ``node``'s daemon (its pid names the bridge's notice socket)."""

    return os.getpid() if node == 0 else os.getppid()


def _host(node: int, peers: dict[int, socket.socket], region: Segment) -> BridgeHost:
    """Node ``node``'s bridge of a group [0 | 1] (one rank each) on ``peers``."""
    return BridgeHost("g", region, [0, 1], [0, 1], node, peers, _daemon_pid(node))


def test_two_bridges_combine_in_node_order_and_publish_in_order() -> None:
    peers0, peers1 = _mesh()
    regions = [_region(), _region()]
    hosts = [_host(0, peers0, regions[0]), _host(1, peers1, regions[1])]
    for host in hosts:
        host.start()
    try:
        rng = np.random.default_rng(5)
        for k in range(1, 3 * fr.DEPTH):  # past the ring's depth
            values = [rng.uniform(-1, 1, 100), rng.uniform(-1, 1, 100)]
            for node in (0, 1):
                _post(regions[node], k, values[node], k)
                hosts[node].all_posted_here(k)
            for node in (0, 1):
                _until(lambda node=node, k=k: bridge_state(regions[node])[0] >= k)
                assert np.array_equal(_result(regions[node], k, 100), values[0] + values[1]), (k, node)
        assert [bridge_state(r) for r in regions] == [(3 * fr.DEPTH - 1, None)] * 2
    finally:
        for host in hosts:
            host.close()


def test_large_parts_sent_both_ways_at_once_neither_block_nor_mix() -> None:
    """Both bridges send a 4 MiB part at the same moment, each from its rank's thread: more than
    the sockets hold, so a blocking send would wait for a peer that itself waits to send."""
    peers0, peers1 = _mesh()
    for sock in (*peers0.values(), *peers1.values()):  # (a loopback socket may hold the whole part)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    regions = [_region(LARGE), _region(LARGE)]
    hosts = [_host(0, peers0, regions[0]), _host(1, peers1, regions[1])]
    for host in hosts:
        host.start()
    count = fr.bridged_max_bytes(fr.SLOT_BYTES, LARGE) // 8
    try:
        rng = np.random.default_rng(7)
        for k in range(1, 5):  # both large slots, twice
            values = [rng.uniform(-1, 1, count), rng.uniform(-1, 1, count)]
            for node in (0, 1):
                _post(regions[node], k, values[node], k, LARGE)
            senders = [threading.Thread(target=hosts[node].all_posted_here, args=(k,)) for node in (0, 1)]
            for thread in senders:
                thread.start()
            for thread in senders:
                thread.join(10)
            for node in (0, 1):
                _until(lambda node=node, k=k: bridge_state(regions[node])[0] >= k)
                assert np.array_equal(_result(regions[node], k, count, LARGE), values[0] + values[1]), (k, node)
        assert [bridge_state(r) for r in regions] == [(4, None)] * 2
    finally:
        for host in hosts:
            host.close()


def test_a_peer_without_the_groups_token_is_refused() -> None:
    peers0, peers1 = _mesh(token_of_node_1=group_token("another secret", "g"))
    assert isinstance(peers0, CommdError) and "nodes [1] never connected" in str(peers0), peers0
    assert isinstance(peers1, CommdError), peers1  # node 0 closed the connection after the bad proof


def _raw_peer() -> tuple[BridgeHost, Segment, socket.socket]:
    """Node 0's bridge, started, and node 1's raw connection to it."""
    peers0, peers1 = _mesh()
    region = _region()
    host = _host(0, peers0, region)
    host.start()
    return host, region, peers1[0]


def _frame(item: dict[str, Any]) -> bytes:
    """A frame as a bridge sends it: the lengths, the map, a part's contribution raw after it."""
    item = dict(item)
    raw = item.pop("d", None) or b""
    body = s.encode(item)
    return (4 + len(body) + len(raw)).to_bytes(4, "little") + len(body).to_bytes(4, "little") + body + raw


def _frame_with_both(part: wire.RingPart) -> bytes:
    """A part whose contribution is in its map and raw after it as well."""
    body, raw = s.encode(part.to_wire()), part.contribution or b""
    return (4 + len(body) + len(raw)).to_bytes(4, "little") + len(body).to_bytes(4, "little") + body + raw


BAD_FRAMES = {
    "too long": (lambda: (1 << 30).to_bytes(4, "little"), "a frame of"),
    "map past its frame": (lambda: (8).to_bytes(4, "little") + (9).to_bytes(4, "little") + b"\0" * 4,
                           "with a map of 9"),
    "contribution twice": (lambda: _frame_with_both(wire.RingPart("g", 1, 1, 1, [0], 2, 0, 1, b"\0" * 8)),
                           "both in the map and raw"),
    "not a part": (lambda: _frame({"t": "ring", "g": "g"}), "missing"),
    "another node's part": (lambda: _frame(wire.RingPart("g", 1, 1, 5, [0], 2, 0, 1, b"\0" * 8).to_wire()),
                            "from node 5"),
    "another group's part": (lambda: _frame(wire.RingPart("h", 1, 1, 1, [0], 2, 0, 1, b"\0" * 8).to_wire()),
                             "of group 'h'"),
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_a_bad_frame_from_a_peer_fails_the_ring_naming_the_node(case: str) -> None:
    host, region, raw = _raw_peer()
    try:
        make, words = BAD_FRAMES[case]
        raw.sendall(make())
        _, failed = _until(lambda: bridge_state(region)[1] and bridge_state(region))
        assert "on node 1 sent" in failed and words in failed, failed
    finally:
        host.close()
        raw.close()


def test_a_valid_part_from_the_raw_peer_completes_and_its_close_is_a_death() -> None:
    host, region, raw = _raw_peer()
    try:
        mine, theirs = np.arange(4, dtype=np.float64), np.full(4, 10.0)
        _post(region, 1, mine, 1)
        host.all_posted_here(1)
        part = wire.RingPart("g", 1, 1, 1, [0], fr.DTYPES.index("float64"), fr.REDUCE_OPS.index("sum"), 4,
                             theirs.tobytes())
        raw.sendall(_frame(part.to_wire()))
        _until(lambda: bridge_state(region)[0] >= 1)
        assert np.array_equal(_result(region, 1, 4), mine + theirs)
        raw.close()  # node 1's bridge is gone
        _, failed = _until(lambda: bridge_state(region)[1] and bridge_state(region))
        assert "rank 1 on node 1" in failed and "is gone" in failed, failed
    finally:
        host.close()


def test_notices_from_strangers_and_malformed_ones_are_dropped_and_the_daemons_fail_is_published() -> None:
    host, region, raw = _raw_peer()

    try:
        address = notice_address(_daemon_pid(0), "g")
        stranger = (f"import socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
                    f"s.sendto({host_notice(fail='forged')!r}, {address!r})")
        subprocess.run([sys.executable, "-c", stranger], check=True, timeout=30)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(b"\x81\xa1t\xa3bad", address)  # not a notice of this protocol
            sock.sendto(host_notice(k=-1), address)  # out of range
            sock.sendto(host_notice(fail="rank 1 has left the job"), address)  # as the daemon sends it
        # read in order: had anything before failed the ring, its reason would be the one published
        _, failed = _until(lambda: bridge_state(region)[1] and bridge_state(region))
        assert failed == "rank 1 has left the job", failed
    finally:
        host.close()
        raw.close()


def test_a_forked_child_does_not_hold_the_bridges_connections_open() -> None:
    """A DataLoader worker forked from the bridging rank: the rank's bridge closing (or its death)
    still reaches the other nodes as their connection closing."""

    host, _, raw = _raw_peer()
    release_r, release_w = os.pipe()
    child = os.fork()
    if child == 0:  # the child holds the copies of the bridge's sockets, unless they were closed at fork
        os.read(release_r, 1)
        os._exit(0)
    try:
        host.close()
        raw.settimeout(10.0)
        assert raw.recv(1) == b"", "node 0's bridge closed, but its connection did not"
    finally:
        os.write(release_w, b"x")
        os.waitpid(child, 0)
        raw.close()


@pytest.mark.parametrize("nodes", range(2, 18))
def test_the_gathers_rounds_give_every_node_every_part_once(nodes: int) -> None:
    """A model of the gather: in each round every node sends what it holds to the node 2**r after
    it; each ends with all parts, none twice, in log2 N rounds (or one send to all below 4 nodes)."""
    rounds = gather_rounds(nodes)
    if rounds == 0:
        assert nodes < 4
        return
    assert rounds == (nodes - 1).bit_length()
    held = [{i} for i in range(nodes)]
    for r in range(rounds):
        sends = [(i, (i + (1 << r)) % nodes, gather_sent(nodes, i, r)) for i in range(nodes)]
        for sender, _, parts in sends:
            assert set(parts) <= held[sender], (r, sender, parts)
        for _, receiver, parts in sends:
            assert not set(parts) & held[receiver], (r, receiver, parts)  # never a part twice
            held[receiver] |= set(parts)
    assert all(h == set(range(nodes)) for h in held)


def _full_mesh(n: int) -> list[dict[int, socket.socket]]:
    listeners = [listen("127.0.0.1") for _ in range(n)]
    endpoints = {i: ("127.0.0.1", lst.getsockname()[1]) for i, lst in enumerate(listeners)}
    meshes: list[Any] = [None] * n

    def node(i: int) -> None:
        meshes[i] = form_mesh("g", i, listeners[i], {p: e for p, e in endpoints.items() if p != i}, TOKEN, 10.0)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return meshes


def test_five_bridges_gather_in_rounds_and_publish_the_sum_in_node_order() -> None:
    """5 nodes take 3 rounds; each node's result equals NumPy's sum in node order, bitwise."""
    n = 5
    meshes = _full_mesh(n)
    regions = [_region() for _ in range(n)]
    # each node's daemon pid names its bridge's notice socket: a live process of its own per node
    daemons = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(n)]
    hosts = [BridgeHost("g", regions[i], list(range(n)), list(range(n)), i, meshes[i], daemons[i].pid)
             for i in range(n)]
    for host in hosts:
        host.start()
    try:
        rng = np.random.default_rng(9)
        for k in range(1, 2 * fr.DEPTH):
            values = [rng.uniform(-1, 1, 64) for _ in range(n)]
            for i in rng.permutation(n):  # the nodes' parts are ready in any order
                _post(regions[i], k, values[i], k)
                hosts[i].all_posted_here(k)
            want = values[0].copy()
            for v in values[1:]:
                want = want + v
            for i in range(n):
                _until(lambda i=i, k=k: bridge_state(regions[i])[0] >= k)
                assert np.array_equal(_result(regions[i], k, 64), want), (k, i)
        assert all(host.rounds == 3 for host in hosts)
        assert all(not host.held for host in hosts)  # every op's gather finished
    finally:
        for host in hosts:
            host.close()
        for daemon in daemons:
            daemon.kill()
            daemon.wait()


def test_a_restarted_rank_making_a_group_again_does_not_wait_for_bridges_that_never_come() -> None:
    """A replacement re-makes the groups its predecessor made (its default group first): every
    node's first rank made them long ago, and none will connect again.  It must see that at once
    (the group's arrivals in the store), not wait out the group's timeout for a mesh."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from commd.torch_backend import ring_ops

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    for rank in (0, 2):  # the first incarnation: both nodes' first ranks arrived, published, connected
        store.add(ring_ops._BRIDGE_KEY.format(name="g").format(rank="arrivals"), 1)
        store.set(ring_ops._BRIDGE_KEY.format(name="g").format(rank=rank), f"{rank // 2}:127.0.0.1:1")
    client = SimpleNamespace(nodes=["a", "a", "b", "b"], daemon_pid=os.getpid())
    ring = SimpleNamespace(rank_bridged=True, hosting={"node": 0, "ip": "127.0.0.1", "token": TOKEN})
    started = time.monotonic()
    assert ring_ops._host_bridge(client, store, "g", 0, [0, 1, 2, 3], ring, 30.0) is None
    assert time.monotonic() - started < 5.0
