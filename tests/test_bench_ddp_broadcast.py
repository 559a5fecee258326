"""benchmarks/ddp_broadcast.py: its deterministic task, its figures and checks, and one real small run.

The benchmark is a script beside its worker module; both are imported from the
benchmarks folder here.  The real run starts 2 simulated hosts (root, network
namespaces; skipped without) and 2 short trainings of 2 ranks each: 17 s on the
idle 2-core machine, about 30 s at load 4, so not marked slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import _ddp_broadcast_worker as worker  # noqa: E402
import ddp_broadcast as bench  # noqa: E402

TINY = {"seed": 3, "inputs": 8, "outputs": 3, "width": 6, "layers": 3, "batch": 4}


def test_teacher_data_and_model_are_the_same_on_every_call() -> None:
    """Every run and setting trains the same student on the same batches: all seeded."""
    a, b = worker.teacher(TINY), worker.teacher(TINY)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    x1, y1 = worker.batch(TINY, a, 5, 1)
    x2, y2 = worker.batch(TINY, b, 5, 1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and torch.equal(y1, a(x1))
    assert not torch.equal(worker.batch(TINY, a, 5, 0)[0], x1)  # ranks see different samples
    assert not torch.equal(worker.batch(TINY, a, 6, 1)[0], x1)  # and every step fresh ones
    ex, _ = worker.eval_set(TINY, a)
    assert ex.shape == (worker.EVAL_SAMPLES, TINY["inputs"]) and torch.equal(ex, worker.eval_set(TINY, b)[0])
    m1, m2 = worker.build_model(TINY), worker.build_model(TINY)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=True))
    assert sum(p.numel() for p in m1.parameters()) == worker.param_count(TINY)
    # the teacher's seed is not the student's: the task is not solved at the start
    assert worker.eval_loss(m1, worker.eval_set(TINY, a)) > 0


def test_parameters_become_views_of_one_flat_buffer() -> None:
    model = worker.build_model(TINY)
    before = [p.detach().clone() for p in model.parameters()]
    flat = worker.flatten_into_views(model)
    assert flat.numel() == worker.param_count(TINY)
    for p, want in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, want) and p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    flat.fill_(0.5)  # a broadcast into the buffer is the model's new weights
    assert all(bool((p == 0.5).all()) for p in model.parameters())
    master, params = worker.master_copy(flat, model)
    params[0].data.add_(1.0)  # the optimizer's copy moves, the model's weights do not
    assert bool((master[:params[0].numel()] == 1.5).all()) and bool((flat == 0.5).all())


def test_digest_and_rounding() -> None:
    t = torch.randn(1 << 19) * 0.02  # 2 MiB: compressed
    assert worker.digest(t) == worker.digest(t.clone())
    u = t.clone()
    u[7] = torch.nextafter(u[7], torch.tensor(1.0))
    assert worker.digest(u) != worker.digest(t)
    assert torch.equal(worker.codec_rounding("bf16", t), t.bfloat16().float())
    assert torch.equal(worker.codec_rounding("fp16", t), t.half().float())
    assert torch.equal(worker.codec_rounding("lossless", t), t) and torch.equal(worker.codec_rounding("none", t), t)
    small = t[:1000]  # under COMPRESS_MIN_BYTES a broadcast travels uncompressed
    assert torch.equal(worker.codec_rounding("bf16", small), small)


def test_settings_interleave_and_the_figures_use_the_slowest_rank() -> None:
    assert bench.interleaved(["none", "bf16"], 3) == [(0, "none"), (0, "bf16"), (1, "bf16"), (1, "none"),
                                                      (2, "none"), (2, "bf16")]
    assert bench.slowest_per_step([[9.0, 0.1, 0.3], [1.0, 0.2, 0.25]], warmup=1) == [0.2, 0.3]
    assert bench.window_loss([[5.0, 1.0, 2.0], [7.0, 3.0, 4.0]], 2) == pytest.approx(2.5)
    run = {"step_times": [[1.0, 0.4, 0.5, 0.6], [1.0, 0.45, 0.5, 0.5]],
           "bcast_times": [[0.5, 0.2, 0.1, 0.3], [0.5, 0.2, 0.2, 0.2]],
           "losses": [[1.0, 0.5, 0.4, 0.3], [1.0, 0.6, 0.2, 0.1]], "loss_after": 0.25, "loss_before": 1.0,
           "compression": {"bf16": {"ops": 4, "ratio": 0.39}}, "broadcast_lanes": {"tcp": {"ops": 4}}}
    fig = bench.setting_figures([run, dict(run, loss_after=0.35)], warmup=1, window=2)
    assert fig["step_s"] == pytest.approx(0.5) and fig["bcast_s"] == pytest.approx(0.2)
    assert fig["bcast_share"] == pytest.approx(0.4)
    assert fig["loss"] == pytest.approx(0.3) and fig["train_loss_last"] == pytest.approx(0.25)
    assert fig["ratio"] == 0.39
    assert bench.setting_figures([dict(run, compression={})], 1, 2)["ratio"] is None


def test_loss_target_and_step_ratio_lines() -> None:
    assert bench.loss_gap(0.101, 0.1) == pytest.approx(0.01)
    assert bench.loss_gap(0.099, 0.1) == pytest.approx(0.01)
    base = {"step_s": 0.4, "bcast_s": 0.2, "loss": 0.1, "train_loss_last": 0.2}
    lines = bench.target_lines({"none": base, "bf16": dict(base, step_s=0.3, bcast_s=0.1, loss=0.1009),
                                "fp16": dict(base, loss=0.102)})
    assert lines[0].startswith("  step time bf16 vs none: 1.33x (400 -> 300 ms")
    assert lines[1].startswith("  loss within 1%: met (bf16 0.1009 vs none 0.1: 0.90%")
    assert lines[3].startswith("  loss within 1%: NOT met (fp16 0.102 vs none 0.1: 2.00%")
    assert bench.target_lines({"bf16": base}) == ["  (no 'none' setting: no ratios)"]


def test_run_checks_name_what_is_wrong() -> None:
    good = {"identical": True, "root_rounded_as_codec": True, "digests": [1, 1]}
    assert bench.check_run(good) is None
    problem = bench.check_run(dict(good, identical=False, digests=[1, 2]))
    assert problem is not None and "differ" in problem and "[1, 2]" in problem
    problem = bench.check_run(dict(good, root_rounded_as_codec=False))
    assert problem is not None and "rank 0" in problem


def test_bad_arguments_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, words in ((["--codecs", "none,zip"], "--codecs: unknown codec 'zip'"),
                        (["--codecs", "bf16,bf16"], "--codecs: give each setting once"),
                        (["--warmup", "40", "--steps", "40"], "--warmup must be"),
                        (["--loss-window", "0"], "--loss-window must be")):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(argv)
        assert exc.value.code == 2
        assert words in capsys.readouterr().err
    args = bench.parse_args(["--rate", "none", "--optimizer", "sgd"])
    assert args.rate is None and args.lr == 0.02 and args.codecs == ["none", "bf16"]
    quick = bench.parse_args(["--quick"])
    assert worker.param_count(bench.worker_config(quick, "bf16")) * 4 >= 1 << 20  # still compressed


def test_without_root_it_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert bench.main(["--quick"]) == 2
    assert "need root" in capsys.readouterr().err


@pytest.mark.slow  # 18 s: make test-all (make test stays under 15 minutes)
@pytest.mark.timeout(300)
def test_quick_run_on_simulated_hosts_prints_the_table_and_targets(tmp_path: Path) -> None:
    """The real thing, small: 2 simulated hosts at 10 Gbit/s, none and bf16, every run's checks pass."""
    if os.geteuid() != 0:
        pytest.skip("simulated hosts need root (network namespaces)")
    from commd.sim.hosts import netns_unavailable, shaping_unavailable

    reason = netns_unavailable() or shaping_unavailable(None, "10gbit")
    if reason:
        pytest.skip(reason)
    # each simulated host has its own runtime dir whatever the caller's is; --timeout per run ends a
    # stuck run (and tears the hosts down) before this test's own timeout kills the script
    env = {**os.environ, "COMMD_RUNTIME_DIR": str(tmp_path)}
    env.pop("COMMD_JOB", None)
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ddp_broadcast.py"), "--quick", "--rate",
                           "10gbit", "--timeout", "110", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=280,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all ranks' parameters bit-identical to rank 0's" in proc.stdout
    assert "step time bf16 vs none:" in proc.stdout and "loss within 1%: " in proc.stdout
    import json

    data = json.loads(out.read_text())
    assert set(data["summary"]) == {"none", "bf16"}
    bf16 = data["summary"]["bf16"]
    assert bf16["compression"]["bf16"]["ops"] >= 8 and bf16["ratio"] < 0.6  # the pushes were coded
    assert not data["summary"]["none"]["compression"]
    for runs in data["runs"].values():
        assert all(r["identical"] and r["root_rounded_as_codec"] for r in runs)
        assert runs[0]["loss_after"] < runs[0]["loss_before"]  # it learns
