"""A torch model into the planner's layer graph, traced on the meta device (no memory, no compute).

``torch.fx`` traces the model with its parameter layers as leaves — ``nn.Linear``, ``nn.Embedding``,
``nn.Conv2d``, ``nn.LayerNorm`` and recognised attention blocks (``nn.MultiheadAttention``, or any
module whose class name ends in ``Attention`` and that holds parameters but no ``nn.Linear``: one
built of Linear projections is traced through, its views and transposes mapping a split of the
features onto the heads) — and a shape pass on meta tensors gives every activation's shape.  Every
other call that makes a tensor (activations, dropout, residual adds, reshapes) becomes a ``follow``
layer; additions and subtractions of two tensors are marked linear (sums of parts are parts of the
sum).  Calls that make no tensor (sizes, attribute reads) are not layers: a layer that reads their
result is wired to the tensors they came from.  torch.nn's modules made of modules
(``nn.TransformerEncoder``, ``nn.TransformerDecoderLayer``) are traced through to their leaves.

The model is called on the batch alone, every other argument of its ``forward`` at its default (no
mask), and every proxy carries its value on the meta device (``meta_tracer.py``): code that asks
about the input's shape (torch's transformer modules do) traces as it runs for this batch; a branch
on a tensor's data does not, and the error names the module.  Dimension 0 of every activation must be
the batch — or dimension 1 of every activation, where the model's ``nn.MultiheadAttention`` blocks
run sequence-first (``batch_first=False``, torch's default).  Models that do not trace take the JSON
layer list instead (``graph.py``).
"""

from __future__ import annotations

import importlib
import math
import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from commd.planner.graph import GraphError, Layer, LayerGraph

#: Calls whose result is the sum of their tensor inputs (a split into parts commutes with them).
LINEAR_CALLS = {operator.add, operator.sub, operator.iadd, "add", "sub", "add_"}


