"""Per-client limits: no client can make the shared daemon hold unbounded memory or wait forever.

A raw-protocol client (ZeroMQ for hello and groups, the SEQPACKET op channel
for ops) floods the daemon the way a buggy or hostile process could; the
daemon's resident memory (VmRSS) must stay within a bound derived from its
limits, the offending ops get a ``limit`` error naming the limit, and
well-behaved clients keep working (checked against NumPy).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from helpers import DaemonProcess, RawSocket, wait_until

from commd.cli.status import format_status
from commd.client import PeerDiedError, ops
from commd.daemon import limits as lim
from commd.protocol import schema as s
from commd.runtime import ConfigError

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
#: Allowance for what a daemon allocates while serving a flood that it then frees or reuses
#: (allocator arenas, message buffers, the last errors kept for status).
RSS_SLACK = 48 * MIB
#: A generous bound on the daemon's own record of one pending op besides its inline bytes.
PER_OP_RECORD = 4096
DAY_MS = 24 * 3600 * 1000


def settled_rss(raw: RawOpClient, daemon: DaemonProcess) -> int:
    """The daemon's RSS once it has loaded torch (it does so in the background, ~200 MiB, soon after
    its ranks connect): a baseline taken before would charge that load to the flood."""
    wait_until(lambda: raw.status(daemon)["torch_loaded"], 60, "the daemon to load torch")
    return rss_bytes(daemon.pid)


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (VmRSS from /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


# ---- a raw-protocol client ----------------------------------------------------
@dataclass
class RawOpClient:
    """One rank registered over ZeroMQ that submits ops on its own SEQPACKET op channel.

    A reader thread collects every reply (batches expanded) unless ``read`` is
    False, in which case nobody ever reads the channel.
    """

    control: RawSocket
    channel: socket.socket
    rank: int
    replies: list[dict[str, Any]] = field(default_factory=list)
    closed_by_daemon: threading.Event = field(default_factory=threading.Event)
    next_id: int = 1
    seq: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def connect(cls, daemon: DaemonProcess, rank: int, world: int, groups: dict[str, list[int]],
                read: bool = True) -> RawOpClient:
        control = RawSocket(daemon.paths)
        welcome = control.request({"t": s.HELLO, "job": daemon.job, "secret": daemon.secret(), "rank": rank,
                                   "local_rank": rank, "world_size": world, "pid": os.getpid(), "segments": []})
        assert welcome["t"] == s.WELCOME, welcome
        for name, ranks in groups.items():
            ack = control.request({"t": s.GROUP, "name": name, "ranks": ranks})
            assert ack["t"] == s.ACK, ack
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        channel.settimeout(10)
        channel.connect(str(daemon.paths.ops_socket))
        channel.send(s.encode({"t": "attach", "client_id": welcome["client_id"], "secret": daemon.secret()}))
        ack = msgpack.unpackb(channel.recv(s.MAX_MESSAGE_BYTES + 1), raw=False)
        assert ack["t"] == s.ACK, ack
        client = cls(control, channel, rank)
        if read:
            threading.Thread(target=client._read, daemon=True).start()
        return client

    def _read(self) -> None:
        self.channel.settimeout(None)
        while True:
            try:
                frame = self.channel.recv(s.MAX_MESSAGE_BYTES + 1)
            except OSError:
                frame = b""
            if not frame:
                self.closed_by_daemon.set()
                return
            reply = msgpack.unpackb(frame, raw=False)
            items = reply["items"] if reply.get("t") == s.BATCH else [reply]
            with self._lock:
                self.replies.extend(items)

    def submit(self, group: str, kind: str = "allreduce", **fields: Any) -> int:
        """Send one op (sequence numbers per group); return its id."""
        op_id = self.next_id
        self.next_id += 1
        message: dict[str, Any] = {"t": s.OP, "id": op_id, "group": group, "kind": kind, **fields}
        if kind in s.COLLECTIVES:
            message["seq"] = self.seq.get(group, 0)
            self.seq[group] = message["seq"] + 1
        self.channel.send(s.encode(message))
        return op_id

    def reply_to(self, op_id: int, timeout: float = 30.0) -> dict[str, Any]:
        """The reply to op ``op_id`` (the reader thread must be running)."""
        def find() -> dict[str, Any] | None:
            with self._lock:
                return next((r for r in reversed(self.replies) if r.get("id") == op_id), None)

        return wait_until(find, timeout, f"the reply to op {op_id}")

    def take_replies(self) -> list[dict[str, Any]]:
        with self._lock:
            taken, self.replies = self.replies, []
        return taken

    def status(self, daemon: DaemonProcess) -> dict[str, Any]:
        reply = self.control.request({"t": s.STATUS, "secret": daemon.secret()})
        assert reply["t"] == s.STATUS, reply
        return reply["status"]

    def close(self) -> None:
        self.channel.close()
        self.control.close()


def allreduce_inline(nbytes: int, **extra: Any) -> dict[str, Any]:
    """Fields of a float32 all-reduce whose buffer travels inline as data."""
    return {"dtype": "float32", "count": nbytes // 4, "buf": {"data": b"\x01" * nbytes}, **extra}


@pytest.fixture
def raw_clients() -> Iterator[Callable[..., RawOpClient]]:
    made: list[RawOpClient] = []

    def make(*args: Any, **kwargs: Any) -> RawOpClient:
        client = RawOpClient.connect(*args, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def healthy_all_reduce(clients: list[Any], group: str, k: int) -> None:
    """An all-reduce among well-behaved clients, checked against NumPy."""
    inputs = [np.arange(64, dtype=np.float32) * (i + 1) + k for i in range(len(clients))]
    tensors = [torch.from_numpy(x.copy()) for x in inputs]
    handles = [ops.all_reduce(c, t, group=group, timeout=20) for c, t in zip(clients, tensors, strict=True)]
    for h in handles:
        h.wait(30)
    want = np.sum(inputs, axis=0)
    for i, t in enumerate(tensors):
        np.testing.assert_array_equal(t.numpy(), want, err_msg=f"client {i} after the flood")


# ---- inline size ----------------------------------------------------------------
def test_oversized_inline_buffers_are_refused_and_pin_no_memory(
    start_daemon: Callable[..., DaemonProcess], raw_clients: Callable[..., RawOpClient],
    connect: Callable[..., Any],
) -> None:
    """400 tiny messages naming 1 MiB inline outputs (and some oversized inline data) get a limit error each."""
    daemon = start_daemon().wait_ready()
    raw = raw_clients(daemon, 0, 3, {"stuck": [0, 1], "solo": [0]})
    healthy = [connect(r, 3) for r in (1, 2)]
    for c in healthy:
        c.register_group("healthy", [1, 2])
    assert raw.reply_to(raw.submit("solo", **allreduce_inline(16)))["t"] == s.DONE
    before = settled_rss(raw, daemon)

    flood = 400
    for _ in range(flood):  # each message is ~100 bytes; the old daemon allocated 1 MiB for each
        raw.submit("stuck", dtype="float32", count=MIB // 4, buf={"inline": MIB}, timeout_ms=DAY_MS)
    for _ in range(8):
        raw.submit("stuck", **allreduce_inline(2 * s.INLINE_MAX_BYTES), timeout_ms=DAY_MS)
    marker = raw.submit("solo", **allreduce_inline(16))
    assert raw.reply_to(marker)["t"] == s.DONE  # the channel is in order: the flood has been handled
    grown = rss_bytes(daemon.pid) - before
    print(f"inline flood: the daemon grew by {grown / MIB:.1f} MiB")
    assert grown <= RSS_SLACK, f"the daemon grew by {grown / MIB:.0f} MiB (bound {RSS_SLACK / MIB:.0f} MiB)"

    errors = [r for r in raw.take_replies() if r["t"] == s.ERROR]
    assert len(errors) == flood + 8, f"{len(errors)} errors for {flood + 8} oversized ops"
    for reply in errors:
        assert reply["code"] == s.E_LIMIT, reply
        assert "'inline'" in reply["message"] and str(s.INLINE_MAX_BYTES) in reply["message"], reply
    status = raw.status(daemon)
    assert status["limits_hit"].get(lim.INLINE) == flood + 8, status["limits_hit"]
    assert status["limits"]["max_op_timeout"] == lim.DEFAULT_MAX_OP_TIMEOUT_S
    healthy_all_reduce(healthy, "healthy", 1)


# ---- pending ops -------------------------------------------------------------------
def test_pending_ops_are_capped_by_count_and_bytes(
    start_daemon: Callable[..., DaemonProcess], raw_clients: Callable[..., RawOpClient],
    connect: Callable[..., Any],
) -> None:
    """A flood of valid ops that never complete: past the caps each gets a limit error; memory stays bounded."""
    max_ops, max_bytes = 3000, 8 * MIB
    daemon = start_daemon(extra=["--max-pending-ops", str(max_ops), "--max-pending-bytes", str(max_bytes)])
    daemon.wait_ready()
    # Rank 3 takes part in 'stuck' but never submits: the flood waits for it until it leaves.
    raw = raw_clients(daemon, 0, 4, {"stuck": [0, 3], "solo": [0]})
    healthy = [connect(r, 4) for r in (1, 2)]
    for c in healthy:
        c.register_group("healthy", [1, 2])
    absent = connect(3, 4)
    assert raw.reply_to(raw.submit("solo", **allreduce_inline(16)))["t"] == s.DONE
    before = settled_rss(raw, daemon)

    inline_flood, barrier_flood = 40_000, 2_000
    for _ in range(inline_flood):  # 4 KiB inline each: the old daemon held all 160 MiB
        raw.submit("stuck", **allreduce_inline(s.INLINE_MAX_BYTES), timeout_ms=DAY_MS)
    for _ in range(barrier_flood):  # no buffers: only the count limit applies
        raw.submit("stuck", kind="barrier", timeout_ms=DAY_MS)
    marker = raw.submit("solo", **allreduce_inline(16))
    marker_reply = raw.reply_to(marker, timeout=60)
    grown = rss_bytes(daemon.pid) - before
    bound = max_bytes + max_ops * PER_OP_RECORD + RSS_SLACK
    print(f"pending flood: the daemon grew by {grown / MIB:.1f} MiB")
    assert grown <= bound, f"the daemon grew by {grown / MIB:.0f} MiB (bound {bound / MIB:.0f} MiB)"

    admitted_inline = max_bytes // s.INLINE_MAX_BYTES
    admitted_barriers = max_ops - admitted_inline
    assert marker_reply["code"] == s.E_LIMIT and "--max-pending-ops" in marker_reply["message"], marker_reply
    errors = [r for r in raw.take_replies() if r["t"] == s.ERROR and r["id"] != marker]
    by_limit = {"bytes": 0, "ops": 0}
    for reply in errors:
        assert reply["code"] == s.E_LIMIT, reply
        by_limit["bytes" if "--max-pending-bytes" in reply["message"] else "ops"] += 1
    assert by_limit == {"bytes": inline_flood - admitted_inline, "ops": barrier_flood - admitted_barriers}
    status = raw.status(daemon)
    row = next(c for c in status["clients"] if c["rank"] == 0)
    assert (row["pending_ops"], row["pending_bytes"]) == (max_ops, admitted_inline * s.INLINE_MAX_BYTES), row
    assert status["limits_hit"] == {lim.PENDING_BYTES: inline_flood - admitted_inline,
                                    lim.PENDING_OPS: barrier_flood - admitted_barriers + 1}, status["limits_hit"]
    assert f"limits hit: pending_bytes {inline_flood - admitted_inline:,}, pending_ops" in format_status(status)
    healthy_all_reduce(healthy, "healthy", 1)

    # The peer leaves: every pending op fails, which frees the client's share; it can submit again.
    absent.close()
    wait_until(lambda: sum(1 for r in raw.replies if r.get("code") == s.E_PEER_DIED) == max_ops, 60,
               f"{max_ops} peer_died errors for the pending ops")
    assert raw.reply_to(raw.submit("solo", **allreduce_inline(16)))["t"] == s.DONE
    row = next(c for c in raw.status(daemon)["clients"] if c["rank"] == 0)
    assert (row["pending_ops"], row["pending_bytes"]) == (0, 0), row


def test_an_op_id_still_pending_cannot_be_reused(
    start_daemon: Callable[..., DaemonProcess], raw_clients: Callable[..., RawOpClient],
) -> None:
    """The daemon tracks a client's pending ops by id: a second op under a pending id is refused."""
    daemon = start_daemon().wait_ready()
    raw = raw_clients(daemon, 0, 2, {"pair": [0, 1], "solo": [0]})
    first = raw.submit("pair", **allreduce_inline(16))
    raw.next_id = first  # the next op reuses the id of the one still waiting for rank 1
    reply = raw.reply_to(raw.submit("solo", **allreduce_inline(16)))
    assert reply["t"] == s.ERROR and reply["code"] == s.E_PROTOCOL, reply
    assert f"op id {first} is already pending" in reply["message"], reply
    assert raw.reply_to(raw.submit("solo", **allreduce_inline(16)))["t"] == s.DONE
    row = next(c for c in raw.status(daemon)["clients"] if c["rank"] == 0)
    assert (row["pending_ops"], row["pending_bytes"]) == (1, 16), row


