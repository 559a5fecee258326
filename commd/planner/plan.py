"""From a layer graph, a mesh and measured costs to a plan: the problem, its solution, plan.json.

Each layer's candidates are its strategies on every mesh dimension together (``layouts.py``);
a candidate's own cost is its share of the layer's training compute (measured forward, backward and
update, with a part that does not shrink with the share; or three times the forward's FLOPs at a
measured rate) and its parameter synchronisation; an edge's cost is the layout conversion of the
activation forward and of its gradient backward, per mesh dimension.  Collectives are priced by
``costs.py`` on the groups of the dimension they run on, so a dimension inside one node and one
across nodes cost what they were measured to cost.  ``plan()`` solves it (``search.py``) and
prices two baselines the same way: data parallel everywhere, and Megatron (linear layers in
column/row pairs, attention split by heads, embeddings by vocabulary, the rest replicated).

A plan of data-parallel layers only (every parameter layer ``dp`` on every mesh dimension) is plain
DDP over all the mesh's ranks (``apply``), so it is priced as DDP synchronises: the gradients in
buckets (``ddp_buckets``: filled in the order backward makes them, the first closed from
``ddp_first_bucket_bytes``, the others from ``ddp_bucket_bytes``, torch's defaults), one all-reduce
each, and plan.json names the buckets so ``apply`` makes exactly those.  A layer at a time (the
search's unit) prices each layer's own all-reduce, more than DDP's buckets cost, so the data-parallel
baseline priced as DDP becomes the plan when it is cheaper than what the search found.

The model adds times: it does not overlap communication with compute (DDP overlaps its
all-reduces with the backward pass), so a prediction is an upper bound where overlap is large.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from commd.planner import search
from commd.planner.costs import CollectiveCosts
from commd.planner.files import check_header, read_json
from commd.planner.graph import WITH_PARAMS, LayerGraph
from commd.planner.layouts import (
    SYNC_NONE,
    B,
    P,
    Strategy,
    candidates,
    conversion,
    split_dim,
    sync_collectives,
)

PLAN_FORMAT = "commd-plan"
PLAN_VERSION = 1
#: ``apply`` converts a layout only where a DTensor style can: in the output of a layer with one of
#: these strategies, or in the input of a layer with one of these (a replicated layer's
#: PrepareModuleInput, but not an attention block's: it takes query, key and value, and apply gives
#: PrepareModuleInput one input's layouts); replicate/fully_shard and parameter-free layers convert
#: nothing.  An edge that needs a conversion elsewhere is priced NOT_APPLIABLE_S: no plan takes it
#: while one without it exists (every layer can keep the layout it is given).
STYLED = ("col", "row", "vocab")  # (SequenceParallel takes and gives the sequence split only)
TAKES_ANY = (*STYLED, "rep")
NOT_APPLIABLE_S = 1e6
SEARCHES = ("descent", "exact", "both")
#: Adjacent layers descent changes at once (two missed the optimum on random models: search.py).
DESCENT_WINDOW = 3
#: ``--search both`` fails when descent is this much worse than the exact optimum.
BOTH_TOLERANCE = 0.01


class PlanError(ValueError):
    """A plan that cannot be made as asked; the message says why."""


@dataclass(frozen=True)
class MeshDim:
    size: int
    role: str  # "any" (1-D), "data" or "model" (2-D)
    nodes: int  # nodes one of its groups spans
    name: str
    #: how many of its groups cross each node's link at once (its groups run together: on a 2x2 mesh of
    #: 2 ranks a node, both dp groups send over every node's link); 1 for groups inside a node
    sharing: int = 1

    def seconds(self, costs: CollectiveCosts, kind: str, nbytes: int) -> float:
        """One of its groups' collective, its groups all at once (the curves were measured one group at a
        time): ``CollectiveCosts.side_by_side``."""
        return costs.side_by_side(kind, nbytes, self.nodes, self.size, self.sharing)


@dataclass(frozen=True)
class Mesh:
    """Ranks laid out row-major over ``shape``; ``nproc_per_node`` consecutive ranks share a node."""

    shape: tuple[int, ...]
    nproc_per_node: int
    gpu: bool = False

    def __post_init__(self) -> None:
        if not 1 <= len(self.shape) <= 2 or any(s < 1 for s in self.shape):
            raise PlanError(f"a mesh is 1-D or 2-D (dp x tp) of positive sizes, not {self.shape}")
        if self.nproc_per_node < 1 or self.world % self.nproc_per_node:
            raise PlanError(f"{self.world} ranks do not fill nodes of {self.nproc_per_node}")

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    def dims(self) -> list[MeshDim]:
        out = []
        for d, size in enumerate(self.shape):
            stride = math.prod(self.shape[d + 1:])
            nodes = len({(i * stride) // self.nproc_per_node for i in range(size)})
            role = "any" if len(self.shape) == 1 else ("data" if d == 0 else "model")
            sharing = max(1, self.nproc_per_node * nodes // size) if nodes > 1 else 1
            out.append(MeshDim(size, role, nodes, "dp" if role == "data" else ("tp" if role == "model" else "world"),
                               sharing))
        return out

    def describe(self) -> str:
        return "x".join(map(str, self.shape)) + f" ({self.world // self.nproc_per_node} node(s) x {self.nproc_per_node})"

    @classmethod
    def parse(cls, text: str, nproc_per_node: int, gpu: bool = False) -> Mesh:
        try:
            shape = tuple(int(x) for x in text.lower().split("x"))
        except ValueError:
            raise PlanError(f"--mesh {text!r}: sizes such as 4 or 2x2") from None
        return cls(shape, nproc_per_node, gpu)


@dataclass
class Options:
    compute: str = "flops"  # "flops" (from the costs' flops_per_s) or "measured" (layer_seconds)
    #: measured training seconds (forward, backward, update) of each whole layer
    layer_seconds: dict[str, float] = field(default_factory=dict)
    #: the part of a layer's measured seconds that does not shrink with its share (absent: none)
    layer_fixed_seconds: dict[str, float] = field(default_factory=dict)
    #: per collective kind, [a, b]: a + b * bytes seconds a layout conversion's collective takes beyond its
    #: measured price — the torch path DTensor takes (functional collectives, fresh tensors), measured
    #: inside the launched job
    convert_overhead_s: dict[str, list[float]] = field(default_factory=dict)
    #: the same for the gradient sync's collectives (FSDP2's direct calls)
    sync_overhead_s: dict[str, list[float]] = field(default_factory=dict)
    #: per wrapper ``apply`` puts on a layer (``replicate``, ``fully_shard``, ``col``, ``row``: FSDP2's and
    #: DTensor's), the seconds a step of a wrapped layer takes of its own (hooks, dispatch), measured in the job
    wrapper_overhead_s: dict[str, float] = field(default_factory=dict)
    #: per wrapper and kind of group it synchronises on (``replicate``, ``replicate@node``,
    #: ``replicate@cross``: ``_scope``), points [bytes, seconds]: what it adds to a layer whose gradient sync is
    #: that many bytes beyond the sync's price (between points: interpolated; beyond: the nearest), measured
    #: at a layer's sizes in the job; where present, it replaces the wrapper's tiny-layer figure
    wrapper_curves_s: dict[str, list[list[float]]] = field(default_factory=dict)
    compute_source: str = ""  # where the measured times come from, for plan.json
    mem_bytes: float | None = None  # per rank
    optimizer_states: int = 2  # extra parameter-sized tensors (Adam: 2, SGD with momentum: 1)
    search: str = "descent"
    #: only strategies ``apply`` can set up through DTensor (False: price every strategy)
    appliable_only: bool = True
    #: the faster baseline (plain DDP or Megatron) stays the plan unless the search's is predicted at least this
    #: fraction faster: a smaller predicted gain is inside the predictions' error (benchmarks/planner.py: within
    #: 25%, most within 15%), and the baselines are what a user falls back on
    #: (0.15: a plan predicted 10.7-11% faster than Megatron measured 1.13-1.15x its step in 2 of 3 benchmark runs)
    min_gain: float = 0.15
    #: DDP's bucket caps (torch's defaults: 1 MiB for the first bucket, the last layers' gradients, 25 MiB after)
    ddp_first_bucket_bytes: int = 1 << 20
    ddp_bucket_bytes: int = 25 << 20


@dataclass
class Priced:
    """The problem, and per layer its candidates (one Strategy per mesh dimension)."""

    problem: search.Problem
    options: list[list[tuple[Strategy, ...]]]
    node_parts: list[list[dict[str, float]]]  # per layer, per candidate: compute, sync seconds
    collectives: dict[tuple[int, int], list[list[tuple[str, int, int, int]]]]  # per edge: [s*kv+t] -> list
    node_collectives: list[list[list[tuple[str, int, int, int]]]]  # per layer, per candidate
    #: plain DDP's gradient sync: its buckets' bytes, their all-reduces and what they cost (see the module)
    ddp: DdpSync | None = None


@dataclass
class DdpSync:
    buckets: list[int]
    collectives: list[tuple[str, int, int, int]]
    seconds: float
    param_layers: list[int]  # the layers with parameters, whose sync the buckets replace


def price(graph: LayerGraph, mesh: Mesh, costs: CollectiveCosts, opts: Options) -> Priced:
    """Every layer's candidates, their costs and the edges' costs."""
    dims = mesh.dims()
    ndim_in = [len(graph.layers[graph.index[x.inputs[0]]].out_shape) if x.inputs else len(x.out_shape)
               for x in graph.layers]
    options, node_costs, node_parts, node_colls = [], [], [], []
    # the groups a collective may run on: each dimension's, and (index len(dims)) all the mesh's ranks
    groups = [*dims, MeshDim(mesh.world, "all", max(1, mesh.world // mesh.nproc_per_node), "all")]
    for i, layer in enumerate(graph.layers):
        per_dim = [candidates(layer, ndim_in[i], d.size, d.role, graph.batch_dim) for d in dims]
        combos, costs_here, parts_here, colls_here = [], [], [], []
        for combo in itertools.product(*per_dim):
            if opts.appliable_only and not all(st.appliable for st in combo):
                continue
            compute = _compute_seconds(layer.name, layer.flops, costs, opts, math.prod(s.compute_share for s in combo))
            colls = []
            syncs = {s.sync for s in combo}
            if len(combo) == 2 and len(syncs) == 1 and SYNC_NONE not in syncs:
                # data parallel on both dimensions alike: one group of all the mesh's ranks (apply's flat mesh)
                colls = [(kind, b, len(dims), 1) for kind, b in sync_collectives(syncs.pop(), graph.param_bytes(i))]
            else:
                for d, s in enumerate(combo):
                    if s.sync != SYNC_NONE and dims[d].size > 1:  # (one rank: nothing to synchronise)
                        nbytes = _held_param_bytes(graph, i, [x for e, x in enumerate(combo) if e != d])
                        colls += [(kind, b, d, 1) for kind, b in sync_collectives(s.sync, nbytes)]
            sync = sum(groups[d].seconds(costs, k, b) + _extra(opts.sync_overhead_s, k, b, groups[d])
                       for k, b, d, _ in colls)
            if opts.mem_bytes is not None and _memory(graph, i, combo, mesh.shape, opts.optimizer_states) > opts.mem_bytes:
                continue
            wrap = sum(_wrapper_seconds(opts, w, colls, groups) for w in wrappers(layer.kind, combo))
            combos.append(combo)
            costs_here.append(compute + sync + wrap)
            parts_here.append({"compute_s": compute, "sync_s": sync, "wrappers_s": wrap})
            colls_here.append(colls)
        if not combos:
            raise PlanError(f"layer {layer.name!r}: no strategy fits in {opts.mem_bytes / 2**30:.2f} GiB per rank")
        options.append(combos)
        node_costs.append(costs_here)
        node_parts.append(parts_here)
        node_colls.append(colls_here)
    edges, edge_colls = {}, {}
    for u, v in graph.edges():
        nbytes = graph.edge_bytes(u)
        ku, kv = len(options[u]), len(options[v])
        matrix = np.zeros((ku, kv))
        lists: list[list[tuple[str, int, int, int]]] = []
        backward = graph.layers[u].kind != "input"  # (no gradient flows into the batch)
        converts_out = graph.layers[u].kind in WITH_PARAMS
        converts_in = graph.layers[v].kind in WITH_PARAMS and graph.layers[v].kind != "attention"
        for s, t in itertools.product(range(ku), range(kv)):
            if opts.appliable_only and not all(
                    a.out == b.inp or (converts_out and a.name in STYLED) or (converts_in and b.name in TAKES_ANY)
                    for a, b in zip(options[u][s], options[v][t], strict=True)):
                matrix[s, t] = NOT_APPLIABLE_S
                lists.append([])
                continue
            colls = _edge_collectives(options[u][s], options[v][t], nbytes, mesh, backward)
            matrix[s, t] = sum(dims[d].seconds(costs, k, b) + _extra(opts.convert_overhead_s, k, b, dims[d])
                               for k, b, d, _ in colls)
            lists.append(colls)
        key = (u, v)
        if key in edges:  # the same producer feeds the consumer twice (x + x): both conversions count
            edges[key] = edges[key] + matrix
            edge_colls[key] = [a + b for a, b in zip(edge_colls[key], lists, strict=True)]
        else:
            edges[key], edge_colls[key] = matrix, lists
    all_ranks = 0 if len(dims) == 1 else len(dims)  # (a 1-D mesh's one dimension is all its ranks)
    ddp = _ddp_sync(graph, mesh, costs, opts, groups[all_ranks], all_ranks)
    return Priced(search.Problem(node_costs, edges), options, node_parts, edge_colls, node_colls, ddp)


#: The DTensor style ``apply`` gives a layer for its model-dimension strategy (linear and embedding layers).
STYLE_WRAPPERS = {"col": "col", "row": "row", "vocab": "row"}


def wrappers(kind: str, combo: tuple[Strategy, ...]) -> list[str]:
    """The wrappers ``apply`` puts on a layer of ``kind`` with ``combo`` (see Options.wrapper_overhead_s):
    a DTensor style on the model dimension, FSDP2's ``replicate``/``fully_shard`` for data parallel (one,
    over all ranks, where both dimensions of a 2-D mesh are data parallel)."""
    if kind not in WITH_PARAMS:
        return []
    names = [s.name for s in combo]
    out = [STYLE_WRAPPERS[names[-1]]] if kind in ("linear", "embedding") and names[-1] in STYLE_WRAPPERS else []
    data = [n for n in names if n in ("dp", "fsdp")]
    if data:
        out.append("replicate" if all(n == "dp" for n in data) else "fully_shard")
    return out


def _wrapper_seconds(opts: Options, name: str, colls: list[tuple[str, int, int, int]], groups: list[MeshDim]) -> float:
    """What wrapper ``name`` costs a layer of its own: its curve for the group the layer's gradient sync
    (``colls``) runs on, at the sync's bytes, where the job measured one; else its tiny-layer figure."""
    dims = {d for _, _, d, _ in colls}
    if len(dims) == 1:
        (d,) = dims
        curve = opts.wrapper_curves_s.get(name + _scope(groups[d]))
        if curve:
            return float(np.interp(sum(b for _, b, _, _ in colls), [x for x, _ in curve], [y for _, y in curve]))
    return opts.wrapper_overhead_s.get(name, 0.0)