def load_factory(spec: str) -> Callable[[], Any]:
    """``MODULE:FACTORY`` → the factory (a callable that builds the model); GraphError naming what is missing."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise GraphError(f"{spec!r}: give the model as MODULE:FACTORY (a function or class that builds it)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise GraphError(f"{spec!r}: cannot import {module_name!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise GraphError(f"{spec!r}: {module_name} has no callable {attr!r}")
    return factory


def trace(factory: Callable[[], Any], input_shape: tuple[int, ...], input_dtype: str = "float32",
          name: str = "") -> LayerGraph:
    """The layer graph of the model ``factory()`` builds, for one batch of ``input_shape``."""
    import torch
    import torch.fx
    from torch.fx.passes.shape_prop import ShapeProp

    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise GraphError(f"{name or 'the factory'} built a {type(model).__name__}, not a torch.nn.Module")

    dtype = getattr(torch, input_dtype)
    example = (torch.zeros(input_shape, dtype=dtype, device="meta") if not dtype.is_floating_point
               else torch.empty(input_shape, dtype=dtype, device="meta"))
    _check_one_input(model, name)
    module = torch.fx.GraphModule(model, _graph(model, example, name))
    try:
        ShapeProp(module).propagate(example)
    except Exception as exc:  # tracing runs the model's own code: any failure is the model's
        raise GraphError(f"{name or 'the model'} does not trace on the meta device ({type(exc).__name__}: {exc}); "
                         "give it as a JSON layer list (--layers)") from None
    return _layers(module, name or type(model).__name__, dtype.itemsize)


def measure(factory: Callable[[], Any], input_shape: tuple[int, ...], input_dtype: str = "float32",
            repeats: int = 5, threads: int | None = None) -> dict[str, float]:
    """Training seconds of every layer ``trace`` names, measured on this machine with real tensors: the
    model built on the CPU and its traced graph run node by node; each node timed on its own, ``repeats``
    times after a warm-up, for its forward, its backward (a gradient of ones into its output, into every
    floating-point input and its parameters) and an SGD update of its parameters; each node's median
    kept under the layer's name.  A rank is charged a strategy's share of the whole layer's time (see
    ``fixed_and_whole`` for the part that does not shrink)."""
    import statistics
    import time

    import torch
    import torch.fx

    with _torch_threads(threads):
        example = _example(input_shape, input_dtype)
        with torch.device("meta"):  # (the graph of trace's meta twin: the same questions answered alike)
            twin = factory()
        module = torch.fx.GraphModule(factory(), _graph(twin, example.to("meta")))
        times: dict[str, list[float]] = {}
        names = {node.name: (_name(node.target) if node.op == "call_module" and _kind_of(module.get_submodule(node.target))
                             else node.name) for node in module.graph.nodes}

        def detached(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value.detach().requires_grad_(value.is_floating_point())
            if isinstance(value, (tuple, list)):
                return type(value)(detached(v) for v in value)
            return value

        class Timer(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                if n.op in ("placeholder", "output", "get_attr"):  # (no work of their own)
                    times.setdefault(names[n.name], []).append(0.0)
                    return super().run_node(n)
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                args, kwargs = detached(args), {k: detached(v) for k, v in kwargs.items()}
                params = list(module.get_submodule(n.target).parameters()) if n.op == "call_module" else []
                began = time.perf_counter()
                result = getattr(self, n.op)(n.target, args, kwargs)
                out = result[0] if isinstance(result, (tuple, list)) and result else result
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.backward(torch.ones_like(out))
                with torch.no_grad():
                    for p in params:
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-1e-6)
                            p.grad = None
                times.setdefault(names[n.name], []).append(time.perf_counter() - began)
                return detached(result)

        for _ in range(repeats + 1):
            Timer(module).run(example)
    return {name: statistics.median(t[1:]) for name, t in times.items()}  # (the first run warms up)


def sgd_step(model: Any, optimizer: Any, x: Any) -> None:
    """One training step as ``commd plan --measure`` runs it and ``step_seconds`` times it: the loss is the
    mean square of the output (any model, no labels), the update plain SGD."""
    optimizer.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    optimizer.step()


def step_seconds(factory: Callable[[], Any], input_shape: tuple[int, ...], input_dtype: str = "float32",
                 repeats: int = 5, threads: int | None = None) -> float:
    """Median seconds of a whole training step (``sgd_step``) of the model ``factory()`` builds, on one
    process: what its layers, timed one at a time by ``measure``, really cost together."""
    import statistics
    import time

    import torch

    with _torch_threads(threads):
        model = factory()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
        example = _example(input_shape, input_dtype)
        times = []
        for _ in range(2 * repeats + 3):
            began = time.perf_counter()
            sgd_step(model, optimizer, example)
            times.append(time.perf_counter() - began)
    return statistics.median(times[2:])  # (the first two warm up)


def measure_in_step(factory: Callable[[], Any], input_shape: tuple[int, ...], input_dtype: str = "float32",
                    repeats: int = 5, threads: int | None = None) -> tuple[dict[str, float], float]:
    """(per layer seconds, the factor they were scaled by): ``measure``'s times scaled so that they add up
    to ``step_seconds``.  A layer timed alone runs with its weights and activations still in the cache
    from its own forward pass; in a step, the other layers' passes evict them between its forward and
    its backward, and the step adds the loss, the autograd engine and the optimizer.  With 4 copies of a
    4-layer MLP sharing 2 cores, its layers timed alone added up to 43–53 ms, its step to 56–65 ms."""
    layers = measure(factory, input_shape, input_dtype, repeats, threads)
    step = step_seconds(factory, input_shape, input_dtype, repeats, threads)
    total = sum(layers.values())
    factor = step / total if total > 0 else 1.0
    return {name: seconds * factor for name, seconds in layers.items()}, factor


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` (None: left as they are) while timing, then restored."""
    import torch

    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _example(input_shape: tuple[int, ...], input_dtype: str) -> Any:
    """A random input of the model: token ids 0 or 1 for integer dtypes."""
    import torch

    dtype = getattr(torch, input_dtype)
    return (torch.randint(0, 2, input_shape, dtype=dtype) if not dtype.is_floating_point
            else torch.randn(input_shape, dtype=dtype))


