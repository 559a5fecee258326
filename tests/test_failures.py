"""Failures a job meets in practice: disagreeing ranks, missing ranks, dead ranks, a dead daemon.

In each case every affected rank must get a specific, actionable exception
(naming the field, the rank, the reason) promptly, never a hang; and the
daemon must either keep serving or shut down cleanly.  Timing assertions
compare wall-clock stamps taken by the workers and by the test on the same
machine, with generous upper bounds (this may run on a loaded 2-core box).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers import DaemonProcess, RawSocket, WorkerContext, Workers, shm_files, wait_until

from commd.protocol import schema as s

WAIT_S = 30.0  # bound on any single wait inside a worker


def _outcome(handles: list[Any]) -> tuple[str, str, float]:
    """Wait for every handle; (exception class name, message, wall time) of the first failure."""
    try:
        for h in handles:
            h.wait(WAIT_S)
    except Exception as exc:  # the class name is what the test checks
        return type(exc).__name__, str(exc), time.time()
    return "completed", "", time.time()


def daemon_status(daemon: DaemonProcess) -> dict[str, Any]:
    sock = RawSocket(daemon.paths)
    try:
        reply = sock.request({"t": s.STATUS, "secret": daemon.secret()}, timeout=5)
    finally:
        sock.close()
    assert reply["t"] == s.STATUS, reply
    return reply["status"]


def waiting(daemon: DaemonProcess, group: str = "world") -> int:
    """Ops (collective sequence numbers or p2p halves) the daemon holds for ``group``."""
    return daemon_status(daemon)["groups"].get(group, {}).get("waiting", 0)


# ---- mismatched ops -------------------------------------------------------------
MISMATCHES: dict[str, tuple[str, ...]] = {
    # variant: words every failing rank's MismatchError must contain
    "dtype": ("'dtype'", "ranks [0, 1] 'float32'", "ranks [2] 'float64'"),
    "count": ("'count'", "ranks [0, 1] 4", "ranks [2] 5"),
    "kind": ("'kind'", "ranks [0, 1] 'allreduce'", "ranks [2] 'broadcast'"),
    "root": ("'root'", "ranks [0, 1] 0", "ranks [2] 1"),
    "reduce_op": ("'reduce_op'", "ranks [0, 1] 'sum'", "ranks [2] 'max'"),
    "counts": ("'counts'", "[2]"),
    "splits": ("rank 1 sends 2 elements to rank 2", "expects 3"),
    "p2p": ("rank 0", "4 x float32", "rank 1", "5 x float32"),
}


def submit_mismatch(client: Any, variant: str, rank: int) -> list[Any]:
    """Rank 2 (for p2p: the receiver) disagrees with the others in exactly one way."""
    from commd.client import ops

    odd = rank == 2
    if variant == "dtype":
        return [ops.all_reduce(client, torch.zeros(4, dtype=torch.float64 if odd else torch.float32))]
    if variant == "count":
        return [ops.all_reduce(client, torch.zeros(5 if odd else 4))]
    if variant == "kind":
        t = torch.zeros(4)
        return [ops.broadcast(client, t, 0) if odd else ops.all_reduce(client, t)]
    if variant == "root":
        return [ops.broadcast(client, torch.zeros(4), 1 if odd else 0)]
    if variant == "reduce_op":
        return [ops.all_reduce(client, torch.zeros(4), "max" if odd else "sum")]
    if variant == "counts":
        counts = [4, 4, 5] if odd else [4, 4, 4]
        return [ops.all_gather(client, torch.zeros(sum(counts)), torch.zeros(counts[rank]), counts)]
    if variant == "splits":
        splits_out = [2, 3, 2] if odd else [2, 2, 2]
        return [ops.all_to_all(client, torch.zeros(sum(splits_out)), torch.zeros(6), [2, 2, 2], splits_out)]
    if variant == "p2p":
        if rank == 0:
            return [ops.send(client, torch.zeros(4), 1, tag=11)]
        if rank == 1:
            return [ops.recv(client, torch.zeros(5), 0, tag=11)]
        return []
    raise AssertionError(variant)


def mismatch_worker(ctx: WorkerContext) -> dict[str, Any]:
    from commd.client import ops

    client = ctx.connect()
    seen: dict[str, Any] = {}
    for variant in MISMATCHES:
        handles = submit_mismatch(client, variant, ctx.rank)
        if handles:
            seen[variant] = _outcome(handles)[:2]
    t = torch.full((4,), float(ctx.rank))
    ops.all_reduce(client, t).wait(WAIT_S)  # a matching op still works afterwards
    seen["recovery"] = t.tolist()
    client.close()
    return seen


@pytest.mark.timeout(90)
def test_mismatched_ops_fail_on_every_rank(start_daemon: Callable[..., DaemonProcess],
                                          start_workers: Callable[..., Workers]) -> None:
    """Disagreeing dtype/count/kind/root/reduce op/counts/splits: MismatchError naming field and ranks."""
    daemon = start_daemon(op_timeout=20)
    workers = start_workers(mismatch_worker, 3)
    daemon.wait_ready()
    results = workers.join(60)
    problems = []
    for variant, words in MISMATCHES.items():
        ranks = [0, 1] if variant == "p2p" else [0, 1, 2]
        for rank in ranks:
            kind, message = results[rank][variant]
            missing = [w for w in words if w not in message]
            if kind != "MismatchError" or missing:
                problems.append(f"{variant}, rank {rank}: got {kind}({message!r}); missing {missing}")
    for rank in range(3):
        if results[rank]["recovery"] != [3.0] * 4:
            problems.append(f"rank {rank}: all-reduce after the mismatches gave {results[rank]['recovery']}")
    assert not problems, "\n".join(problems)


# ---- op timeout ---------------------------------------------------------------
def timeout_worker(ctx: WorkerContext) -> dict[str, Any]:
    """Rank 0 waits on ops rank 1 does not (yet) submit."""
    from commd.client import CommdError, ops

    client = ctx.connect()
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        start = time.time()
        out["collective"] = (*_outcome([ops.all_reduce(client, torch.ones(4))]), start)
        start = time.time()
        out["recv"] = (*_outcome([ops.recv(client, torch.zeros(4), 1, tag=7)]), start)
        ctx.event("timed out")
        t = torch.full((4,), 1.0)
        ops.all_reduce(client, t, timeout=WAIT_S).wait(WAIT_S)  # own timeout: rank 1 comes later
        out["recovery"] = t.tolist()
    else:
        ctx.command()  # the test says when rank 0 has timed out
        try:  # the late half of the expired op #0 must fail, not match anything
            ops.all_reduce(client, torch.ones(4), timeout=WAIT_S).wait(WAIT_S)
            out["late"] = ("completed", "")
        except CommdError as exc:
            out["late"] = (type(exc).__name__, str(exc))
        t = torch.full((4,), 2.0)
        ops.all_reduce(client, t, timeout=WAIT_S).wait(WAIT_S)
        out["recovery"] = t.tolist()
    client.close()
    return out


@pytest.mark.timeout(90)
def test_missing_rank_times_out_naming_it(start_daemon: Callable[..., DaemonProcess],
                                          start_workers: Callable[..., Workers]) -> None:
    """--op-timeout 2: the waiting rank gets CommTimeoutError naming rank 1 after ~2 s, not before."""
    op_timeout = 2.0
    daemon = start_daemon(op_timeout=op_timeout)
    workers = start_workers(timeout_worker, 2)
    daemon.wait_ready()
    workers.wait_event(0, "timed out", 60)
    workers.send(1, "go")
    results = workers.join(60)
    for what in ("collective", "recv"):
        kind, message, failed_at, started = results[0][what]
        elapsed = failed_at - started
        assert kind == "CommTimeoutError", f"{what}: {kind}({message!r})"
        assert "[1]" in message or "rank 1" in message, f"{what}: message does not name rank 1: {message!r}"
        assert "timed out" in message
        assert op_timeout - 0.1 <= elapsed <= op_timeout + 4, f"{what} failed after {elapsed:.2f}s"
    late_kind, late_message = results[1]["late"]
    assert late_kind != "completed" and "timed out" in late_message, results[1]["late"]
    assert results[0]["recovery"] == results[1]["recovery"] == [3.0] * 4


@pytest.mark.timeout(60)
def test_late_rank_of_a_timed_out_op_gets_comm_timeout_error(
    start_daemon: Callable[..., DaemonProcess], connect: Callable[..., Any],
) -> None:
    """The rank that arrives after an op expired should see the same CommTimeoutError as the others."""
    from commd.client import CommTimeoutError, ops

    start_daemon(op_timeout=1).wait_ready()
    early, late = connect(0, 2), connect(1, 2)
    with pytest.raises(CommTimeoutError):
        ops.all_reduce(early, torch.ones(4)).wait(WAIT_S)
    with pytest.raises(CommTimeoutError, match="timed out"):
        ops.all_reduce(late, torch.ones(4)).wait(WAIT_S)


@pytest.mark.timeout(60)
def test_peer_leaving_fails_ops_that_need_it(daemon: DaemonProcess, connect: Callable[..., Any]) -> None:
    """A rank that closes its client cannot take part any more: its peers should learn it at once."""
    from commd.client import PeerDiedError, ops

    stays, leaves = connect(0, 2), connect(1, 2)
    handle = ops.all_reduce(stays, torch.ones(4))
    leaves.close()
    with pytest.raises(PeerDiedError, match="rank 1"):
        handle.wait(5)  # the daemon's op timeout is 20 s


@pytest.mark.timeout(60)
def test_close_fails_pending_handles(daemon: DaemonProcess, connect: Callable[..., Any]) -> None:
    """Handles still pending when their client closes must complete with an error, not hang."""
    from commd.client import ops

    client = connect(0, 2)
    handle = ops.all_reduce(client, torch.ones(4))  # rank 1 never joins
    client.close()
    wait_until(handle.is_completed, 5, "the pending handle to be failed by close()")
    assert handle.exception() is not None


# ---- a rank killed mid-collective ----------------------------------------------
def killed_peer_worker(ctx: WorkerContext) -> dict[str, Any]:
    """Ranks 0 and 2 enter an all-reduce; the test kills 2; rank 1 arrives afterwards."""
    from commd.client import ops

    client = ctx.connect()
    out: dict[str, Any] = {}
    if ctx.rank == 1:
        ctx.event("connected")
        ctx.command()  # after rank 2 was killed
        out["late"] = _outcome([ops.all_reduce(client, torch.ones(4))])
    else:
        handle = ops.all_reduce(client, torch.ones(1 << 16))
        ctx.event("submitted")
        if ctx.rank == 2:
            ctx.command(120)  # killed while waiting here
            raise AssertionError("rank 2 should have been killed")
        out["waiting"] = _outcome([handle])
        ctx.event("failed")
    ctx.command()
    client.close()
    return out


@pytest.mark.timeout(90)
def test_killed_peer_fails_the_op_and_daemon_keeps_serving(
    start_daemon: Callable[..., DaemonProcess], start_workers: Callable[..., Workers],
    connect: Callable[..., Any],
) -> None:
    """SIGKILL of a rank mid-collective: PeerDiedError naming it, well within the op timeout."""
    from commd.client import ops

    op_timeout = 15.0
    daemon = start_daemon(op_timeout=op_timeout)
    workers = start_workers(killed_peer_worker, 3)
    daemon.wait_ready()
    for rank, event in ((0, "submitted"), (2, "submitted"), (1, "connected")):
        workers.wait_event(rank, event, 60)
    wait_until(lambda: (daemon_status(daemon)["oldest_waiting"] or {}).get("missing_ranks") == [1], 20,
               "ranks 0 and 2 to be waiting in the daemon")
    killed_at = time.time()
    workers.kill(2)
    workers.wait_event(0, "failed", 30)
    workers.send(1, "go")
    workers.send(0, "close")
    workers.send(1, "close")
    results = workers.join(60, ranks=[0, 1])
    for rank, what in ((0, "waiting"), (1, "late")):
        kind, message, failed_at = results[rank][what]
        assert kind == "PeerDiedError", f"rank {rank}: {kind}({message!r})"
        assert "rank 2" in message and "died" in message, f"rank {rank}: {message!r}"
    delay = results[0]["waiting"][2] - killed_at
    assert delay < min(5.0, op_timeout), f"PeerDiedError came {delay:.1f}s after the kill"

    # A new set of clients (a restarted job) is served normally.
    wait_until(lambda: not daemon_status(daemon)["clients"], 20, "the old clients to be gone")
    clients = [connect(r, 2) for r in range(2)]
    tensors = [torch.full((8,), float(r + 1)) for r in range(2)]
    handles = [ops.all_reduce(c, t) for c, t in zip(clients, tensors, strict=True)]
    for h in handles:
        h.wait(WAIT_S)
    for t in tensors:
        np.testing.assert_array_equal(t.numpy(), np.full(8, 3.0, dtype=np.float32))


# ---- the daemon stopped or killed under waiting ops -----------------------------
def waiting_worker(ctx: WorkerContext) -> dict[str, Any]:
    """Rank 0 waits in an all-reduce rank 1 never joins; rank 1 waits on a recv nobody sends.

    After the daemon is gone, rank 1 may be told to submit once more ('again')."""
    from commd.client import CommdError, ops

    client = ctx.connect()
    out: dict[str, Any] = {}
    handle = ops.all_reduce(client, torch.ones(4)) if ctx.rank == 0 else ops.recv(client, torch.zeros(4), 0, tag=5)
    ctx.event("submitted")
    out["waiting"] = _outcome([handle])
    if ctx.command() == "again":
        started = time.time()
        try:
            ops.barrier(client).wait(WAIT_S)
            out["again"] = ("completed", "", time.time(), started)
        except CommdError as exc:
            out["again"] = (type(exc).__name__, str(exc), time.time(), started)
    client.close()
    return out


@pytest.mark.timeout(90)
def test_sigterm_fails_waiting_ops_and_cleans_up(
    start_daemon: Callable[..., DaemonProcess], start_workers: Callable[..., Workers],
) -> None:
    """SIGTERM: DaemonShutdownError('shutting down') everywhere, exit 0, no files left behind."""
    daemon = start_daemon(op_timeout=60)
    workers = start_workers(waiting_worker, 2)
    daemon.wait_ready()
    for rank in range(2):
        workers.wait_event(rank, "submitted", 60)
    wait_until(lambda: waiting(daemon) == 2, 20, "both ops to be waiting in the daemon")
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=20) == 0, daemon.log_tail()
    for rank in range(2):
        workers.send(rank, "stop")
    results = workers.join(60)
    for rank in range(2):
        kind, message, _ = results[rank]["waiting"]
        assert kind == "DaemonShutdownError", f"rank {rank}: {kind}({message!r})"
        assert "shutting down" in message, message
    paths = daemon.paths
    left = [p.name for p in (paths.socket, paths.pid_file, paths.secret_file) if p.exists()]
    assert not left, f"the daemon left {left} behind"
    assert shm_files(daemon.job) == []


@pytest.mark.timeout(90)
def test_sigkill_of_the_daemon_fails_clients_promptly(
    start_daemon: Callable[..., DaemonProcess], start_workers: Callable[..., Workers],
    connect: Callable[..., Any],
) -> None:
    """A daemon killed with SIGKILL: waiting and new ops get DaemonDiedError within seconds;
    a new daemon for the job then starts over the stale files and serves new clients."""
    from commd.client import ops

    daemon = start_daemon(op_timeout=60)
    workers = start_workers(waiting_worker, 2)
    daemon.wait_ready()
    for rank in range(2):
        workers.wait_event(rank, "submitted", 60)
    wait_until(lambda: waiting(daemon) == 2, 20, "both ops to be waiting in the daemon")
    daemon_secret = daemon.secret()
    killed_at = time.time()
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.proc.wait(timeout=10)
    workers.send(0, "stop")
    workers.send(1, "again")
    results = workers.join(60)
    for rank in range(2):
        kind, message, failed_at = results[rank]["waiting"]
        assert kind == "DaemonDiedError", f"rank {rank}: {kind}({message!r})"
        assert failed_at - killed_at < 5, f"rank {rank} noticed the dead daemon after {failed_at - killed_at:.1f}s"
    kind, message, failed_at, started = results[1]["again"]
    assert kind == "DaemonDiedError", f"an op submitted after the daemon died: {kind}({message!r})"
    assert failed_at - started < 5

    # The crashed daemon left its socket, pid and secret files; a new one must start over them.
    restarted = start_daemon(op_timeout=20).wait_ready()
    assert restarted.secret() != daemon_secret
    clients = [connect(r, 2) for r in range(2)]
    tensors = [torch.full((8,), float(r + 1)) for r in range(2)]
    handles = [ops.all_reduce(c, t) for c, t in zip(clients, tensors, strict=True)]
    for h in handles:
        h.wait(WAIT_S)
    assert all(torch.equal(t, torch.full((8,), 3.0)) for t in tensors)


@pytest.mark.timeout(90)
def test_stall_is_logged_shown_and_can_shut_the_daemon_down(
    start_daemon: Callable[..., DaemonProcess], connect: Callable[..., Any], tmp_path: Any,
) -> None:
    """Rank 1 never submits: after stall_warning_s the op is logged and listed with rank 1; after
    stall_shutdown_s the daemon shuts down and rank 0 learns why."""
    from commd.client import CommdError, ops

    config = tmp_path / "commd.toml"
    config.write_text("[scheduler]\nstall_warning_s = 0.5\nstall_shutdown_s = 3\n")
    daemon = start_daemon(op_timeout=60, extra=["--config", str(config)]).wait_ready()
    waiting, _absent = connect(0, 2), connect(1, 2)
    handle = ops.all_reduce(waiting, torch.ones(4))

    def stalled() -> list[dict[str, Any]]:
        return [r for r in daemon_status(daemon)["stalls"] if r["missing_ranks"] == [1]]

    rows = wait_until(stalled, 20, "the stall to be listed with rank 1")
    assert rows[0]["kind"] == "allreduce" and rows[0]["waiting_s"] >= 0.5
    with pytest.raises(CommdError, match="stalled"):
        handle.wait(30)
    assert "stalled: allreduce #0 on group 'world'" in daemon.log_tail(80)
    daemon.proc.wait(timeout=20)


def test_bad_config_file_is_refused_at_start(start_daemon: Callable[..., DaemonProcess], tmp_path: Any) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[[rules]]\nlane = "pigeon"\n')
    daemon = start_daemon(extra=["--config", str(config)])
    assert daemon.proc.wait(timeout=60) == 2
    assert "'lane' must be one of" in daemon.log_tail()


def test_auto_started_daemon_that_no_client_reaches_exits(start_daemon: Callable[..., DaemonProcess]) -> None:
    """Whoever auto-started the daemon died before connecting: it must not serve an empty job forever."""
    daemon = start_daemon(extra=["--exit-when-idle", "--first-client-grace", "1"]).wait_ready()
    try:
        code = daemon.proc.wait(timeout=30)
    except Exception as exc:
        raise AssertionError(f"the daemon still runs 30 s after a 1 s first-client grace:\n{daemon.log_tail()}") from exc
    assert code == 0, daemon.log_tail()
    assert "no client connected within 1s of the start" in daemon.log_tail(), daemon.log_tail()


def test_first_client_grace_is_validated(start_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemon(extra=["--exit-when-idle", "--first-client-grace", "0"])
    assert daemon.proc.wait(timeout=60) != 0
    assert "--first-client-grace 0.0 must lie in" in daemon.log_tail(), daemon.log_tail()