def ddp_buckets(graph: LayerGraph, first_bytes: int, bucket_bytes: int) -> list[int]:
    """The bytes of DDP's gradient buckets, in the order it fills them: the layers' parameters from the
    last layer back (the order backward makes their gradients), a bucket closed once it holds at least
    its cap (``first_bytes`` for the first, ``bucket_bytes`` after); a layer is never split."""
    out, size = [], 0
    for i in reversed(range(len(graph.layers))):
        nbytes = graph.param_bytes(i)
        if not nbytes:
            continue
        size += nbytes
        if size >= (first_bytes if not out else bucket_bytes):
            out.append(size)
            size = 0
    if size:
        out.append(size)
    return out


def _ddp_sync(graph: LayerGraph, mesh: Mesh, costs: CollectiveCosts, opts: Options, group: MeshDim,
              mesh_dim: int) -> DdpSync | None:
    """Plain DDP's gradient sync over all the mesh's ranks (None: one rank, or no parameters)."""
    buckets = ddp_buckets(graph, opts.ddp_first_bucket_bytes, opts.ddp_bucket_bytes)
    if mesh.world < 2 or not buckets:
        return None
    colls = [("allreduce", b, mesh_dim, 1) for b in buckets]
    seconds = sum(group.seconds(costs, "allreduce", b) + _extra(opts.sync_overhead_s, "allreduce", b, group)
                  for b in buckets)
    return DdpSync(buckets, colls, seconds, [i for i in range(len(graph.layers)) if graph.param_bytes(i)])


