"""``commd.planner.apply``: plans of traced models applied through DTensor on the commd backend.

Plans come from ``plan.plan()`` on a traced model with the Megatron baseline's choice (and a
sequence-parallel LayerNorm, or FSDP on a 2-D mesh's data dimension, forced among the planner's own
candidates), or are the planner's own optimum (a VGG-like CNN: data-parallel convolutions, a Megatron
classifier).  The reference is the same model trained in one process without parallelism; the
placement check must refuse a model whose parameters the plan does not describe.
"""

from __future__ import annotations

import copy
import itertools
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
from commd.planner.apply import ApplyError, apply, check, gradient_divisor, specs
from commd.planner.trace import trace

STEPS = 2


#: The VGG-like model's batch in the plans below, and the compute rates (FLOP/s) at which the planner's
#: optimum is mixed: data-parallel convolutions, then the classifier's column/row pair and its last layer
#: replicated (2e10), or the last layer row-split too (2e9).
CNN_BATCH = 8
CNN_RATES = {"mixed": 2e10, "mixed-row-row": 2e9}


def forced_plan(factory: str, shape: tuple[int, ...], input_shape: tuple[int, ...],
                overrides: dict[str, tuple[str, ...]] | None = None, dtype: str = "float32",
                appliable_only: bool = True, base: str = "megatron", flops_per_s: float = 2e10) -> dict[str, Any]:
    """plan.json for a traced model with Megatron's choice (``base="optimum"``: the search's own, what
    `commd plan --min-gain 0` writes), some layers' strategies (one name per mesh dimension) overridden (``appliable_only=False``:
    strategies apply cannot set up are offered too)."""
    graph = trace(getattr(planner_models, factory), input_shape, dtype)
    mesh, costs = planner.Mesh(shape, math.prod(shape)), synthetic_costs(flops_per_s=flops_per_s)
    opts = planner.Options(appliable_only=appliable_only, search="both" if base == "optimum" else "descent",
                           min_gain=0.0)
    made = planner.plan(graph, mesh, costs, opts)
    priced = planner.price(graph, mesh, costs, opts)
    choice = (planner.megatron(graph, priced) if base == "megatron" else planner.data_parallel(graph, priced)
              if base == "data_parallel" else planner.solve(priced, "descent", graph)[0].choice)
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
    """By default the planner offers no attention heads, convolution splits, partial residual streams or
    conversions where no DTensor style converts (between parameter-free layers, out of a data-parallel
    layer): the optimum and both baselines of every model family are plans ``specs`` accepts, at
    compute rates that make the optimum data parallel, mixed or split."""
    for factory, shape, dtype in (("TinyGPT", (2, 16), "int64"), ("cnn", (4, 3, 16, 16), "float32"),
                                  ("mlp", (8, 32), "float32"), ("vgg", (8, 3, 16, 16), "float32"),
                                  ("split_gpt", (4, 8), "int64")):
        graph = trace(getattr(planner_models, factory), shape, dtype)
        for mesh, rate in itertools.product((planner.Mesh((2,), 2), planner.Mesh((2, 2), 2)), (2e8, 2e10, 2e12)):
            made = planner.plan(graph, mesh, synthetic_costs(flops_per_s=rate), planner.Options())
            priced = planner.price(graph, mesh, synthetic_costs(flops_per_s=rate), planner.Options())
            for choice in (planner.megatron(graph, priced), planner.data_parallel(graph, priced)):
                assert choice is not None
                specs({**made, "layers": planner.layer_rows(graph, priced, choice)})
            specs(made)


def _strategies(made: dict[str, Any]) -> dict[str, str]:
    return {row["name"]: row["strategy"][0] for row in made["layers"] if row["kind"] not in ("follow", "input")}


