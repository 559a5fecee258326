"""The daemon's control protocol under hostile or broken input, spoken over a raw DEALER socket.

The daemon is a shared service: one process sending garbage, a forged
secret or out-of-range buffer references must get a precise error back and
must neither crash the daemon nor disturb the other clients.  So every bad
message below is followed by an all-reduce between two well-behaved
clients (ranks 0 and 1 of a 3-rank world; the raw socket plays rank 2).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import socket
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from helpers import DaemonProcess, OpSocket, RawSocket, shm_files

from commd.client import AuthError, RequestError, ops
from commd.memory.arena import Segment
from commd.protocol import schema as s

pytestmark = pytest.mark.timeout(90)

WORLD = 3
RAW_RANK = 2
SEGMENT_BYTES = 1 << 16


@dataclass
class Healthy:
    """Ranks 0 and 1: after each bad message they must still complete an all-reduce."""

    clients: list[Any]
    counter: Iterator[int]

    def check(self, after: str) -> str | None:
        """Run one all-reduce on group 'pair'; describe the problem if it does not work."""
        k = next(self.counter)
        inputs = [np.arange(16, dtype=np.float32) * (r + 1) + k for r in range(2)]
        tensors = [torch.from_numpy(x.copy()) for x in inputs]
        try:
            handles = [ops.all_reduce(c, t, group="pair", timeout=10) for c, t in zip(self.clients, tensors, strict=True)]
            for h in handles:
                h.wait(15)
        except Exception as exc:  # reported as the daemon no longer serving
            return f"after {after}: all-reduce between healthy clients failed: {exc!r}"
        want = inputs[0] + inputs[1]
        for rank, t in enumerate(tensors):
            if not np.array_equal(t.numpy(), want):
                return f"after {after}: rank {rank} got {t[:4].tolist()}..., want {want[:4].tolist()}..."
        return None


@pytest.fixture
def healthy(daemon: DaemonProcess, connect: Callable[..., Any]) -> Healthy:
    clients = [connect(r, WORLD) for r in range(2)]
    for c in clients:
        c.register_group("pair", [0, 1])
    probe = Healthy(clients, itertools.count(1))
    assert probe.check("start") is None
    return probe


@pytest.fixture
def raw(daemon: DaemonProcess) -> Iterator[Callable[[], RawSocket]]:
    """Factory for raw sockets on the daemon's control endpoint, closed at teardown."""
    sockets: list[RawSocket] = []

    def make() -> RawSocket:
        sock = RawSocket(daemon.paths)
        sockets.append(sock)
        return sock

    yield make
    for sock in sockets:
        sock.close()


def hello(daemon: DaemonProcess, **fields: Any) -> dict[str, Any]:
    """A valid hello for rank 2 of the 3-rank world (override any field)."""
    message = {
        "t": s.HELLO, "job": daemon.job, "secret": daemon.secret(), "rank": RAW_RANK,
        "local_rank": RAW_RANK, "world_size": WORLD, "pid": os.getpid(), "segments": [],
    }
    message.update(fields)
    return {k: v for k, v in message.items() if v is not None}


def expect_error(reply: dict[str, Any], code: str, *words: str) -> str | None:
    """None if ``reply`` is an error with ``code`` whose message contains ``words``."""
    if reply.get("t") != s.ERROR:
        return f"expected an error reply with code {code!r}, got {reply}"
    problems = []
    if reply.get("code") != code:
        problems.append(f"code {reply.get('code')!r} != {code!r}")
    missing = [w for w in words if w not in str(reply.get("message"))]
    if missing:
        problems.append(f"message does not mention {missing}")
    return f"{'; '.join(problems)} (reply: {reply})" if problems else None


def run_table(
    table: list[tuple[str, Callable[[], dict[str, Any]], str, tuple[str, ...]]], healthy: Healthy
) -> None:
    """Each row: name, send-and-receive, expected code, words; then the health check."""
    failures = []
    for name, exchange, code, words in table:
        try:
            problem = expect_error(exchange(), code, *words)
        except AssertionError as exc:
            problem = str(exc)
        if problem:
            failures.append(f"{name}: {problem}")
        trouble = healthy.check(name)
        if trouble:
            failures.append(trouble)
    assert not failures, "\n".join(failures)