def plain_ddp(priced: Priced, choice: list[int]) -> bool:
    """Whether ``choice`` is data parallel on every mesh dimension in every layer with parameters
    (``apply`` makes it plain DDP over all ranks, synchronised in ``priced.ddp``'s buckets)."""
    return priced.ddp is not None and all(
        all(s.name == "dp" for s in priced.options[i][choice[i]]) for i in priced.ddp.param_layers)


def _held_param_bytes(graph: LayerGraph, i: int, strategies: list[Strategy]) -> int:
    """The bytes of layer ``i``'s parameters one rank holds under ``strategies`` (on the other mesh
    dimensions): their share, but a row-split linear layer's bias whole (Megatron adds it once the
    partial sums are reduced, so every rank holds all of it)."""
    layer, whole = graph.layers[i], graph.param_bytes(i)
    share = math.prod(s.param_share for s in strategies)
    fan_in, fan_out = layer.attrs.get("in_features"), layer.attrs.get("out_features")
    if layer.kind != "linear" or not fan_in or not fan_out or all(s.name != "row" for s in strategies):
        return int(whole * share)
    bias = max(0, layer.params - fan_in * fan_out) * graph.dtype_bytes
    return int((whole - bias) * share + bias * math.prod(s.param_share for s in strategies if s.name != "row"))