def test_the_planners_optimum_for_a_vgg_like_cnn_is_data_parallel_convolutions_and_a_megatron_classifier() -> None:
    """AutoDDL's VGG plans: the convolutions (few parameters, large activations) data parallel, the
    classifier (1.6M parameters, small activations) split; the batch-split activation all-gathered into
    the first column layer, its partial gradient reduce-scattered back (the plan's own collectives,
    against the model's sizes)."""
    input_shape = (CNN_BATCH, 3, 16, 16)
    made = forced_plan("vgg", (2,), input_shape, base="optimum")
    assert made["search"]["descent_gap"] <= 1e-9  # descent's plan (what `commd plan` writes) is the exact optimum
    assert _strategies(made) == {"0": "dp", "3": "dp", "7": "col", "9": "row", "11": "rep", "output": "rep"}
    assert made["predicted"]["step_s"] < min(b["step_s"] for b in made["baselines"].values())
    got = {s.name: (s.style, s.data, s.arrives, s.gives, s.grad_divisor) for s in specs(made)}
    assert got == {"0": (None, "dp", "S(0)", "S(0)", 1), "3": (None, "dp", "S(0)", "S(0)", 1),
                   "7": ("col", None, "S(0)", "S(1)", 1), "9": ("row", None, "S(1)", "B", 1),
                   "11": (None, None, "B", "B", 1)}
    flat, hidden = CNN_BATCH * 32 * 4 * 4 * 4, CNN_BATCH * 1024 * 4  # bytes of the activations
    conv_params = [(16 * 3 * 9 + 16) * 4, (32 * 16 * 9 + 32) * 4]
    want = sorted([("allgather", flat), ("reduce_scatter", flat), ("allreduce", hidden)]
                  + [("allreduce", b) for b in conv_params])
    assert sorted((c["kind"], c["bytes"]) for c in made["predicted"]["collectives"] for _ in range(c["count"])) == want
    row_row = forced_plan("vgg", (2,), input_shape, base="optimum", flops_per_s=CNN_RATES["mixed-row-row"])
    assert row_row["search"]["descent_gap"] <= 1e-9
    # (a tie: 9 column-split instead costs the same all-gather and reduce-scatter, of its input instead)
    assert _strategies(row_row) == {"0": "dp", "3": "dp", "7": "col", "9": "row", "11": "row", "output": "rep"}
    assert {s.name: s.gives for s in specs(row_row)}["9"] == "S(1)"  # its sum reduce-scattered into row 11


def test_the_step_is_one_loss_a_batch_split_output_averages_the_ranks_losses() -> None:
    """A whole output: data-parallel gradients summed (divisor 1); an output split by the batch: every
    gradient divided by the ranks (DDP's mean), which for a data-parallel-only plan is FSDP2's default."""
    input_shape = (CNN_BATCH, 3, 16, 16)
    assert gradient_divisor(forced_plan("vgg", (2,), input_shape, base="optimum")) == 1
    split_out = forced_plan("vgg", (2,), input_shape, SPLIT_OUTPUT, base="optimum")
    assert gradient_divisor(split_out) == 2 and {s.grad_divisor for s in specs(split_out)} == {2}
    assert {s.name: s.gives for s in specs(split_out)}["9"] == "S(0)"  # the row layer's sum reduce-scattered
    assert gradient_divisor(forced_plan("mlp", (2, 2), (8, 32))) == 2  # dp x tp: the batch split over dp
    # a layer list without an output layer: what the last layer gives
    for made, want in ((forced_plan("vgg", (2,), input_shape, base="optimum"), 1), (split_out, 2)):
        assert gradient_divisor({**made, "layers": [r for r in made["layers"] if r["kind"] != "output"]}) == want
    (out,) = [r for r in split_out["layers"] if r["kind"] == "output"]
    two = {**split_out, "layers": [*split_out["layers"], {**out, "name": "output2", "input": ["B"]}]}
    with pytest.raises(ApplyError, match=r"outputs are split by the batch over different ranks \(\[1, 2\]\)"):
        specs(two)


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


def _train(model: torch.nn.Module, batches: list[torch.Tensor], scale: float = 1.0,
           mean: bool = False) -> list[torch.Tensor]:
    """``mean``: the mean loss, at a learning rate that moves every parameter as far as the sum's does."""
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0 if mean else 0.05)
    for x in batches:
        optimizer.zero_grad()
        y = model(x).pow(2)
        ((y.mean() if mean else y.sum()) * scale).backward()
        optimizer.step()
    return [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], untrained: torch.nn.Module, what: str,
                  tolerance: float = 1e-5) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance, msg=lambda m, i=i: f"{what}: param {i}: {m}")
    assert not all(torch.equal(a, b.detach()) for a, b in zip(got, untrained.parameters(), strict=True)), (
        "training changed nothing: the comparison would prove nothing")


#: The optimum's classifier tail made data parallel, so the output is split by the batch (a plan the planner
#: prices but does not choose here: the row-split tail is cheaper).
SPLIT_OUTPUT = {"_10": ("dp",), "11": ("dp",), "output": ("dp",)}


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