def fixed_and_whole(whole: dict[str, float], part: dict[str, float], share: float) -> dict[str, tuple[float, float]]:
    """Per layer (fixed, whole) seconds from its time on the whole batch and on a ``share`` of it: a
    layer's time on a share s is taken as fixed + (whole - fixed) * s — the fixed part (Python, autograd,
    small kernels) does not shrink when a strategy splits the layer."""
    out = {}
    for name, t_whole in whole.items():
        t_part = part.get(name, t_whole * share)
        variable = max(0.0, (t_whole - t_part) / (1.0 - share)) if share < 1 else t_whole
        fixed = min(max(0.0, t_whole - variable), t_part)
        out[name] = (fixed, t_whole)
    return out


def _graph(model: Any, example: Any, name: str = "") -> Any:
    """The ``torch.fx`` graph of ``model`` called on ``example`` (a meta tensor) alone, its parameter layers
    (``_kind_of``) as leaves.  Every other argument of its ``forward`` keeps its default: fx would hand each
    one in as a proxy, and torch's own modules read an absent mask as a tensor (``nn.TransformerEncoder``:
    ``F._none_or_dtype(mask)``).  Proxies carry their values on the meta device (``meta_tracer``), so the
    model's questions about shapes (``src.dim() != 3``, ``len(src.size())``, ``src.is_nested``) are answered
    for this batch.  GraphError naming the innermost module whose code failed."""
    import inspect

    from commd.planner.meta_tracer import MetaTracer

    defaults = {p.name: p.default for p in list(inspect.signature(model.forward).parameters.values())[1:]
                if p.default is not inspect.Parameter.empty}
    tracer = MetaTracer(example, lambda m: _kind_of(m) is not None)
    try:
        return tracer.trace(model, concrete_args=defaults or None)
    except Exception as exc:  # tracing runs the model's own code: any failure is the model's
        qualname, failed = tracer.failed_in or ("", model)
        hint = ""
        if type(failed).__module__.startswith("torch.nn"):  # (torch's own: a mask made in forward, most likely)
            hint = (f" or, if the model hands {type(failed).__name__} a mask it computes in forward, plan a factory "
                    "whose forward leaves the mask out (the same layers, shapes and plan; apply that plan to the "
                    "model with its mask)")
        raise GraphError(f"{name or 'the model'} does not trace on the meta device (in {qualname or 'the model'} "
                         f"({type(failed).__name__}): {type(exc).__name__}: {exc}); give it as a JSON layer list "
                         f"(--layers){hint}") from None


