"""``commd plan`` on torch's own transformer modules: ``nn.TransformerEncoder``, ``nn.TransformerDecoder``
and ``nn.MultiheadAttention`` (packed q/k/v projections, and kdim/vdim's separate ones), as torch builds
them by default — sequence-first, so the batch is dimension 1 of every activation — and what the
planner refuses, naming the module and what to do.

References are torch's: the parameters a model holds and the output shape it computes on the CPU;
the issue's own encoder (512 wide, 8 heads, 2 layers, an 8x128x512 batch) is planned through the
command line.  tests/test_planner_apply.py trains a small one on 2 ranks like one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import planner_models
import pytest
import torch
from test_planner import synthetic_costs, write_costs
from torch import nn

from commd.planner import plan as planner
from commd.planner.apply import gradient_divisor, specs
from commd.planner.graph import GraphError, LayerGraph
from commd.planner.trace import measure, trace


def _torch_reference(factory: Any, shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """(parameters, output shape) of the model as torch builds and runs it on the CPU."""
    torch.manual_seed(0)
    model = factory()
    return sum(p.numel() for p in model.parameters()), tuple(model(torch.randn(shape)).shape)


def _checked(graph: LayerGraph, factory: Any, shape: tuple[int, ...]) -> None:
    """Every parameter is some layer's, and the traced output is torch's shape."""
    params, out = _torch_reference(factory, shape)
    assert sum(layer.params for layer in graph.layers) == params
    assert graph.layers[graph.index[graph.layers[-1].inputs[0]]].out_shape == out


def _appliable(made: dict[str, Any]) -> None:
    """The plan and both baselines are plans ``apply`` can set up."""
    specs(made)
    for baseline in made["baselines"].values():
        if baseline is not None:
            specs({**made, "layers": baseline["layers"]})


def _attention(graph: LayerGraph) -> dict[str, tuple[str, ...]]:
    return {layer.name: layer.inputs for layer in graph.layers if layer.kind == "attention"}


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # (torch's, building the issue's model as is)
def test_the_issues_transformer_encoder_plans_through_commd_plan(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """nn.TransformerEncoder(nn.TransformerEncoderLayer(512, 8), 2) on an 8x128x512 batch: torch reads it
    as (sequence 8, batch 128, features 512), so the plan splits the batch on dimension 1."""
    from commd.cli.main import main

    graph = trace(planner_models.transformer_encoder, (8, 128, 512))
    _checked(graph, planner_models.transformer_encoder, (8, 128, 512))
    assert graph.batch_dim == 1
    assert _attention(graph) == {"layers_0_self_attn": ("src",), "layers_1_self_attn": ("layers_0_norm2",)}
    kinds = [layer.kind for layer in graph.layers]
    assert (kinds.count("linear"), kinds.count("layernorm")) == (4, 4)
    costs, out = write_costs(tmp_path / "costs.json"), tmp_path / "plan.json"
    assert main(["plan", "planner_models:transformer_encoder", "--input", "8x128x512", "--mesh", "2",
                 "--costs", str(costs), "--compute", "flops", "-o", str(out)]) == 0
    assert "the batch is dimension 1 of every activation" in capsys.readouterr().out
    made = planner.load(out)
    assert made["batch_dim"] == 1
    (fed,) = [row["output"][0] for row in made["layers"] if row["kind"] == "input"]
    assert fed in ("B", "S(1)")  # the batch whole, or split on its own dimension: never the sequence (S(0))
    assert gradient_divisor(made) == (2 if fed == "S(1)" else 1)
    _appliable(made)


def test_a_traced_encoder_is_measured_layer_by_layer_on_real_tensors() -> None:
    """``--compute measured`` (commd plan's default for a model) times every layer of the traced graph."""
    graph = trace(planner_models.small_encoder, (6, 4, 16))
    seconds = measure(planner_models.small_encoder, (6, 4, 16), repeats=1, threads=1)
    assert {layer.name for layer in graph.layers} <= set(seconds)
    assert all(seconds[x.name] > 0 for x in graph.layers if x.kind in ("attention", "linear", "layernorm"))


def test_torchs_transformer_decoder_traces_with_its_cross_attention() -> None:
    """nn.TransformerDecoder (batch-first) over nn.TransformerEncoder's memory: traced through, not kept as
    two parameter-less layers; its cross-attention takes its query and the memory."""
    graph = trace(planner_models.EncoderDecoder, (2, 8, 32))
    _checked(graph, planner_models.EncoderDecoder, (2, 8, 32))
    assert graph.batch_dim == 0
    assert _attention(graph) == {"encoder_layers_0_self_attn": ("x",), "decoder_layers_0_self_attn": ("x",),
                                 "decoder_layers_0_multihead_attn": ("decoder_layers_0_norm1",
                                                                     "encoder_layers_0_norm2")}
    for mesh in (planner.Mesh((2,), 2), planner.Mesh((2, 2), 2)):
        made = planner.plan(graph, mesh, synthetic_costs(flops_per_s=2e8), planner.Options())
        _appliable(made)


def test_multihead_attention_with_packed_projections_runs_sequence_first_by_default() -> None:
    """nn.MultiheadAttention(32, 4): one in_proj_weight for q, k and v, (sequence, batch, features): one
    attention layer holding all its parameters, and data parallelism splits dimension 1 (the batch)."""
    graph = trace(planner_models.SelfAttention, (8, 4, 32))
    _checked(graph, planner_models.SelfAttention, (8, 4, 32))
    (attn,) = [layer for layer in graph.layers if layer.kind == "attention"]
    assert (attn.inputs, attn.params, attn.attrs["heads"]) == (("x",), 4 * 32 * 32 + 4 * 32, 4)
    assert graph.batch_dim == 1 and LayerGraph.from_json(graph.to_json()).batch_dim == 1  # (--write-layers keeps it)
    made = planner.plan(graph, planner.Mesh((2,), 2), synthetic_costs(flops_per_s=2e6), planner.Options())
    _appliable(made)
    dp = made["baselines"]["data_parallel"]["layers"]
    assert {(row["input"][0], row["output"][0]) for row in dp if row["kind"] != "input"} == {("S(1)", "S(1)")}


def test_multihead_attention_with_other_key_and_value_widths_takes_both_inputs() -> None:
    """kdim, vdim != embed_dim: separate q, k, v projections (no in_proj_weight); the attention layer takes
    the queries and the memory its keys and values come from."""
    graph = trace(planner_models.CrossAttention, (2, 8, 32))
    _checked(graph, planner_models.CrossAttention, (2, 8, 32))
    (attn,) = [layer for layer in graph.layers if layer.kind == "attention"]
    assert attn.inputs == ("x", "memory") and attn.params == 32 * 32 + 2 * 24 * 32 + 3 * 32 + 32 * 32 + 32
    _appliable(planner.plan(graph, planner.Mesh((2,), 2), synthetic_costs(), planner.Options()))


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x  # a branch on the data: no meta tensor can answer it


class _GatedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.gate = nn.Linear(8, 8), _Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.fc(x))