def _extra(overheads: dict[str, list[float]], kind: str, nbytes: int, dim: MeshDim) -> float:
    """What the torch path adds to a collective's price on one of ``dim``'s groups: the line the job
    probed on groups like them where it did — one node's ranks (``KIND@node``), or one rank of each node
    with the others' groups side by side (``KIND@cross``: a 2-D mesh's dp groups) — else the kind's, probed
    on all ranks."""
    a, b = overheads.get(kind + _scope(dim)) or overheads.get(kind) or (0.0, 0.0)
    return a + b * nbytes


def _scope(dim: MeshDim) -> str:
    """The suffix of the measured lines for groups like ``dim``'s: ``@node`` (one node's ranks), ``@cross``
    (one rank of each node, the other ranks' groups side by side), or none (the groups of all ranks)."""
    return "@node" if dim.nodes == 1 else ("@cross" if dim.sharing > 1 and dim.nodes == dim.size else "")


def _compute_seconds(name: str, flops: float, costs: CollectiveCosts, opts: Options, share: float) -> float:
    """A rank's training seconds of one layer when a strategy gives it ``share`` of the layer's work."""
    if opts.compute == "measured":
        if name not in opts.layer_seconds:
            raise PlanError(f"layer {name!r} has no measured time")
        whole, fixed = opts.layer_seconds[name], opts.layer_fixed_seconds.get(name, 0.0)
        return fixed + (whole - fixed) * share
    if opts.compute != "flops":
        raise PlanError(f"compute must be 'flops' or 'measured', not {opts.compute!r}")
    if flops and not costs.flops_per_s:
        raise PlanError("compute from FLOPs needs a measured rate: run `commd plan calibrate` (flops_per_s)")
    return 3 * flops / costs.flops_per_s * share if flops else 0.0  # (backward: twice the forward)


