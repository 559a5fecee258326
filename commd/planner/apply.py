"""A plan (plan.json) applied to a torch model through DTensor, and its parameter placements checked.

On the model dimension (a 1-D mesh's only one, a 2-D mesh's ``tp``) each parameter layer's strategy
becomes a ``parallelize_module`` style: ``col`` → ``ColwiseParallel``, ``row`` and an embedding's
``vocab`` → ``RowwiseParallel``, ``seq`` → ``SequenceParallel``, ``rep`` → none.  Layouts come from
the plan: a layer's ``input_layouts`` are what its producer really gives (a column layer after
data-parallel ones: ``Shard(0)``, all-gathered forward and its partial gradient reduce-scattered
backward, inside the style, as the plan prices it), and a partial (``P``)
output is converted where it is made into the layout its consumers take (the plan's edges), so no
partial tensor leaves a module.  A replicated layer whose input arrives in another layout gets a
``PrepareModuleInput`` to convert it (not an attention block: it takes query, key and value, and the
planner gives it its input as it takes it); a parameter-free layer has no module to convert in, so a
plan that needs a conversion into one is refused.  On the data dimension (a 2-D mesh's ``dp``, or
a 1-D layer whose strategy is ``dp``/``fsdp``), ``fsdp`` → ``fully_shard`` and ``dp`` →
``replicate`` (FSDP2's replicated variant), both on that dimension's sub-mesh.

The caller feeds the model its input in the plan's input layer's layouts (the local shard of a
split batch or sequence, the whole tensor where it is ``B``) and gets the output in the layout the
plan's output layer takes.  ``specs`` (no torch) decides everything; ``apply`` only carries it out.

One loss, whatever the plan mixes on a dimension.  Where the output is whole (``B``) every rank
computes the same loss, the whole batch's, as one process would; where it is split by the batch
(``S(0)``; ``S(1)`` where the plan's ``batch_dim`` is 1, a sequence-first model) the step's loss is
the mean of the ranks' losses on their parts (DDP's convention).
Autograd through DTensor gives every parameter the gradient of the ranks' losses summed (a whole
output's counted once), a data-parallel layer in per-rank parts; so a data-parallel layer sums its
parts where the output is whole (FSDP2 would average them), and where the output is batch-split every
gradient is divided by the ranks (FSDP2's own average for data-parallel layers, a gradient hook on the
other layers' parameters).  A plan of data-parallel layers only (``dp`` on every mesh dimension of
every parameter layer) is plain DDP over all the mesh's ranks: ``apply`` returns the model wrapped in
``DistributedDataParallel``, its buckets the plan's ``ddp_buckets`` (the planner prices those).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from commd.planner.graph import WITH_PARAMS, LayerGraph
from commd.planner.layouts import B, P, split_dim


class ApplyError(ValueError):
    """A plan that cannot be applied to this model or mesh; the message names the layer and why."""


#: (kind, model-dimension strategy) → the style applied; strategies not here (and not ``rep``) fail.
STYLES = {("linear", "col"): "col", ("linear", "row"): "row", ("linear", "seq"): "seq",
          ("layernorm", "seq"): "seq", ("embedding", "vocab"): "row", ("embedding", "col"): "col"}
#: Why the strategies DTensor's styles cannot express are refused.
UNSUPPORTED = {
    "heads": "DTensor cannot column-split the packed in_proj of nn.MultiheadAttention (split the attention's "
             "projections into separate Linear layers and plan those)",
    "col": "DTensor has no column style for convolutions",
    "row": "DTensor has no row style for convolutions",
}
#: Per style, a parameter's placement on the model dimension (by its name; others: replicated).
PARAM_LAYOUTS = {
    ("linear", "col"): {"weight": "S(0)", "bias": "S(0)"},
    ("linear", "row"): {"weight": "S(1)", "bias": B},
    ("embedding", "col"): {"weight": "S(1)"},
    ("embedding", "row"): {"weight": "S(0)"},
}
DATA = ("dp", "fsdp")


@dataclass(frozen=True)
class LayerSpec:
    """What ``apply`` does to one parameter layer.  Layouts are the model dimension's."""

    name: str
    kind: str
    style: str | None  # "col", "row", "seq" or None (replicated on the model dimension)
    arrives: str  # the layout its input arrives in
    takes: str  # the layout the plan says it takes
    gives: str  # the layout of its output, after any conversion of a partial one
    data: str | None  # "dp", "fsdp" or None: its data-dimension strategy
    #: what its parameters' gradients are divided by once summed over its data-parallel ranks: the ranks
    #: of the dimensions the output is batch-split on (1: a whole output, the gradient of its one loss)
    grad_divisor: int = 1
    #: on a 2-D mesh, its model-dimension strategy when that is data parallel too ("dp" or "fsdp"): its
    #: batch is split over both dimensions, so its gradients are synchronised over all the mesh's ranks
    model_data: str | None = None