# ---- reply backlog ---------------------------------------------------------------------
def test_client_that_stops_reading_replies_is_dropped(
    start_daemon: Callable[..., DaemonProcess], raw_clients: Callable[..., RawOpClient],
    connect: Callable[..., Any],
) -> None:
    """Replies pile up for a client that never reads: it is dropped, its peer's op fails naming it."""
    backlog = 2 * MIB
    daemon = start_daemon(extra=["--max-reply-backlog", str(backlog)]).wait_ready()
    raw = raw_clients(daemon, 0, 3, {"solo": [0], "with_raw": [0, 1]}, read=False)
    healthy = [connect(r, 3) for r in (1, 2)]
    for c in healthy:
        c.register_group("healthy", [1, 2])
    healthy[0].register_group("with_raw", [0, 1])
    waiting = ops.all_reduce(healthy[0], torch.ones(16), group="with_raw", timeout=60)
    before = settled_rss(raw, daemon)

    def dropped() -> bool:
        ranks = [c["rank"] for c in raw.status(daemon)["clients"]]
        return 0 not in ranks

    sent = 0
    deadline = time.monotonic() + 60
    try:  # ~4 KiB of reply per op; the daemon closes the channel once the backlog passes its limit
        while sent < 50_000 and time.monotonic() < deadline:
            raw.submit("solo", **allreduce_inline(s.INLINE_MAX_BYTES))
            sent += 1
            if sent % 1000 == 0 and dropped():
                break
    except OSError:
        pass  # the daemon closed the channel
    grown = rss_bytes(daemon.pid) - before
    print(f"reply flood: the daemon grew by {grown / MIB:.1f} MiB")
    wait_until(dropped, 30, f"the daemon to drop the client that left {sent} replies unread")
    assert grown <= backlog + RSS_SLACK, f"the daemon grew by {grown / MIB:.0f} MiB while replies piled up"

    with pytest.raises(PeerDiedError) as failed:
        waiting.wait(30)
    assert "rank 0" in str(failed.value) and "stopped reading replies" in str(failed.value), failed.value
    status = raw.status(daemon)
    assert status["limits_hit"].get(lim.REPLY_BACKLOG) == 1, status["limits_hit"]
    log = (daemon.paths.directory / "daemon.out").read_text(errors="replace")
    assert log.count("hit the reply_backlog limit") == 1, daemon.log_tail()
    healthy_all_reduce(healthy, "healthy", 1)


