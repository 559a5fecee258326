"""A model as the planner sees it: layers in a topological order, each with what its strategies
need (parameters, output shape, forward FLOPs), and edges that carry activations.

Built by tracing a model (``trace.py``) or read from a JSON layer list, the way in for models
that do not trace::

    {"format": "commd-layers", "version": 1, "dtype_bytes": 4,  (optional: "batch_dim": 1)
     "layers": [{"name": "fc1", "kind": "linear", "inputs": ["x"], "out_shape": [64, 1024],
                 "params": 1049600, "flops": 134217728, "in_features": 1024, "out_features": 1024}, ...]}

Kinds: ``input`` (the batch; no inputs), ``linear``, ``embedding``, ``conv2d``, ``layernorm``,
``attention`` (a recognised attention block: its projections and the attention between them),
``follow`` (parameter-free and element-wise or token-wise: activations, dropout, residual adds; its
output keeps its input's layout) and ``output`` (the loss; the end of the graph).  Dimension
``batch_dim`` of every activation is the batch: 0, or 1 for a model that runs sequence-first
(``nn.MultiheadAttention(batch_first=False)``, torch's default: (sequence, batch, features)); a 3-D
activation's other leading dimension is the sequence.  An attention layer takes one input (self-attention)
or up to three (query, key, value: cross-attention's query and memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commd.planner.files import check_header, read_json

LAYERS_FORMAT = "commd-layers"
LAYERS_VERSION = 1
KINDS = ("input", "linear", "embedding", "conv2d", "layernorm", "attention", "follow", "output")
#: Kinds that hold parameters (and so may have their gradients synchronised).
WITH_PARAMS = ("linear", "embedding", "conv2d", "layernorm", "attention")


class GraphError(ValueError):
    """A layer list that is not a usable graph; the message names the layer and the field."""


@dataclass(frozen=True)
class Layer:
    name: str
    kind: str
    inputs: tuple[str, ...]
    out_shape: tuple[int, ...]
    params: int = 0  # parameter elements
    flops: float = 0.0  # forward FLOPs of the whole batch
    attrs: dict[str, Any] = field(default_factory=dict)  # in_features, out_features, heads, ...

    def out_elements(self) -> int:
        return math.prod(self.out_shape)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "inputs": list(self.inputs), "out_shape": list(self.out_shape),
                "params": self.params, "flops": self.flops, **self.attrs}


@dataclass
class LayerGraph:
    layers: list[Layer]
    dtype_bytes: int = 4
    source: str = ""
    batch_dim: int = 0  # the dimension of every activation that is the batch (see the module)

    def __post_init__(self) -> None:
        if self.batch_dim not in (0, 1):
            raise GraphError(f"batch_dim must be 0 or 1, not {self.batch_dim!r}")
        seen: dict[str, int] = {}
        for i, layer in enumerate(self.layers):
            where = f"layer {i} ({layer.name!r})"
            if layer.kind not in KINDS:
                raise GraphError(f"{where}: kind {layer.kind!r} is not one of {', '.join(KINDS)}")
            if layer.name in seen:
                raise GraphError(f"{where}: the name is used twice")
            if not layer.out_shape or any(not isinstance(d, int) or d <= 0 for d in layer.out_shape):
                raise GraphError(f"{where}: out_shape must be positive integers, not {list(layer.out_shape)}")
            if layer.kind != "output" and len(layer.out_shape) <= self.batch_dim:
                raise GraphError(f"{where}: out_shape {list(layer.out_shape)} has no batch dimension {self.batch_dim}")
            if layer.params < 0 or layer.flops < 0:
                raise GraphError(f"{where}: params and flops must not be negative")
            if layer.kind == "input" and layer.inputs:
                raise GraphError(f"{where}: an input layer has no inputs")
            if layer.kind != "input" and not layer.inputs:
                raise GraphError(f"{where}: a {layer.kind} layer needs an input")
            for name in layer.inputs:
                if name not in seen:
                    raise GraphError(f"{where}: input {name!r} is not an earlier layer (layers go in a topological order)")
            if layer.kind == "linear" and len(layer.inputs) != 1:
                raise GraphError(f"{where}: a {layer.kind} layer takes one input")
            if layer.kind == "attention" and not 1 <= len(layer.inputs) <= 3:
                raise GraphError(f"{where}: an attention layer takes one to three inputs (query, key, value)")
            seen[layer.name] = i
        if not self.layers:
            raise GraphError("the graph has no layers")
        self.index = seen

    def edges(self) -> list[tuple[int, int]]:
        """(producer, consumer) per activation edge, in the layers' order."""
        return [(self.index[src], i) for i, layer in enumerate(self.layers) for src in layer.inputs]

    def edge_bytes(self, producer: int) -> int:
        return self.layers[producer].out_elements() * self.dtype_bytes

    def param_bytes(self, i: int) -> int:
        return self.layers[i].params * self.dtype_bytes

    def to_json(self) -> dict[str, Any]:
        return {"format": LAYERS_FORMAT, "version": LAYERS_VERSION, "dtype_bytes": self.dtype_bytes,
                **({"batch_dim": self.batch_dim} if self.batch_dim else {}),
                "layers": [layer.to_json() for layer in self.layers]}

    @classmethod
    def from_json(cls, raw: Any, where: str = "layer list") -> LayerGraph:
        check_header(raw, where, LAYERS_FORMAT, LAYERS_VERSION, "layer list", GraphError)
        dtype_bytes = raw.get("dtype_bytes", 4)
        if dtype_bytes not in (1, 2, 4, 8):
            raise GraphError(f"{where}: dtype_bytes must be 1, 2, 4 or 8, not {dtype_bytes!r}")
        rows = raw.get("layers")
        if not isinstance(rows, list):
            raise GraphError(f"{where}: 'layers' must be a list")
        layers = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise GraphError(f"{where}: layer {i} is not an object")
            rest = {k: v for k, v in row.items() if k not in ("name", "kind", "inputs", "out_shape", "params", "flops")}
            try:
                layers.append(Layer(name=_text(row, "name"), kind=_text(row, "kind"),
                                    inputs=tuple(_text({"input": x}, "input") for x in row.get("inputs", [])),
                                    out_shape=tuple(row["out_shape"]), params=int(row.get("params", 0)),
                                    flops=float(row.get("flops", 0.0)), attrs=rest))
            except (KeyError, TypeError, ValueError) as exc:
                raise GraphError(f"{where}: layer {i}: {exc}") from None
        return cls(layers, dtype_bytes, where, raw.get("batch_dim", 0))

    @classmethod
    def load(cls, path: Path) -> LayerGraph:
        return cls.from_json(read_json(path, "layer list", GraphError), str(path))


def _text(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key!r} must be a non-empty string, not {value!r}")
    return value