def _check_one_input(model: Any, name: str) -> None:
    """GraphError unless ``model.forward`` takes one input (every other argument has a default)."""
    import inspect

    params = list(inspect.signature(model.forward).parameters.values())
    required = [p.name for p in params[1:] if p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if not params or required:
        raise GraphError(f"{name or 'the model'}: its forward takes {', '.join(p.name for p in params) or 'nothing'}; "
                         "the planner traces a model on one input (the batch), every other argument left at its "
                         "default: wrap it in a module whose forward takes the batch alone")


def _kind_of(m: Any) -> str | None:
    import torch.nn as nn

    if isinstance(m, nn.Linear):
        return "linear"
    if isinstance(m, nn.Embedding):
        return "embedding"
    if isinstance(m, nn.Conv2d):
        return "conv2d"
    if isinstance(m, nn.LayerNorm):
        return "layernorm"
    if isinstance(m, nn.MultiheadAttention) or (type(m).__name__.endswith("Attention")
                                                 and any(True for _ in m.parameters())
                                                 and not any(isinstance(c, nn.Linear) for c in m.modules())):
        return "attention"  # (one made of Linear projections is traced through: Megatron splits those)
    return None


def _layers(module: Any, name: str, input_itemsize: int) -> LayerGraph:
    import torch

    layers: list[Layer] = []
    produced: dict[str, list[str]] = {}  # fx node -> the layers its value comes from
    modules = dict(module.named_modules())
    dtype_bytes = 4
    batch_first: dict[str, bool] = {}  # nn.MultiheadAttention layers' batch_first
    for node in module.graph.nodes:
        meta = node.meta.get("tensor_meta")
        shape = tuple(int(d) for d in meta.shape) if meta is not None and hasattr(meta, "shape") else None
        inputs = node.all_input_nodes
        if _target_name(node) in RESHAPES | TRANSPOSES and inputs:  # the rest of their arguments are sizes
            inputs = inputs[:1]
        if node.op == "call_module" and isinstance(modules[node.target], torch.nn.MultiheadAttention):
            inputs = _attention_inputs(node)
        sources = [layer for arg in inputs for layer in produced.get(arg.name, [])]
        sources = list(dict.fromkeys(sources))  # (x, x, x) into attention: one input
        if node.op == "placeholder" and any(x.kind == "input" for x in layers):
            produced[node.name] = []  # an argument left at its default (trace passes the batch alone)
        elif node.op == "placeholder":
            layers.append(Layer(node.name, "input", (), shape or (1,)))
            produced[node.name] = [node.name]
        elif node.op == "output":
            layers.append(Layer("output", "output", tuple(sources[:1]), (1,)))
        elif node.op == "call_module" and _kind_of(modules[node.target]) is not None:
            m = modules[node.target]
            kind = _kind_of(m)
            if shape is None:  # attention returns (output, weights): its output is the first
                first = node.meta.get("tensor_meta")
                shape = tuple(int(d) for d in first[0].shape) if isinstance(first, (tuple, list)) else (1,)
            params = sum(p.numel() for p in m.parameters())
            mha = isinstance(m, torch.nn.MultiheadAttention)  # (cross-attention: its query and its memory)
            layers.append(Layer(_name(node.target), kind, tuple(sources if mha else sources[:1]), shape, params,
                                _flops(kind, m, shape, layers, sources), _attrs(kind, m)))
            produced[node.name] = [layers[-1].name]
            if mha:
                batch_first[layers[-1].name] = bool(m.batch_first)
            dtype_bytes = max(p.element_size() for p in m.parameters()) if params else dtype_bytes
        elif shape is not None and sources:
            attrs: dict[str, Any] = {"linear": True} if (node.target in LINEAR_CALLS) and len(sources) > 1 else {}
            first = node.all_input_nodes[0].meta.get("tensor_meta") if node.all_input_nodes else None
            if first is not None and hasattr(first, "shape"):
                dims = _dim_map(node, tuple(int(d) for d in first.shape), shape)
                if dims != list(range(len(shape))):
                    attrs["dims"] = dims
            layers.append(Layer(node.name, "follow", tuple(sources), shape, attrs=attrs))
            produced[node.name] = [node.name]
        else:
            produced[node.name] = sources  # no tensor of its own (a size, a constant): pass the wiring on
    if not layers or layers[-1].kind != "output" or not layers[-1].inputs:
        raise GraphError(f"{name}: the traced graph has no tensor output")
    return LayerGraph(layers, dtype_bytes, f"{name} (traced)", _batch_dim(name, batch_first, layers))


def _batch_dim(name: str, batch_first: dict[str, bool], layers: list[Layer]) -> int:
    """The activations' batch dimension: 1 where the model's ``nn.MultiheadAttention`` blocks (their
    ``batch_first`` by layer name) run sequence-first (``batch_first=False``, torch's default: (sequence,
    batch, features)), else 0.  The planner splits the same dimension of every activation as the batch,
    so a sequence-first model must keep its batch at dimension 1 throughout: GraphError naming the layer
    that moves it, or the blocks where some run batch-first and others do not."""
    if len(set(batch_first.values())) > 1:
        seq_first = sorted(n for n, first in batch_first.items() if not first)
        raise GraphError(f"{name}: attention layers {seq_first} run sequence-first (batch_first=False) and the others "
                         "batch-first: build them all alike")
    if not batch_first or next(iter(batch_first.values())):
        return 0
    for layer in layers:
        dims = layer.attrs.get("dims")
        if layer.kind != "output" and (len(layer.out_shape) < 2 or (dims is not None and dims[1:2] != [1])):
            raise GraphError(f"{name}: layer {layer.name!r} ({layer.kind}, shape {list(layer.out_shape)}) moves the "
                             "batch off dimension 1, where the model's nn.MultiheadAttention(batch_first=False) "
                             "keeps it: build its attention batch_first=True (and feed it (batch, sequence, ...))")
    return 1


def _attention_inputs(node: Any) -> list[Any]:
    """The nodes an ``nn.MultiheadAttention`` call attends with: its query, key and value (positional or by
    name), not its masks."""
    import torch.fx

    named = [node.kwargs.get(k) for k in ("query", "key", "value")]
    return list(dict.fromkeys(a for a in (*node.args[:3], *named) if isinstance(a, torch.fx.Node)))


#: Calls that only move a tensor's dimensions (their first argument's) around.
RESHAPES = {"view", "reshape", "flatten", "unflatten", "contiguous"}
TRANSPOSES = {"transpose", "permute"}
MATMULS = {"matmul", "bmm", "baddbmm", "einsum"}


def _dim_map(node: Any, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[int | None]:
    """For each dimension of a parameter-free layer's (first) input, the output dimension a split of it
    becomes (None: no split of that dimension survives as a split).  Reshapes keep a split of the
    leading dimension of each group of dimensions they merge or divide; transposes move it; every
    other call keeps dimensions where they are (elementwise, attention, activations)."""
    import torch

    target = _target_name(node)
    if target in MATMULS:  # the last two dimensions are the product's own: only the batch-like ones split
        return [d if d < len(in_shape) - 2 and len(in_shape) == len(out_shape) else None for d in range(len(in_shape))]
    if node.op == "call_module" or target not in RESHAPES | TRANSPOSES:
        flatten = node.op == "call_module" and type(node.graph.owning_module.get_submodule(node.target)) is \
            torch.nn.Flatten
        if not flatten:
            same = len(in_shape) == len(out_shape)
            return [d if same or (d < len(out_shape) and in_shape[d] == out_shape[d]) else None
                    for d in range(len(in_shape))]
    if target in TRANSPOSES:
        ndim = len(in_shape)
        if target == "transpose":
            a, b = (int(x) % ndim for x in node.args[1:3])
            order = list(range(ndim))
            order[a], order[b] = order[b], order[a]
        else:
            raw = node.args[1:] if len(node.args) > 2 or not isinstance(node.args[1], (tuple, list)) else node.args[1]
            order = [int(x) % ndim for x in raw]
        return [order.index(d) for d in range(ndim)]
    return reshape_map(in_shape, out_shape)


def _target_name(node: Any) -> str:
    """A call's name: the method's, or the function's (``torch.reshape`` → ``reshape``)."""
    if node.op == "call_module":
        return ""
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def reshape_map(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[int | None]:
    """Dimensions of a reshape grouped where their products meet; a group's leading input dimension
    maps to its leading output dimension (a contiguous block of one is a contiguous block of the
    other), the rest map nowhere."""
    out: list[int | None] = [None] * len(in_shape)
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        while pi != pj:
            if pi < pj and gi[-1] + 1 < len(in_shape):
                gi.append(gi[-1] + 1)
                pi *= in_shape[gi[-1]]
            elif pj < pi and gj[-1] + 1 < len(out_shape):
                gj.append(gj[-1] + 1)
                pj *= out_shape[gj[-1]]
            else:
                return out
        out[i] = j
        i, j = gi[-1] + 1, gj[-1] + 1
    return out


def _name(target: str) -> str:
    return target.replace(".", "_") if target else "module"


def _attrs(kind: str, m: Any) -> dict[str, Any]:
    if kind == "linear":
        return {"in_features": m.in_features, "out_features": m.out_features}
    if kind == "attention":
        return {"heads": getattr(m, "num_heads", 0)}
    return {}


def _flops(kind: str, m: Any, out_shape: tuple[int, ...], layers: list[Layer], sources: list[str]) -> float:
    """Forward FLOPs of one leaf for the whole batch (multiply-adds count two)."""
    out = math.prod(out_shape)
    if kind == "linear":
        return 2.0 * out * m.in_features
    if kind == "conv2d":
        k = math.prod(m.kernel_size)
        return 2.0 * out * k * m.in_channels / m.groups
    if kind == "layernorm":
        return 5.0 * out
    if kind == "attention":
        hidden = out_shape[-1]
        tokens = out // hidden
        seq_first = len(out_shape) == 3 and getattr(m, "batch_first", True) is False  # (sequence, batch, features)
        seq = out_shape[0] if seq_first else out_shape[-2] if len(out_shape) >= 3 else tokens
        return 2.0 * tokens * hidden * 4 * hidden + 4.0 * tokens * seq * hidden
    return 0.0
