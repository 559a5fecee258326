"""The torch backend's use of a group's exchange ring (``commd/client/fastring.py``).

A group whose ranks all live on this node gets a ring when it is created (a group that
spans nodes a bridged one on each node, whose daemon takes part: ``fabric/bridge.py``;
it carries ops of one 64 KiB entry at most); every rank
must then take the ring for exactly the same all-reduces, so the choice depends only
on what the ranks agree on anyway: the ring exists (agreed through the store), the
tensor is on the CPU, its dtype has a NumPy kernel, the reduce op suits the dtype, and
it is no larger than the ring's largest op.  Everything else goes through the daemon as before.

A ring op takes the group's next collective number from the client (``Client.numbering``),
the number the daemon path would have given it, so the two paths number the group's ops
as one sequence: after an op fails on the ring (a timeout, a disagreement) and the group
moves to the daemon path, op k of every rank is still op k.

Ranks that disagree (one's all-reduce takes the ring, another's collective at the same
place goes to the daemon) learn it at once: every daemon collective of the group is
counted in the ring (``Client.on_numbered`` → ``note_submitted``), a ring op that meets
such a place fails with a MismatchError and submits the same all-reduce, under the same
number, to the daemon (``on_diverged``), whose own agreement check then fails the peers'
op too; the ring is left, and the group's later ops all take the daemon path.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from commd.client import fastring, ringbridge
from commd.client.connection import Client
from commd.client.errors import CommdError
from commd.client.handle import Handle
from commd.client.ringbridge import BridgeHost, NoticeSender
from commd.kernels.dtypes import UnsupportedReduction, check_supported
from commd.kernels.reduce import DTYPE_NAMES
from commd.kernels.small import NUMPY_DTYPES
from commd.protocol import fastring as fr
from commd.runtime import ConfigError
from commd.torch_backend.store import read_from_ranks

log = logging.getLogger("commd.torch")

#: torch dtype -> name, for the dtypes a ring slot can carry.
RING_DTYPES = {dtype: name for dtype, name in DTYPE_NAMES.items() if name in NUMPY_DTYPES}
TORCH_DTYPES = {name: dtype for dtype, name in RING_DTYPES.items()}
_STORE_KEY = "commd/ring/{name}/{rank}"
_BRIDGE_KEY = "commd/ringbridge/{name}/{{rank}}"


def open_ring(client: Client, store: dist.Store, name: str, rank: int, size: int,
              global_ranks: list[int], timeout: float | None, lane: str | None = None) -> fastring.ExchangeRing | None:
    """The group's ring if every rank of it got one (agreed through the store), else None.

    A group that spans nodes gets a bridged ring on each: needs a fabric, at most ``MAX_RANKS``
    of its ranks on each node, and no lane asked for (a group made with ``commd.Options(lane=...)``
    runs every op on that lane).  Its bridge line is played by the daemon (``COMMD_RING_BRIDGE=daemon``,
    the default) or by the node's first rank of the group, connected directly to the other nodes'
    first ranks (``rank``); the group's ranks agree on it through the store."""
    nodes = client.nodes
    here = len(global_ranks) if nodes is None else sum(nodes[r] == nodes[client.rank] for r in global_ranks)
    spans = here < len(global_ranks)
    ring = None
    if fastring.available() and (2 <= size if not spans else lane is None and 1 <= here) and here <= fr.MAX_RANKS:
        try:
            region, meta = fastring.request_ring(client.paths.ops_socket, client.client_id, client.secret, name,
                                                 30.0, client.daemon_pid, bridge_host() if spans else "daemon")
            ring = fastring.ExchangeRing(region, meta, name, client.rank, client.daemon_pid,
                                         timeout or client.op_timeout)
        except CommdError as exc:
            log.warning("group %s: no exchange ring, small all-reduces go through the daemon: %s", name, exc)
    host: BridgeHost | None = None
    if spans and nodes is not None:
        try:
            host = _host_bridge(client, store, name, rank, global_ranks, ring, timeout)
        except CommdError as exc:
            log.warning("group %s: no exchange ring, small all-reduces go through the daemon: %s", name, exc)
            if ring is not None:
                ring.close()
            ring = None
    store.set(_STORE_KEY.format(name=name, rank=rank), "1" if ring is not None else "0")
    got = read_from_ranks(store, lambda r: _STORE_KEY.format(name=name, rank=r), range(size),
                          "whether they got the group's exchange ring", timeout)
    if all(value == b"1" for value in got):
        assert ring is not None
        ring.take_number = client.numbering(name)
        ring.global_ranks = list(global_ranks)
        client.on_numbered(name, ring.note_submitted)
        ring.on_failed = lambda number, code, why: client.notify_ring(name, failed=number, code=code, why=why[:1024])
        ring.on_trace = lambda records: client.notify_ring(name, trace=records)
        ring.on_diverged = lambda dtype, op, count, number: _numbered_all_reduce(
            client, name, torch.zeros(count, dtype=TORCH_DTYPES[dtype]), op, timeout, number)
        if ring.rank_bridged:
            notices = NoticeSender(client.daemon_pid, name)
            ring.on_all_posted = notices.all_posted if host is None else host.all_posted_here
            ring.on_left = notices.left
            ring.on_close.append(notices.close)
            if host is not None:
                ring.on_close.append(host.close)
                host.start()
        elif ring.bridged:
            ring.on_all_posted = lambda seq: client.notify_ring(name, k=seq)
            ring.on_left = lambda code, why, number: client.notify_ring(
                name, left=why[:1024], code=code, **({} if number is None else {"n": number}))
        return ring
    if host is not None:
        host.close()
    if ring is not None:
        ring.close()
    return None


