"""``torch.fx``'s tracer with every proxy's value worked out on the meta device, for ``trace.py``.

Symbolic tracing knows no values, so a model that asks about its input's shape (``if src.dim() != 3``,
``len(src.size())``, ``src.is_nested``: ``nn.TransformerEncoder`` and its layers do) cannot be traced by
plain ``torch.fx``.  Here each node's value is computed as the node is made — the batch and the
parameters as meta tensors, each call run on them, a leaf module's forward run whole — so such a
question is answered as it would be for the traced batch, and the graph is the one that batch takes.
A branch on a tensor's data (``if mask.any()``) still fails: a meta tensor has no data.  Nothing is
patched beyond what ``torch.fx.Tracer`` itself patches while it traces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx.proxy import Attribute

#: A node's value that tracing did not work out (a call that failed on meta, or an input of one).
UNKNOWN = object()


class ValuedProxy(torch.fx.Proxy):
    """A proxy whose ``len()`` is its value's where the tracer knows it (a size, a shape, a tuple)."""

    def __len__(self) -> int:
        value = self.tracer.values.get(self.node, UNKNOWN)  # (made by MetaTracer.proxy: its tracer's)
        return len(value) if value is not UNKNOWN and hasattr(value, "__len__") else super().__len__()

    def __getattr__(self, k: str) -> Any:
        return ValuedAttribute(self, k)


class ValuedAttribute(Attribute, ValuedProxy):
    """``x.shape``, ``x.is_nested``: an attribute read, its value known too."""


class MetaTracer(torch.fx.Tracer):
    """Modules for which ``is_leaf`` is true become ``call_module`` nodes, and so do torch.nn's modules made
    of no other module (activations, dropout, pooling); torch.nn's modules made of modules
    (``nn.TransformerEncoderLayer``, ``nn.TransformerEncoder``) are traced through — fx's default keeps them
    whole, and their parameters with them.  Every node's value is kept in ``values`` (UNKNOWN where it
    could not be worked out)."""

    def __init__(self, example: torch.Tensor, is_leaf: Callable[[torch.nn.Module], bool]) -> None:
        super().__init__()
        self.example = example
        self.is_leaf = is_leaf
        self.values: dict[torch.fx.Node, Any] = {}
        self.inside = 0  # >0 while a value is worked out: the model's calls then are not nodes
        #: the innermost module whose forward raised while it was traced, and its qualified name, for the error
        self.failed_in: tuple[str, torch.nn.Module] | None = None

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return self.is_leaf(m) or (super().is_leaf_module(m, module_qualified_name)
                                   and not any(True for _ in m.children()))

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return ValuedProxy(node, self)

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     name: str | None = None, type_expr: Any = None, proxy_factory_fn: Any = None) -> torch.fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        node = proxy.node
        if kind == "placeholder":  # the batch first; the other arguments are left at their defaults
            first = not any(n.op == "placeholder" for n in self.values)
            self.values[node] = self.example if first else (args[0] if args else UNKNOWN)
        elif kind == "get_attr":
            self.values[node] = self.evaluate(lambda: meta(attribute(self.root, str(target))))
        elif kind == "call_function":
            self.values[node] = self.evaluate(target, args, kwargs)
        elif kind == "call_method":
            self.values[node] = self.evaluate(lambda obj, *a, **k: getattr(obj, target)(*a, **k), args, kwargs)
        return proxy  # (a leaf module's value: call_module, which holds its forward)

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        if self.inside:  # a leaf's own submodules while its value is worked out: run, not traced
            return forward(*args, **kwargs)
        try:
            out = super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # (its name from the root: path_of_module's answer varies with torch's state)
                name = next((n for n, sub in self.root.named_modules() if sub is m), "")
                self.failed_in = (name, m)
            raise
        if isinstance(out, torch.fx.Proxy) and out.node.op == "call_module" and out.node not in self.values:
            self.values[out.node] = self.evaluate(forward, args, kwargs)
        return out

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        return attr_val if self.inside else super().getattr(attr, attr_val, parameter_proxy_cache)

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        value = self.values.get(obj.node, UNKNOWN)
        if value is UNKNOWN or isinstance(value, torch.Tensor):  # a branch on data: fx's own error
            return super().to_bool(obj)
        return bool(value)

    def iter(self, obj: torch.fx.Proxy) -> Any:
        value = self.values.get(obj.node, UNKNOWN)
        if isinstance(value, (tuple, list)):  # (torch.Size too: a shape's dimensions, one node each)
            return iter([obj[i] for i in range(len(value))])
        return super().iter(obj)

    def evaluate(self, fn: Callable[..., Any], args: Any = (), kwargs: Any = None) -> Any:
        """``fn`` called on the values of ``args`` and ``kwargs`` (UNKNOWN if one is, or the call fails)."""
        missing = False

        def value(a: Any) -> Any:
            nonlocal missing
            if not isinstance(a, torch.fx.Proxy):
                return a
            v = self.values.get(a.node, UNKNOWN)
            missing = missing or v is UNKNOWN
            return v

        a = torch.fx.node.map_aggregate(args, value)
        k = torch.fx.node.map_aggregate(kwargs or {}, value)
        if missing:
            return UNKNOWN
        self.inside += 1
        try:
            return fn(*a, **k)
        except Exception:  # a value tracing cannot work out: only a question about it fails (fx's error)
            return UNKNOWN
        finally:
            self.inside -= 1


def attribute(root: Any, target: str) -> Any:
    """``root.a.b.c`` for ``target`` "a.b.c"."""
    for atom in target.split("."):
        root = getattr(root, atom)
    return root


def meta(value: Any) -> Any:
    """A tensor's stand-in on the meta device (same shape and dtype); anything else as it is."""
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return torch.empty_like(value, device="meta")
    return value
