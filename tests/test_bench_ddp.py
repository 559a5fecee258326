"""benchmarks/ddp.py: its reference, its checks, its figures, its buffer counters, and one real run (slow).

The benchmark is a script beside its worker module; both are imported from the
benchmarks folder here.  The end-to-end run starts daemons and 6 runs of 2 ranks,
which takes about a minute on a loaded 2-core machine: marked slow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import _ddp_worker as worker  # noqa: E402
import ddp  # noqa: E402

TINY = {"inputs": 6, "width": 5, "layers": 2}


def test_reference_is_the_average_of_the_ranks_gradients() -> None:
    """One reference step = SGD with the mean of each rank's own mean-loss gradient (what DDP computes)."""
    args = ddp.parse_args(["--paths", "commd,gloo", "--warmup", "1", "--steps", "1", "--nproc", "3"])
    spec = {"model": TINY, "batch": 4}
    got = ddp.reference_params(spec, args)
    model = worker.build_model(TINY, args.seed)
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for rank in range(3):
        x, y = worker.make_batches(TINY, 4, 2, args.seed, rank)[0]
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for g, p in zip(grads, model.parameters(), strict=True):
            g += p.grad / 3
    # The second step uses the second batch: apply step one by hand, then compare after step two the same way.
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            p -= worker.LEARNING_RATE * g
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for rank in range(3):
        x, y = worker.make_batches(TINY, 4, 2, args.seed, rank)[1]
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for g, p in zip(grads, model.parameters(), strict=True):
            g += p.grad / 3
    with torch.no_grad():
        want = [p - worker.LEARNING_RATE * g for p, g in zip(model.parameters(), grads, strict=True)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(got, worker.build_model(TINY, args.seed).parameters(),
                                                       strict=True))


def test_compare_params_names_the_parameter_that_differs() -> None:
    want = [torch.ones(3, 2), torch.zeros(4)]
    assert ddp.compare_params([t.clone() for t in want], want, "x")[0] is None
    off = [want[0].clone(), torch.tensor([0.0, 0.0, 0.01, 0.0])]
    problem, worst = ddp.compare_params(off, want, "demo/commd run 1 rank 1")
    assert problem is not None and "demo/commd run 1 rank 1" in problem and "parameter 1" in problem
    assert worst == pytest.approx(0.01)
    problem, _ = ddp.compare_params([torch.ones(2, 3), torch.zeros(4)], want, "y")
    assert problem is not None and "shape" in problem
    problem, _ = ddp.compare_params(want[:1], want, "z")
    assert problem is not None and "1 parameter tensors" in problem


def test_figures_use_the_slowest_rank_and_pair_each_step_with_its_compute_step() -> None:
    ranks = [{"step_times": [9.0, 0.100, 0.090, 0.300], "compute_times": [0.040, 0.060, 0.270],
              "in_flight_s": [5.0, 0.030, 0.020, 0.040]},
             {"step_times": [1.0, 0.120, 0.080, 0.310], "compute_times": [0.050, 0.030, 0.240],
              "in_flight_s": [5.0, 0.020, 0.025, 0.010]}]
    row = ddp.run_figures({"ranks": ranks}, warmup=1)
    # slowest rank per step: steps 0.12, 0.09, 0.31; compute 0.05, 0.06, 0.27; in flight 0.03, 0.025, 0.04
    assert row["step_s"] == pytest.approx(0.12)
    assert row["compute_s"] == pytest.approx(0.06)
    assert row["comm_s"] == pytest.approx(0.04)  # median of 0.07, 0.03, 0.04, not 0.12 - 0.06
    assert row["in_flight_s"] == pytest.approx(0.03)
    row = dict(row, comm_s=0.063, step_s=0.105)
    fig = ddp.path_figures([row, dict(row, step_s=0.2, comm_s=0.16), dict(row, step_s=0.3, comm_s=0.01)],
                           grad_bytes=50_000_000, nproc=4)
    assert fig["step_s"] == pytest.approx(0.2) and fig["comm_s"] == pytest.approx(0.063)
    assert fig["algbw_gbps"] == pytest.approx(50e6 / 0.063 / 1e9)
    assert fig["busbw_gbps"] == pytest.approx(fig["algbw_gbps"] * 1.5)
    hidden = ddp.path_figures([dict(row, step_s=1.0, comm_s=0.01)], grad_bytes=1000, nproc=2)
    assert hidden["algbw_gbps"] is None and hidden["busbw_gbps"] is None
    assert fig["in_flight_busbw_gbps"] == pytest.approx(50e6 / 0.03 / 1e9 * 1.5)


def test_in_flight_time_is_the_union_of_the_buckets_spans() -> None:
    assert worker.in_flight([]) == 0.0
    assert worker.in_flight([(1.0, 2.0), (1.5, 3.0), (5.0, 5.5), (2.5, 2.8)]) == pytest.approx(2.5)