def _mixed_rank(rank: int, plans: dict[str, dict[str, Any]]) -> None:
    """Data-parallel convolutions and a Megatron classifier on one dimension: each rank is fed its half of
    the batch and takes the mean loss of its output (the whole batch's where the output is whole, its
    half's where the output is split by the batch): one process's mean loss on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, 2)
    mesh = init_device_mesh("cpu", (2,))
    batches = [torch.randn((CNN_BATCH, 3, 16, 16), generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
    want = _train(_built("vgg"), batches, mean=True)
    for name, made in plans.items():
        model = apply(_built("vgg"), made, mesh)
        got = _train(model, [x.chunk(2)[rank] for x in batches], mean=True)
        _assert_close(got, want, _built("vgg"), f"{name} rank {rank}")
        check(model, made, mesh)
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
@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_megatron_plans_applied_on_commd_train_like_one_process(backend_env: Path) -> None:
    plans = {"mlp": forced_plan("mlp", (2,), (8, 32)),
             "sp_mlp": forced_plan("sp_mlp", (2,), (2, 4, 8), {"3": ("seq",)})}
    spawn(_one_d_rank, (plans,))


@pytest.mark.timeout(240)
@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_an_fsdp_plan_on_a_1d_mesh_applied_on_commd_trains_like_one_process(backend_env: Path) -> None:
    graph = trace(planner_models.mlp, (8, 32))
    made = forced_plan("mlp", (2,), (8, 32), {x.name: ("fsdp",) if x.kind == "linear" else ("dp",)
                                              for x in graph.layers})
    assert [s.data for s in specs(made)] == ["fsdp"] * 3
    spawn(_data_parallel_rank, (made,))


@pytest.mark.slow  # (make test: the counters' 2x2 case runs this plan, test_torch_parallel_mesh trains dp x tp)
@pytest.mark.timeout(300)
def test_a_dp_by_tp_plan_applied_on_commd_trains_like_one_process(backend_env: Path) -> None:
    fsdp = {name: ("fsdp", s) for name, s in (("0", "col"), ("2", "row"), ("4", "col"))}
    plans = {"fsdp": forced_plan("mlp", (2, 2), (8, 32), fsdp), "dp": forced_plan("mlp", (2, 2), (8, 32))}
    assert {s.data for s in specs(plans["dp"])} == {"dp"} and {s.data for s in specs(plans["fsdp"])} == {"fsdp"}
    spawn(_two_d_rank, (plans,), timeout=240, nprocs=4)


@pytest.mark.timeout(240)
@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_a_mixed_cnn_plan_applied_on_commd_trains_like_one_process(backend_env: Path) -> None:
    """The planner's optimum (whole output: the data-parallel convolutions' gradients summed), its row-split
    variant, the optimum with its convolutions fully sharded (summed by reduce-scatter), and with its tail
    data parallel (output split by the batch: every gradient halved)."""
    shape = (CNN_BATCH, 3, 16, 16)
    plans = {name: forced_plan("vgg", (2,), shape, base="optimum", flops_per_s=rate) for name, rate in CNN_RATES.items()}
    plans["fsdp-convolutions"] = forced_plan("vgg", (2,), shape, {"0": ("fsdp",), "3": ("fsdp",)}, base="optimum")
    plans["split-output"] = forced_plan("vgg", (2,), shape, SPLIT_OUTPUT, base="optimum")
    spawn(_mixed_rank, (plans,))
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
@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_megatron_splits_separate_projection_attention_by_heads_and_trains_like_one_process(
        backend_env: Path) -> None:
    """q, k, v column layers, their views, transposes and attention split by heads, the output projection
    their row partner; on 2 ranks of the commd backend it trains like one process."""
    made = forced_plan("split_gpt", (2,), (2, 8), dtype="int64")
    rows = {r["name"]: (r["strategy"][0], r["output"][0]) for r in made["layers"]}
    assert [rows[f"blocks_0_attn_{p}"][0] for p in "qkvo"] == ["col", "col", "col", "row"]
    assert rows["scaled_dot_product_attention"] == ("split1", "S(1)")  # (batch, heads, sequence, head_dim)
    spawn(_split_gpt_rank, (made,))


def _both_dims_rank(rank: int, plans: dict[str, dict[str, Any]]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, 4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mine = 2 * mesh["dp"].get_local_rank() + mesh["tp"].get_local_rank()  # the batch split dp-major
    batch = [torch.randn(2, 32, generator=torch.Generator().manual_seed(4 * s + q)) for s in range(STEPS)
             for q in range(4)]
    # the output is split by the batch over all four ranks: the step's loss is their mean
    want = _train(_built("mlp"), [torch.cat(batch[4 * s:4 * s + 4]) for s in range(STEPS)], scale=0.25)
    for name, made in plans.items():
        got = _train(apply(_built("mlp"), made, mesh), batch[mine::4])
        _assert_close(got, want, _built("mlp"), f"{name} rank {rank}")
    from torch.nn.parallel import DistributedDataParallel

    ddp = apply(_built("mlp"), plans["ddp"], mesh)
    assert isinstance(ddp, DistributedDataParallel) and ddp.process_group.size() == 4
    check(ddp, plans["ddp"], mesh)
    grads = sum(p.numel() * p.element_size() for p in _built("mlp").parameters())
    for buckets, error in (([grads - 4], rf"hold {grads - 4} bytes but the model's gradients are {grads} bytes"),
                           ([grads, 0], "a list of positive byte counts"), ("25", "a list of positive byte counts")):
        with pytest.raises(ApplyError, match=error):  # every rank refuses before any collective: none hangs
            apply(_built("mlp"), {**plans["ddp"], "ddp_buckets": buckets}, mesh)
    dist.destroy_process_group()


@pytest.mark.slow  # (make test: the counters' 2x2-data-parallel-buckets case runs these plans' collectives)
@pytest.mark.timeout(240)
def test_data_parallel_on_both_dimensions_of_a_2x2_mesh_trains_like_one_process(backend_env: Path) -> None:
    """Data parallel on dp and on tp: every rank a quarter of the batch and gradients synchronised over
    all four ranks — plain DDP over them (bad ``ddp_buckets`` refused on every rank), fully_shard on one
    flat mesh, or FSDP2's hybrid (replicated over dp, sharded over tp) — not only over dp, where the tp
    pairs' replicas would drift apart."""
    plans = {"ddp": forced_plan("mlp", (2, 2), (8, 32), base="data_parallel"),
             "fully_shard": forced_plan("mlp", (2, 2), (8, 32), {n: ("fsdp", "fsdp") for n in ("0", "2", "4")},
                                        base="data_parallel"),
             "hybrid": forced_plan("mlp", (2, 2), (8, 32), {n: ("dp", "fsdp") for n in ("0", "2", "4")},
                                   base="data_parallel")}
    assert {(s.data, s.model_data) for s in specs(plans["hybrid"])} == {("dp", "fsdp")}
    spawn(_both_dims_rank, (plans,), timeout=240, nprocs=4)


