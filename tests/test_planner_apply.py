"""``commd.planner.apply``: plans of traced models applied through DTensor on the commd backend.

Plans come from ``plan.plan()`` on a traced model with the Megatron baseline's choice (and a
sequence-parallel LayerNorm, or FSDP on a 2-D mesh's data dimension, forced among the planner's own
candidates).  The reference is the same model trained in one process without parallelism; the
placement check must refuse a model whose parameters the plan does not describe.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

import planner_models
import pytest
import torch
import torch.distributed as dist
from test_planner import synthetic_costs
from test_torch_backend import spawn

from commd.planner import plan as planner
from commd.planner.apply import ApplyError, apply, check, specs
from commd.planner.trace import trace

STEPS = 2


def forced_plan(factory: str, shape: tuple[int, ...], input_shape: tuple[int, ...],
                overrides: dict[str, tuple[str, ...]] | None = None, dtype: str = "float32",
                appliable_only: bool = True) -> dict[str, Any]:
    """plan.json for a traced model with Megatron's choice, some layers' strategies (one name per mesh
    dimension) overridden (``appliable_only=False``: strategies apply cannot set up are offered too)."""
    graph = trace(getattr(planner_models, factory), input_shape, dtype)
    mesh, costs = planner.Mesh(shape, math.prod(shape)), synthetic_costs()
    opts = planner.Options(appliable_only=appliable_only)
    made = planner.plan(graph, mesh, costs, opts)
    priced = planner.price(graph, mesh, costs, opts)
    choice = planner.megatron(graph, priced)
    assert choice is not None
    for name, names in (overrides or {}).items():
        i = graph.index[name]
        choice[i] = next(k for k, combo in enumerate(priced.options[i]) if tuple(s.name for s in combo) == names)
    made["layers"] = planner.layer_rows(graph, priced, choice)
    return made


# ---- in one process: what apply will do, and what it refuses --------------------------------------
def test_a_megatron_plan_becomes_column_row_pairs_with_partial_outputs_converted_for_their_consumers() -> None:
    made = forced_plan("mlp", (2,), (8, 32))
    got = {s.name: (s.style, s.arrives, s.gives) for s in specs(made)}
    # 0 col: the batch arrives whole, its output stays split for the ReLU and row layer 2; 2's
    # partial output is all-reduced for the GELU (which takes it whole); 4 col is gathered for the loss
    assert got == {"0": ("col", "B", "S(1)"), "2": ("row", "S(1)", "B"), "4": ("col", "B", "B")}


def test_a_sequence_parallel_layernorm_takes_its_row_layers_output_reduce_scattered() -> None:
    made = forced_plan("sp_mlp", (2,), (2, 4, 8), {"3": ("seq",)})
    got = {s.name: (s.style, s.arrives, s.gives) for s in specs(made)}
    assert got == {"0": ("col", "B", "S(2)"), "2": ("row", "S(2)", "S(1)"), "3": ("seq", "S(1)", "S(1)"),
                   "4": ("col", "S(1)", "S(2)"), "6": ("row", "S(2)", "B")}


def test_strategies_dtensor_cannot_express_are_refused_naming_the_layer() -> None:
    """Plans made from every strategy (the planner's default leaves these out: see the next test)."""
    gpt = forced_plan("TinyGPT", (2,), (2, 16), dtype="int64", appliable_only=False)
    with pytest.raises(ApplyError, match=r"layer 'blocks_0_attn' \(attention, strategy 'heads'\).*in_proj"):
        specs(gpt)
    # with the attention replicated, the residual stream stays partial after the vocabulary split
    # embedding (Megatron's plan adds partial sums), but DTensor's styles hand on local tensors only
    replicated = forced_plan("TinyGPT", (2,), (2, 16), {"blocks_0_attn": ("rep",), "blocks_1_attn": ("rep",)},
                             dtype="int64", appliable_only=False)
    with pytest.raises(ApplyError, match=r"layer 'embed' \(embedding, strategy 'vocab'\): its consumers take its "
                                         r"output in different layouts \['B', 'P'\]"):
        specs(replicated)
    cnn = forced_plan("cnn", (2,), (4, 3, 16, 16), appliable_only=False)
    with pytest.raises(ApplyError, match=r"layer '0' \(conv2d, strategy 'col'\).*convolutions"):
        specs(cnn)


def test_the_planners_own_plans_use_only_what_apply_can_set_up() -> None:
    """By default the planner offers no attention heads, convolution splits or partial residual streams:
    the optimum and both baselines of every model family are plans ``specs`` accepts."""
    for factory, shape, dtype in (("TinyGPT", (2, 16), "int64"), ("cnn", (4, 3, 16, 16), "float32"),
                                  ("mlp", (8, 32), "float32")):
        graph = trace(getattr(planner_models, factory), shape, dtype)
        for mesh in (planner.Mesh((2,), 2), planner.Mesh((2, 2), 2)):
            made = planner.plan(graph, mesh, synthetic_costs(), planner.Options())
            priced = planner.price(graph, mesh, synthetic_costs(), planner.Options())
            for choice in (planner.megatron(graph, priced), planner.data_parallel(graph, priced)):
                assert choice is not None
                specs({**made, "layers": planner.layer_rows(graph, priced, choice)})
            specs(made)


def test_a_plan_without_edges_needs_its_graph() -> None:
    made = forced_plan("mlp", (2,), (8, 32))
    for row in made["layers"]:
        del row["inputs"]
    with pytest.raises(ApplyError, match="pass its layer graph"):
        specs(made)
    graph = trace(planner_models.mlp, (8, 32))
    assert [s.style for s in specs(made, graph)] == ["col", "row", "col"]


# ---- on the commd backend ---------------------------------------------------------------------------
def _init(rank: int, world: int) -> Any:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd")


def _built(factory: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(planner_models, factory)()


def _train(model: torch.nn.Module, batches: list[torch.Tensor], scale: float = 1.0) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x in batches:
        optimizer.zero_grad()
        (model(x).pow(2).sum() * scale).backward()
        optimizer.step()
    return [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], untrained: torch.nn.Module, what: str,
                  tolerance: float = 1e-5) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance, msg=lambda m, i=i: f"{what}: param {i}: {m}")
    assert not all(torch.equal(a, b.detach()) for a, b in zip(got, untrained.parameters(), strict=True)), (
        "training changed nothing: the comparison would prove nothing")


