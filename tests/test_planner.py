"""commd plan's offline core: the solvers against brute force and each other, layouts and their
conversions, α-β fits, costs files and tuning tables, plans of the model families, plan.json.

References are independent: brute force over every combination for the solvers, hand-derived
collectives (Megatron's all-reduces) for the cost model, exact points for the fits.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from commd.planner import examples, search
from commd.planner import plan as planner
from commd.planner.costs import AlphaBeta, CollectiveCosts, CostError, fit
from commd.planner.graph import GraphError, Layer, LayerGraph
from commd.planner.layouts import B, P, conversion, split
from commd.scheduler.tuning import TuningEntry, TuningTable

KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast")


def random_problem(rng: np.random.Generator, dag: bool) -> search.Problem:
    n, k = int(rng.integers(3, 12)), int(rng.integers(2, 5))
    costs = [list(rng.uniform(0, 10, k)) for _ in range(n)]
    edges = {}
    for v in range(1, n):
        preds = {v - 1} if not dag else set(rng.choice(v, size=min(v, int(rng.integers(1, 3))), replace=False).tolist())
        for u in preds:
            m = rng.uniform(0, 10, (k, k))
            m[np.arange(k), np.arange(k)] = 0
            edges[(u, v)] = m
    return search.Problem(costs, edges)


def synthetic_costs(rng: np.random.Generator | None = None, flops_per_s: float = 2e10) -> CollectiveCosts:
    """Curves for groups inside a node (fast) and across nodes (slow), per kind."""
    curves = {}
    for key, (alpha, bandwidth) in {"1x2": (50e-6, 2e9), "1x4": (60e-6, 1.5e9), "2x2": (300e-6, 1.1e8),
                                    "2x4": (400e-6, 1e8), "4x4": (500e-6, 9e7)}.items():
        for kind in KINDS:
            a = alpha * (rng.uniform(0.5, 2) if rng is not None else 1)
            bw = bandwidth * (rng.uniform(0.3, 3) if rng is not None else 1)
            curves[(key, kind)] = AlphaBeta(a, (2 if kind == "allreduce" else 1) / bw, 2, "synthetic")
    return CollectiveCosts(curves, flops_per_s, "synthetic")


def random_model(rng: np.random.Generator) -> LayerGraph:
    family = rng.integers(3)
    if family == 0:
        return examples.mlp(int(2 ** rng.integers(4, 12)), int(2 ** rng.integers(6, 12)), int(rng.integers(1, 6)))
    if family == 1:
        hidden = int(2 ** rng.integers(6, 10))
        return examples.gpt(int(2 ** rng.integers(0, 4)), int(2 ** rng.integers(5, 9)), hidden, 4,
                            int(rng.integers(1, 3)), int(rng.integers(1000, 20000)))
    return examples.cnn(int(2 ** rng.integers(3, 7)), 16, (16, 32), int(2 ** rng.integers(7, 12)))


# ---- solvers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dag", [False, True])
def test_the_exact_solvers_find_what_brute_force_finds(dag: bool) -> None:
    for seed in range(25):
        problem = random_problem(np.random.default_rng(seed), dag)
        if np.prod([len(c) for c in problem.node_costs]) > 200_000:
            continue
        truth = search.brute_force(problem, limit=200_000)
        found = search.exact(problem)
        assert found.total == pytest.approx(truth.total, rel=1e-9), f"seed {seed}"
        assert found.method == ("integer program" if dag and not problem.is_chain() else "dynamic programming") \
            or problem.is_chain()


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_descent_with_windows_of_three_from_32_starts_finds_the_optimum_of_200_random_chains_and_graphs() -> None:
    for seed in range(200):
        for dag in (False, True):
            problem = random_problem(np.random.default_rng(seed), dag)
            optimum = search.exact(problem).total
            assert search.descent(problem, window=3, random_starts=32).total == pytest.approx(optimum, rel=1e-9), f"seed {seed}, dag {dag}"


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_the_planners_descent_finds_the_exact_optimum_on_200_random_models() -> None:
    """Windows of two from the planner's starts, on models of every family, random sizes and costs,
    1-D and 2-D meshes: ``--search both`` never finds a gap."""
    for seed in range(200):
        rng = np.random.default_rng(seed)
        graph = random_model(rng)
        mesh = planner.Mesh((4,), 2) if rng.integers(2) else planner.Mesh((2, 2), 2)
        priced = planner.price(graph, mesh, synthetic_costs(rng), planner.Options())
        best, notes = planner.solve(priced, "both", graph)
        assert notes["descent_gap"] <= 1e-9, f"seed {seed}: {graph.source} on {mesh.shape}: gap {notes['descent_gap']}"


def test_a_problem_must_be_numbered_in_a_topological_order() -> None:
    with pytest.raises(search.SearchError, match="topological"):
        search.Problem([[1.0], [1.0]], {(1, 0): np.zeros((1, 1))})
    with pytest.raises(search.SearchError, match="cost matrix"):
        search.Problem([[1.0], [1.0, 2.0]], {(0, 1): np.zeros((1, 1))})
    with pytest.raises(search.SearchError, match="chain"):
        search.exact_chain(search.Problem([[1.0]] * 3, {(0, 2): np.zeros((1, 1))}))


# ---- layouts and costs ----------------------------------------------------------------------------
def test_conversions_are_the_collectives_of_the_sbp_table() -> None:
    n = 1000
    assert conversion(B, split(0), n) == [] and conversion(split(1), P, n) == [] and conversion(P, P, n) == []
    assert conversion(P, B, n) == [("allreduce", n)]
    assert conversion(P, split(1), n) == [("reduce_scatter", n)]
    assert conversion(split(0), B, n) == [("allgather", n)]
    assert conversion(split(0), split(1), n) == [("allgather", n)]  # CPU meshes: gather, then slice
    assert conversion(split(0), split(1), n, gpu=True) == [("alltoall", n)]


def test_a_fit_recovers_alpha_and_beta_and_prices_nothing_for_nothing() -> None:
    points = [(b, 1e-4 + 2e-9 * b) for b in (1 << 10, 1 << 16, 1 << 20, 1 << 24)]
    curve = fit(points, "test")
    assert curve.alpha == pytest.approx(1e-4, rel=1e-6) and curve.beta == pytest.approx(2e-9, rel=1e-6)
    assert curve(0) == 0.0
    assert fit([(1 << 20, 1e-3)], "one point").beta == pytest.approx(1e-3 / (1 << 20))
    with pytest.raises(CostError, match="no measurement"):
        fit([], "empty")


def test_costs_come_from_a_tuning_tables_winning_lanes() -> None:
    entries = [TuningEntry("allreduce", "2", 0, 1 << 62, size, "tcp",
                           measured={"tcp": {"median_us": 100 + size * 0.01}, "gloo": {"median_us": 1e9}})
               for size in (1 << 12, 1 << 16, 1 << 20)]
    costs = CollectiveCosts.from_table(TuningTable({"nodes": 2, "lanes": ["tcp", "gloo"]}, entries))
    got = costs.seconds("allreduce", 1 << 18, nodes=2, ranks=4)  # any ranks per node: the table's class
    assert got == pytest.approx((100 + (1 << 18) * 0.01) / 1e6, rel=1e-6)
    with pytest.raises(CostError, match="calibrate"):
        costs.seconds("allreduce", 1 << 18, nodes=1, ranks=2)
    with pytest.raises(CostError, match="allgather"):
        costs.seconds("allgather", 1 << 18, nodes=2, ranks=2)
    # a table tuned with --algorithms native: the tcp lane's figures are "tcp/native", its winner "tcp"
    native = [TuningEntry("allgather", "2", 0, 1 << 62, size, "tcp", algorithm="native",
                          measured={"tcp/native": {"median_us": 50 + size * 0.02}}) for size in (1 << 12, 1 << 20)]
    costs = CollectiveCosts.from_table(TuningTable({"nodes": 2, "lanes": ["tcp"]}, native))
    assert costs.seconds("allgather", 1 << 20, nodes=2, ranks=4) == pytest.approx((50 + (1 << 20) * 0.02) / 1e6)


@pytest.mark.parametrize(("raw", "error"), [
    ({"format": "x"}, "not a costs file"),
    ({"format": "commd-costs", "version": 9}, "version"),
    ({"format": "commd-costs", "version": 1, "groups": {"two": {}}}, "NODESxRANKS"),
    ({"format": "commd-costs", "version": 1, "groups": {"1x2": {"gossip": [[1, 1]]}}}, "gossip"),
    ({"format": "commd-costs", "version": 1, "groups": {"1x2": {"allreduce": [[1, -1]]}}}, "positive"),
    ({"format": "commd-costs", "version": 1, "groups": {"1x2": {"allreduce": "fast"}}}, "pairs"),
    ({"format": "commd-costs", "version": 1, "groups": {}, "flops_per_s": -1}, "flops_per_s"),
])
def test_a_bad_costs_file_is_refused_naming_what_is_wrong(raw: dict, error: str) -> None:
    with pytest.raises(CostError, match=error):
        CollectiveCosts.from_json(raw)


def test_a_reduce_scatter_without_measurements_is_priced_as_the_all_gather_of_the_same_tensor() -> None:
    costs = CollectiveCosts.from_json({"format": "commd-costs", "version": 1,
                                       "groups": {"1x2": {"allgather": [[1 << 10, 1e-5], [1 << 20, 1e-3]]}}})
    assert costs.seconds("reduce_scatter", 1 << 15, 1, 2) == costs.seconds("allgather", 1 << 15, 1, 2)


# ---- graphs ---------------------------------------------------------------------------------------
def test_a_layer_list_round_trips_and_bad_ones_are_refused(tmp_path: Path) -> None:
    graph = examples.gpt(2, 16, 32, 4, 2, 100)
    path = tmp_path / "layers.json"
    path.write_text(json.dumps(graph.to_json()))
    again = LayerGraph.load(path)
    assert again.to_json() == graph.to_json() and again.edges() == graph.edges()
    bad = graph.to_json()
    bad["layers"][3]["inputs"] = ["nowhere"]
    with pytest.raises(GraphError, match="'nowhere' is not an earlier layer"):
        LayerGraph.from_json(bad)
    with pytest.raises(GraphError, match="kind 'magic'"):
        LayerGraph([Layer("x", "input", (), (2, 2)), Layer("m", "magic", ("x",), (2, 2))])
    with pytest.raises(GraphError, match="out_shape"):
        LayerGraph([Layer("x", "input", (), (2, 0))])


# ---- plans ----------------------------------------------------------------------------------------
def test_megatron_on_an_mlp_issues_one_all_reduce_per_column_row_pair_forward() -> None:
    """x -> fc0 (column) -> act -> fc1 (row) -> loss on 2 ranks of one node: the row layer's partial
    output is all-reduced before the loss (Megatron's g); the column layer's backward all-reduce (f)
    is not needed for the batch, which has no gradient.  Nothing else moves."""
    graph = examples.mlp(batch=8, width=16, depth=2)
    priced = planner.price(graph, planner.Mesh((2,), 2), synthetic_costs(), planner.Options())
    choice = planner.megatron(graph, priced)
    assert [priced.options[i][c][0].name for i, c in enumerate(choice)] == ["rep", "col", "split1", "row", "rep"]
    got = planner.breakdown(priced, choice)["collectives"]
    assert got == [{"kind": "allreduce", "bytes": 8 * 16 * 4, "mesh_dim": 0, "count": 1}]


def test_data_parallel_syncs_every_parameter_once_in_ddp_buckets_and_converts_nothing() -> None:
    """Plain DDP: the gradients from the last layer back, a bucket closed once it holds its cap (the first
    one's smaller), one all-reduce per bucket, every parameter in exactly one."""
    graph = examples.mlp(batch=8, width=16, depth=3)
    layers = [graph.param_bytes(i) for i, layer in enumerate(graph.layers) if layer.params]
    assert layers == [1088, 1088, 1088]
    for first, cap, want in ((1 << 20, 25 << 20, [3264]), (1000, 2000, [1088, 2176]), (1, 1, [1088] * 3),
                             (2000, 1, [2176, 1088])):
        opts = planner.Options(ddp_first_bucket_bytes=first, ddp_bucket_bytes=cap)
        priced = planner.price(graph, planner.Mesh((4,), 2), synthetic_costs(), opts)
        figures = planner.breakdown(priced, planner.data_parallel(graph, priced))
        assert figures["ddp_buckets"] == want, (first, cap)
        synced = [c["bytes"] for c in figures["collectives"] for _ in range(c["count"])]
        assert sorted(synced) == sorted(want) and all(c["kind"] == "allreduce" for c in figures["collectives"])
        assert figures["conversions_s"] == 0
        costs = synthetic_costs()
        assert figures["sync_s"] == pytest.approx(sum(costs.seconds("allreduce", b, 2, 4) for b in want))


def test_plain_ddp_becomes_the_plan_where_its_buckets_beat_the_search_that_priced_a_layer_at_a_time() -> None:
    graph = examples.mlp(batch=64, width=64, depth=8)
    mesh, costs = planner.Mesh((4,), 2), synthetic_costs(flops_per_s=1e9)
    priced = planner.price(graph, mesh, costs, planner.Options())
    searched = planner.solve(priced, "exact", graph)[0].choice
    dp = planner.data_parallel(graph, priced)
    assert searched != dp  # priced a layer's all-reduce at a time, data parallel loses ...
    assert planner.breakdown(priced, dp)["step_s"] < planner.breakdown(priced, searched)["step_s"]  # ... as DDP not
    assert "ddp_buckets" not in planner.breakdown(priced, searched)
    made = planner.plan(graph, mesh, costs, planner.Options(search="exact"))
    assert made["search"]["ddp_baseline_chosen"] is True
    assert [r["strategy"] for r in made["layers"]] == made["baselines"]["data_parallel"]["strategy"]
    assert made["ddp_buckets"] == made["predicted"]["ddp_buckets"] == [sum(graph.param_bytes(i) for i in
                                                                          range(len(graph.layers)))]
    assert made["predicted"]["step_s"] == made["baselines"]["data_parallel"]["step_s"]


def test_megatron_stays_the_plan_where_the_search_gains_less_than_the_margin_over_it() -> None:
    """The margin holds against the faster baseline, Megatron as well as data parallel: a choice predicted
    4% faster than Megatron is inside the predictions' error, so Megatron is the plan and the search's
    choice is kept aside in plan.json."""
    graph, mesh = examples.cnn(32), planner.Mesh((2, 2), 2)
    free = planner.plan(graph, mesh, synthetic_costs(), planner.Options(min_gain=0.0))
    megatron, dp = free["baselines"]["megatron"], free["baselines"]["data_parallel"]
    assert 0.9 * megatron["step_s"] < free["predicted"]["step_s"] < megatron["step_s"] < dp["step_s"]
    kept = planner.plan(graph, mesh, synthetic_costs(), planner.Options(min_gain=0.1))
    assert [r["strategy"] for r in kept["layers"]] == megatron["strategy"]
    assert kept["predicted"]["step_s"] == megatron["step_s"]
    aside = kept["search"]["below_min_gain"]
    assert aside["baseline"] == "megatron" and aside["searched_strategy"] == [r["strategy"] for r in free["layers"]]


def test_a_row_split_layer_synchronises_its_weights_share_and_its_whole_bias() -> None:
    """Megatron on a 2x2 mesh's tp, DDP on dp: a rank holds half of each weight, all of a row layer's bias
    (added after the reduction) and half of a column layer's (hand-derived bytes)."""
    graph = examples.mlp(batch=8, width=16, depth=2)
    priced = planner.price(graph, planner.Mesh((2, 2), 2), synthetic_costs(), planner.Options())
    figures = planner.breakdown(priced, planner.megatron(graph, priced))
    synced = sorted(c["bytes"] for c in figures["collectives"] if c["mesh_dim"] == 0 for _ in range(c["count"]))
    assert synced == sorted([(16 * 16 // 2 + 16 // 2) * 4, (16 * 16 // 2 + 16) * 4])  # fc0 column, fc1 row


def test_the_plan_is_never_predicted_slower_than_its_baselines_and_survives_a_round_trip(tmp_path: Path) -> None:
    for graph in (examples.mlp(64, 1024, 4), examples.cnn(32), examples.gpt(4, 64, 128, 4, 2, 1000)):
        for mesh in (planner.Mesh((4,), 2), planner.Mesh((2, 2), 2)):
            made = planner.plan(graph, mesh, synthetic_costs(), planner.Options(search="both", min_gain=0.0),
                                table_id="t")
            for name, baseline in made["baselines"].items():
                assert baseline is not None, name
                assert made["predicted"]["step_s"] <= baseline["step_s"] * (1 + 1e-9), (graph.source, mesh, name)
            # with a margin: the search's plan only where it is predicted >= 10% faster than the faster baseline
            kept = planner.plan(graph, mesh, synthetic_costs(), planner.Options(search="both", min_gain=0.1))
            best = min(kept["baselines"].values(), key=lambda b: b["step_s"])
            if made["predicted"]["step_s"] > 0.9 * best["step_s"]:
                assert [r["strategy"] for r in kept["layers"]] == best["strategy"], (graph.source, mesh)
                assert kept["predicted"]["step_s"] == best["step_s"]
                assert made["layers"] == best["layers"] or kept["search"]["below_min_gain"]["searched_strategy"] == \
                    [r["strategy"] for r in made["layers"]]
            else:
                assert kept["layers"] == made["layers"], (graph.source, mesh)
            path = tmp_path / "plan.json"
            planner.save(made, path)
            assert planner.load(path) == json.loads(json.dumps(made))
            text = planner.show(made)
            assert all(layer.name in text for layer in graph.layers) and "megatron" in text


def test_a_memory_limit_removes_the_candidates_that_do_not_fit() -> None:
    graph = examples.mlp(batch=8, width=2048, depth=2)  # 16 MiB of weights per layer: 64 MiB with grads + Adam
    roomy = planner.price(graph, planner.Mesh((4,), 4), synthetic_costs(), planner.Options())
    tight = planner.price(graph, planner.Mesh((4,), 4), synthetic_costs(), planner.Options(mem_bytes=40 << 20))
    names = {s[0].name for s in tight.options[1]}
    assert "dp" in {s[0].name for s in roomy.options[1]} and "dp" not in names and {"fsdp", "col", "row"} <= names
    with pytest.raises(planner.PlanError, match="no strategy fits"):
        planner.price(graph, planner.Mesh((4,), 4), synthetic_costs(), planner.Options(mem_bytes=1 << 20))


def test_a_24_block_transformer_plans_within_the_issues_10_seconds() -> None:
    graph = examples.gpt(8, 512, 1024, 16, 24, 32000)
    began = time.perf_counter()
    made = planner.plan(graph, planner.Mesh((2, 2), 2), synthetic_costs(), planner.Options())
    took = time.perf_counter() - began
    assert len(made["layers"]) == len(graph.layers)
    assert took < 10, f"planning a 24-block transformer took {took:.1f} s"


# ---- the command line -----------------------------------------------------------------------------
def write_costs(path: Path) -> Path:
    groups = {}
    for key, (alpha, bandwidth) in {"1x2": (5e-5, 2e9), "2x2": (3e-4, 1.1e8), "2x4": (4e-4, 1e8)}.items():
        groups[key] = {kind: [[b, alpha + (2 if kind == "allreduce" else 1) * b / bandwidth] for b in (4096, 1 << 20, 1 << 24)]
                       for kind in ("allreduce", "allgather")}
    path.write_text(json.dumps({"format": "commd-costs", "version": 1, "flops_per_s": 2e10, "groups": groups}))
    return path


def test_commd_plan_writes_a_plan_it_can_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from commd.cli.main import main

    costs, out, layers = write_costs(tmp_path / "costs.json"), tmp_path / "plan.json", tmp_path / "layers.json"
    assert main(["plan", "--example", "gpt", "--mesh", "2x2", "--nproc-per-node", "2", "--costs", str(costs),
                 "--search", "both", "--write-layers", str(layers), "-o", str(out)]) == 0
    made = planner.load(out)
    assert made["mesh"]["dims"] == [{"name": "dp", "size": 2, "nodes": 2}, {"name": "tp", "size": 2, "nodes": 1}]
    assert made["search"]["descent_gap"] <= 1e-9
    capsys.readouterr()
    assert main(["plan", "--show", str(out)]) == 0
    assert "h3.attn" in capsys.readouterr().out
    assert main(["plan", "--layers", str(layers), "--mesh", "2x2", "--nproc-per-node", "2", "--costs", str(costs),
                 "-o", str(tmp_path / "again.json")]) == 0  # the written layer list plans the same model
    assert planner.load(tmp_path / "again.json")["layers"] == made["layers"]


@pytest.mark.parametrize(("args", "error"), [
    (["--example", "gpt", "--costs", "COSTS"], "--mesh is needed"),
    (["--example", "gpt", "--mesh", "2y2", "--costs", "COSTS"], "sizes such as"),
    (["--example", "gpt", "--mesh", "4"], "no measured costs"),
    (["--example", "gpt", "--mesh", "4", "--costs", "COSTS"], "calibrate"),  # 4 ranks on one node: not measured
    (["--mesh", "4", "--costs", "COSTS"], "give the model"),
    (["--example", "gpt", "--mesh", "3", "--nproc-per-node", "2", "--costs", "COSTS"], "do not fill nodes"),
    (["--example", "gpt", "--mesh", "2", "--costs", "COSTS", "--mem-gb", "0.00001"], "no strategy fits"),
    (["--example", "gpt", "--mesh", "2", "--costs", "COSTS", "--min-gain", "1"], "--min-gain must be a fraction"),
    (["--example", "gpt", "--mesh", "2", "--costs", "COSTS", "--min-gain", "-0.1"], "--min-gain must be a fraction"),
])
def test_commd_plan_refuses_bad_input_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                               error: str) -> None:
    from commd.cli.main import main

    costs = str(write_costs(tmp_path / "costs.json"))
    assert main(["plan", *[costs if a == "COSTS" else a for a in args]]) == 2
    assert error in capsys.readouterr().err


def test_calibration_keeps_the_checked_commd_rows_per_group_and_kind() -> None:
    from commd.planner.calibrate import group_sizes, points_from_rows

    assert group_sizes(1) == [] and group_sizes(2) == [2] and group_sizes(6) == [2, 4, 6] and group_sizes(8) == [2, 4, 8]
    rows = [{"op": "allreduce", "bytes": 4096, "via": "commd", "check": "ok", "world": 2, "nodes": 1, "median_us": 50.0},
            {"op": "allreduce", "bytes": 4096, "via": "gloo", "check": "ok", "world": 2, "nodes": 1, "median_us": 9.0},
            {"op": "allgather", "bytes": 8192, "via": "commd", "check": "FAILED", "world": 2, "nodes": 1, "median_us": 1.0},
            {"op": "barrier", "bytes": 0, "via": "commd", "check": "ok", "world": 2, "nodes": 1, "median_us": 5.0}]
    assert points_from_rows(rows) == {"1x2": {"allreduce": [[4096, 50e-6]]}}


# ---- tracing torch models ------------------------------------------------------------------------
@pytest.mark.parametrize(("factory", "shape", "dtype"), [("mlp", (8, 32), "float32"), ("TinyGPT", (2, 16), "int64"),
                                                         ("cnn", (4, 3, 16, 16), "float32")])
def test_a_traced_model_holds_every_parameter_and_the_shapes_torch_computes(factory: str, shape: tuple[int, ...],
                                                                            dtype: str) -> None:
    import planner_models
    import torch

    from commd.planner.trace import trace

    graph = trace(getattr(planner_models, factory), shape, dtype)
    model = getattr(planner_models, factory)()  # on the CPU: the reference
    assert sum(layer.params for layer in graph.layers) == sum(p.numel() for p in model.parameters())
    out = model(torch.zeros(shape, dtype=getattr(torch, dtype)))
    last = graph.layers[graph.index[graph.layers[-1].inputs[0]]]
    assert last.out_shape == tuple(out.shape)
    for layer in graph.layers:
        if layer.kind == "linear":
            batch = math.prod(layer.out_shape[:-1])
            assert layer.flops == 2.0 * batch * layer.attrs["in_features"] * layer.attrs["out_features"]


def test_a_traced_transformer_has_its_residual_adds_and_attention_blocks() -> None:
    import planner_models

    from commd.planner.trace import trace

    graph = trace(planner_models.TinyGPT, (2, 16), "int64")
    kinds = [layer.kind for layer in graph.layers]
    assert kinds.count("attention") == 2 and kinds.count("layernorm") == 5 and kinds.count("embedding") == 1
    adds = [layer for layer in graph.layers if layer.attrs.get("linear")]
    assert len(adds) == 4 and all(len(layer.inputs) == 2 for layer in adds)
    made = planner.plan(graph, planner.Mesh((2,), 2), synthetic_costs(), planner.Options(search="both"))
    assert made["search"]["descent_gap"] <= 1e-9


def test_commd_plan_traces_a_factory_and_refuses_what_it_cannot_trace(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from commd.cli.main import main

    costs = str(write_costs(tmp_path / "costs.json"))
    assert main(["plan", "planner_models:TinyGPT", "--input", "2x16", "--input-dtype", "int64", "--mesh", "2",
                 "--costs", costs, "-o", str(tmp_path / "plan.json")]) == 0
    assert "blocks_1_attn" in capsys.readouterr().out
    for args, error in ((["planner_models:TinyGPT", "--mesh", "2"], "--input SHAPE"),
                        (["planner_models:nothing", "--input", "2x16", "--mesh", "2"], "no callable 'nothing'"),
                        (["no_such_module_here:f", "--input", "2", "--mesh", "2"], "cannot import"),
                        (["planner_models:not_a_model", "--input", "2", "--mesh", "2"], "not a torch.nn.Module"),
                        (["planner_models:mlp", "--input", "2x7", "--mesh", "2"], "does not trace")):
        assert main(["plan", *args, "--costs", costs]) == 2
        assert error in capsys.readouterr().err, args


def test_measured_layer_times_price_the_compute_and_every_layer_has_one(tmp_path: Path) -> None:
    """Measured training times (this machine, real tensors) replace FLOPs: every traced layer has a time,
    a plan's compute is their sum on one rank when nothing is split, and a layer's fixed part is
    charged whole when a strategy splits it."""
    import planner_models

    from commd.planner.trace import measure, trace

    graph = trace(planner_models.TinyGPT, (2, 16), "int64")
    seconds = measure(planner_models.TinyGPT, (2, 16), "int64", repeats=3, threads=1)
    assert {layer.name for layer in graph.layers} <= set(seconds)
    assert all(seconds[x.name] > 0 for x in graph.layers if x.kind not in ("input", "output"))
    opts = planner.Options(compute="measured", layer_seconds=seconds)
    priced = planner.price(graph, planner.Mesh((1,), 1), synthetic_costs(), opts)
    choice = [next(k for k, c in enumerate(options) if c[0].name == "rep") for options in priced.options]
    assert planner.breakdown(priced, choice)["compute_s"] == pytest.approx(
        sum(seconds[layer.name] for layer in graph.layers))
    fixed = {name: t / 4 for name, t in seconds.items()}
    opts = planner.Options(compute="measured", layer_seconds=seconds, layer_fixed_seconds=fixed)
    priced = planner.price(graph, planner.Mesh((2,), 2), synthetic_costs(), opts)
    choice = [next(k for k, c in enumerate(options) if c[0].name == "dp") for options in priced.options]
    assert planner.breakdown(priced, choice)["compute_s"] == pytest.approx(
        sum(fixed[x.name] + (seconds[x.name] - fixed[x.name]) / 2 for x in graph.layers))
    with pytest.raises(planner.PlanError, match="no measured time"):
        planner.price(graph, planner.Mesh((1,), 1), synthetic_costs(), planner.Options(compute="measured"))


def test_fixed_part_of_a_layer_from_its_time_on_the_whole_batch_and_on_a_share() -> None:
    """t(s) = fixed + (whole - fixed) * s through both measured points; a share timed slower than its
    line allows is all fixed, one timed faster than proportional has no fixed part."""
    from commd.planner.trace import fixed_and_whole

    got = fixed_and_whole({"a": 10.0, "b": 8.0, "c": 8.0}, {"a": 4.0, "b": 9.0, "c": 1.0}, 0.25)
    fixed, whole = got["a"]
    assert whole == 10.0 and fixed + (whole - fixed) * 0.25 == pytest.approx(4.0)
    assert got["b"] == (8.0, 8.0) and got["c"] == (0.0, 8.0)


def test_layers_timed_alone_are_scaled_to_add_up_to_a_whole_training_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``measure_in_step`` keeps the layers' proportions and makes their sum the step's time, and the
    step it times is a real SGD step of the whole model: every forward pass counted, the weights moved."""
    import torch

    from commd.planner import trace

    monkeypatch.setattr(trace, "measure", lambda *a, **k: {"a": 1.0, "b": 3.0, "out": 0.0})
    monkeypatch.setattr(trace, "step_seconds", lambda *a, **k: 6.0)
    layers, factor = trace.measure_in_step(lambda: None, (2, 4))
    assert factor == 1.5 and layers == {"a": 1.5, "b": 4.5, "out": 0.0}
    monkeypatch.undo()

    calls, built = [], []

    def factory() -> torch.nn.Module:
        model = torch.nn.Linear(4, 3)
        model.register_forward_hook(lambda *_: calls.append(1))
        built.append((model, model.weight.detach().clone()))
        return model

    assert trace.step_seconds(factory, (2, 4), repeats=2, threads=1) > 0
    (model, before), = built
    assert len(calls) == 2 * 2 + 3 and not torch.equal(model.weight.detach(), before)


def test_a_measured_step_ends_when_the_slowest_rank_finishes_it() -> None:
    """Step times from the job's end times (the largest over ranks): ranks taking turns being slow do
    not make every step read as a slow turn."""
    from commd.planner.measure_worker import step_times

    fast_slow, slow_fast = [0.03, 0.10, 0.13, 0.20], [0.07, 0.10, 0.17, 0.20]
    job = [max(a, b) for a, b in zip(fast_slow, slow_fast, strict=True)]
    assert step_times(job) == pytest.approx([0.07, 0.03, 0.07, 0.03])
    assert sum(step_times(job)) == pytest.approx(0.20)  # the job's steps add up to its time, 50 ms a step
    durations = [max(a, b) for a, b in zip(step_times(fast_slow), step_times(slow_fast), strict=True)]
    assert statistics.median(step_times(job)) == pytest.approx(0.05) and min(durations) == pytest.approx(0.07)


def job_measurement(graph: LayerGraph, probe_s: float) -> dict:
    """A job measurement as ``measure.job_compute`` writes it: probes of 64 KiB and 4 MiB per rank."""
    sizes = {"allreduce": (65536, 4194304), "allgather": (262144, 16777216), "reduce_scatter": (65536, 4194304)}
    return {"layers": {x.name: [1e-4, 1e-3] for x in graph.layers}, "world": 4, "hosts": 2, "nproc_per_node": 2,
            "rate": "1gbit", "delay_ms": 0.2, "input": [64, 32],
            "collectives": {path: {kind: [[b, probe_s] for b in sizes[kind]] for kind in sizes}
                            for path in ("plain", "functional")}}


def test_torch_path_overheads_are_what_the_job_measured_beyond_the_costs() -> None:
    """A line through what each probe took beyond the costs' price: never below zero, nor falling."""
    from commd.planner.measure import torch_path_overheads

    costs = synthetic_costs()
    job = job_measurement(examples.mlp(64, 32, 2), 0.05)
    job["collectives"]["plain"]["allreduce"] = [[65536, 0.0], [4194304, 0.0]]  # faster than priced: none
    price = costs.seconds("allgather", 262144, 2, 4), costs.seconds("allgather", 16777216, 2, 4)
    job["collectives"]["functional"]["allgather"] = [[262144, price[0] + 0.001], [16777216, price[1] + 0.011]]
    convert, sync = torch_path_overheads(job, costs)
    a, b = convert["allgather"]
    assert a + b * 262144 == pytest.approx(0.001) and a + b * 16777216 == pytest.approx(0.011)
    assert sync["allreduce"] == [0.0, 0.0] and sync["reduce_scatter"][0] > 0


def test_overheads_probed_on_one_nodes_ranks_price_the_groups_inside_a_node() -> None:
    """A job with several nodes of several ranks also probes a node's group: its lines (``KIND@node``) are
    taken beyond the one-node price and charged to collectives inside a node, the others' to the rest."""
    from commd.planner.measure import torch_path_overheads

    costs = synthetic_costs()
    job = job_measurement(examples.mlp(64, 32, 2), 0.05)
    node_price = costs.seconds("allreduce", 65536, 1, 2), costs.seconds("allreduce", 4194304, 1, 2)
    job["node_collectives"] = {"plain": {"allreduce": [[65536, 0.0], [4194304, 0.0]]},
                               "functional": {"allreduce": [[65536, node_price[0] + 0.002],
                                                            [4194304, node_price[1] + 0.004]]}}
    job["node_ranks"] = 2
    convert, sync = torch_path_overheads(job, costs)
    a, b = convert["allreduce@node"]
    assert a + b * 65536 == pytest.approx(0.002) and a + b * 4194304 == pytest.approx(0.004)
    assert sync["allreduce@node"] == [0.0, 0.0] and "allreduce" in convert  # (all ranks' lines kept)

    graph = examples.mlp(batch=64, width=256, depth=4)
    mesh = planner.Mesh((2, 2), 2)  # dp across the nodes, tp inside them: Megatron converts on tp only

    def conversions(lines: dict[str, list[float]]) -> tuple[float, int]:
        priced = planner.price(graph, mesh, costs, planner.Options(convert_overhead_s=lines))
        figures = planner.breakdown(priced, planner.megatron(graph, priced))
        inside = sum(c["count"] for c in figures["collectives"] if c["mesh_dim"] == 1 and c["kind"] == "allreduce")
        return figures["conversions_s"], inside

    base, inside = conversions({})
    assert inside > 0
    assert conversions({"allreduce@node": [1.0, 0.0]})[0] == pytest.approx(base + inside)
    assert conversions({"allreduce": [1.0, 0.0]})[0] == pytest.approx(base + inside)  # no node line: the kind's
    assert conversions({"allreduce": [7.0, 0.0], "allreduce@node": [1.0, 0.0]})[0] == pytest.approx(base + inside)


def test_overheads_probed_on_one_rank_of_each_node_price_a_2x2_meshs_dp_sync() -> None:
    """The job's groups of one rank per node, side by side (a 2-D mesh's dp groups): their line
    (``KIND@cross``) is taken beyond the price of their collectives side by side, and charged
    to the dp dimension's gradient sync, not to DDP's over all ranks."""
    from commd.planner.measure import torch_path_overheads

    costs = synthetic_costs()
    job = job_measurement(examples.mlp(64, 32, 2), 0.05)
    job["node_ranks"] = 2
    side_by_side = costs.side_by_side("allreduce", 65536, 2, 2, 2), costs.side_by_side("allreduce", 4194304, 2, 2, 2)
    job["cross_collectives"] = {"plain": {"allreduce": [[65536, side_by_side[0] + 0.003],
                                                        [4194304, side_by_side[1] + 0.005]]},
                                "functional": {"allreduce": [[65536, 0.0], [4194304, 0.0]]}}
    convert, sync = torch_path_overheads(job, costs)
    a, b = sync["allreduce@cross"]
    assert a + b * 65536 == pytest.approx(0.003) and a + b * 4194304 == pytest.approx(0.005)
    assert convert["allreduce@cross"] == [0.0, 0.0]

    graph = examples.mlp(batch=64, width=256, depth=4)
    mesh = planner.Mesh((2, 2), 2)  # Megatron syncs its gradients on dp, one rank of each node

    def sync_of(pick: Any, lines: dict[str, list[float]], dim: int) -> tuple[float, int]:
        priced = planner.price(graph, mesh, costs, planner.Options(sync_overhead_s=lines))
        figures = planner.breakdown(priced, pick(graph, priced))
        return figures["sync_s"], sum(c["count"] for c in figures["collectives"] if c["mesh_dim"] == dim)

    base, calls = sync_of(planner.megatron, {}, 0)
    assert calls > 0
    assert sync_of(planner.megatron, {"allreduce@cross": [1.0, 0.0]}, 0)[0] == pytest.approx(base + calls)
    assert sync_of(planner.megatron, {"allreduce": [7.0, 0.0], "allreduce@cross": [1.0, 0.0]}, 0)[0] == \
        pytest.approx(base + calls)
    ddp, buckets = sync_of(planner.data_parallel, {}, 2)  # DDP: over all ranks (the mesh's dimension 2)
    assert buckets > 0 and sync_of(planner.data_parallel, {"allreduce@cross": [1.0, 0.0]}, 2)[0] == pytest.approx(ddp)


def test_each_wrapped_layer_is_charged_its_wrappers_own_cost_and_plain_ddp_none() -> None:
    """Megatron on 2x2: every column and row layer is charged its DTensor style's cost and FSDP2's
    replicate on dp; data parallel everywhere is plain DDP, which wraps no layer."""
    from commd.planner.layouts import candidates

    graph = examples.mlp(batch=64, width=256, depth=4)
    mesh, costs = planner.Mesh((2, 2), 2), synthetic_costs()
    lines = {"col": 1.0, "row": 10.0, "replicate": 100.0, "fully_shard": 1000.0}
    bare = planner.price(graph, mesh, costs, planner.Options())
    wrapped = planner.price(graph, mesh, costs, planner.Options(wrapper_overhead_s=lines))
    choice = planner.megatron(graph, bare)
    styles = [bare.options[i][c][1].name for i, c in enumerate(choice) if graph.layers[i].kind == "linear"]
    assert sorted(styles) == ["col", "col", "row", "row"]
    extra = planner.breakdown(wrapped, choice)["compute_s"] - planner.breakdown(bare, choice)["compute_s"]
    assert extra == pytest.approx(2 * 1.0 + 2 * 10.0 + 4 * 100.0)
    dp = planner.data_parallel(graph, bare)
    assert planner.breakdown(wrapped, dp)["compute_s"] == planner.breakdown(bare, dp)["compute_s"]  # plain DDP
    linear = graph.layers[1]
    by_names = {tuple(s.name for s in combo): combo for combo in (
        (a, b) for a in candidates(linear, 2, 2, "data") for b in candidates(linear, 2, 2, "model"))}
    assert planner.wrappers("linear", by_names[("fsdp", "col")]) == ["col", "fully_shard"]
    assert planner.wrappers("linear", by_names[("dp", "dp")]) == ["replicate"]
    assert planner.wrappers("linear", by_names[("dp", "fsdp")]) == ["fully_shard"]
    assert planner.wrappers("follow", by_names[("dp", "col")]) == []


def test_replicate_is_charged_what_the_job_measured_beyond_its_priced_all_reduce() -> None:
    """The job's wrapped-step times per group become points beyond the all-reduce's price on those groups
    and its sync line (never below zero); a layer FSDP2 replicates on a 2x2 mesh's dp groups is charged the
    cross curve at its gradient's bytes, a layer replicated over all ranks the world curve, and a group
    with no curve (or a wrapper without one) the tiny-layer figure."""
    from commd.planner.measure import replicate_curves

    costs = synthetic_costs()
    job = job_measurement(examples.mlp(64, 32, 2), 0.05)
    job["node_ranks"] = 2
    cross = [costs.side_by_side("allreduce", n, 2, 2, 2) for n in (1000, 100000)]
    world = [costs.side_by_side("allreduce", n, 2, 4, 1) for n in (1000, 100000)]
    job["replicate_steps"] = {"cross": [[100000, cross[1] + 0.004 + 0.0005], [1000, cross[0] + 0.001 + 0.0005]],
                              "world": [[1000, world[0] + 0.002], [100000, world[1] - 0.001]]}
    curves = replicate_curves(job, costs, {"allreduce@cross": [0.0005, 0.0], "allreduce": [0.0, 0.0]})
    assert set(curves) == {"replicate@cross", "replicate"}
    assert [n for n, _ in curves["replicate@cross"]] == [1000, 100000]  # (sorted by bytes)
    assert [t for _, t in curves["replicate@cross"]] == pytest.approx([0.001, 0.004])
    assert [t for _, t in curves["replicate"]] == pytest.approx([0.002, 0.0])  # (below the price: none)

    assert replicate_curves({**job, "replicate_steps": {}}, costs, {}) == {}  # (a job from before: none)
    for bad, named in (({"cross": [[1000, "slow"]]}, "'cross'"), ({"cross": [[0, 0.1]]}, "'cross'"),
                       ({"cross": [[1000, -1.0]]}, "'cross'"), ({"rack": []}, "'rack'"), ([[1000, 0.1]], "mapping"),
                       ({"world": {"1000": 0.1}}, "'world'"), ({"node": [[1000.5, 0.1]]}, "'node'"),
                       ({"node": [[float("inf"), 0.1]]}, "'node'"), ({"node": [[float("nan"), 0.1]]}, "'node'"),
                       ({"node": [[1000, float("nan")]]}, "'node'")):
        with pytest.raises(planner.PlanError, match=named):
            replicate_curves({**job, "replicate_steps": bad}, costs, {})

    graph = examples.mlp(batch=64, width=256, depth=4)
    mesh = planner.Mesh((2, 2), 2)
    flat = {"replicate": 0.5, "col": 0.25, "row": 0.125}

    def wrappers_of(pick: Any, curves: dict[str, list[list[float]]]) -> tuple[float, list[int]]:
        priced = planner.price(graph, mesh, costs, planner.Options(wrapper_overhead_s=flat, wrapper_curves_s=curves))
        choice = pick(graph, priced)
        synced = [sum(b for _, b, _, _ in priced.node_collectives[i][c]) for i, c in enumerate(choice)]
        return sum(priced.node_parts[i][c]["wrappers_s"] for i, c in enumerate(choice)), [b for b in synced if b]

    curve = [[1000, 0.001], [100000, 0.004]]
    styles = 2 * 0.25 + 2 * 0.125  # (Megatron's two column and two row layers)
    charged, synced = wrappers_of(planner.megatron, {"replicate@cross": curve})
    assert len(synced) == 4 and charged == pytest.approx(styles + sum(np.interp(b, [1000, 100000], [0.001, 0.004])
                                                                      for b in synced))
    assert wrappers_of(planner.megatron, {"replicate@node": curve})[0] == pytest.approx(styles + 4 * 0.5)
    assert wrappers_of(planner.megatron, {})[0] == pytest.approx(styles + 4 * 0.5)
    # data parallel on both dimensions: replicate over all ranks (the world curve; beyond it, its last point)
    everywhere = lambda graph, priced: planner.data_parallel(graph, priced)  # noqa: E731
    charged, synced = wrappers_of(everywhere, {"replicate": [[10, 0.003], [20, 0.007]]})
    assert len(synced) == 4 and charged == pytest.approx(4 * 0.007)


def test_a_job_measurement_prices_compute_and_conversions(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--compute-from reuses a job measurement: every layer's compute and every collective's overhead
    come from it (a huge probe time makes every conversion dearer than data parallel), and a file
    without one is refused."""
    from commd.cli.main import main
    from commd.planner.trace import load_factory, trace

    graph = trace(load_factory("planner_models:mlp"), (64, 32), "float32", "planner_models:mlp")
    costs = str(write_costs(tmp_path / "costs.json"))
    job = tmp_path / "job.json"
    job.write_text(json.dumps(job_measurement(graph, 10.0)))
    out = tmp_path / "plan.json"
    mesh = ["--mesh", "4", "--nproc-per-node", "2"]
    assert main(["plan", "planner_models:mlp", "--input", "64x32", *mesh, "--costs", costs,
                 "--compute-from", str(job), "-o", str(out)]) == 0
    made = planner.load(out)
    assert made["compute"]["source"].startswith("job on 2 simulated hosts x 2 ranks")
    assert made["compute"]["job"]["layers"] == json.loads(job.read_text())["layers"]
    assert made["predicted"]["conversions_s"] == 0.0  # (every conversion costs 10 s more)
    n = len(graph.layers)
    assert n * (1e-4 + 0.9e-3 / 4) <= made["predicted"]["compute_s"] <= n * 1e-3
    assert main(["plan", "planner_models:mlp", "--input", "64x32", "--mesh", "2", "--costs", costs,
                 "--compute-from", str(job)]) == 2
    assert "measured on 4 ranks" in capsys.readouterr().err
    job.write_text(json.dumps({"layers": {}}))
    assert main(["plan", "planner_models:mlp", "--input", "64x32", *mesh, "--costs", costs,
                 "--compute-from", str(job)]) == 2
    assert "no job measurement" in capsys.readouterr().err


def test_a_split_follows_views_and_transposes_onto_the_heads() -> None:
    """A reshape keeps a split of the leading dimension of each group it divides or merges; a transpose
    moves it; the rest of a view's arguments are sizes, not inputs.  Checked against torch: a block of
    the features, viewed as heads, is that block of the heads."""
    import planner_models
    import torch

    from commd.planner.trace import reshape_map, trace

    assert reshape_map((8, 64, 256), (8, 64, 8, 32)) == [0, 1, 2]
    assert reshape_map((8, 64, 8, 32), (8, 64, 256)) == [0, 1, 2, None]
    assert reshape_map((4, 3, 5), (60,)) == [0, None, None]
    x = torch.arange(2 * 3 * 8).reshape(2, 3, 8)
    halves = x.chunk(2, dim=2)  # the features split in two: rank r's view holds heads 2r, 2r+1
    assert all(torch.equal(x.view(2, 3, 4, 2).chunk(2, dim=2)[r], h.reshape(2, 3, -1, 2)) for r, h in enumerate(halves))
    graph = trace(planner_models.split_gpt, (2, 8), "int64")
    by_name = {layer.name: layer for layer in graph.layers}
    assert by_name["view"].inputs == ("blocks_0_attn_q",) and by_name["view"].attrs["dims"] == [0, 1, 2]
    assert by_name["transpose"].attrs["dims"] == [0, 2, 1, 3]
    assert len(by_name["scaled_dot_product_attention"].inputs) == 3
    assert "blocks_0_attn" not in by_name  # (made of Linear layers: traced through, not one attention leaf)


def test_groups_of_one_dimension_that_cross_a_node_link_together_share_it() -> None:
    """On 2 nodes x 2 ranks, both dp groups of a 2x2 mesh send over every node's link at once, through
    the same daemons: all-reduces up to the fusion threshold run fused, priced as the measured curve for
    their summed bytes; larger ones, and every all-gather, run one after the other, priced as twice one
    group's.  One group of all ranks, or a group inside a node, is priced as measured."""
    from commd.planner.costs import FUSION_THRESHOLD
    from commd.scheduler.config import SchedulerConfig

    assert FUSION_THRESHOLD == SchedulerConfig().fusion_threshold_bytes  # (the daemons' own default)
    costs = synthetic_costs()
    dp, tp = planner.Mesh((2, 2), 2).dims()
    (world,) = planner.Mesh((4,), 2).dims()
    assert (dp.nodes, dp.sharing, tp.nodes, tp.sharing, world.sharing) == (2, 2, 1, 1, 1)
    small, large = FUSION_THRESHOLD, FUSION_THRESHOLD + 1
    assert dp.seconds(costs, "allreduce", small) == costs.seconds("allreduce", 2 * small, 2, 2)
    assert dp.seconds(costs, "allreduce", large) == 2 * costs.seconds("allreduce", large, 2, 2)
    assert dp.seconds(costs, "allgather", small) == 2 * costs.seconds("allgather", small, 2, 2)
    assert tp.seconds(costs, "allreduce", 1 << 20) == costs.seconds("allreduce", 1 << 20, 1, 2)
    assert world.seconds(costs, "allreduce", 1 << 20) == costs.seconds("allreduce", 1 << 20, 2, 4)
    assert planner.Mesh((2, 2), 1).dims()[0].sharing == 1  # (one rank a node: each dp group its own links)
