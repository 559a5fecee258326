"""`commd bench` and the machine's load: the cores a run needs, the warnings, the load in the report and the JSON.

The load source is injected (a list of samples, no sleeps), so nothing here
depends on how busy this machine is.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from commd.bench import load
from commd.cli.main import main as commd_main


def _samples(*one_minute: float) -> load.LoadSource:
    """A load source giving these 1-minute averages in turn (5 and 15 minutes: fixed), then the last again."""
    values: Iterator[float] = iter(one_minute)
    last = [one_minute[0]]

    def source() -> tuple[float, float, float]:
        last[0] = next(values, last[0])
        return last[0], 1.25, 0.75

    return source


def _kernel_share(running: int, seconds: int) -> float:
    """What Linux's 1-minute average reaches from 0 with ``running`` tasks for ``seconds``: its recurrence,
    load = load * e + running * (1 - e) with e = exp(-5/60), once per 5 s tick (kernel/sched/loadavg.c)."""
    decay, value = math.exp(-5 / 60), 0.0
    for _ in range(seconds // 5):
        value = value * decay + running * (1 - decay)
    return value


def test_needs_count_every_rank_and_daemon() -> None:
    assert load.needs_of(2, 0).cores == 3  # this host: 2 ranks + its daemon
    assert load.needs_of(2, 4).cores == 12  # 4 simulated hosts x 2 ranks + 4 daemons
    assert load.needs_of(1, 2).describe() == "2 ranks + 2 daemons"


@pytest.mark.parametrize("seconds", [5, 30, 60, 300])
def test_own_share_is_the_kernels_average(seconds: int) -> None:
    assert load.own_share(3, seconds) == pytest.approx(_kernel_share(3, seconds), rel=1e-9)


@pytest.mark.parametrize(("cores", "start", "warns"), [(8, 0.0, False), (8, 5.0, False), (8, 5.01, True),
                                                       (2, 0.0, True), (16, 9.5, False), (4, 9.5, True)])
def test_start_warning_when_the_load_leaves_too_few_cores(cores: int, start: float, warns: bool) -> None:
    watch = load.LoadWatch(load.needs_of(2, 0), cores, _samples(start))
    warning = watch.begin()
    assert (warning is not None) == warns == (start + 3 > cores)
    if warns:
        assert warning is not None and warning.startswith("WARNING: the 1-minute load average is")
        assert f"{start:.2f} on {cores} cores" in warning and "needs 3 (2 ranks + 1 daemon)" in warning
        assert watch.warnings == [warning]


@pytest.mark.parametrize(("start", "end", "elapsed", "warns"), [
    (0.5, 5.0, 60, True),   # others ~3.1 after the run's share (at most 1.9): 3.1 + 3 > 4
    (0.5, 2.3, 60, False),  # all of it may be the run's own processes
    (0.5, 1.0, 5, False),   # the end is no higher than the others' start
    (2.0, 3.5, 60, False),  # the start warned; the others' load did not rise
])
def test_end_warning_only_when_the_others_load_rose(start: float, end: float, elapsed: int, warns: bool) -> None:
    watch = load.LoadWatch(load.needs_of(2, 0), 4, _samples(start, end))
    watch.begin()
    warning = watch.finish(elapsed)
    others = end - _kernel_share(3, elapsed)
    assert (warning is not None) == warns == (others + 3 > 4 and others > start)
    if warns:
        assert warning is not None and f"rose to {end:.2f} on 4 cores" in warning
    record = watch.to_json()
    assert record["start"] == {"1m": start, "5m": 1.25, "15m": 0.75}
    assert record["end"] == {"1m": end, "5m": 1.25, "15m": 0.75}
    assert record["cores"] == 4 and record["needed_cores"] == 3 and record["elapsed_s"] == elapsed
    assert len(record["warnings"]) == (start + 3 > 4) + warns


def test_bench_warns_and_records_the_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A run at a load of 9.5 that rose to 30: a warning on stderr before and after, both in the printed
    report, and the load (1/5/15 minutes, start and end) with the core count in the JSON."""
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("COMMD_TUNING_DIR", str(tmp_path / "tuning"))
    for key in ("COMMD_JOB", "COMMD_SECRET"):
        monkeypatch.delenv(key, raising=False)
    cores = os.cpu_count() or 1
    monkeypatch.setattr(load, "read_loadavg", _samples(9.5 + cores, 30.0 + 2 * cores))
    out = tmp_path / "bench.json"
    code = commd_main(["bench", "--nproc-per-node", "2", "--ops", "allreduce", "--min-bytes", "1K",
                       "--max-bytes", "1K", "--iters", "2", "--warmup", "0", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    before = f"WARNING: the 1-minute load average is {9.5 + cores:.2f} on {cores} cores before the run"
    after = f"WARNING: the 1-minute load average rose to {30.0 + 2 * cores:.2f} on {cores} cores"
    for where in (captured.err, captured.out):
        assert before in where and after in where, where
    assert f"load average (1/5/15 min): {9.5 + cores:.2f} 1.25 0.75 at the start" in captured.out
    data = json.loads(out.read_text())
    record = data["load"]
    assert record["start"] == {"1m": round(9.5 + cores, 2), "5m": 1.25, "15m": 0.75}
    assert record["end"] == {"1m": round(30.0 + 2 * cores, 2), "5m": 1.25, "15m": 0.75}
    assert record["cores"] == cores == data["host"]["cpus"]
    assert record["needed_cores"] == 3 and record["needed"] == "2 ranks + 1 daemon"
    assert record["elapsed_s"] > 0 and len(record["warnings"]) == 2
    assert "load" not in data["layout"]