#: torch's own nn.TransformerEncoder (planner_models.small_encoder): sequence-first, so its batch is dimension 1.
ENCODER_SHAPE = (6, 4, 16)  # (sequence, batch, features)


def _encoder_rank(rank: int, plans: dict[str, dict[str, Any]]) -> None:
    """Each plan trained on 2 ranks: where the plan splits the batch (dimension 1) each rank is fed its half
    of it, else the whole batch; the mean loss of what each rank outputs is one process's on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, 2)
    mesh = init_device_mesh("cpu", (2,))
    batches = [torch.randn(ENCODER_SHAPE, generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
    want = _train(_built("small_encoder"), batches, mean=True)
    for name, made in plans.items():
        (fed,) = [row["output"][0] for row in made["layers"] if row["kind"] == "input"]
        model = apply(_built("small_encoder"), made, mesh)
        got = _train(model, [x.chunk(2, dim=1)[rank] if fed == "S(1)" else x for x in batches], mean=True)
        _assert_close(got, want, _built("small_encoder"), f"{name} rank {rank}")
        check(model, made, mesh)
    dist.destroy_process_group()


@pytest.mark.timeout(240)
@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_torchs_transformer_encoder_applied_on_commd_trains_like_one_process(backend_env: Path) -> None:
    """nn.TransformerEncoder as torch builds it by default (sequence-first, packed attention projections):
    the planner's own plan where compute is dear (plain DDP, the batch split on its dimension 1, as for the
    issue's 512-wide encoder), Megatron (the feed-forward layers as column/row pairs, the attention
    replicated), FSDP on every layer (the packed in_proj sharded), and the mixed plan the planner makes for
    the 512-wide one on 4 ranks: data-parallel attention, the feed-forward pairs fed the batch all-gathered
    on dimension 1, their sum reduce-scattered back onto it."""
    plans = {"optimum": forced_plan("small_encoder", (2,), ENCODER_SHAPE, base="optimum", flops_per_s=2e6),
             "megatron": forced_plan("small_encoder", (2,), ENCODER_SHAPE)}
    graph = trace(planner_models.small_encoder, ENCODER_SHAPE)
    plans["fsdp"] = forced_plan("small_encoder", (2,), ENCODER_SHAPE, {
        x.name: ("fsdp",) if x.params else ("dp",) for x in graph.layers if x.kind != "input"}, base="data_parallel")
    plans["mixed"] = forced_plan("small_encoder", (2,), ENCODER_SHAPE, {
        **{f"layers_{b}_{name}": (strategy,) for b in range(2) for name, strategy in
           (("linear1", "col"), ("dropout", "split2"), ("linear2", "row"))},
        "relu": ("split2",), "relu_1": ("split2",)}, base="data_parallel")
    assert [s.gives for s in specs(plans["mixed"]) if s.style == "row"] == ["S(1)", "S(1)"]  # (reduce-scattered)
    assert plans["optimum"]["batch_dim"] == 1 and "ddp_buckets" in plans["optimum"]
    assert gradient_divisor(plans["optimum"]) == 2 and gradient_divisor(plans["fsdp"]) == 2
    assert _strategies(plans["megatron"])["layers_0_linear1"] == "col"
    assert _strategies(plans["megatron"])["layers_0_self_attn"] == "rep"
    spawn(_encoder_rank, (plans,))