def _memory(graph: LayerGraph, i: int, combo: tuple[Strategy, ...], shape: tuple[int, ...],
            optimizer_states: int) -> float:
    """A candidate's bytes per rank: its parameters, gradients and optimizer states, and its output
    activation (kept for the backward pass)."""
    params = graph.param_bytes(i) * math.prod(s.param_share for s in combo) * (2 + optimizer_states)
    act = graph.edge_bytes(i) / math.prod(_shards(s.out, shape[d]) for d, s in enumerate(combo))
    return params + act


def _shards(layout: str, size: int) -> int:
    return size if split_dim(layout) is not None else 1


def _edge_collectives(su: tuple[Strategy, ...], sv: tuple[Strategy, ...], nbytes: int, mesh: Mesh,
                      backward: bool) -> list[tuple[str, int, int, int]]:
    """The conversions of one edge per mesh dimension, forward and backward: (kind, bytes, dim, 1)."""
    out = []
    for d in range(len(mesh.shape)):
        if mesh.shape[d] == 1:  # one rank per group: every layout is the whole tensor, nothing moves
            continue
        others = math.prod(mesh.shape[e] if split_dim(su[e].out) is not None else 1
                           for e in range(len(mesh.shape)) if e != d)
        b = nbytes // others
        out += [(k, n, d, 1) for k, n in conversion(su[d].out, sv[d].inp, b, mesh.gpu)]
        if backward:  # the producer's output gradient: its layout, but whole where the output is partial
            # (each rank's part of a sum gets the sum's whole gradient: P's dual is B)
            wanted = B if su[d].out == P else su[d].out
            out += [(k, n, d, 1) for k, n in conversion(sv[d].in_grad, wanted, b, mesh.gpu)]
    return out


