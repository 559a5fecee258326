"""``commd plan --measure``: its argument checks, the per-rank input shapes, and one real small run.

The real run plans tests/planner_models.py's MLP on a mesh of 4 and measures the plan and both
baselines on 2 simulated hosts x 2 ranks (root, network namespaces; skipped without), unshaped, with
few steps: about 30 s on the idle 2-core machine, so it runs in ``make test-all`` (``make test`` stays
under 15 minutes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_planner import write_costs

from commd.planner import measure
from commd.planner import plan as planner
from commd.planner.measure_worker import local_shape

ROOT = Path(__file__).resolve().parent.parent


def _plan(tmp_path: Path) -> Path:
    from commd.cli.main import main

    out = tmp_path / "plan.json"
    assert main(["plan", "planner_models:mlp", "--input", "8x32", "--mesh", "4", "--nproc-per-node", "2",
                 "--costs", str(write_costs(tmp_path / "costs.json")), "--compute", "flops", "-o", str(out)]) == 0
    return out


def test_the_mesh_must_be_hosts_times_ranks_per_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from commd.cli.main import main

    plan = _plan(tmp_path)
    capsys.readouterr()
    assert main(["plan", "--measure", str(plan), "--hosts", "3", "--nproc-per-node", "2"]) == 2
    assert "--hosts 3 x --nproc-per-node 2 = 6 ranks, but the plan's mesh 4 has 4" in capsys.readouterr().err
    with pytest.raises(planner.PlanError, match="must be positive"):
        measure.check(planner.load(plan), 0, 4)
    measure.check(planner.load(plan), 2, 2)  # the right size passes


def test_plans_without_a_model_factory_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from commd.cli.main import main

    out = tmp_path / "example.json"
    assert main(["plan", "--example", "narrow-mlp", "--mesh", "4", "--nproc-per-node", "2", "--costs",
                 str(write_costs(tmp_path / "costs.json")), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["plan", "--measure", str(out), "--hosts", "2", "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert "no model_factory" in err and "--layers or --example" in err


def test_settings_skip_a_null_baseline_and_the_summary_names_the_fastest(tmp_path: Path) -> None:
    made = planner.load(_plan(tmp_path))
    made["baselines"]["megatron"] = None
    got, skipped = measure.settings(made)
    assert list(got) == ["plan", "data_parallel"] and skipped and skipped[0].startswith("megatron:")
    assert got["data_parallel"]["plan"]["layers"] == made["baselines"]["data_parallel"]["layers"]
    runs: dict[str, list[dict[str, Any]]] = {"plan": [{"median_s": 0.004}, {"median_s": 0.002}, {"median_s": 0.005}],
                                             "data_parallel": [{"median_s": 0.003}]}
    result = measure.summary(got, runs)
    assert result["fastest"] == "data_parallel"
    assert result["settings"]["plan"]["measured_step_s"] == pytest.approx(0.004)  # the median run
    assert "fastest measured: data_parallel" in measure.table(result)
    assert measure.interleaved(["a", "b"], 2) == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]


def test_a_baseline_with_the_plans_own_layers_is_the_same_setting_run_once(tmp_path: Path) -> None:
    made = planner.load(_plan(tmp_path))
    made["layers"] = made["baselines"]["data_parallel"]["layers"]
    made["baselines"]["megatron"]["layers"] = made["layers"]
    got, _ = measure.settings(made)
    assert [got[n]["same_as"] for n in got] == [None, "plan", "plan"]
    runs: dict[str, list[dict[str, Any]]] = {"plan": [{"median_s": 0.004}]}
    runs.update(data_parallel=runs["plan"], megatron=runs["plan"])  # what measure() hands summary
    result = measure.summary(got, runs)
    assert {row["measured_step_s"] for row in result["settings"].values()} == {0.004}
    assert result["settings"]["data_parallel"]["same_as"] == "plan"
    assert "the same layers as plan: run once" in measure.table(result)
    made["baselines"]["megatron"] = planner.load(_plan(tmp_path))["baselines"]["megatron"]
    assert measure.settings(made)[0]["megatron"]["same_as"] is None  # different layers: its own job


def test_each_rank_gets_the_share_of_the_batch_its_input_layer_splits(tmp_path: Path) -> None:
    made = planner.load(_plan(tmp_path))
    dp = dict(made, layers=made["baselines"]["data_parallel"]["layers"])
    assert local_shape(dp, [8, 32]) == (2, 32)  # S(0) over 4 ranks
    assert local_shape(dict(made, layers=made["baselines"]["megatron"]["layers"]), [8, 32]) == (8, 32)  # B
    two_d = {"mesh": {"shape": [2, 2]}, "layers": [{"kind": "input", "output": ["S(0)", "B"]}]}
    assert local_shape(two_d, [8, 32]) == (4, 32)
    with pytest.raises(ValueError, match="does not split"):
        local_shape(dp, [6, 32])


@pytest.mark.slow  # 30 s: make test-all (make test stays under 15 minutes)
@pytest.mark.timeout(240)
def test_measure_runs_every_setting_on_simulated_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() != 0:
        pytest.skip("simulated hosts need root (network namespaces)")
    from commd.sim.hosts import netns_unavailable

    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    from commd.cli.main import main

    plan = _plan(tmp_path)
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(tmp_path))  # each simulated host still gets its own
    capsys.readouterr()
    out = tmp_path / "measured.json"
    assert main(["plan", "--measure", str(plan), "--hosts", "2", "--nproc-per-node", "2", "--steps", "4",
                 "--warmup", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fastest measured: " in printed
    data = json.loads(out.read_text())
    assert set(data["settings"]) == {"plan", "data_parallel", "megatron"} and not data["skipped"]
    for name, row in data["settings"].items():
        assert row["predicted_step_s"] > 0 and row["measured_step_s"] > 0, name
        assert name in printed
        (run,) = data["runs"][name]
        assert len(run["step_s"]) == 4 and run["world"] == 4
    assert data["runs"]["data_parallel"][0]["local_input"] == [2, 32]  # each rank its share of the batch
    assert data["runs"]["megatron"][0]["local_input"] == [8, 32]


def test_a_probe_inside_a_step_is_what_the_collective_adds_to_a_loop_of_compute() -> None:
    """Per round, the loop with the collective minus the loop of compute alone; the median round; less
    the cost of making the input; never below zero."""
    from commd.planner.measure_worker import under_compute

    # rounds: 9-4=5, 10-4=6, 30-5=25 (an outlier round) -> the median 6, less 1 to make the input
    assert under_compute([9.0, 10.0, 30.0], [4.0, 4.0, 5.0], 1.0) == pytest.approx(5.0)
    assert under_compute([4.0, 4.1, 3.9], [4.0, 4.0, 4.0], 0.5) == 0.0
    with pytest.raises(ValueError):
        under_compute([1.0, 2.0], [1.0], 0.0)  # (rounds are paired)


@pytest.mark.slow  # (15 s; `make test` stays under 15 minutes: `make test-all` runs it, as does the benchmark)
@pytest.mark.timeout(240)
def test_the_compute_job_times_layers_probes_and_wrappers_on_simulated_hosts(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``--compute job`` on 2 simulated hosts x 2 ranks: every layer's times, the probes on all ranks and
    on one node's, every wrapper's own cost; the overhead lines priced from them, the node's apart."""
    if os.geteuid() != 0:
        pytest.skip("simulated hosts need root (network namespaces)")
    from commd.sim.hosts import netns_unavailable

    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    from commd.planner.measure_worker import PROBES, REPLICATE_WIDTHS, WRAPPERS
    from commd.planner.trace import load_factory, trace

    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(tmp_path))
    factory = {"factory": "planner_models:mlp", "input": [8, 32], "input_dtype": "float32"}
    job = measure.job_compute(factory, 2, 2, repeats=2)
    graph = trace(load_factory("planner_models:mlp"), (8, 32), "float32", "planner_models:mlp")
    assert set(job["layers"]) == {x.name for x in graph.layers}
    assert all(0 <= fixed <= whole for fixed, whole in job["layers"].values())
    assert job["world"] == 4 and job["hosts"] == 2 and job["node_ranks"] == 2
    for key in ("collectives", "node_collectives", "cross_collectives"):
        for path in ("plain", "functional"):
            assert set(job[key][path]) == {"allreduce", "allgather", "reduce_scatter"}, (key, path)
            assert all(len(points) == len(PROBES) and all(t >= 0 for _, t in points)
                       for points in job[key][path].values()), (key, path)
    assert set(job["wrappers"]) == set(WRAPPERS) and all(v >= 0 for v in job["wrappers"].values())
    # DTensor's collectives, counted as the wrapped step ran: the row layer all-reduces its output, the column
    # layer (its input needs no gradient) issues none, so none of the tiny all-reduce's time comes off its cost
    assert {name: job["wrapper_collectives"][name] for name in ("col", "row")} == {"col": 0, "row": 1}
    assert job["probe_compute"]["matmul_side"] >= 16 and job["probe_compute"]["seconds"] > 0
    # FSDP2's replicate timed at a layer's sizes on every kind of group a plan may sync on
    assert set(job["replicate_steps"]) == {"world", "node", "cross"}
    for points in job["replicate_steps"].values():
        assert [n for n, _ in points] == [(w * w + w) * 4 for w in REPLICATE_WIDTHS]
        assert all(t >= 0 for _, t in points)
    from commd.planner.costs import CollectiveCosts

    convert, sync = measure.torch_path_overheads(job, CollectiveCosts.load(write_costs(tmp_path / "costs.json")))
    for lines in (convert, sync):
        assert {"allreduce", "allreduce@node", "allreduce@cross"} <= set(lines) and all(
            a >= 0 and b >= 0 for a, b in lines.values())
