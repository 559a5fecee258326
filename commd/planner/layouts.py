"""SBP layouts, the strategies a layer may take on one mesh dimension, and the collectives that
convert one layout into another.

A tensor's layout on one mesh dimension of n ranks is ``B`` (broadcast: every rank holds all of
it), ``S(k)`` (split: rank r holds the r-th n-th along dimension k) or ``P`` (partial: the tensor is
the sum of the ranks' tensors).  A strategy says which layout a layer takes its input in, which it
gives its output in, and which its backward pass gives its input's gradient in (Megatron's column
layer takes ``B`` and gives its input's gradient as ``P``: the all-reduce in its backward pass).

Converting layouts (``conversion``) costs collectives over the dimension's groups; ``nbytes`` is
always the whole tensor's bytes as that group sees it:

| from → to | collective |
|---|---|
| equal, or → ``P``, or ``B`` → ``S(k)`` | none (a local slice or nothing) |
| ``P`` → ``B`` | all-reduce |
| ``P`` → ``S(k)`` | reduce-scatter |
| ``S(i)`` → ``B`` | all-gather |
| ``S(i)`` → ``S(j)`` | an all-gather then a slice (CPU meshes: torch's DTensor issues no all-to-all there); an all-to-all of the tensor on GPU meshes |
"""

from __future__ import annotations

from dataclasses import dataclass

from commd.planner.graph import Layer

B, P = "B", "P"


def split(dim: int) -> str:
    return f"S({dim})"


def split_dim(layout: str) -> int | None:
    """k for ``S(k)``; None for ``B`` and ``P``."""
    return int(layout[2:-1]) if layout.startswith("S(") else None


#: Ways of synchronising parameter gradients on a dimension whose ranks see different data.
SYNC_NONE, SYNC_DDP, SYNC_FSDP = "none", "ddp", "fsdp"


@dataclass(frozen=True)
class Strategy:
    """One layer's strategy on one mesh dimension."""

    name: str
    inp: str  # the layout each input must arrive in
    out: str  # the layout of its output
    in_grad: str  # the layout of the gradient its backward pass gives each input
    compute_share: float  # the part of the layer's work each rank does (1 / n or 1)
    param_share: float  # the part of the parameters each rank holds
    sync: str = SYNC_NONE  # how parameter gradients are synchronised across this dimension
    #: whether ``commd.planner.apply`` can set it up through DTensor (plans are made of those only,
    #: unless asked otherwise; the rest stay for pricing what DTensor cannot express)
    appliable: bool = True


def conversion(src: str, dst: str, nbytes: int, gpu: bool = False) -> list[tuple[str, int]]:
    """The collectives (kind, bytes) that turn a tensor laid out ``src`` into ``dst`` on one dimension."""
    if src == dst or dst == P or src == B:
        return []
    if src == P:
        return [("allreduce", nbytes)] if dst == B else [("reduce_scatter", nbytes)]
    if dst == B:
        return [("allgather", nbytes)]
    return [("alltoall", nbytes)] if gpu else [("allgather", nbytes)]


def sync_collectives(sync: str, param_bytes: int) -> list[tuple[str, int]]:
    """A step's parameter synchronisation: DDP all-reduces the gradients; FSDP all-gathers the
    parameters before the forward and the backward pass and reduce-scatters the gradients."""
    if sync == SYNC_DDP:
        return [("allreduce", param_bytes)]
    if sync == SYNC_FSDP:
        return [("allgather", param_bytes), ("allgather", param_bytes), ("reduce_scatter", param_bytes)]
    return []


def feature_dim(layer: Layer) -> int:
    """The dimension a layer's features live on: channels (1) for convolutions, the last otherwise."""
    return 1 if layer.kind == "conv2d" or (layer.kind == "follow" and len(layer.out_shape) == 4) else \
        len(layer.out_shape) - 1


def candidates(layer: Layer, in_ndim: int, n: int, role: str, batch_dim: int = 0) -> list[Strategy]:
    """Every strategy of ``layer`` on a dimension of ``n`` ranks.  ``role``: ``"data"`` (the data-parallel
    dimension of a 2-D mesh: the batch is split, parameters synchronised), ``"model"`` (the other one)
    or ``"any"`` (a 1-D mesh): every strategy, data parallel ones too (on a 2-D mesh: data parallel
    over both dimensions).  ``batch_dim``: the activations' batch dimension (0, or 1 sequence-first: a
    3-D activation's sequence is then dimension 0)."""
    share = 1.0 / n
    out_ndim = len(layer.out_shape)
    batch, seq = split(batch_dim), split(1 - batch_dim)
    data: list[Strategy] = []
    model: list[Strategy] = []
    kind = layer.kind
    if kind == "input":
        data = [Strategy("dp", B, batch, B, 1.0, 1.0)]
        model = [Strategy("rep", B, B, B, 1.0, 1.0)]
        if out_ndim == 3:
            model.append(Strategy("seq", B, seq, B, 1.0, 1.0))
    elif kind == "output":
        data = [Strategy("dp", batch, batch, batch, share, 1.0)]
        model = [Strategy("rep", B, B, B, 1.0, 1.0)]
        if in_ndim == 3:
            model.append(Strategy("seq", seq, seq, seq, share, 1.0))
    elif kind == "follow":
        data = [Strategy("dp", batch, batch, batch, share, 1.0)]
        model = [Strategy("rep", B, B, B, 1.0, 1.0)]
        # a split survives where the layer keeps (or moves) its dimension: attrs "dims" (traced views,
        # reshapes, transposes) says where each input dimension goes; otherwise dimensions stay put
        dims = layer.attrs.get("dims") or list(range(min(in_ndim, out_ndim)))
        for dim, to in enumerate(dims[:in_ndim]):
            if dim != batch_dim and to is not None and to != batch_dim and layer.out_shape[to] % n == 0:
                model.append(Strategy(f"split{dim}", split(dim), split(to), split(dim), share, 1.0))
        if layer.attrs.get("linear"):  # a residual add or a scaling: sums of parts are parts of the sum
            model.append(Strategy("partial", P, P, P, share, 1.0, appliable=False))  # (styles hand on local tensors)
    else:
        sync_share = 1.0
        data = [Strategy("dp", batch, batch, batch, share, sync_share, SYNC_DDP),
                Strategy("fsdp", batch, batch, batch, share, share, SYNC_FSDP)]
        model = [Strategy("rep", B, B, B, 1.0, 1.0)]
        if out_ndim == 3 and kind in ("linear", "layernorm"):  # token-wise: the sequence splits
            model.append(Strategy("seq", seq, seq, seq, share, 1.0, SYNC_DDP))
        feat_in, feat_out = in_ndim - 1 if kind != "conv2d" else 1, feature_dim(layer)
        if kind in ("linear", "conv2d"):
            conv = kind == "conv2d"  # (DTensor has no style that splits a convolution)
            model.append(Strategy("col", B, split(feat_out), P, share, share, appliable=not conv))
            model.append(Strategy("row", split(feat_in), P, split(feat_in), share, share, appliable=not conv))
        elif kind == "embedding":
            model.append(Strategy("col", B, split(feat_out), B, share, share))  # embedding dim split
            model.append(Strategy("vocab", B, P, B, share, share))  # rows split: each rank looks its own up
        elif kind == "attention":
            # Megatron: qkv columns, output rows (DTensor cannot split nn.MultiheadAttention's packed in_proj)
            model.append(Strategy("heads", B, P, P, share, share, appliable=False))
    return data if role == "data" else data + model