# ---- baselines ------------------------------------------------------------------------------------
def data_parallel(graph: LayerGraph, priced: Priced) -> list[int] | None:
    """Every dimension data parallel (DDP)."""
    return _pick(priced, lambda i, combo: all(s.name == "dp" for s in combo))


def megatron(graph: LayerGraph, priced: Priced, row_first: bool = False) -> list[int] | None:
    """Data parallel on a 2-D mesh's data dimension; on the other (a 1-D mesh's only one): a linear
    layer is a row layer where its input arrives with its features split (a column layer's output,
    through parameter-free layers: attention's separate q, k, v projections are three column layers
    and its output projection their row partner), else a column layer; convolutions alternate, attention splits heads, embeddings the vocabulary,
    parameter-free layers keep the layout they are given (an activation after a column layer stays
    split), everything else is replicated (and so is a layer whose split the plan may not use).  ``row_first``: the pairs shifted by one layer (a start for
    descent, which cannot shift every pair at once)."""
    choice: list[int] = []
    column_next = not row_first
    model_dim = len(priced.options[0][0]) - 1
    for i, layer in enumerate(graph.layers):
        combos = priced.options[i]
        want: str | None
        if layer.kind == "linear" and not row_first and layer.inputs:  # pairs by dataflow: a linear layer
            src = graph.index[layer.inputs[0]]  # fed features split by a column layer is its row partner
            given = priced.options[src][choice[src]][model_dim].out
            want = "row" if split_dim(given) == len(graph.layers[src].out_shape) - 1 else "col"
        elif layer.kind in ("linear", "conv2d"):
            want, column_next = ("col" if column_next else "row"), not column_next
        elif layer.kind == "attention":
            want = "heads"
        elif layer.kind == "embedding":
            want = "vocab"
        elif layer.kind == "follow":
            given = priced.options[graph.index[layer.inputs[0]]][choice[graph.index[layer.inputs[0]]]][model_dim].out
            want = next((c[model_dim].name for c in combos if c[model_dim].inp == given and c[model_dim].name != "dp"),
                        "rep")
        else:
            want = "rep"
        found = None
        for name in (want, "rep"):  # a split the plan may not use (one apply cannot set up): replicated
            found = next((k for k, combo in enumerate(combos)
                          if combo[model_dim].name == name and all(s.name == "dp" for s in combo[:model_dim])), None)
            if found is not None:
                break
        if found is None:
            return None
        choice.append(found)
    return choice


def _pick(priced: Priced, fits: Any) -> list[int] | None:
    choice = []
    for i, combos in enumerate(priced.options):
        found = next((k for k, combo in enumerate(combos) if fits(i, combo)), None)
        if found is None:
            return None
        choice.append(found)
    return choice


# ---- the plan -------------------------------------------------------------------------------------
def starts(priced: Priced, graph: LayerGraph | None = None) -> list[list[int]]:
    """Descent's structured starts: for each strategy (its names on every mesh dimension), every layer
    that has it takes it and the others their cheapest candidate; and Megatron's column/row pairs in
    both phases.  A window of adjacent layers cannot move a transformer's residual stream from one
    layout to another (every block's adds at once), nor shift every column/row pair by one layer;
    a start that is there already can, and costs one descent each."""
    names = sorted({tuple(s.name for s in combo) for combos in priced.options for combo in combos})
    out = []
    for name in names:
        choice = []
        for v, combos in enumerate(priced.options):
            k = next((k for k, combo in enumerate(combos) if tuple(s.name for s in combo) == name), None)
            choice.append(k if k is not None else int(np.argmin(priced.problem.node_costs[v])))
        out.append(choice)
    if graph is not None:
        out += [c for c in (megatron(graph, priced), megatron(graph, priced, row_first=True)) if c is not None]
    return out