# ---- op timeouts -----------------------------------------------------------------------
def test_op_timeout_is_capped_at_the_daemon_maximum(
    start_daemon: Callable[..., DaemonProcess], raw_clients: Callable[..., RawOpClient],
) -> None:
    """An op asking to wait 7 days for a peer that never comes fails at --max-op-timeout."""
    cap = 2.0
    daemon = start_daemon(op_timeout=1.0, extra=["--max-op-timeout", str(cap)]).wait_ready()
    raw = raw_clients(daemon, 0, 2, {"pair": [0, 1]})
    started = time.monotonic()
    op_id = raw.submit("pair", **allreduce_inline(16), timeout_ms=7 * DAY_MS)
    reply = raw.reply_to(op_id, timeout=30)
    waited = time.monotonic() - started
    assert reply["t"] == s.ERROR and reply["code"] == s.E_TIMEOUT, reply
    assert f"within the op timeout of {cap:.1f}s" in reply["message"], reply
    assert cap - 0.2 <= waited <= cap + 10, f"failed after {waited:.1f}s, the cap is {cap}s"
    assert raw.status(daemon)["limits_hit"].get(lim.OP_TIMEOUT) == 1


# ---- settings ----------------------------------------------------------------------------
def _args(**given: Any) -> argparse.Namespace:
    names = ("max_pending_ops", "max_pending_bytes", "max_reply_backlog", "max_op_timeout")
    return argparse.Namespace(**{name: given.get(name) for name in names})