class _ShapeAsking(nn.Module):
    """Asks about its input's shape as torch's transformer modules do: answered for the traced batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        if x.dim() == 2 and len(x.size()) == 2 and not x.is_nested:
            x = x.unsqueeze(1)
        return self.fc(x) * scale


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fc(x + y)


class _PooledSequenceFirst(nn.Module):
    """Sequence-first attention, then a mean over the sequence: the batch moves to dimension 0."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)[0].mean(0)


class _Masked(nn.Module):
    """A causal mask made in forward: a traced tensor, which torch's own modules refuse as a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = planner_models.small_encoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, mask=nn.Transformer.generate_square_subsequent_mask(x.size(0)), is_causal=True)


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.MultiheadAttention(8, 2, batch_first=True)
        self.second = nn.MultiheadAttention(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(*[self.first(x, x, x)[0]] * 3)[0]


def test_questions_about_shapes_are_answered_and_what_cannot_trace_is_refused_naming_the_module() -> None:
    """A question about the input's shape traces (as for the traced batch); a branch on data, a mask made in
    forward, a second input, a sequence-first model that moves its batch, or sequence-first and batch-first
    attention mixed are refused, each naming where and saying what to do."""
    graph = trace(_ShapeAsking, (4, 8))
    assert [layer.out_shape for layer in graph.layers if layer.kind == "linear"] == [(4, 1, 8)]
    for factory, shape, error in (
            (_GatedModel, (4, 8), r"does not trace on the meta device \(in gate \(_Gate\): TraceError: .*"
                                  r"give it as a JSON layer list \(--layers\)"),
            (_Masked, (6, 4, 16), r"\(in encoder \(TransformerEncoder\): .*or, if the model hands TransformerEncoder a "
                                  "mask it computes in forward, plan a factory whose forward leaves the mask out"),
            (_TwoInputs, (4, 8), r"its forward takes x, y; the planner traces a model on one input .* wrap it in a "
                                 "module whose forward takes the batch alone"),
            (_PooledSequenceFirst, (5, 4, 8), r"layer 'mean' \(follow, shape \[4, 8\]\) moves the batch off "
                                              r"dimension 1.*build its attention batch_first=True"),
            (_Mixed, (4, 5, 8), r"attention layers \['second'\] run sequence-first \(batch_first=False\) and the "
                                "others batch-first")):
        with pytest.raises(GraphError, match=error):
            trace(factory, shape, name=factory.__name__)


def test_an_attention_block_takes_its_input_as_it_arrives() -> None:
    """PrepareModuleInput converts the inputs it has layouts for, and attention takes query, key and value:
    a plan that gathers the batch into a replicated attention block is refused, and the planner makes none."""
    from commd.planner.apply import ApplyError

    graph = trace(planner_models.SelfAttention, (8, 4, 32))
    mesh, costs = planner.Mesh((2,), 2), synthetic_costs()
    priced = planner.price(graph, mesh, costs, planner.Options(appliable_only=False))
    want = {"x": "dp", "attn": "rep"}
    choice = [next(k for k, combo in enumerate(options) if combo[0].name == want.get(layer.name, "rep"))
              for layer, options in zip(graph.layers, priced.options, strict=True)]
    made = {**planner.plan(graph, mesh, costs, planner.Options()), "layers": planner.layer_rows(graph, priced, choice)}
    with pytest.raises(ApplyError, match=r"layer 'attn' \(attention, strategy 'rep'\): its input arrives S\(1\) but "
                                         r"it takes it B; an attention block takes query, key and value"):
        specs(made)
    for rate in (2e6, 2e8, 2e10):
        _appliable(planner.plan(graph, mesh, synthetic_costs(flops_per_s=rate), planner.Options()))