def solve(priced: Priced, how: str, graph: LayerGraph | None = None) -> tuple[search.Solution, dict[str, Any]]:
    """The chosen candidates, and what the search did (times, and the exact check for ``both``)."""
    if how not in SEARCHES:
        raise PlanError(f"--search must be one of {', '.join(SEARCHES)}, not {how!r}")
    notes: dict[str, Any] = {"method": how}
    began = time.perf_counter()
    if how == "exact":
        best = search.exact(priced.problem)
        notes["exact_s"] = time.perf_counter() - began
        return best, notes
    best = search.descent(priced.problem, window=DESCENT_WINDOW, starts=starts(priced, graph))
    notes["descent_s"] = time.perf_counter() - began
    if how == "both":
        began = time.perf_counter()
        optimum = search.exact(priced.problem)
        notes["exact_s"] = time.perf_counter() - began
        notes["exact_total_s"] = optimum.total
        gap = (best.total - optimum.total) / optimum.total if optimum.total > 0 else 0.0
        notes["descent_gap"] = gap
        if gap > BOTH_TOLERANCE:
            raise PlanError(f"coordinate descent's plan ({best.total * 1e3:.3f} ms) is {gap:.1%} worse than the exact "
                            f"optimum ({optimum.total * 1e3:.3f} ms): more than {BOTH_TOLERANCE:.0%}")
    return best, notes


def breakdown(priced: Priced, choice: list[int]) -> dict[str, Any]:
    """The predicted step: compute, conversions and sync seconds, and the collectives per step (each one
    group's: ``mesh_dim`` d < the mesh's dimensions is a group of that dimension, d = their number the
    group of all the mesh's ranks)."""
    ddp = priced.ddp if plain_ddp(priced, choice) else None
    compute = sum(priced.node_parts[v][s]["compute_s"] + (0.0 if ddp is not None else  # (DDP wraps no layer)
                                                           priced.node_parts[v][s].get("wrappers_s", 0.0))
                  for v, s in enumerate(choice))
    conversions = sum(float(m[choice[u], choice[v]]) for (u, v), m in priced.problem.edges.items())
    counter: Counter[tuple[str, int, int]] = Counter()
    if ddp is not None:  # DDP's buckets instead of each layer's own all-reduce
        sync = ddp.seconds
        for kind, nbytes, d, _ in ddp.collectives:
            counter[(kind, nbytes, d)] += 1
    else:
        sync = sum(priced.node_parts[v][s]["sync_s"] for v, s in enumerate(choice))
    for v, s in enumerate(choice):
        for kind, nbytes, d, _ in ([] if ddp is not None else priced.node_collectives[v][s]):
            counter[(kind, nbytes, d)] += 1
    for (u, v), lists in priced.collectives.items():
        kv = len(priced.options[v])
        for kind, nbytes, d, _ in lists[choice[u] * kv + choice[v]]:
            counter[(kind, nbytes, d)] += 1
    colls = [{"kind": k, "bytes": b, "mesh_dim": d, "count": n} for (k, b, d), n in sorted(counter.items())]
    out = {"step_s": compute + sync + conversions, "compute_s": compute, "conversions_s": conversions,
           "sync_s": sync, "collectives": colls}
    if ddp is not None:
        out["ddp_buckets"] = list(ddp.buckets)
    return out


def layer_rows(graph: LayerGraph, priced: Priced, choice: list[int]) -> list[dict[str, Any]]:
    """plan.json's layers for a choice (the solved one, or a baseline's): per layer its inputs (the
    graph's edges, which ``apply`` follows to convert partial outputs), strategy and layouts per dimension."""
    rows = []
    for i, layer in enumerate(graph.layers):
        combo = priced.options[i][choice[i]]
        rows.append({"name": layer.name, "kind": layer.kind, "inputs": list(layer.inputs),
                     "strategy": [s.name for s in combo], "input": [s.inp for s in combo],
                     "output": [s.out for s in combo], "sync": [s.sync for s in combo]})
    return rows


def _strategy_names(priced: Priced, choice: list[int]) -> list[list[str]]:
    """Each layer's strategy names per mesh dimension, as plan.json writes them."""
    return [[s.name for s in priced.options[i][c]] for i, c in enumerate(choice)]