def specs(plan: Mapping[str, Any], graph: LayerGraph | None = None) -> list[LayerSpec]:
    """Each parameter layer's style and layouts; ApplyError where the plan cannot be applied."""
    rows = plan["layers"]
    ndim = len(plan["mesh"]["shape"])
    m = ndim - 1
    divisor = gradient_divisor(plan, graph)
    inputs = {row["name"]: _inputs(row, graph) for row in rows}
    wants: dict[str, set[str]] = {}
    for row in rows:
        for src in inputs[row["name"]]:
            wants.setdefault(src, set()).add(row["input"][m])
    for row in rows:  # a strategy no style expresses first: it is why the plan cannot apply
        strategy = row["strategy"][m]
        if row["kind"] in WITH_PARAMS and strategy not in ("rep", *DATA) and (row["kind"], strategy) not in STYLES:
            why = UNSUPPORTED.get(strategy, "no DTensor style applies it")
            raise ApplyError(f"layer {row['name']!r} ({row['kind']}, strategy {strategy!r}): cannot be applied "
                             f"through DTensor: {why}")
    gives: dict[str, str] = {}
    out: list[LayerSpec] = []
    for row in rows:
        name, kind, strategy = row["name"], row["kind"], row["strategy"][m]
        takes, own_out = row["input"][m], row["output"][m]
        where = f"layer {name!r} ({kind}, strategy {strategy!r})"
        if kind == "input":
            gives[name] = own_out
            continue
        arriving = {gives[src] for src in inputs[name]}
        if len(arriving) != 1:
            raise ApplyError(f"{where}: its inputs arrive in different layouts {sorted(arriving)}")
        arrives = arriving.pop()
        if kind not in WITH_PARAMS:
            if arrives != takes:
                raise ApplyError(f"{where}: its input arrives {arrives} but the plan takes it {takes}, and a "
                                 f"parameter-free layer has no module to convert it in")
            gives[name] = own_out
            continue
        data = row["strategy"][0] if ndim == 2 else (strategy if strategy in DATA else None)
        if data is not None and data not in DATA:
            raise ApplyError(f"{where}: data-dimension strategy {data!r} is not dp or fsdp")
        style = STYLES.get((kind, strategy))  # None: replicated on the model dimension (checked above)
        if kind == "attention" and arrives != takes:
            raise ApplyError(f"{where}: its input arrives {arrives} but it takes it {takes}; an attention block takes "
                             "query, key and value, and PrepareModuleInput converts one input")
        target = wants.get(name, {own_out})
        if style in ("col", "row"):
            if len(target) != 1:
                raise ApplyError(f"{where}: its consumers take its output in different layouts {sorted(target)}")
            given = target.pop()
            if given == P:
                raise ApplyError(f"{where}: a consumer takes its output partial ({P}); DTensor's module styles "
                                 "give local tensors, which cannot stay partial across modules")
        else:
            given = own_out
            if style == "seq" and (split_dim(arrives) is None or arrives != takes or own_out != takes):
                raise ApplyError(f"{where}: SequenceParallel takes and gives the sequence split {takes}; "
                                 f"its input arrives {arrives}")
        gives[name] = given
        model_data = strategy if ndim == 2 and strategy in DATA else None
        out.append(LayerSpec(name, kind, style, arrives, takes, given, data, divisor, model_data))
    return out