def test_limit_settings_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("COMMD_MAX_PENDING_OPS", "COMMD_MAX_PENDING_BYTES", "COMMD_MAX_REPLY_BACKLOG",
                "COMMD_MAX_OP_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    assert lim.limits_from_args(_args(), 30.0) == lim.ClientLimits()
    assert lim.limits_from_args(_args(), 2 * 86400.0).max_op_timeout == 2 * 86400.0  # never below --op-timeout
    got = lim.limits_from_args(_args(max_pending_ops=10, max_reply_backlog=2 * MIB, max_op_timeout=60.0), 30.0)
    assert (got.max_pending_ops, got.max_reply_backlog, got.max_op_timeout) == (10, 2 * MIB, 60.0)
    monkeypatch.setenv("COMMD_MAX_PENDING_BYTES", str(MIB))
    assert lim.limits_from_args(_args(), 30.0).max_pending_bytes == MIB
    bad = [
        (_args(max_pending_ops=0), "--max-pending-ops"),
        (_args(max_pending_bytes=100), "--max-pending-bytes"),
        (_args(max_reply_backlog=1000), "--max-reply-backlog"),
        (_args(max_op_timeout=10.0), "shorter than the default op timeout"),
        (_args(max_op_timeout=8 * 86400.0), "--max-op-timeout"),
    ]
    for args, words in bad:
        with pytest.raises(ConfigError, match=words):
            lim.limits_from_args(args, 30.0)
    monkeypatch.setenv("COMMD_MAX_PENDING_OPS", "many")
    with pytest.raises(ConfigError, match="COMMD_MAX_PENDING_OPS"):
        lim.limits_from_args(_args(), 30.0)


def test_limits_from_the_config_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A [limits] table in the daemon's config: used when no flag or variable says otherwise; checked."""
    monkeypatch.delenv("COMMD_MAX_PENDING_OPS", raising=False)
    monkeypatch.delenv("COMMD_MAX_OP_TIMEOUT", raising=False)
    path = tmp_path / "commd.toml"
    path.write_text("[limits]\nmax_pending_ops = 100\nmax_op_timeout = 3600\n")
    section = lim.config_section(str(path))
    got = lim.limits_from_args(_args(), 30.0, section)
    assert (got.max_pending_ops, got.max_op_timeout) == (100, 3600.0)
    assert lim.limits_from_args(_args(max_pending_ops=7), 30.0, section).max_pending_ops == 7
    monkeypatch.setenv("COMMD_MAX_PENDING_OPS", "9")
    assert lim.limits_from_args(_args(), 30.0, section).max_pending_ops == 9
    for text, words in [("[limits]\nmax_pending_ops = 0\n", "max_pending_ops"),
                        ("[limits]\nmax_pending_bytes = \"lots\"\n", "max_pending_bytes"),
                        ("[limits]\nmax_ops = 5\n", "unknown"),
                        ("limits = 5\n", "must be a table")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=words):
            lim.config_section(str(path))


def test_daemon_refuses_a_bad_limit_flag(runtime_dir: Any) -> None:
    proc = subprocess.run([sys.executable, "-m", "commd", "daemon", "--job", "limits-flag-check",
                           "--max-reply-backlog", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--max-reply-backlog 0 must lie in" in proc.stderr, proc.stderr