def plan(graph: LayerGraph, mesh: Mesh, costs: CollectiveCosts, opts: Options, table_id: str = "") -> dict[str, Any]:
    """The plan as plan.json holds it."""
    priced = price(graph, mesh, costs, opts)
    best, notes = solve(priced, opts.search, graph)
    choice = best.choice
    picks = {"data_parallel": data_parallel(graph, priced), "megatron": megatron(graph, priced)}
    figures = {name: breakdown(priced, pick) for name, pick in picks.items() if pick is not None}
    searched = breakdown(priced, choice)["step_s"]
    dp = picks["data_parallel"]
    if dp is not None and dp != choice and figures["data_parallel"]["step_s"] < searched:
        choice = dp  # plain DDP's buckets cost less than a layer's all-reduce at a time (see the module)
        notes["ddp_baseline_chosen"] = True
    elif figures:
        # the faster baseline stays unless the search's choice is predicted at least min_gain faster: a
        # smaller gain is inside the predictions' error
        name = min(figures, key=lambda n: figures[n]["step_s"])
        if picks[name] != choice and searched > (1 - opts.min_gain) * figures[name]["step_s"]:
            notes["below_min_gain"] = {"min_gain": opts.min_gain, "searched_step_s": searched, "baseline": name,
                                       "searched_strategy": _strategy_names(priced, choice)}
            choice = picks[name]
    dims = mesh.dims()
    layers = layer_rows(graph, priced, choice)
    predicted = breakdown(priced, choice)
    baselines = {name: None if pick is None else {
        **figures[name], "strategy": _strategy_names(priced, pick),
        "layers": layer_rows(graph, priced, pick)}  # (what apply needs to set the baseline up)
        for name, pick in picks.items()}
    return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "mesh": {"shape": list(mesh.shape), "nproc_per_node": mesh.nproc_per_node, "gpu": mesh.gpu,
                     "dims": [{"name": d.name, "size": d.size, "nodes": d.nodes} for d in dims]},
            "table_id": table_id, "costs": costs.source, "model": graph.source, "batch_dim": graph.batch_dim,
            "search": notes,
            "compute": {"source": opts.compute_source or opts.compute, "convert_overhead_s": opts.convert_overhead_s,
                        "sync_overhead_s": opts.sync_overhead_s, "wrapper_overhead_s": opts.wrapper_overhead_s,
                        "wrapper_curves_s": opts.wrapper_curves_s},
            "layers": layers, "predicted": predicted, "baselines": baselines,
            **({"ddp_buckets": predicted["ddp_buckets"]} if "ddp_buckets" in predicted else {})}


def save(plan_json: dict[str, Any], path: Path) -> None:
    Path(path).write_text(json.dumps(plan_json, indent=1) + "\n")


def load(path: Path) -> dict[str, Any]:
    raw = read_json(path, "plan", PlanError)
    check_header(raw, str(path), PLAN_FORMAT, PLAN_VERSION, "plan", PlanError)
    return raw


def show(plan_json: dict[str, Any]) -> str:
    """The plan for people: per layer its strategy and layouts, then the predicted step beside the baselines."""
    lines = [f"plan for {plan_json.get('model') or 'a model'} on mesh "
             f"{'x'.join(map(str, plan_json['mesh']['shape']))} ({plan_json['mesh']['nproc_per_node']} ranks per node); "
             f"costs: {plan_json.get('costs')}"]
    if plan_json.get("batch_dim"):  # (a sequence-first model: S(1) splits the batch, S(0) the sequence)
        lines.append(f"the batch is dimension {plan_json['batch_dim']} of every activation (sequence-first)")
    names = [d["name"] for d in plan_json["mesh"]["dims"]]
    lines.append(f"{'layer':<28} {'kind':<10} " + " ".join(f"{n:<10}" for n in names) + "  in -> out")
    for layer in plan_json["layers"]:
        lines.append(f"{layer['name']:<28} {layer['kind']:<10} " + " ".join(f"{s:<10}" for s in layer["strategy"])
                     + f"  {','.join(layer['input'])} -> {','.join(layer['output'])}")
    lines.append(f"{'predicted per step (ms)':<28} {'step':>9} {'compute':>9} {'convert':>9} {'sync':>9}")
    rows = [("this plan", plan_json["predicted"])] + [(k, v) for k, v in plan_json["baselines"].items()]
    for name, fig in rows:
        if fig is None:
            lines.append(f"{name:<28} {'(does not fit)':>9}")
            continue
        lines.append(f"{name:<28} {fig['step_s'] * 1e3:9.3f} {fig['compute_s'] * 1e3:9.3f} "
                     f"{fig['conversions_s'] * 1e3:9.3f} {fig['sync_s'] * 1e3:9.3f}")
    return "\n".join(lines)