def gradient_divisor(plan: Mapping[str, Any], graph: LayerGraph | None = None) -> int:
    """The ranks of the mesh dimensions the model's output is split by the batch on (``S(0)``, or the plan's
    ``batch_dim``'s split for a sequence-first model): the step's
    loss is then the mean of those ranks' losses; 1 where the output is whole or split otherwise.  The
    output is what the plan's output layers take, or (a layer list without one) what the layers nobody
    consumes give; ApplyError where they differ (no one loss)."""
    rows = plan["layers"]
    ends = [row["input"] for row in rows if row["kind"] == "output"]
    if not ends:
        consumed = {src for row in rows for src in _inputs(row, graph)}
        ends = [row["output"] for row in rows if row["name"] not in consumed]
    divisors = set()
    batch_dim = plan.get("batch_dim", 0)
    for layouts in ends:
        divisor = 1
        for size, layout in zip(plan["mesh"]["shape"], layouts, strict=True):
            if split_dim(layout) == batch_dim:
                divisor *= size
        divisors.add(divisor)
    if len(divisors) > 1:
        raise ApplyError(f"the model's outputs are split by the batch over different ranks ({sorted(divisors)}): "
                         "their losses do not make one step")
    return divisors.pop() if divisors else 1


def _inputs(row: Mapping[str, Any], graph: LayerGraph | None) -> list[str]:
    if "inputs" in row:
        return list(row["inputs"])
    if graph is None or row["name"] not in graph.index:
        raise ApplyError(f"layer {row['name']!r}: the plan has no inputs (an older plan.json): pass its layer graph")
    return list(graph.layers[graph.index[row["name"]]].inputs)


def expected_placements(spec: LayerSpec, param: str, dims: list[str]) -> dict[str, str]:
    """A parameter's placement per mesh dimension name, after ``apply`` (dims absent: a plain tensor there)."""
    want: dict[str, str] = {}
    if spec.model_data is not None:  # data parallel over both dimensions (see data_mesh)
        if spec.data == spec.model_data:
            return {FLAT: "S(0)" if spec.data == "fsdp" else B}
        return {dims[0]: "S(0)" if spec.data == "fsdp" else B, dims[1]: "S(0)" if spec.model_data == "fsdp" else B}
    if spec.data is not None:
        want[dims[0]] = "S(0)" if spec.data == "fsdp" else B
    if spec.style is not None:
        want[dims[-1]] = PARAM_LAYOUTS.get((spec.kind, spec.style), {}).get(param, B)
    return want


