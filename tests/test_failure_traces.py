"""Failures leave a clear trace: in the daemon's log, in `commd status`, in the job directory.

Each test provokes one kind of failure against a real daemon (or the pure
component that decides the trace) and checks the trace against what was
provoked: the op kind, group, sequence number and ranks it must name, the
number of log lines a flood may cost, what is kept on disk and what is not.
"""

from __future__ import annotations

import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import DaemonProcess, RawSocket, new_job, wait_until

from commd.cli.status import format_status
from commd.client import ops
from commd.client.connection import Client
from commd.client.errors import CommdError
from commd.observe.stats import LATENCY_WINDOW, Stats
from commd.protocol import schema as s

WAIT_S = 30.0


@pytest.fixture
def daemon(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[DaemonProcess]:
    """A daemon (op timeout 2 s) in a private runtime dir; in-process clients find it through the env."""
    runtime = tmp_path_factory.mktemp("trace")
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("COMMD_JOB", raising=False)
    proc = DaemonProcess.start(runtime, new_job(), op_timeout=2.0).wait_ready()
    try:
        yield proc
    finally:
        proc.stop()


def _log(daemon: DaemonProcess) -> str:
    return (daemon.paths.directory / "daemon.out").read_text(errors="replace")


def _log_lines(daemon: DaemonProcess, pattern: str) -> list[str]:
    return [line for line in _log(daemon).splitlines() if re.search(pattern, line)]


def _clients(daemon: DaemonProcess, n: int) -> list[Client]:
    clients = [Client(r, n, job=daemon.job, arena_bytes=1 << 20) for r in range(n)]
    for c in clients:
        c.register_group("world", list(range(n)))
    return clients


def _status(daemon: DaemonProcess) -> dict[str, Any]:
    sock = RawSocket(daemon.paths)
    try:
        reply = sock.request({"t": s.STATUS, "secret": daemon.secret()}, timeout=10)
    finally:
        sock.close()
    assert reply["t"] == s.STATUS, reply
    return reply["status"]


# ---- a. one log line per op failure ------------------------------------------------
@pytest.mark.timeout(120)
def test_mismatch_timeout_and_dead_peer_each_leave_one_log_line(daemon: DaemonProcess) -> None:
    c0, c1 = _clients(daemon, 2)
    try:
        # mismatch: rank 1 sends float64 where rank 0 sends float32 (sequence 0)
        h0 = ops.all_reduce(c0, torch.zeros(4), group="world")
        h1 = ops.all_reduce(c1, torch.zeros(4, dtype=torch.float64), group="world")
        for h in (h0, h1):
            with pytest.raises(CommdError, match="mismatch"):
                h.wait(WAIT_S)
        # timeout: only rank 0 submits sequence 1 (op timeout 2 s)
        h0 = ops.all_reduce(c0, torch.zeros(4), group="world")
        with pytest.raises(CommdError, match="timed out"):
            h0.wait(WAIT_S)
        # peer died: rank 0 waits on broadcast #2 while rank 1 leaves
        h0 = ops.broadcast(c0, torch.zeros(4), 0, group="world")
        c1.close()
        with pytest.raises(CommdError, match="left the job"):
            h0.wait(WAIT_S)
    finally:
        c0.close()
        c1.close()
    mismatch = wait_until(lambda: _log_lines(daemon, r"op failed \(mismatch\)"), 10, "the mismatch log line")
    timeout = wait_until(lambda: _log_lines(daemon, r"op failed \(timeout\)"), 10, "the timeout log line")
    died = wait_until(lambda: _log_lines(daemon, r"op failed \(peer_died\)"), 10, "the peer-died log line")
    assert len(mismatch) == len(timeout) == len(died) == 1, (mismatch, timeout, died)
    assert " WARNING " in mismatch[0] and "allreduce #0 on group 'world', ranks [0, 1]" in mismatch[0], mismatch
    assert "'dtype'" in mismatch[0], mismatch  # the reason, as the ranks got it
    assert " WARNING " in timeout[0] and "allreduce #1 on group 'world', ranks [0]" in timeout[0], timeout
    assert "global ranks [1]" in timeout[0], timeout  # who did not submit
    assert " ERROR " in died[0] and "broadcast #2 on group 'world', ranks [0]" in died[0], died
    assert "global rank 1) left the job" in died[0], died


# ---- f. a flooding client costs a bounded number of log lines ---------------------------
@pytest.mark.extended  # make test-extended (CI runs it after make test)
@pytest.mark.timeout(120)
def test_a_flood_of_bad_messages_is_rate_limited(daemon: DaemonProcess) -> None:
    flood = 500
    sock = RawSocket(daemon.paths)
    started = time.monotonic()
    try:
        for _ in range(flood):
            sock.send_raw(b"\xc1 not msgpack")
        answers = [sock.recv(WAIT_S) for _ in range(flood)]
    finally:
        sock.close()
    periods = int((time.monotonic() - started) // 10) + 1  # rate-limit periods (10 s) the flood spanned
    assert all(a["t"] == s.ERROR and a["code"] == s.E_PROTOCOL for a in answers)  # every one answered
    lines = _log_lines(daemon, "not valid msgpack")
    assert 1 <= len(lines) <= 10 * periods, f"{len(lines)} log lines for {flood} bad messages"

    def accounted() -> bool:  # the rest are summarized once their period ends (the watchdog flushes)
        summaries = _log_lines(daemon, r"suppressed \d+ similar messages")
        suppressed = sum(int(re.search(r"suppressed (\d+)", line).group(1)) for line in summaries)
        return len(lines) + suppressed == flood

    wait_until(accounted, 30, f"summaries accounting for all {flood} messages")


def test_rate_limited_log_bounds_lines_per_key_and_summarizes() -> None:
    from commd.daemon.loglimit import RateLimitedLog

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("commd.test.loglimit")
    logger.propagate = False
    logger.addHandler(Collect())
    logger.setLevel(logging.INFO)
    now = [100.0]
    limiter = RateLimitedLog(logger, burst=3, period_s=10.0, max_keys=2, clock=lambda: now[0])
    written = [limiter.log(logging.WARNING, "a", "key a", "a %d", i) for i in range(10)]
    assert written == [True] * 3 + [False] * 7
    assert limiter.log(logging.WARNING, "b", "key b", "b") is True  # other keys are not affected
    assert records == ["a 0", "a 1", "a 2", "b"]
    now[0] += 10.0
    limiter.flush()
    assert records[-1] == "suppressed 7 similar messages (key a) in the last 10s"
    assert limiter.log(logging.WARNING, "a", "key a", "a again") is True  # a new period
    # A full key table summarizes (and forgets) its stalest key instead of growing.
    for i in range(4):
        limiter.log(logging.WARNING, "c", "key c", "c %d", i)
    limiter.log(logging.WARNING, "d", "key d", "d")  # evicts "a" (least recently used)
    limiter.log(logging.WARNING, "e", "key e", "e")  # evicts "c", which had suppressed one line
    assert "suppressed 1 similar messages (key c) in the last 0s" in records
    assert len(limiter._windows) <= 2


# ---- g. status: departures, the latency window, aligned tables --------------------------
@pytest.mark.timeout(120)
def test_a_normal_departure_is_not_an_error(daemon: DaemonProcess) -> None:
    c0, c1 = _clients(daemon, 2)
    try:
        handles = [ops.all_reduce(c, torch.ones(4), group="world") for c in (c0, c1)]
        for h in handles:
            h.wait(WAIT_S)
        c1.close()
        status = wait_until(lambda: (st := _status(daemon))["clients"][1:] == [] and st, 10, "rank 1 to be gone")
    finally:
        c0.close()
        c1.close()
    assert status["last_errors"] == [], status["last_errors"]
    assert [d["message"] for d in status.get("departures", [])] == ["rank 1 left the job"]
    assert "recent departures (1)" in format_status(status)


def test_latency_percentiles_say_they_cover_a_window() -> None:
    stats = Stats()
    total = LATENCY_WINDOW + 952
    for i in range(total):
        stats.finished("world", "allreduce", 8, 1e-6 * (i + 1), ok=True)
    row = stats.latency_table()["allreduce"]
    assert row["count"] == total  # every op counted, not only the window
    assert row["window"] == LATENCY_WINDOW
    # the window holds the most recent ops: latencies 953..3000 us
    assert row["p50_us"] == pytest.approx(1e6 * 1e-6 * (total - LATENCY_WINDOW / 2), rel=0.01)
    text = format_status({"latency_us": {"allreduce": row}})
    assert f"{total:,}" in text and f"last {LATENCY_WINDOW:,}" in text and "window" in text


def _column_ends(line: str) -> list[int]:
    """Offsets where each cell of a table line ends (cells are separated by 2+ spaces)."""
    return [m.end() for m in re.finditer(r"\S+(?: \S+)*", line)]


def test_per_kind_table_columns_line_up_for_any_name_length() -> None:
    by_kind = {
        "allreduce": {"local": {"ops": 123_456, "bytes": 5 << 30}, "tcp": {"ops": 4321, "bytes": 100}},
        "a_very_long_kind_name_indeed": {"gloo": {"ops": 1, "bytes": 10}},
        "x": {"tcp": {"ops": 99_999_999, "bytes": 1 << 20}},
    }
    text = format_status({"ops_by_lane": by_kind})
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ops per kind and lane"))
    table = lines[start + 1 : start + 5]
    assert table[0].split()[0] == "kind" and len(table) == 4, table
    ends = [_column_ends(line) for line in table]
    assert all(len(e) == len(ends[0]) for e in ends), table  # the same number of cells on every row
    for col in range(1, len(ends[0])):  # numbers right-aligned under their header
        assert len({e[col] for e in ends}) == 1, f"column {col} misaligned:\n" + "\n".join(table)
    row = {line.split()[0]: line for line in table}
    assert "123,456" in row["allreduce"] and "5.0 GiB" in row["allreduce"]

    def end(kind: str, cell: str) -> int:
        return row[kind].index(cell) + len(cell)

    # The tcp lane's op counts line up with each other, and so do its byte counts.
    assert end("allreduce", "4,321") == end("x", "99,999,999"), "\n".join(table)
    assert end("allreduce", "100 B") == end("x", "1.0 MiB"), "\n".join(table)


# ---- c. an empty op-channel datagram is a bad message, not a disconnect -------------------
@pytest.mark.timeout(120)
def test_daemon_answers_an_empty_datagram_and_keeps_the_client(daemon: DaemonProcess) -> None:
    (client,) = _clients(daemon, 1)
    try:
        client._ops.send(b"")  # what a buggy or hostile peer may send
        # The client is still served: an op after it completes, on the same channel.
        t = torch.full((4,), 3.0)
        ops.all_reduce(client, t, group="world").wait(WAIT_S)
        assert t.tolist() == [3.0] * 4
        status = _status(daemon)
        assert [c["rank"] for c in status["clients"]] == [0], status["clients"]
        assert any("empty message" in e["message"] for e in status["last_errors"]), status["last_errors"]
    finally:
        client.close()
    assert not _log_lines(daemon, "closed its op channel|rank 0 .*died"), _log(daemon)


@pytest.mark.timeout(120)
def test_client_ignores_an_empty_datagram_but_sees_a_real_close(daemon: DaemonProcess) -> None:
    (client,) = _clients(daemon, 1)
    mine, fake_daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    real = client._ops
    try:
        mine.setblocking(False)
        client._ops = mine  # the client now reads from a "daemon" this test controls
        client._ops_poll = select.poll()
        client._ops_poll.register(mine.fileno(), select.POLLIN)
        fake_daemon.send(b"")
        client.pump(1.0)
        assert client._broken is None, client._broken
        fake_daemon.close()
        client.pump(1.0)
        assert client._broken is not None and "closed the op channel" in str(client._broken)
    finally:
        client._ops = real
        client.close()
        mine.close()


# ---- d. a daemon that was frozen says so instead of blaming the coordinator -----------------
def op_after_go(ctx: Any) -> str:
    """Worker: one all-reduce, then (after the test's 'go') another; returns the second one's error."""
    client = ctx.connect()
    t = torch.ones(4)
    ops.all_reduce(client, t).wait(60)
    ctx.event("first-done")
    ctx.command()
    try:
        ops.all_reduce(client, t, timeout=60).wait(60)
        return "no error"
    except CommdError as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.timeout(240)
@pytest.mark.extended
def test_a_frozen_daemon_says_it_was_not_scheduled(cluster: Any) -> None:
    c = cluster(nnodes=2, nproc=1, peer_timeout=2.0)
    workers = c.start_workers(op_after_go)
    for w in workers:
        for rank in w.procs:
            w.wait_event(rank, "first-done")
    frozen = c.daemon_pid(1)
    os.kill(frozen, signal.SIGSTOP)  # node 1's daemon stops being scheduled...
    try:
        # ...until node 0 has given it up (so it was frozen for longer than the peer timeout)
        wait_until(lambda: not c.status(0)["fabric"]["nodes"][1]["alive"], 60, "node 0 to declare node 1 dead")
    finally:
        os.kill(frozen, signal.SIGCONT)
        resumed = time.monotonic()
    # the coordinator told node 1 it was given up; node 1 reads that as soon as it runs again
    wait_until(lambda: c.status(1)["fabric"]["broken"] is not None, 10, "node 1 to learn it was declared dead")
    learnt = time.monotonic() - resumed
    assert learnt < 1.0 + 0.5, f"node 1 learnt it was declared dead {learnt:.2f}s after it resumed"  # (+ the query)
    assert "declared this node dead" in c.status(1)["fabric"]["broken"]
    for w in workers:
        for rank in w.procs:
            w.send(rank, "go")
    results = c.join(workers, timeout=120)
    # Node 1's rank: the error says that its own daemon was frozen, not merely that node 0 went silent.
    assert "PeerDied" in results[1] and "this daemon (node 1, n1) was itself not scheduled for" in results[1], results
    # Node 0's rank: node 1 (by name) was lost, for the op it names.
    assert "allreduce #1 on group 'world'" in results[0] and "node 1 (n1)" in results[0], results
    log1 = (c.runtime[1] / "daemon.out").read_text(errors="replace")
    assert re.search(r"this daemon \(node 1, n1\) was not scheduled for \d+\.\d+s", log1), c.logs()
    assert re.search(r"op failed \(peer_died\): allreduce #1 on group 'world', ranks \[1\]", log1), c.logs()


# ---- b. job directories: logs kept, the rest cleaned, old ones pruned -----------------------
@pytest.fixture
def rt(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private runtime root (short path: ipc socket paths are limited to ~107 bytes)."""
    path = tmp_path_factory.mktemp("jobs")
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(path))
    monkeypatch.delenv("COMMD_JOB", raising=False)
    monkeypatch.delenv("COMMD_SECRET", raising=False)
    return path


@pytest.mark.timeout(150)
def test_launch_keeps_the_daemon_log_after_a_clean_run(rt: Path, tmp_path: Path) -> None:
    script = Path(__file__).resolve().parent / "scripts" / "cli_allreduce_worker.py"
    proc = subprocess.run([sys.executable, "-m", "commd", "launch", "--nproc-per-node", "2", str(script),
                           str(tmp_path)], capture_output=True, text=True, timeout=120, check=False,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr
    dirs = list(rt.iterdir())
    assert len(dirs) == 1, f"expected the job's directory with its log, found {dirs}"
    job_dir = dirs[0]
    assert sorted(p.name for p in job_dir.iterdir()) == ["daemon.log"]  # sockets, secret, pid: gone
    log = (job_dir / "daemon.log").read_text()
    assert "client rank 1" in log and "daemon stopped" in log, log


def _finished_job(root: Path, name: str, age_s: float, extra: dict[str, str] | None = None) -> Path:
    """A job directory as a finished daemon leaves it, last touched ``age_s`` ago."""
    job = root / name
    job.mkdir(mode=0o700)
    files = {"daemon.log": f"log of {name}\n", "start.lock": "", **(extra or {})}
    for file, text in files.items():
        (job / file).write_text(text)
    stamp = time.time() - age_s
    for path in [*job.iterdir(), job]:
        os.utime(path, (stamp, stamp))
    return job


@pytest.mark.timeout(120)
def test_a_daemon_start_prunes_old_finished_job_directories(rt: Path) -> None:
    from commd.cli.launch import stop_daemon
    from commd.client.spawn import start_daemon
    from commd.runtime import JobPaths, new_secret

    hour, day = 3600.0, 24 * 3600.0
    finished = [_finished_job(rt, f"old{i:02d}", (i + 1) * hour) for i in range(13)]  # old00 is the newest
    ancient = _finished_job(rt, "ancient", 8 * day)
    alive = _finished_job(rt, "alive", 2 * day, {"daemon.pid": str(os.getpid())})  # a live daemon's
    foreign = _finished_job(rt, "foreign", 2 * day, {"notes.txt": "not commd's"})
    fresh = _finished_job(rt, "fresh", 1.0)  # may be starting right now
    paths = JobPaths.for_job("newjob")
    daemon = start_daemon(paths, new_secret(), exit_when_idle=False, timeout=60)
    try:
        left = {p.name for p in rt.iterdir()}
    finally:
        assert stop_daemon(daemon) == 0
    kept_finished = {p.name for p in finished[:10]}
    assert left == kept_finished | {alive.name, foreign.name, fresh.name, "newjob"}, sorted(left)
    assert ancient.name not in left
    # the daemon that exits cleanly leaves only its log (the start lock, if any, is harmless)
    assert {p.name for p in paths.directory.iterdir()} <= {"daemon.log", "start.lock"}
    assert "daemon stopped" in paths.log_file.read_text()


def test_finished_job_directories_older_than_a_week_are_pruned_even_when_few(tmp_path: Path) -> None:
    from commd.runtime import KEEP_FINISHED_S, prune_finished_jobs

    recent = _finished_job(tmp_path, "recent", 3600.0)
    old = _finished_job(tmp_path, "old", KEEP_FINISHED_S + 3600.0)
    assert prune_finished_jobs(tmp_path) == [old]
    assert [p.name for p in tmp_path.iterdir()] == [recent.name]


def test_failure_line_levels_and_point_to_point_description() -> None:
    """A lane error is an ERROR line naming the op; a p2p failure names send/recv and both ranks."""
    from commd.core.ops import Submission
    from commd.daemon.failure_log import OpFailureLog
    from commd.daemon.loglimit import RateLimitedLog

    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("commd.test.failures")
    logger.propagate = False
    logger.addHandler(Collect())
    members = {"g": [4, 5, 6, 7]}
    failures = OpFailureLog(RateLimitedLog(logger), members.get)

    def sub(kind: str, group_rank: int, seq: int = 0) -> Submission:
        return Submission(client_id=1, op_id=1, group="g", group_rank=group_rank, group_size=4, seq=seq,
                          kind=kind, dtype="float32")

    failures.record(s.E_INTERNAL, "lane tcp: peer node 1 closed the connection", [sub("allreduce", 0, 9),
                                                                                  sub("allreduce", 1, 9)])
    failures.record(s.E_MISMATCH, "send 4 x float32 vs recv 5 x float32", [sub("send", 2), sub("recv", 3)])
    lane, p2p = records
    assert lane.levelno == logging.ERROR
    assert lane.getMessage() == ("op failed (internal): allreduce #9 on group 'g', ranks [4, 5]: "
                                 "lane tcp: peer node 1 closed the connection")
    assert p2p.levelno == logging.WARNING
    assert p2p.getMessage().startswith("op failed (mismatch): send/recv on group 'g', ranks [6, 7]: ")