# ---- files and status -------------------------------------------------------
def test_control_files_are_private(daemon: DaemonProcess, runtime_dir: Path) -> None:
    """Only the job's user may reach the socket or read the secret."""
    modes = {
        "control socket": (daemon.paths.socket, 0o600),
        "job dir": (daemon.paths.directory, 0o700),
        "runtime dir": (runtime_dir, 0o700),
        "secret file": (daemon.paths.secret_file, 0o600),
    }
    for what, (path, want) in modes.items():
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == want, f"{what} {path} has mode {oct(mode)}, expected {oct(want)}"
    assert stat.S_ISSOCK(os.stat(daemon.paths.socket).st_mode)
    assert int(daemon.paths.pid_file.read_text()) == daemon.pid


def test_status_needs_the_secret_and_reports_clients(
    daemon: DaemonProcess, healthy: Healthy, raw: Callable[[], RawSocket]
) -> None:
    sock = raw()
    reply = sock.request({"t": s.STATUS, "secret": daemon.secret()})
    assert reply["t"] == s.STATUS, reply
    status = reply["status"]
    assert status["job"] == daemon.job
    assert status["pid"] == daemon.pid
    assert [c["rank"] for c in status["clients"]] == [0, 1]
    assert all(c["pid"] == os.getpid() for c in status["clients"])
    assert "pair" in status["groups"] and status["groups"]["pair"]["size"] == 2
    assert status["ops_done"] >= 1 and status["closing"] is False
    for bad in ({"t": s.STATUS, "secret": "0" * 64}, {"t": s.STATUS}, {"t": s.STATUS, "secret": 7}):
        assert expect_error(sock.request(bad), s.E_AUTH, "secret") is None
    assert healthy.check("status requests") is None


def test_client_with_a_wrong_secret_is_refused(daemon: DaemonProcess, healthy: Healthy) -> None:
    from commd.client import Client

    try:
        with pytest.raises(AuthError, match="secret"):
            Client(RAW_RANK, WORLD, job=daemon.job, secret="f" * 64, connect_timeout=10)
        assert healthy.check("a refused client") is None
    finally:
        for name in shm_files(daemon.job):  # checked by the test below
            Path("/dev/shm", name).unlink(missing_ok=True)


def test_refused_client_leaves_nothing_in_dev_shm(daemon: DaemonProcess) -> None:
    from commd.client import Client

    try:
        with pytest.raises(AuthError):
            Client(RAW_RANK, WORLD, job=daemon.job, secret="f" * 64, connect_timeout=10)
        leaked = shm_files(daemon.job)
        assert not leaked, f"a refused client left its arena segment behind in /dev/shm: {leaked}"
    finally:
        for name in shm_files(daemon.job):
            Path("/dev/shm", name).unlink(missing_ok=True)


def test_group_registration_is_validated(healthy: Healthy) -> None:
    """Conflicting, foreign, duplicate or out-of-range memberships are refused; nothing breaks."""
    c0, c1 = healthy.clients
    c0.register_group("g", [0, 1])
    refused = [
        (c1, "g", [1, 0], "already registered"),
        (c1, "h", [0, 2], "not a member"),
        (c0, "h", [0, 0], "twice"),
        (c0, "h", [0, 3], r"\[0, 3\)"),
        (c0, "h", [0, True], "integers"),
        (c0, "h", [], "1 to 3 ranks"),
        (c0, "bad name!", [0], "not valid"),
        (c0, "x" * 300, [0], "not valid"),
    ]
    for client, name, ranks, match in refused:
        with pytest.raises(RequestError, match=match):
            client.register_group(name, ranks)
    with pytest.raises(RequestError, match="not registered"):
        ops.barrier(c0, group="h")
    c1.register_group("g", [0, 1])
    handles = [ops.barrier(c, group="g") for c in (c0, c1)]
    for h in handles:
        h.wait(15)
    assert healthy.check("refused group registrations") is None


