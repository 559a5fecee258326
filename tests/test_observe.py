"""Metrics, the per-op trace and torch.profiler ranges, checked against the ops the tests ran.

Metrics are scraped over real HTTP while the job's ranks are connected and
parsed with prometheus_client's own parser; the counts must equal what the
workers ran (KNOWN_OPS), and the textfile export must say the same.  The
trace of a 2-node loopback fabric must be valid JSON with every op's phases,
in causal order, on both nodes.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import observe_workers as ow
import pytest
from cluster import free_port
from helpers import OpSocket, RawSocket, new_job, wait_until
from prometheus_client.parser import text_string_to_metric_families

from commd.daemon.node import Daemon, DaemonConfig
from commd.protocol import schema as s
from commd.runtime import JobPaths, new_secret

SCRAPE_TIMEOUT_S = 10.0
PHASES = ["submit", "negotiate", "queue", "lane", "reply"]
#: An all-reduce between nodes has its lane phase as its three steps.
LANE_STEPS = ["local", "wire", "out"]
#: The phases of an op released on a schedule (fabric/scheduled.py): no negotiation, an agreement.
SCHEDULED_PHASES = ["submit", "schedule", "queue", "agree", "lane", "reply"]
#: Nodes convert the shared monotonic clock to epoch time each on its own: allow this much skew (µs).
CLOCK_SLACK_US = 500.0


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as reply:
        assert reply.status == 200
        return reply.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def expected_totals(rounds: int) -> dict[tuple[str, str], tuple[int, int]]:
    """(kind, lane) -> (ops, bytes) that ``known_ops`` runs on one node."""
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for kind, n, count in ow.KNOWN_OPS:
        totals[(kind, "local")][0] += count * rounds
        totals[(kind, "local")][1] += count * rounds * n * 4
    return {key: (ops, nbytes) for key, (ops, nbytes) in totals.items()}


def check_op_counts(values: dict, rounds: int) -> None:
    for (kind, lane), (ops, nbytes) in expected_totals(rounds).items():
        labels = (("group", "world"), ("kind", kind), ("lane", lane))
        assert values.get(("commd_ops_total", labels)) == ops, (kind, values.get(("commd_ops_total", labels)))
        assert values.get(("commd_bytes_total", labels)) == nbytes, kind
        assert values.get(("commd_op_latency_seconds_count", labels)) == ops, kind
        inf = (("group", "world"), ("kind", kind), ("lane", lane), ("le", "+Inf"))
        assert values.get(("commd_op_latency_seconds_bucket", inf)) == ops, kind
        assert values.get(("commd_op_latency_seconds_sum", labels), 0) > 0


def test_metrics_scraped_during_a_job_equal_the_ops_run(start_daemon, start_workers, tmp_path: Path) -> None:
    port = free_port()
    textfile = tmp_path / "commd.prom"
    daemon = start_daemon(extra=["--metrics-port", str(port), "--metrics-textfile", str(textfile),
                                 "--metrics-interval", "0.2"]).wait_ready()
    workers = start_workers(ow.known_ops, 2, 2)
    for rank in (0, 1):
        workers.wait_event(rank, "round0")
    values = samples(scrape(port))  # mid-job: both ranks connected, round 0 done
    check_op_counts(values, rounds=1)
    assert values[("commd_clients", ())] == 2
    assert values[("commd_queue_depth", (("group", "world"), ("stage", "waiting")))] == 0
    assert ("commd_stalled_ops", ()) in values and ("commd_uptime_seconds", ()) in values
    # one home: `commd status` reports the same numbers
    from commd.cli.status import format_status, query_status

    status = query_status(daemon.paths)
    assert status["observe"] == {"metrics_url": f"http://127.0.0.1:{port}/metrics",
                                 "metrics_textfile": str(textfile), "trace": None}
    assert f"metrics http://127.0.0.1:{port}/metrics" in format_status(status)
    assert status["ops_by_lane"]["allreduce"]["local"]["ops"] == values[
        ("commd_ops_total", (("group", "world"), ("kind", "allreduce"), ("lane", "local")))]
    for rank in (0, 1):
        workers.send(rank, "go")
    for rank in (0, 1):
        workers.wait_event(rank, "round1")
    check_op_counts(samples(scrape(port)), rounds=2)

    def textfile_says_two_rounds() -> bool:
        try:
            check_op_counts(samples(textfile.read_text()), rounds=2)
        except (AssertionError, OSError):
            return False
        return True

    wait_until(textfile_says_two_rounds, 20, "the textfile to show both rounds")
    for rank in (0, 1):
        workers.send(rank, "go")
    for rank in (0, 1):
        workers.wait_event(rank, "mismatched")
    errors = samples(scrape(port))
    assert errors[("commd_error_replies_total", (("code", "mismatch"),))] == 2  # one per rank
    for rank in (0, 1):
        workers.send(rank, "go")
    assert set(workers.join().values()) == {"ok"}
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log_tail()
    final = samples(textfile.read_text())  # written at exit
    check_op_counts(final, rounds=2)
    assert final[("commd_error_replies_total", (("code", "mismatch"),))] == 2
    assert not list(tmp_path.glob("commd.prom.*")), "a temporary textfile was left behind"


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--metrics-port", "70000"], {}, "--metrics-port 70000 must be a port number"),
    (["--metrics-port", "0", "--metrics-addr", "localhost"], {}, "--metrics-addr 'localhost' is not an IP address"),
    ([], {"COMMD_METRICS_PORT": "http"}, "COMMD_METRICS_PORT 'http' is not a port number"),
    ([], {"COMMD_GC_FREEZE": "yes"}, "COMMD_GC_FREEZE"),
    (["--metrics-textfile", "/nonexistent-dir/x.prom"], {}, "does not exist"),
    (["--trace", "/nonexistent-dir/t.json"], {}, "does not exist"),
])
def test_bad_metrics_or_trace_settings_stop_the_daemon_with_the_reason(
    runtime_dir: Path, job: str, args: list[str], env: dict[str, str], message: str
) -> None:
    out = subprocess.run([sys.executable, "-m", "commd", "daemon", "--job", job, *args], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, **env))
    assert out.returncode == 2, out.stderr
    assert message in out.stderr, out.stderr


def test_metrics_port_in_use_stops_the_daemon_with_the_reason(runtime_dir: Path, job: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "commd", "daemon", "--job", job, "--metrics-port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr, out.stderr


def test_bad_metrics_config_section_is_refused(runtime_dir: Path, job: str, tmp_path: Path) -> None:
    config = tmp_path / "commd.toml"
    config.write_text("[metrics]\nport = 9400\nbogus = 1\n")
    out = subprocess.run([sys.executable, "-m", "commd", "daemon", "--job", job, "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "bogus" in out.stderr, out.stderr


# ---- the trace -----------------------------------------------------------------------
def op_phases(events: list[dict[str, Any]]) -> dict[tuple[int, str, int], dict[str, tuple[float, float]]]:
    """(node, group, seq) -> phase -> (begin, end), from the async slices of each op."""
    by_id: dict[tuple[int, int], dict[str, Any]] = defaultdict(dict)
    for e in events:
        if e.get("ph") in ("b", "e"):
            slot = by_id[(e["pid"], e["id"])]
            if "args" in e:
                slot["op"] = e["args"]
            phase = slot.setdefault("phases", {}).setdefault(e["name"], [None, None])
            phase[0 if e["ph"] == "b" else 1] = e["ts"]
    out = {}
    for (node, _), slot in by_id.items():
        args = slot["op"]
        key = (node, args["group"], args["seq"])
        assert key not in out, f"op {key} traced twice"
        out[key] = {name: (b, e) for name, (b, e) in slot["phases"].items()
                    if name in PHASES + SCHEDULED_PHASES + LANE_STEPS}
    return out


def op_kinds(events: list[dict[str, Any]]) -> dict[tuple[int, str, int], tuple[str, int]]:
    """(node, group, seq) -> the op's kind and bytes."""
    return {(e["pid"], e["args"]["group"], e["args"]["seq"]): (e["args"]["kind"], e["args"]["bytes"])
            for e in events if e.get("ph") == "b" and "args" in e}