def apply(model: Any, plan: Mapping[str, Any], mesh: Any, graph: LayerGraph | None = None) -> Any:
    """Parallelize ``model`` (in place) as ``plan`` says on ``mesh`` (a DeviceMesh of the plan's shape;
    2-D: dims named "dp", "tp"), check every parameter's placement, and return the model."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    layer_specs = specs(plan, graph)
    dims = _check_mesh(plan, mesh)
    if plain_ddp(layer_specs, len(dims), mesh.size()):
        return _ddp(model, plan, mesh, graph)
    model_mesh, data_mesh = (mesh, mesh) if len(dims) == 1 else (mesh["tp"], mesh["dp"])
    modules = modules_by_layer(model)
    for spec in layer_specs:
        if spec.name not in modules:
            raise ApplyError(f"layer {spec.name!r}: the model has no module of that name")
    for spec in layer_specs:
        style = _style(spec)
        if style is not None:
            parallelize_module(modules[spec.name], model_mesh, style)
    meshes: dict[str, Any] = {}
    for spec in layer_specs:
        module = modules[spec.name]
        if spec.model_data is not None:  # data parallel over both dimensions: synchronised over all ranks
            _data_parallel_everywhere(module, spec, mesh, meshes)
        elif spec.data == "fsdp":  # resharded after forward even as its own FSDP root (FSDP2 keeps a root's
            # parameters gathered until backward): the plan prices, and its memory model assumes, ZeRO-3's
            # all-gathers before forward and backward
            module = fully_shard(module, mesh=data_mesh, reshard_after_forward=True)
        elif spec.data == "dp":
            from torch.distributed._composable.replicate_with_fsdp import replicate

            module = replicate(module, mesh=data_mesh)
        if spec.model_data is not None:
            if spec.grad_divisor != mesh.size():
                module.set_gradient_divide_factor(float(spec.grad_divisor))
                module.set_force_sum_reduction_for_comms(True)
        elif spec.data is not None:
            if spec.grad_divisor != data_mesh.size():  # (FSDP2's default: the mean over its ranks)
                module.set_gradient_divide_factor(float(spec.grad_divisor))
                module.set_force_sum_reduction_for_comms(True)  # SUM, then the division (no PREMUL_SUM)
        elif spec.grad_divisor > 1:
            for param in module.parameters():
                param.register_hook(_divided_by(spec.grad_divisor))
    check(model, plan, mesh, graph)
    return model


#: The name of the 1-D mesh over all ranks of a 2-D mesh, for layers data parallel on both dimensions.
FLAT = "dp_tp"


def plain_ddp(layer_specs: list[LayerSpec], ndim: int, ranks: int) -> bool:
    """Every parameter layer data parallel (``dp``) on each of the mesh's ``ndim`` dimensions, the loss
    the mean over all ``ranks`` (DDP's average): the plan is plain DDP."""
    return bool(layer_specs) and all(
        spec.style is None and spec.data == "dp" and spec.model_data == ("dp" if ndim == 2 else None)
        and spec.grad_divisor == ranks for spec in layer_specs)


def _ddp(model: Any, plan: Mapping[str, Any], mesh: Any, graph: LayerGraph | None) -> Any:
    """``model`` wrapped in DDP over all the mesh's ranks, in the plan's ``ddp_buckets`` (torch's own
    bucketing where the plan names none); ApplyError when those do not hold the model's gradients."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel

    check(model, plan, mesh, graph)  # (plain tensors everywhere)
    buckets = plan.get("ddp_buckets")
    options: dict[str, Any] = {}
    if buckets is not None:
        if not isinstance(buckets, list) or not buckets or not all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in buckets):
            raise ApplyError(f"ddp_buckets: a list of positive byte counts, not {buckets!r}")
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if sum(buckets) != grads:
            raise ApplyError(f"ddp_buckets hold {sum(buckets)} bytes but the model's gradients are {grads} bytes: "
                             "the plan was made for another model")
        options["bucket_cap_mb_list"] = [b / 2**20 for b in buckets]  # (exact: a power of two divides)
    flat = mesh if mesh.ndim == 1 else DeviceMesh(mesh.device_type, mesh.mesh.flatten(), mesh_dim_names=(FLAT,))
    return DistributedDataParallel(model, process_group=flat.get_group(), **options)


def _data_parallel_everywhere(module: Any, spec: LayerSpec, mesh: Any, meshes: dict[str, Any]) -> None:
    """A layer data parallel on both dimensions of a 2-D mesh: ``dp`` on both, ``replicate`` over all
    ranks; ``fsdp`` on both, ``fully_shard`` over all ranks (one flat mesh); one of each, FSDP2's hybrid
    (replicated over the ``dp`` dimension and sharded over the ``fsdp`` one, the mesh ordered so)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    key = FLAT if spec.data == spec.model_data else ("dp_first" if spec.data == "dp" else "tp_first")
    if key not in meshes:  # (every rank applies the same plan: the meshes' groups are made in one order)
        if key == FLAT:
            meshes[key] = DeviceMesh(mesh.device_type, mesh.mesh.flatten(), mesh_dim_names=(FLAT,))
        elif key == "dp_first":
            meshes[key] = mesh
        else:
            names = tuple(reversed(mesh.mesh_dim_names))
            meshes[key] = DeviceMesh(mesh.device_type, mesh.mesh.t().contiguous(), mesh_dim_names=names)
    target = meshes[key]
    if spec.data == spec.model_data == "dp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(module, mesh=target)
    else:
        fully_shard(module, mesh=target, reshard_after_forward=True)


def _divided_by(divisor: int) -> Any:
    """A parameter's gradient hook: the gradient divided by ``divisor``."""

    def hook(grad: Any) -> Any:
        return grad / divisor

    return hook


def check(model: Any, plan: Mapping[str, Any], mesh: Any, graph: LayerGraph | None = None) -> None:
    """Every parameter of the plan's layers placed as its strategy implies: a DTensor with those
    placements, or a plain tensor where the plan replicates it; ApplyError naming the first that is not."""
    from torch.nn.parallel import DistributedDataParallel

    dims = _check_mesh(plan, mesh)
    if isinstance(model, DistributedDataParallel):
        model = model.module
    layer_specs = specs(plan, graph)
    ddp = plain_ddp(layer_specs, len(dims), mesh.size())
    modules = modules_by_layer(model)
    for spec in layer_specs:
        module = modules.get(spec.name)
        if module is None:
            raise ApplyError(f"layer {spec.name!r}: the model has no module of that name")
        for pname, param in module.named_parameters():
            want = {} if ddp else expected_placements(spec, pname.rsplit(".", 1)[-1], dims)
            got = placements(param, dims)
            if got != want:
                raise ApplyError(f"layer {spec.name!r} ({spec.kind}, {spec.style or 'replicated'}"
                                 f"{', ' + spec.data if spec.data else ''}): parameter {pname!r} is placed "
                                 f"{_show(got)}, the plan implies {_show(want)}")


def placements(param: Any, dims: list[str]) -> dict[str, str]:
    """A parameter's placement per mesh dimension name ({} for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return {}
    names = param.device_mesh.mesh_dim_names or tuple(dims[:param.device_mesh.ndim])
    out = {}
    for name, pl in zip(names, param.placements, strict=True):
        if pl.is_shard() or type(pl).__name__ == "_StridedShard":  # FSDP's shard of a TP shard
            out[name] = f"S({pl.dim})"
        elif pl.is_replicate():
            out[name] = B
        elif pl.is_partial():
            out[name] = P
        else:
            out[name] = repr(pl)
    return out


def _show(placed: dict[str, str]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in placed.items()) if placed else "a plain tensor"


def modules_by_layer(model: Any) -> dict[str, Any]:
    """The model's modules by their layer names (trace.py's: the qualified name with '.' as '_')."""
    out = {}
    for qualname, module in model.named_modules():
        out[qualname] = module
        out.setdefault(qualname.replace(".", "_") or "module", module)
    return out


def _check_mesh(plan: Mapping[str, Any], mesh: Any) -> list[str]:
    """The plan's dimension names, once the mesh is checked to be the plan's."""
    shape = tuple(plan["mesh"]["shape"])
    if tuple(mesh.shape) != shape:
        raise ApplyError(f"the plan is for a mesh of {list(shape)}, the mesh given is {list(mesh.shape)}")
    dims = [d["name"] for d in plan["mesh"]["dims"]]
    if len(shape) == 2 and tuple(mesh.mesh_dim_names or ()) != ("dp", "tp"):
        raise ApplyError(f"a 2-D plan needs a mesh with dims named ('dp', 'tp'), not {mesh.mesh_dim_names}")
    return dims


def _layout(layout: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if layout == B:
        return Replicate()
    k = split_dim(layout)
    if k is None:
        raise ApplyError(f"layout {layout!r} has no DTensor placement here")
    return Shard(k)


def _style(spec: LayerSpec) -> Any:
    """The ParallelStyle that makes ``spec`` so, or None."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if spec.style == "col":
        return ColwiseParallel(input_layouts=_layout(spec.arrives), output_layouts=_layout(spec.gives))
    if spec.style == "row":
        return RowwiseParallel(input_layouts=_layout(spec.arrives), output_layouts=_layout(spec.gives))
    if spec.style == "seq":
        return SequenceParallel(sequence_dim=split_dim(spec.takes))  # (specs checked it is a split: 0 or 1)
    if spec.arrives != spec.takes:
        return PrepareModuleInput(input_layouts=(_layout(spec.arrives),), desired_input_layouts=(_layout(spec.takes),),
                                  use_local_output=True)
    return None