def bridge_host() -> str:
    """Who plays a bridged ring's bridge line: ``COMMD_RING_BRIDGE`` (``rank`` or ``daemon``)."""
    value = os.environ.get("COMMD_RING_BRIDGE", "daemon").strip() or "daemon"
    if value not in ("rank", "daemon"):
        raise ConfigError(f"COMMD_RING_BRIDGE={value!r}: use 'rank' (the node's first rank of a group bridges "
                          "its ring to the other nodes) or 'daemon'")
    return value


def _host_bridge(client: Client, store: dist.Store, name: str, rank: int, global_ranks: list[int],
                 ring: fastring.ExchangeRing | None, timeout: float | None) -> BridgeHost | None:
    """This node's first rank of a group that spans nodes: when its ring's bridge line is a rank's,
    connect it to the other nodes' first ranks and return its bridge (not started); the others
    return None.  Every first rank publishes its node and listener, or ``-`` (no such bridge here),
    so the first ranks decide alike; a failure raises CommdError (this rank then takes no ring)."""
    assert client.nodes is not None
    names = [client.nodes[r] for r in global_ranks]
    firsts = {names.index(n) for n in names}  # each node's first group rank
    if rank not in firsts:
        return None
    key = _BRIDGE_KEY.format(name=name)
    if ring is None or not ring.rank_bridged:
        store.set(key.format(rank=rank), "-")
        return None
    if int(store.add(key.format(rank="arrivals"), 1)) > len(firsts):
        # every node's first rank made this group already: this process is a replacement making
        # it again (its groups are numbered from the start), and the others will never connect
        log.info("group %s: made again by a restarted rank; its small all-reduces go through the daemon", name)
        return None
    listener = ringbridge.listen(ring.hosting["ip"])
    try:
        port = listener.getsockname()[1]
        store.set(key.format(rank=rank), f"{ring.hosting['node']}:{ring.hosting['ip']}:{port}")
        others = sorted(firsts - {rank})
        values = read_from_ranks(store, lambda r: key.format(rank=r), others,
                                 "their node's exchange-ring bridge", timeout)
        if any(v == b"-" for v in values):
            listener.close()
            return None
        endpoints: dict[int, tuple[str, int]] = {}
        node_of_name = {names[rank]: ring.hosting["node"]}
        for r, value in zip(others, values, strict=True):
            node, ip, peer_port = value.decode().rsplit(":", 2)
            endpoints[int(node)] = (ip, int(peer_port))
            node_of_name[names[r]] = int(node)
    except BaseException:
        listener.close()
        raise
    peers = ringbridge.form_mesh(name, ring.hosting["node"], listener, endpoints, ring.hosting["token"],
                                 timeout or 30.0)
    try:
        return BridgeHost(name, ring.region, list(global_ranks), [node_of_name[n] for n in names],
                          ring.hosting["node"], peers, client.daemon_pid,
                          lambda number, code, why: client.notify_ring(name, failed=number, code=code, why=why[:1024]))
    except OSError as exc:  # its notice socket is taken: a bridge of the same group still runs here
        for sock in peers.values():
            sock.close()
        raise CommdError(f"group {name!r}: cannot bridge the exchange ring: {exc}") from None


def ring_all_reduce(client: Client, ring: fastring.ExchangeRing, tensor: torch.Tensor, op: str,
                    timeout: float | None, result: Any) -> Handle | None:
    """``tensor`` all-reduced through the ring, or None when it is not a ring op (see the module doc)."""
    dtype = RING_DTYPES.get(tensor.dtype)
    nbytes = tensor.nbytes
    if (dtype is None or not tensor.is_cpu or nbytes > ring.max_bytes or (op, dtype) not in _SUPPORTED
            or not ring.usable()):
        return None
    client.wait_group_idle(ring.group)  # program order with the group's pending daemon ops
    client.wait_writes_to(tensor)
    flat = tensor if tensor.is_contiguous() else tensor.contiguous()

    def hand_over(number: int) -> Handle:
        return _numbered_all_reduce(client, ring.group, flat, op, timeout, number)

    try:
        if flat is tensor:
            handle = ring.post(tensor.data_ptr(), nbytes, dtype, op, timeout, result=result, hand_over=hand_over)
        else:
            handle = ring.post(flat.data_ptr(), nbytes, dtype, op, timeout, result=result,
                               after=lambda: tensor.copy_(flat), keep=flat, hand_over=hand_over)
    except fastring.RingLeft:
        return None  # left since ``usable()`` (a peer's failure): the daemon path, as on the other ranks'
    if not handle.is_completed():
        client.note_write_back(tensor, handle)
    return handle


def _numbered_all_reduce(client: Client, group: str, tensor: torch.Tensor, op: str, timeout: float | None,
                         number: int) -> Handle:
    """A ring op as the daemon path runs it, under the number it took on the ring."""
    return client.submit("allreduce", group, {"buf": (tensor, "inout")}, tensor.dtype, count=tensor.numel(),
                         op=op, timeout=timeout, seq=number)


def _supported(op: str, dtype: str) -> bool:
    try:
        check_supported(op, dtype)
    except UnsupportedReduction:
        return False
    return True


#: (reduce op, dtype) pairs the ring takes: those the daemon's kernels support.
_SUPPORTED = frozenset((op, dtype) for op in fr.REDUCE_OPS for dtype in RING_DTYPES.values() if _supported(op, dtype))