def check_causal(phases: dict[str, tuple[float, float]], what: Any, split: bool = False) -> None:
    """The op's phases, back to back in their order; ``split``: with its lane phase as the 3 steps
    of an all-reduce between nodes (which one whose result came with its agreement or release,
    a tiny one, does not have)."""
    names = SCHEDULED_PHASES if "schedule" in phases else PHASES
    if split:
        at = names.index("lane")
        names = names[:at] + LANE_STEPS + names[at + 1:]
    assert set(phases) == set(names), (what, split, phases)
    previous_end = None
    for name in names:
        begin, end = phases[name]
        assert begin is not None and end is not None and begin <= end, (what, name, phases)
        if previous_end is not None:
            assert begin == pytest.approx(previous_end, abs=0.01), (what, name, phases)
        previous_end = end


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
def test_two_node_trace_has_every_op_phase_on_both_nodes_in_causal_order(cluster, tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    c = cluster(extra=["--trace", str(trace)])
    workers = c.start_workers(ow.known_ops, 1)
    for w in workers:
        for rank in w.procs:
            w.wait_event(rank, "round0")
            w.send(rank, "go")
    for w in workers:  # every rank has its mismatch error before any leaves: a rank that left first
        for rank in w.procs:  # would turn a slower node's pending op into a departure instead
            w.wait_event(rank, "mismatched")
    for w in workers:
        for rank in w.procs:
            w.send(rank, "go")
    assert set(c.join(workers).values()) == {"ok"}
    c.stop()  # SIGTERM: each daemon finishes its file
    files = [tmp_path / "trace.node0.json", tmp_path / "trace.node1.json"]
    for f in files:
        json.loads(f.read_text())  # each node's file alone is valid JSON
    merged = tmp_path / "merged.json"
    out = subprocess.run([sys.executable, "-m", "commd", "trace", "merge", str(merged), *map(str, files)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    with open(merged) as f:
        events = json.load(f)
    assert isinstance(events, list) and all({"ph", "pid"} <= set(e) for e in events)
    assert {e["args"]["name"] for e in events if e.get("name") == "process_name"} == {"node 0 (n0)", "node 1 (n1)"}
    ops, kinds = op_phases(events), op_kinds(events)
    seqs = sum(count for _, _, count in ow.KNOWN_OPS)
    for node in (0, 1):
        assert sorted(seq for (n, g, seq) in ops if n == node and g == "world") == list(range(seqs)), node
    scheduled = 0
    for seq in range(seqs):
        per_node = [ops[(node, "world", seq)] for node in (0, 1)]
        for node, phases in enumerate(per_node):
            kind, nbytes = kinds[(node, "world", seq)]
            check_causal(phases, (node, seq), split=kind == "allreduce" and nbytes >= 70_000 * 4)
        if all("schedule" in p for p in per_node):
            # on a schedule: the lane starts only once every node's ranks were ready (the agreement)
            scheduled += 1
            last_ready = max(p["schedule"][0] for p in per_node)
            first_start = min(p["lane" if "lane" in p else "local"][0] for p in per_node)
            assert last_ready <= first_start + CLOCK_SLACK_US, (seq, per_node)
            continue
        # the coordinator releases an op only after every node reported it ready
        last_ready = max(p["negotiate"][0] for p in per_node)
        first_release = min(p["queue"][0] for p in per_node)
        assert last_ready <= first_release + CLOCK_SLACK_US, (seq, per_node)
    assert scheduled > 0  # the 7 all-reduces in a row go onto a schedule
    lanes = [e for e in events if e.get("ph") == "X"]
    assert len(lanes) == 2 * seqs and all(e["args"]["lane"] == "tcp" for e in lanes)


def test_trace_started_and_stopped_on_a_running_daemon(start_daemon, start_workers, runtime_dir: Path,
                                                       tmp_path: Path) -> None:
    daemon = start_daemon(extra=["--metrics-port", "0"]).wait_ready()  # 0: any free port
    from commd.cli.status import query_status

    url = query_status(daemon.paths)["observe"]["metrics_url"]
    assert url.startswith("http://127.0.0.1:") and not url.startswith("http://127.0.0.1:0/"), url
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
        assert "commd_clients 0.0" in reply.read().decode()
    workers = start_workers(ow.known_ops, 2, 3)
    for rank in (0, 1):
        workers.wait_event(rank, "round0")
    trace = tmp_path / "live.json"

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "commd", "trace", *argv, "--job", daemon.job],
                              capture_output=True, text=True, timeout=60)

    out = cli("start", str(trace))
    assert out.returncode == 0 and str(trace) in out.stdout, out.stderr
    assert query_status(daemon.paths)["observe"]["trace"] == str(trace)
    again = cli("start", str(tmp_path / "other.json"))
    assert again.returncode == 1 and "already" in again.stderr, again.stderr
    for rank in (0, 1):
        workers.send(rank, "go")
    for rank in (0, 1):
        workers.wait_event(rank, "round1")
    out = cli("stop")
    assert out.returncode == 0 and "trace finished" in out.stdout, out.stderr
    for rank in (0, 1):
        workers.send(rank, "go")
    for rank in (0, 1):
        workers.wait_event(rank, "round2")
    with open(trace) as f:
        events = json.load(f)
    ops = op_phases(events)
    per_round = sum(count for _, _, count in ow.KNOWN_OPS)
    # exactly round 1's ops, each with its single-node phases
    assert sorted(seq for (_, _, seq) in ops) == list(range(per_round, 2 * per_round))
    assert query_status(daemon.paths)["observe"]["trace"] is None
    for key, phases in ops.items():
        assert set(phases) == {"submit", "queue", "lane", "reply"}, (key, phases)
    bad = cli("start", str(tmp_path / "missing" / "t.json"))
    assert bad.returncode == 1 and "does not exist" in bad.stderr, bad.stderr
    for rank in (0, 1):
        workers.send(rank, "go")
    for rank in (0, 1):
        workers.wait_event(rank, "mismatched")
        workers.send(rank, "go")
    assert set(workers.join().values()) == {"ok"}


def test_torch_profiler_shows_commd_collectives(start_workers) -> None:
    workers = start_workers(ow.profiled_all_reduce, 2, free_port())
    for rank, names in workers.join(timeout=100).items():
        assert "commd:all_reduce" in names, (rank, names)
        assert "commd:broadcast" in names, (rank, names)


def test_launch_trace_records_the_jobs_collectives(runtime_dir: Path, tmp_path: Path) -> None:
    trace = tmp_path / "launch.json"
    script = Path(__file__).resolve().parent / "scripts" / "cli_allreduce_worker.py"
    out = subprocess.run([sys.executable, "-m", "commd", "launch", "--nproc-per-node", "2", "--trace", str(trace),
                          str(script), str(tmp_path)], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    with open(trace) as f:
        events = json.load(f)  # the launcher stopped the daemon: the file is finished
    ops = op_phases(events)
    sizes = sorted(args["bytes"] for e in events if e.get("ph") == "b" and (args := e.get("args"))
                   and args["kind"] == "allreduce")
    assert sizes == [7 * 4, 300_000 * 4], sizes  # the script's two all_reduces (float32)
    for key, phases in ops.items():
        assert set(phases) == {"submit", "queue", "lane", "reply"}, (key, phases)
        assert all(b <= e for b, e in phases.values()), (key, phases)


def test_a_ring_trace_sent_before_bye_is_traced_whichever_socket_is_read_first(runtime_dir: Path,
                                                                                tmp_path: Path) -> None:
    """A rank's exchange ring sends its last traced ops on the op channel as the group is destroyed, then
    the client says BYE on the control socket.  Nothing orders the two sockets: when the daemon reads the
    BYE first (here: forced, by handling the control socket while the op channel still holds the ring's
    ops), the ops must still reach the trace, not be dropped with the channel (``commd launch --trace``
    once wrote a trace without the job's all-reduces)."""
    paths = JobPaths.for_job(new_job())
    secret = new_secret()
    trace = tmp_path / "bye.json"
    daemon = Daemon(DaemonConfig(paths=paths, secret=secret, trace=str(trace)))
    daemon.bind()
    loop = asyncio.new_event_loop()

    def connect() -> tuple[RawSocket, OpSocket]:
        control, ops = RawSocket(paths), OpSocket(paths)
        welcome = control.request({"t": s.HELLO, "job": paths.job, "secret": secret, "rank": 0, "local_rank": 0,
                                   "world_size": 1, "pid": os.getpid(), "segments": []})
        assert welcome["t"] == s.WELCOME, welcome
        assert ops.attach(welcome["client_id"], secret)["t"] == s.ACK
        assert control.request({"t": s.GROUP, "name": "g", "ranks": [0]})["t"] == s.ACK
        return control, ops

    async def scenario() -> None:
        served = asyncio.ensure_future(daemon.run())
        await asyncio.sleep(0)  # one step: run() sets up its sockets before its first await
        control, ops = await loop.run_in_executor(None, connect)
        try:
            # From here to the next await the loop is ours: the ring's ops and the BYE both arrive unread.
            now = time.monotonic()
            ops.send({"t": s.RINGOP, "g": "g", "trace": [[0, 28, now, now, now, None]]})
            control.send({"t": s.BYE})
            assert daemon.control.sock.poll(10_000), "the BYE did not arrive"
            daemon.flush()  # the control socket's turn comes before the op channel's (as after any reply)
            assert (await loop.run_in_executor(None, control.recv))["t"] == s.ACK
        finally:
            control.close()
            ops.close()
            daemon.shutdown("test over")
            await served

    try:
        loop.run_until_complete(asyncio.wait_for(scenario(), 60))
    finally:
        loop.close()
    events = json.loads(trace.read_text())
    ring = [e["args"] for e in events if e.get("ph") == "b" and "args" in e and e["args"].get("lane") == "ring"]
    assert [(a["kind"], a["group"], a["bytes"]) for a in ring] == [("allreduce", "g", 28)], events


def test_trace_paths_are_validated(runtime_dir: Path, tmp_path: Path) -> None:
    script = Path(__file__).resolve().parent / "scripts" / "cli_allreduce_worker.py"
    out = subprocess.run([sys.executable, "-m", "commd", "launch", "--trace", str(tmp_path), str(script)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "is a directory" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "commd", "trace", "stop", "--job", "nosuchjob"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no daemon for job 'nosuchjob'" in out.stderr, out.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    out = subprocess.run([sys.executable, "-m", "commd", "trace", "merge", str(tmp_path / "m.json"), str(broken)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "not a trace-event JSON file" in out.stderr, out.stderr


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
def test_trace_started_on_node0_of_a_running_fabric_reaches_every_node(cluster, tmp_path: Path) -> None:
    c = cluster()
    workers = c.start_workers(ow.known_ops, 2)
    everyone = [(w, rank) for w in workers for rank in w.procs]
    for w, rank in everyone:
        w.wait_event(rank, "round0")
    env = dict(os.environ, COMMD_RUNTIME_DIR=str(c.runtime[0]))

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "commd", "trace", *argv, "--job", c.job],
                              capture_output=True, text=True, timeout=60, env=env)

    trace = tmp_path / "live.json"
    out = cli("start", str(trace))
    assert out.returncode == 0 and "forwarded to 1 other node" in out.stdout, out.stdout + out.stderr
    for w, rank in everyone:
        w.send(rank, "go")
    for w, rank in everyone:
        w.wait_event(rank, "round1")
    out = cli("stop")
    assert out.returncode == 0, out.stderr
    files = [tmp_path / "live.node0.json", tmp_path / "live.node1.json"]

    def finished(path: Path) -> Any:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    per_round = sum(count for _, _, count in ow.KNOWN_OPS)
    for node, path in enumerate(files):
        events = wait_until(lambda path=path: finished(path), 30, f"node {node}'s trace to be finished")
        ops, kinds = op_phases(events), op_kinds(events)
        assert sorted(seq for (n, _, seq) in ops if n == node) == list(range(per_round, 2 * per_round)), node
        for key, phases in ops.items():
            kind, nbytes = kinds[key]
            check_causal(phases, key, split=kind == "allreduce" and nbytes >= 70_000 * 4)
    for w, rank in everyone:
        w.send(rank, "go")
    for w, rank in everyone:  # every rank has its error before any leaves (see the test above)
        w.wait_event(rank, "mismatched")
    for w, rank in everyone:
        w.send(rank, "go")
    assert set(c.join(workers).values()) == {"ok"}


def test_metrics_settings_precedence_flag_then_env_then_config(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from commd.observe.settings import resolve

    config = tmp_path / "commd.toml"
    config.write_text(f'[metrics]\nport = 0\naddr = "127.0.0.1"\ntextfile = "{tmp_path / "c.prom"}"\n'
                      "interval_s = 2.5\n")
    for name in ("PORT", "ADDR", "TEXTFILE", "INTERVAL"):
        monkeypatch.delenv(f"COMMD_METRICS_{name}", raising=False)
    assert not resolve(None, None, None, None, None).enabled  # off by default
    from_config = resolve(None, None, None, None, str(config))
    assert (from_config.port, from_config.textfile, from_config.interval_s) == (0, str(tmp_path / "c.prom"), 2.5)
    monkeypatch.setenv("COMMD_METRICS_PORT", "0")
    monkeypatch.setenv("COMMD_METRICS_INTERVAL", "7")
    monkeypatch.setenv("COMMD_METRICS_TEXTFILE", str(tmp_path / "e.prom"))
    from_env = resolve(None, None, None, None, str(config))
    assert (from_env.textfile, from_env.interval_s) == (str(tmp_path / "e.prom"), 7.0)
    from_flags = resolve(0, "127.0.0.1", str(tmp_path / "f.prom"), 1.0, str(config))
    assert (from_flags.textfile, from_flags.interval_s) == (str(tmp_path / "f.prom"), 1.0)


@pytest.mark.parametrize("freeze", ["1", "0"])
def test_a_daemon_freezes_torchs_heap_and_reports_its_collector_pauses(start_daemon, monkeypatch: pytest.MonkeyPatch,
                                                                       freeze: str) -> None:
    """Once torch is loaded its objects are frozen out of full collections (each one a stall of the
    whole daemon otherwise; COMMD_GC_FREEZE=0 leaves them in); status and metrics show the frozen
    count and the pauses per generation."""
    from commd.cli.status import query_status

    monkeypatch.setenv("COMMD_GC_FREEZE", freeze)
    port = free_port()
    daemon = start_daemon(extra=["--metrics-port", str(port)]).wait_ready()
    wait_until(lambda: query_status(daemon.paths)["torch_loaded"], 60, "the daemon to load torch")
    status = query_status(daemon.paths)["gc"]
    if freeze == "0":
        assert status["frozen_objects"] == 0, status
        return
    assert status["frozen_objects"] >= 50_000, status  # torch alone holds well over 100,000
    assert [set(g) for g in status["generations"]] == [{"collections", "seconds", "longest_ms"}] * 3
    assert status["generations"][0]["collections"] > 0, status  # counted from the daemon's start
    values = samples(scrape(port))
    assert values[("commd_gc_frozen_objects", ())] >= 50_000  # (frozen objects freed since lower the count)
    for generation, counts in enumerate(status["generations"]):
        labels = (("generation", str(generation)),)
        assert values[("commd_gc_collections_total", labels)] >= counts["collections"]
        assert values[("commd_gc_pause_seconds_total", labels)] >= counts["seconds"]