#: Per model, the layer a tampered plan claims replicated (its layouts still fit), its kind and where
#: its weight really is.
TAMPER = {"mlp": ("2", "linear", r"S\(1\)"), "sp_mlp": ("3", "layernorm", "B")}


def _one_d_rank(rank: int, plans: dict[str, dict[str, Any]]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, 2)
    mesh = init_device_mesh("cpu", (2,))
    shapes = {"mlp": (8, 32), "sp_mlp": (2, 4, 8)}
    for factory, made in plans.items():
        batches = [torch.randn(shapes[factory], generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
        model = apply(_built(factory), made, mesh)  # every rank the whole batch: the plan's input is B
        _assert_close(_train(model, batches), _train(_built(factory), batches), _built(factory),
                      f"{factory} rank {rank}")
        check(model, made, mesh)  # training keeps the placements
        name, kind, placed = TAMPER[factory]
        tampered = copy.deepcopy(made)
        row = next(r for r in tampered["layers"] if r["name"] == name)
        row.update(strategy=["rep"], input=["B"], output=["B"])  # a split layer claimed replicated
        with pytest.raises(ApplyError, match=rf"layer '{name}' \({kind}, replicated\): parameter 'weight' is placed "
                                             rf"world: {placed}, the plan implies a plain tensor"):
            check(model, tampered, mesh)
        with pytest.raises(ApplyError, match=r"layer '0' .*'weight' is placed a plain tensor, the plan implies "
                                             r"world: S\(0\)"):
            check(_built(factory), made, mesh)
    dist.destroy_process_group()


def _data_parallel_rank(rank: int, made: dict[str, Any]) -> None:
    """FSDP over the whole 1-D mesh: each rank its own batch, gradients averaged."""
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, 2)
    mesh = init_device_mesh("cpu", (2,))
    batch = [torch.randn(4, 32, generator=torch.Generator().manual_seed(2 * s + r)) for s in range(STEPS)
             for r in range(2)]
    got = _train(apply(_built("mlp"), made, mesh), batch[rank::2])
    want = _train(_built("mlp"), [torch.cat(batch[2 * s:2 * s + 2]) for s in range(STEPS)], scale=0.5)
    _assert_close(got, want, _built("mlp"), f"fsdp rank {rank}")
    dist.destroy_process_group()


def _two_d_rank(rank: int, plans: dict[str, dict[str, Any]]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, 4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    batch = [torch.randn(4, 32, generator=torch.Generator().manual_seed(2 * s + d)) for s in range(STEPS)
             for d in range(2)]
    # the dp ranks' gradients are averaged: one process on both halves, half the loss
    want = _train(_built("mlp"), [torch.cat(batch[2 * s:2 * s + 2]) for s in range(STEPS)], scale=0.5)
    for data, made in plans.items():
        model = apply(_built("mlp"), made, mesh)
        got = _train(model, batch[dp::2])  # the plan splits the batch over dp: each dp rank its half
        _assert_close(got, want, _built("mlp"), f"{data} x tp rank {rank}")
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_megatron_plans_applied_on_commd_train_like_one_process(backend_env: Path) -> None:
    plans = {"mlp": forced_plan("mlp", (2,), (8, 32)),
             "sp_mlp": forced_plan("sp_mlp", (2,), (2, 4, 8), {"3": ("seq",)})}
    spawn(_one_d_rank, (plans,))


@pytest.mark.timeout(240)
def test_an_fsdp_plan_on_a_1d_mesh_applied_on_commd_trains_like_one_process(backend_env: Path) -> None:
    graph = trace(planner_models.mlp, (8, 32))
    made = forced_plan("mlp", (2,), (8, 32), {x.name: ("fsdp",) if x.kind == "linear" else ("dp",)
                                              for x in graph.layers})
    assert [s.data for s in specs(made)] == ["fsdp"] * 3
    spawn(_data_parallel_rank, (made,))


@pytest.mark.timeout(300)
def test_a_dp_by_tp_plan_applied_on_commd_trains_like_one_process(backend_env: Path) -> None:
    fsdp = {name: ("fsdp", s) for name, s in (("0", "col"), ("2", "row"), ("4", "col"))}
    plans = {"fsdp": forced_plan("mlp", (2, 2), (8, 32), fsdp), "dp": forced_plan("mlp", (2, 2), (8, 32))}
    assert {s.data for s in specs(plans["dp"])} == {"dp"} and {s.data for s in specs(plans["fsdp"])} == {"fsdp"}
    spawn(_two_d_rank, (plans,), timeout=240, nprocs=4)


def _split_gpt_rank(rank: int, made: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, 2)
    mesh = init_device_mesh("cpu", (2,))
    tokens = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
    model = apply(_built("split_gpt"), made, mesh)
    # (sums over split features and heads add in another order than one process's: 1e-4)
    _assert_close(_train(model, tokens), _train(_built("split_gpt"), tokens), _built("split_gpt"), f"rank {rank}",
                  tolerance=1e-4)
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_megatron_splits_separate_projection_attention_by_heads_and_trains_like_one_process(
        backend_env: Path) -> None:
    """q, k, v column layers, their views, transposes and attention split by heads, the output projection
    their row partner; on 2 ranks of the commd backend it trains like one process."""
    made = forced_plan("split_gpt", (2,), (2, 8), dtype="int64")
    rows = {r["name"]: (r["strategy"][0], r["output"][0]) for r in made["layers"]}
    assert [rows[f"blocks_0_attn_{p}"][0] for p in "qkvo"] == ["col", "col", "col", "row"]
    assert rows["scaled_dot_product_attention"] == ("split1", "S(1)")  # (batch, heads, sequence, head_dim)
    spawn(_split_gpt_rank, (made,))