def test_buffer_counters_are_found_wherever_the_status_keeps_them() -> None:
    status = {"ops_done": 7, "buffers": {"staged": {"ops": 2, "bytes": 4096}, "registered_bytes": 1 << 20,
                                         "closing": True},
              "clients": [{"rank": 0, "staged_bytes": 10}], "registered_flag": False}
    assert ddp.buffer_counters(status) == {"buffers.staged.ops": 2, "buffers.staged.bytes": 4096,
                                           "buffers.registered_bytes": 1 << 20, "clients.0.staged_bytes": 10}
    assert ddp.buffer_counters({"ops_done": 1, "clients": []}) == {}
    by_kind = {"bytes_by_path": {"registered": 9, "arena": 1, "staged": 2, "inline": 3, "cuda": 0}, "ops_done": 4}
    assert ddp.buffer_counters(by_kind) == {f"bytes_by_path.{k}": v for k, v in by_kind["bytes_by_path"].items()}


def test_counters_report_says_after_which_step_nothing_more_was_staged() -> None:
    def st(staged: int) -> dict[str, Any]:
        return {"bytes_by_path": {"staged": staged, "registered": 8},
                "clients": [{"rank": 0, "registered_bytes": 4, "bytes_by_path": {"staged": staged // 2}}]}

    same = ddp.counters_report({"1": st(100), "2": st(100), "end": st(100)})
    assert same[0] == "    after step 1   bytes_by_path.registered=8, bytes_by_path.staged=100"
    assert "per client at the end: clients.0.bytes_by_path.staged=50, clients.0.registered_bytes=4" in same[3]
    assert same[-1].endswith("after step 1 +0, after step 2 +0  (nothing staged after step 1)")
    later = ddp.counters_report({"1": st(100), "2": st(300), "3": st(300), "end": st(300)})[-1]
    assert "(bytes_by_path.staged)" in later and "after step 1 +200, after step 2 +0" in later
    assert "STAGED after step 1; nothing staged after step 2" in later
    always = ddp.counters_report({"1": st(100), "end": st(300)})[-1]
    assert always.endswith("after step 1 +200  (STAGED after every snapshot)")
    per_client_only = ddp.counters_report({"1": {"clients": [{"staged_bytes": 5}]},
                                           "end": {"clients": [{"staged_bytes": 5}]}})
    assert per_client_only[-1].endswith("after step 1 +0  (nothing staged after step 1)")
    absent = ddp.counters_report({"1": {"ops_done": 3}, "end": {"error": "no daemon"}})
    assert "n/a (no staged/registered counters)" in absent[0]
    assert "status not available: no daemon" in absent[1]
    assert absent[-1] == "    staged after step 1: n/a"


def test_bad_arguments_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, words in ((["--paths", "commd,nccl"], "--paths: unknown ['nccl']"),
                        (["--paths", "commd", "--configs", "huge"], "--configs: unknown ['huge']"),
                        (["--paths", "commd", "--warmup", "0"], "--warmup must be at least 1"),
                        (["--paths", "commd", "--bucket-mb", "-1"], "--bucket-mb must be positive")):
        with pytest.raises(SystemExit) as exc:
            ddp.parse_args(argv)
        assert exc.value.code == 2
        assert words in capsys.readouterr().err


def test_no_figures_when_a_run_disagrees_with_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A path whose training went wrong makes the benchmark exit 1 naming it, with no table printed."""
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(ddp, "configurations", lambda quick, bucket: {
        "demo": {"model": TINY, "batch": 2, "bucket_mb": 1.0, "params": 1, "grad_bytes": 4}})

    def fake_run(path: str, spec: dict[str, Any], args: Any, work: Path, tag: str) -> dict[str, Any]:
        params = ddp.reference_params(spec, args)
        if path == "gloo":
            params[0] = params[0] + 0.5  # gloo's run "trained" something else
        files = []
        for rank in range(args.nproc):
            files.append(str(work / f"{tag}-{rank}.pt"))
            torch.save(params, files[-1])
        rank_result = {"step_times": [0.1] * 4, "compute_times": [0.05] * 3, "in_flight_s": None, "status": {}}
        return {"ranks": [rank_result] * args.nproc, "params": files}

    monkeypatch.setattr(ddp, "run_once", fake_run)
    assert ddp.main(["--paths", "commd,gloo", "--configs", "demo", "--repeats", "1", "--steps", "2"]) == 1
    out, err = capsys.readouterr()
    assert "NO FIGURES" in err and "demo/gloo run 1 rank 0: parameter 0 differs" in err
    assert "demo/commd" not in err
    assert "step ms" not in out


@pytest.mark.slow
@pytest.mark.timeout(300)  # 3 runs of 2 ranks each import torch: a minute or more on a loaded machine
def test_quick_run_trains_every_path_alike_and_prints_the_figures(tmp_path: Path) -> None:
    """The real thing, tiny: daemons, Gloo, mpiexec; the parameters check passes, every path has a row."""
    paths = "commd,gloo,mpi" if shutil.which("mpiexec", path=str(Path(sys.executable).parent)) else "commd,gloo"
    env = {**os.environ, "COMMD_RUNTIME_DIR": str(tmp_path)}
    env.pop("COMMD_JOB", None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ddp.py"), "--quick", "--configs", "demo",
                           "--paths", paths], cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parameters match the single-process reference" in proc.stdout
    for path in paths.split(","):
        assert any(line.split()[:1] == [path] for line in proc.stdout.splitlines()), proc.stdout
    assert "commd/gloo: step time" in proc.stdout
    assert "commd daemon buffer counters" in proc.stdout and "after step 1" in proc.stdout