# ---- malformed and unauthenticated messages ---------------------------------
def test_malformed_and_unauthenticated_messages(
    daemon: DaemonProcess, healthy: Healthy, raw: Callable[[], RawSocket]
) -> None:
    """Each gets a precise error on the same socket; nothing else is disturbed."""
    sock = raw()
    op_sock = OpSocket(daemon.paths)
    secret = daemon.secret()

    def send(message: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        return lambda: (sock.send_raw(msgpack.packb(message, use_bin_type=True)), sock.recv())[1]

    def send_op_socket(message: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        return lambda: op_sock.request(message)

    def send_raw(frame: bytes) -> Callable[[], dict[str, Any]]:
        return lambda: (sock.send_raw(frame), sock.recv())[1]

    valid = hello(daemon)
    table = [
        ("wrong secret", send({"v": s.PROTOCOL_VERSION, **hello(daemon, secret="0" * 64)}), s.E_AUTH, ("authentication",)),
        ("missing secret", send({"v": s.PROTOCOL_VERSION, **{k: v for k, v in valid.items() if k != "secret"}}), s.E_AUTH, ("secret",)),
        ("secret of the wrong type", send({"v": s.PROTOCOL_VERSION, **hello(daemon, secret=123)}), s.E_AUTH, ("secret",)),
        ("wrong job", send({"v": s.PROTOCOL_VERSION, **hello(daemon, job="another-job")}), s.E_AUTH, ("another-job",)),
        ("unknown protocol version", send({**valid, "v": 99}), s.E_VERSION, ("99",)),
        ("no protocol version", send({"t": s.PING}), s.E_VERSION, ("version",)),
        ("garbage bytes", send_raw(b"\xc1\x00 not msgpack \xff"), s.E_PROTOCOL, ("msgpack",)),
        ("truncated msgpack", send_raw(msgpack.packb({"v": s.PROTOCOL_VERSION, **valid})[:-5]), s.E_PROTOCOL, ("msgpack",)),
        ("empty frame", send_raw(b""), s.E_PROTOCOL, ("msgpack",)),
        ("a list, not a map", send([1, "hello", 3]), s.E_PROTOCOL, ("map",)),
        ("a bare integer", send_raw(msgpack.packb(7)), s.E_PROTOCOL, ("map",)),
        ("integer map keys", send_raw(msgpack.packb({1: 2})), s.E_PROTOCOL, ("msgpack",)),
        ("missing type", send({"v": s.PROTOCOL_VERSION}), s.E_PROTOCOL, ("'t'",)),
        ("type not a string", send({"v": s.PROTOCOL_VERSION, "t": 5}), s.E_PROTOCOL, ("'t'",)),
        ("unknown type", send({"v": s.PROTOCOL_VERSION, "t": "launch"}), s.E_PROTOCOL, ("launch",)),
        ("hello without world_size", send({"v": s.PROTOCOL_VERSION, **hello(daemon, world_size=None)}), s.E_PROTOCOL,
         ("'world_size'",)),
        ("hello without rank", send({"v": s.PROTOCOL_VERSION, **hello(daemon, rank=None)}), s.E_PROTOCOL, ("'rank'",)),
        ("hello without segments", send({"v": s.PROTOCOL_VERSION, **hello(daemon, segments=None)}), s.E_PROTOCOL, ("'segments'",)),
        ("rank as a string", send({"v": s.PROTOCOL_VERSION, **hello(daemon, rank="2")}), s.E_PROTOCOL, ("'rank'", "str")),
        ("rank as a bool", send({"v": s.PROTOCOL_VERSION, **hello(daemon, rank=True)}), s.E_PROTOCOL, ("'rank'", "bool")),
        ("rank out of range", send({"v": s.PROTOCOL_VERSION, **hello(daemon, rank=3)}), s.E_PROTOCOL, ("'rank'",)),
        ("rank already connected", send({"v": s.PROTOCOL_VERSION, **hello(daemon, rank=0)}), s.E_PROTOCOL, ("rank 0",)),
        ("world size disagrees", send({"v": s.PROTOCOL_VERSION, **hello(daemon, world_size=4)}), s.E_PROTOCOL, ("world size",)),
        ("negative pid", send({"v": s.PROTOCOL_VERSION, **hello(daemon, pid=-1)}), s.E_PROTOCOL, ("'pid'",)),
        ("segment by name in hello", send({"v": s.PROTOCOL_VERSION, **hello(daemon, segments=[
            {"seg": 0, "name": "commd-x", "size": 64}])}), s.E_PROTOCOL, ("'segments' must be empty", "memfd")),
        ("segment entry not a map", send({"v": s.PROTOCOL_VERSION, **hello(daemon, segments=["commd-x"])}), s.E_PROTOCOL,
         ("'segments'",)),
        ("op on the control socket", send({"v": s.PROTOCOL_VERSION, "t": s.OP, "id": 1, "kind": "barrier", "group": "world",
                                           "seq": 0}), s.E_PROTOCOL, ("op socket",)),
        ("op on the op socket before attach", send_op_socket({"t": s.OP, "id": 1, "kind": "barrier", "group": "world",
                                                              "seq": 0}), s.E_AUTH, ("attach",)),
        ("segment before hello", send({"v": s.PROTOCOL_VERSION, "t": s.SEGMENT, "seg": 1, "name": "commd-x", "size": 64}),
         s.E_AUTH, ("hello",)),
        ("group before hello", send({"v": s.PROTOCOL_VERSION, "t": s.GROUP, "name": "g", "ranks": [2]}), s.E_AUTH, ("hello",)),
        ("attach on the control socket", send({"v": s.PROTOCOL_VERSION, "t": "attach", "client_id": 1, "secret": secret}),
         s.E_PROTOCOL, ("op socket",)),
        ("attach with a wrong secret", send_op_socket({"t": "attach", "client_id": 1, "secret": "x"}), s.E_AUTH,
         ("secret",)),
        ("attach to an unknown client", send_op_socket({"t": "attach", "client_id": 999, "secret": secret}),
         s.E_AUTH, ("client",)),
    ]
    try:
        run_table(table, healthy)
        assert sock.request({"t": s.PING})["pid"] == daemon.pid  # the same socket still works
    finally:
        op_sock.close()


def test_oversized_messages(daemon: DaemonProcess, healthy: Healthy, raw: Callable[[], RawSocket]) -> None:
    """Over MAX_MESSAGE_BYTES: an error naming the size; far over it: the connection is dropped."""
    sock = raw()
    size = s.MAX_MESSAGE_BYTES + 1
    frame = msgpack.packb({"v": s.PROTOCOL_VERSION, "t": s.PING, "pad": b"x" * (size - 32)}, use_bin_type=True)
    frame += b"\x00" * (size - len(frame))  # trailing bytes: the size check comes first
    sock.send_raw(frame)
    problem = expect_error(sock.recv(), s.E_PROTOCOL, str(len(frame)), str(s.MAX_MESSAGE_BYTES))
    assert problem is None, problem
    assert healthy.check("a message 1 byte over the limit") is None
    assert sock.request({"t": s.PING})["pid"] == daemon.pid

    huge = raw()
    huge.send_raw(b"\x00" * (17 * s.MAX_MESSAGE_BYTES))  # beyond zmq's frame limit on the daemon
    assert huge.silent(1.0), "a frame beyond zmq's limit must not be answered"
    assert healthy.check("a 17 MiB frame") is None
    assert raw().request({"t": s.PING})["pid"] == daemon.pid


# ---- a registered raw client: buffer references and segments ------------------
@dataclass
class RawClient:
    """Rank 2 over raw sockets: hello with one real segment, op channel attached."""

    req: RawSocket
    ops: OpSocket
    segment_bytes: int
    seq: Iterator[int]
    ids: Iterator[int]
    client_id: int = 0

    def op(self, **fields: Any) -> dict[str, Any]:
        """Submit an op on the op channel; its error or completion comes back there."""
        message = {"t": s.OP, "id": next(self.ids), "group": "raw", "seq": next(self.seq), **fields}
        return self.ops.request(message)

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        return self.req.request(message)


def register_fds(daemon: DaemonProcess, fields: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    """A segment registration on its own op-socket connection, with ``fds`` attached; the reply."""
    message = {"t": s.SEGMENT, "secret": daemon.secret(), **fields}
    frame = s.encode({k: v for k, v in message.items() if v is not None})
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(str(daemon.paths.ops_socket))
        if fds:
            import array

            sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            sock.send(frame)
        return msgpack.unpackb(sock.recv(1 << 16), raw=False)


@pytest.fixture
def raw_client(daemon: DaemonProcess, healthy: Healthy, raw: Callable[[], RawSocket]) -> Iterator[RawClient]:
    segment = Segment.create(0, f"commd-{daemon.job}-raw", SEGMENT_BYTES)
    op_sock = OpSocket(daemon.paths)
    try:
        req = raw()
        welcome = req.request(hello(daemon))
        assert welcome["t"] == s.WELCOME, welcome
        registered = register_fds(daemon, {"client_id": welcome["client_id"], "seg": 0, "name": segment.name,
                                           "size": SEGMENT_BYTES}, [segment.fd])
        assert registered["t"] == s.ACK, registered
        ack = op_sock.attach(welcome["client_id"], daemon.secret())
        assert ack["t"] == s.ACK, ack
        assert req.request({"t": s.GROUP, "name": "raw", "ranks": [RAW_RANK]})["t"] == s.ACK
        client = RawClient(req, op_sock, SEGMENT_BYTES, itertools.count(), itertools.count(1))
        client.client_id = welcome["client_id"]
        good = client.op(kind="allreduce", dtype="float32", count=4, buf={"seg": 0, "off": 64, "n": 16})
        assert good["t"] == s.DONE, good
        yield client
    finally:
        op_sock.close()
        segment.close_fd()


def test_ops_travel_only_on_the_op_socket(daemon: DaemonProcess, raw_client: RawClient, healthy: Healthy) -> None:
    """A registered client's op or attach on the ZeroMQ control socket is refused, saying where ops go;
    the same op on its op channel runs."""
    op = {"t": s.OP, "id": 10_000, "group": "raw", "seq": 1, "kind": "allreduce", "dtype": "float32", "count": 4,
          "buf": {"seg": 0, "off": 64, "n": 16}}
    table = [
        ("op on the control socket", lambda: raw_client.request(dict(op)), s.E_PROTOCOL, ("op socket", "SEQPACKET")),
        ("attach on the control socket",
         lambda: raw_client.request({"t": "attach", "client_id": raw_client.client_id, "secret": daemon.secret()}),
         s.E_PROTOCOL, ("op socket",)),
    ]
    run_table(table, healthy)
    done = raw_client.ops.request(dict(op))  # the op refused above changed nothing: seq 1 is still next
    assert done["t"] == s.DONE and done["id"] == 10_000, done


def test_bad_buffer_references(daemon: DaemonProcess, raw_client: RawClient, healthy: Healthy) -> None:
    """Out-of-bounds, unknown-segment, misaligned and inconsistent buffers are refused."""
    end = raw_client.segment_bytes

    def op(**fields: Any) -> Callable[[], dict[str, Any]]:
        return lambda: raw_client.op(**fields)

    f32 = {"kind": "allreduce", "dtype": "float32", "count": 4}
    table = [
        ("buffer past the segment end", op(**f32, buf={"seg": 0, "off": end - 8, "n": 16}), s.E_BOUNDS,
         ("outside", str(end))),
        ("buffer starting past the end", op(**f32, buf={"seg": 0, "off": 1 << 40, "n": 16}), s.E_BOUNDS,
         ("outside",)),
        ("huge length", op(kind="allreduce", dtype="float32", count=1 << 36, buf={"seg": 0, "off": 0, "n": 1 << 38}),
         s.E_BOUNDS, ("outside",)),
        ("unknown segment id", op(**f32, buf={"seg": 7, "off": 0, "n": 16}), s.E_BOUNDS, ("segment 7",)),
        ("misaligned offset", op(**f32, buf={"seg": 0, "off": 2, "n": 16}), s.E_BOUNDS, ("aligned",)),
        ("misaligned float64", op(kind="allreduce", dtype="float64", count=2, buf={"seg": 0, "off": 4, "n": 16}),
         s.E_BOUNDS, ("aligned",)),
        ("negative offset", op(**f32, buf={"seg": 0, "off": -16, "n": 16}), s.E_PROTOCOL, ("'off'",)),
        ("length disagrees with count", op(**f32, buf={"seg": 0, "off": 0, "n": 20}), s.E_PROTOCOL, ("20 bytes",)),
        ("missing buffer", op(**f32), s.E_PROTOCOL, ("'buf'",)),
        ("buffer not a map", op(**f32, buf=[0, 0, 16]), s.E_PROTOCOL, ("'buf'",)),
        ("inline data of the wrong length", op(**f32, buf={"data": b"\x00" * 12}), s.E_PROTOCOL, ("12 bytes",)),
        ("inline output over the limit", op(**f32, buf={"inline": s.MAX_MESSAGE_BYTES + 1}), s.E_PROTOCOL,
         ("'inline'",)),
        ("inline output over the inline limit", op(**f32, buf={"inline": s.INLINE_MAX_BYTES + 4}), s.E_LIMIT,
         ("'inline'", str(s.INLINE_MAX_BYTES))),
        ("missing kind", op(dtype="float32", count=4, buf={"seg": 0, "off": 0, "n": 16}), s.E_PROTOCOL, ("'kind'",)),
        ("unknown kind", op(**{**f32, "kind": "allreduce2"}, buf={"seg": 0, "off": 0, "n": 16}), s.E_PROTOCOL,
         ("allreduce2",)),
        ("unknown dtype", op(**{**f32, "dtype": "float8"}, buf={"seg": 0, "off": 0, "n": 16}), s.E_PROTOCOL,
         ("float8",)),
        ("unknown reduce op", op(**f32, op="median", buf={"seg": 0, "off": 0, "n": 16}), s.E_PROTOCOL, ("median",)),
        ("unregistered group", op(**f32, group="nope", buf={"seg": 0, "off": 0, "n": 16}), s.E_PROTOCOL, ("nope",)),
        ("root outside the group", op(kind="broadcast", dtype="float32", count=4, root=3,
                                      buf={"seg": 0, "off": 0, "n": 16}), s.E_PROTOCOL, ("root 3",)),
        ("send to itself", op(kind="send", dtype="float32", count=4, peer=0, **{"in": {"seg": 0, "off": 0, "n": 16}}),
         s.E_PROTOCOL, ("itself",)),
        ("counts of the wrong length", op(kind="allgather", dtype="float32", counts=[4, 4],
                                          **{"in": {"data": b"\x00" * 16}, "out": {"inline": 32}}),
         s.E_PROTOCOL, ("'counts'",)),
        ("second hello on the connection", lambda: raw_client.request(hello(daemon)), s.E_PROTOCOL,
         ("already",)),
        ("timeout of zero", op(**f32, timeout_ms=0, buf={"seg": 0, "off": 0, "n": 16}), s.E_PROTOCOL,
         ("timeout_ms",)),
    ]
    run_table(table, healthy)
    good = raw_client.op(kind="allreduce", dtype="float32", count=4, buf={"seg": 0, "off": 0, "n": 16})
    assert good["t"] == s.DONE, f"the raw client itself no longer works: {good}"


def test_bad_segments_are_refused(daemon: DaemonProcess, raw_client: RawClient, healthy: Healthy,
                                  tmp_path: Path) -> None:
    """A segment is a sealed memfd passed beside its registration: anything else, or a lie about it, is refused."""
    job = daemon.job
    regular = tmp_path / "not-shared-memory"
    regular.write_bytes(b"\x00" * 8192)
    opened: list[int] = []

    def memfd(size: int = 4096, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, reserve: bool = True) -> int:
        fd = os.memfd_create("commd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        opened.append(fd)
        os.ftruncate(fd, size)
        if reserve:
            os.posix_fallocate(fd, 0, size)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        return fd

    def plain_fd(path: Path) -> int:
        fd = os.open(path, os.O_RDONLY if path.is_dir() else os.O_RDWR)
        opened.append(fd)
        return fd

    seg_ids = itertools.count(1)

    def register(fds: list[int], size: int = 4096, name: str | None = None, **fields: Any) -> Callable[[], dict]:
        def exchange() -> dict[str, Any]:
            message = {"client_id": raw_client.client_id, "seg": next(seg_ids),
                       "name": name or f"commd-{job}-x", "size": size, **fields}
            return register_fds(daemon, message, fds)
        return exchange

    try:
        good = memfd()
        table = [
            ("no descriptor", register([]), s.E_PROTOCOL, ("exactly one file descriptor", "not 0")),
            ("two descriptors", register([good, memfd()]), s.E_PROTOCOL, ("exactly one", "not 2")),
            ("a regular file", register([plain_fd(regular)]), s.E_PROTOCOL, ("not a sealable memfd",)),
            ("a directory", register([plain_fd(tmp_path)]), s.E_PROTOCOL, ("not a regular file",)),
            ("a memfd not sealed against shrinking", register([memfd(seals=0)]), s.E_PROTOCOL, ("F_SEAL_SHRINK",)),
            ("a memfd sealed against growing only", register([memfd(seals=fcntl.F_SEAL_GROW)]), s.E_PROTOCOL,
             ("F_SEAL_SHRINK",)),
            ("size beyond the memfd", register([good], size=8192), s.E_PROTOCOL, ("fewer than",)),
            ("pages not reserved", register([memfd(reserve=False)]), s.E_PROTOCOL, ("posix_fallocate",)),
            ("size zero", register([good], size=0), s.E_PROTOCOL, ("'size'",)),
            ("path as the name", register([good], name="../etc/passwd"), s.E_PROTOCOL, ("not a valid",)),
            ("wrong secret", register([good], secret="0" * 64), s.E_AUTH, ("secret",)),
            ("unknown client", register([good], client_id=999), s.E_AUTH, ("unknown client",)),
            ("segment id reused", lambda: register_fds(daemon, {"client_id": raw_client.client_id, "seg": 0,
                                                                "name": f"commd-{job}-x", "size": 4096}, [good]),
             s.E_PROTOCOL, ("already",)),
            ("segment by name on the control socket", lambda: raw_client.request(
                {"t": s.SEGMENT, "seg": 50, "name": f"commd-{job}-x", "size": 4096}), s.E_PROTOCOL, ("memfd",)),
        ]
        run_table(table, healthy)
    finally:
        for fd in opened:
            os.close(fd)
    assert regular.read_bytes() == b"\x00" * 8192


def test_cuda_references_are_validated_without_a_gpu() -> None:
    """A CUDA reference names its export by id; the first carries the handles, ``drop`` lists dead exports."""
    from commd.protocol.cuda import MAX_DROPS, MAX_HANDLE_BYTES, CudaRef

    first = CudaRef({"id": 3, "device": 0, "event": b"e" * 64, "handle": b"h" * 64, "size": 4096, "offset": 512,
                     "ref_handle": b"r", "ref_offset": 8})
    assert (first.export_id, first.handle, first.size, first.offset, first.drop) == (3, b"h" * 64, 4096, 512, [])
    again = CudaRef({"id": 3, "device": 0, "event": b"e", "drop": [1, 2]})
    assert again.handle is None and again.drop == [1, 2]
    bad = [
        ({"device": 0, "event": b"e"}, "'id'"),
        ({"id": 0, "device": 0, "event": b"e"}, "'id'"),
        ({"id": 1, "device": 0, "event": b"e", "handle": b"h"}, "'size'"),  # a first reference is whole
        ({"id": 1, "device": 0, "event": b"e" * (MAX_HANDLE_BYTES + 1)}, "longer than"),
        ({"id": 1, "device": 0, "event": b"e", "drop": [0]}, "'drop'"),
        ({"id": 1, "device": 0, "event": b"e", "drop": "1"}, "'drop'"),
        ({"id": 1, "device": 0, "event": b"e", "drop": [1] * (MAX_DROPS + 1)}, "'drop'"),
    ]
    for raw, needle in bad:
        with pytest.raises(s.ProtocolError, match=needle):
            CudaRef(raw)


# ---- op batches ------------------------------------------------------------------
def _item(op_id: int, seq: int, **fields: Any) -> dict[str, Any]:
    """One op of a batch on the raw client's group: a 4-element all-reduce in its segment."""
    return {"t": s.OP, "id": op_id, "group": "raw", "seq": seq, "kind": "allreduce", "dtype": "float32",
            "count": 4, "buf": {"seg": 0, "off": 64, "n": 16}, **fields}


def _send_batch(raw_client: RawClient, message: dict[str, Any], replies: int) -> list[dict[str, Any]]:
    raw_client.ops.send({"t": s.OPS, **message})
    return [raw_client.ops.recv() for _ in range(replies)]


def _raw_status(daemon: DaemonProcess) -> tuple[int, dict[str, int], int]:
    """The raw group's next sequence number, the daemon's batch counters, the raw rank's pending ops."""
    from commd.client.status import query_status

    status = query_status(daemon.paths)
    pending = next(c["pending_ops"] for c in status["clients"] if c["rank"] == RAW_RANK)
    return status["groups"]["raw"]["next_seq"], status["op_batches"], pending


def test_an_op_batch_runs_every_op_in_order(daemon: DaemonProcess, raw_client: RawClient) -> None:
    """Three ops in one message: each answered under its own id, in order, with its own result; the
    same three behind a bad fourth are all refused and leave no trace."""
    seqs = [next(raw_client.seq) for _ in range(3)]
    data = [np.arange(4, dtype=np.float32) * (i + 1) for i in range(3)]
    items = [_item(100 + i, seq, buf={"data": data[i].tobytes()}) for i, seq in enumerate(seqs)]
    to_itself = {"t": s.OP, "id": 103, "group": "raw", "kind": "send", "dtype": "float32", "count": 0, "peer": 0,
                 "in": {"data": b""}}  # the raw group's only rank sends to itself
    replies = _send_batch(raw_client, {"items": [*items, to_itself]}, 4)
    assert all(r["t"] == s.ERROR and "item 3 of 4" in r["message"] for r in replies), replies
    _, counted, pending = _raw_status(daemon)
    assert counted == {"batches": 0, "ops": 0} and pending == 0, (counted, pending)

    replies = _send_batch(raw_client, {"items": items[:3]}, 3)
    assert [r["t"] for r in replies] == [s.DONE] * 3, replies
    assert [r["id"] for r in replies] == [100, 101, 102], "replies out of the batch's order"
    for reply, want in zip(replies, data, strict=True):
        assert np.array_equal(np.frombuffer(reply["data"], dtype=np.float32), want), reply
    next_seq, counted, pending = _raw_status(daemon)
    assert (next_seq, counted, pending) == (seqs[-1] + 1, {"batches": 1, "ops": 3}, 0)


def test_bad_op_batches_are_refused_whole(daemon: DaemonProcess, raw_client: RawClient, healthy: Healthy) -> None:
    """A malformed batch, or one bad op in it, refuses the whole batch: every op's rank hears why,
    naming the item; nothing of it is taken; the daemon serves everyone after."""
    end = raw_client.segment_bytes
    first, second = next(raw_client.seq), next(raw_client.seq)
    good = [_item(200, first), _item(201, second)]
    bad_buffer = _item(201, second, buf={"seg": 0, "off": end - 8, "n": 16})
    table: list[tuple[str, dict[str, Any], int, str, tuple[str, ...]]] = [
        ("items not a list", {"items": {"a": 1}}, 1, s.E_PROTOCOL, ("'items'",)),
        ("no items", {"items": []}, 1, s.E_PROTOCOL, ("1 to", str(s.MAX_BATCH_OPS))),
        ("too many items", {"items": [{}] * (s.MAX_BATCH_OPS + 1)}, 1, s.E_PROTOCOL, (str(s.MAX_BATCH_OPS + 1),)),
        ("an item not a map", {"items": [good[0], 7]}, 1, s.E_PROTOCOL, ("item 1 must be a map",)),
        ("a batch inside a batch", {"items": [good[0], {"t": s.OPS, "items": good}]}, 1, s.E_PROTOCOL,
         ("item 1", "'op'")),
        ("an item of another protocol version", {"items": [good[0], {**good[1], "v": 1}]}, 2, s.E_VERSION,
         ("item 1",)),
        ("an item out of its segment", {"items": [good[0], bad_buffer]}, 2, s.E_BOUNDS,
         ("item 1 of 2", "outside", str(end))),
        ("an item of an unknown group", {"items": [{**good[0], "group": "nope"}, good[1]]}, 2, s.E_PROTOCOL,
         ("item 0 of 2", "nope")),
        ("two items with one id", {"items": [good[0], {**good[1], "id": 200}]}, 2, s.E_PROTOCOL,
         ("item 1 of 2", "already pending")),
        ("an inline item over the inline limit", {"items": [good[0], {**good[1], "buf": {"inline": 4100}}]}, 2,
         s.E_LIMIT, ("item 1 of 2", str(s.INLINE_MAX_BYTES))),
    ]
    before = _raw_status(daemon)
    failures = []
    for name, message, replies, code, words in table:
        try:
            for reply in _send_batch(raw_client, message, replies):
                problem = expect_error(reply, code, "op batch refused", *words)
                if problem:
                    failures.append(f"{name}: {problem}")
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
        if _raw_status(daemon) != before:
            failures.append(f"{name}: the refused batch changed the daemon's state: {before} -> {_raw_status(daemon)}")
        trouble = healthy.check(name)
        if trouble:
            failures.append(trouble)
    assert not failures, "\n".join(failures)
    replies = _send_batch(raw_client, {"items": good}, 2)  # the same ids and sequence numbers: all still free
    assert [(r["t"], r["id"]) for r in replies] == [(s.DONE, 200), (s.DONE, 201)], replies
