"""One op at one size on one rank: its buffers, their contents, and the check against NumPy.

Every rank fills its input from its rank and the element index only
(``pattern``), so each rank can compute every other rank's input, and so the
exact expected result, without communicating.  The values are small integers:
sums over many ranks stay exact in every benchmarked dtype, so the check is
an exact comparison.  Buffers are allocated by the measured path (arena
tensors for commd, ordinary tensors for Gloo, NumPy arrays for MPI); a case
only sees them through NumPy views.

The uneven all-to-all (``alltoallv``) has a fixed skew (``skew``): rank r sends rank
j ``1 + (r + 2j) mod (n + 1)`` units of ``base`` elements, so the ranks send (and
receive) different totals and, with the ranks placed node by node, the nodes send
each other different bytes (what makes the coordinator decide it by its alltoallv
cells).  S is the largest buffer of any rank, input or output (the size the
coordinator looks the op up by): with W that buffer in units, ``base`` = S / itemsize
// W, and the first rank whose buffer is W units keeps the remainder (under W
elements) in the block it sends itself, so that its buffer holds exactly S.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from commd.bench.spec import ROOT

#: alloc(count) -> (native buffer the path's library takes, NumPy view of the same memory)
Alloc = Callable[[int], tuple[Any, np.ndarray]]
#: Marks output elements not yet written: a result the op never delivered fails the check.
SENTINEL = -1


def pattern(rank: int, start: int, count: int) -> np.ndarray:
    """Rank ``rank``'s input elements [start, start+count) as float64 (exact small integers)."""
    index = np.arange(start, start + count, dtype=np.int64)
    return ((index % 13) + 3 * rank + 1).astype(np.float64)


def model_like(count: int, seed: int = 0) -> np.ndarray:
    """Weights as a model holds them: N(0, 0.02), one value in 97 a hundred times larger (float32 values)."""
    values = (np.random.default_rng([count, seed]).standard_normal(count) * 0.02).astype(np.float32)
    values[::97] *= 100
    return values


def skew(src: int, dst: int, world: int) -> int:
    """alltoallv's block from rank ``src`` to rank ``dst``, in units (1 to world + 1): uneven per rank
    and, for ranks placed node by node on 2 or more nodes, node to node too."""
    return 1 + (src + 2 * dst) % (world + 1)


def alltoallv_splits(world: int, elements: int) -> list[list[int]] | None:
    """``splits[src][dst]``: the elements rank src sends rank dst in an alltoallv whose largest buffer
    (input or output) holds ``elements``; None if that is less than one element per unit."""
    units = [[skew(src, dst, world) for dst in range(world)] for src in range(world)]
    largest = [max(sum(units[r]), sum(row[r] for row in units)) for r in range(world)]
    most = max(largest)
    base = elements // most
    if base < 1:
        return None
    splits = [[base * u for u in row] for row in units]
    keeper = largest.index(most)
    splits[keeper][keeper] += elements - base * most  # its input and output grow to exactly ``elements``
    return splits


class CheckError(Exception):
    """A wrong result; the message names op, size, path and rank."""


@dataclass
class Case:
    """Buffers of one op on one rank; ``nbytes`` is S as nccl-tests define it (the op's total buffer;
    alltoallv: the largest buffer of any rank)."""

    op: str
    rank: int
    world: int
    count: int  # elements per rank's block (allgather, reduce_scatter, alltoall) or of the whole buffer
    #            (alltoallv: of this rank's input)
    nbytes: int
    #: alltoallv: ``splits[src][dst]``, the elements rank src sends rank dst (``alltoallv_splits``)
    splits: list[list[int]] = field(default_factory=list)
    native: dict[str, Any] = field(default_factory=dict)
    view: dict[str, np.ndarray] = field(default_factory=dict)
    #: a compressed op's codec (``commd.codecs``): model-like data instead of ``pattern``, whose small
    #: integers any codec would shrink to nothing
    codec: str | None = None
    #: model-like data though no codec is named (the plain and automatic paths of a run that compresses,
    #: so that they move what the codec paths move)
    model: bool = False

    @property
    def model_data(self) -> bool:
        return bool(self.codec) or self.model

    @property
    def last(self) -> int:
        return self.world - 1

    @property
    def splits_in(self) -> list[int]:
        """alltoallv: the elements this rank sends each rank."""
        return self.splits[self.rank]

    @property
    def splits_out(self) -> list[int]:
        """alltoallv: the elements this rank receives from each rank."""
        return [row[self.rank] for row in self.splits]

    def fill(self) -> None:
        """Inputs from ``pattern``; outputs to the sentinel."""
        r, n, c = self.rank, self.world, self.count
        v = self.view
        if self.op == "allreduce" and self.model_data:
            v["buf"][:] = model_like(c, r)
        elif self.op in ("allreduce", "reduce"):
            v["buf"][:] = pattern(r, 0, c)
        elif self.op == "broadcast":
            source = model_like(c) if self.model_data else pattern(ROOT, 0, c)
            v["buf"][:] = source if r == ROOT else SENTINEL
        elif self.op == "allgather":
            v["in"][:] = model_like(c, r) if self.model_data else pattern(r, r * c, c)
            v["out"][:] = SENTINEL
        elif self.op in ("reduce_scatter", "alltoall"):
            v["in"][:] = pattern(r, 0, c * n)
            v["out"][:] = SENTINEL
        elif self.op == "alltoallv":
            v["in"][:] = pattern(r, 0, sum(self.splits_in))
            v["out"][:] = SENTINEL
        elif self.op == "sendrecv":
            v["send"][:] = pattern(ROOT, 0, c)
            v["recv"][:] = SENTINEL
        elif self.op == "alltonext":
            v["in"][:] = pattern(r, 0, c)
            v["out"][:] = SENTINEL

    def expected(self) -> dict[str, np.ndarray]:
        """The buffers this rank must hold after one op, computed with NumPy."""
        r, n, c = self.rank, self.world, self.count
        if self.op == "allreduce" and self.model_data:
            return {"buf": sum(model_like(c, j).astype(np.float64) for j in range(n))}
        if self.op == "allreduce" or (self.op == "reduce" and r == ROOT):
            return {"buf": sum(pattern(j, 0, c) for j in range(n))}
        if self.op in ("broadcast", "allgather") and self.model_data:
            blocks = [model_like(c)] if self.op == "broadcast" else [model_like(c, j) for j in range(n)]
            want = np.concatenate(blocks)
            if self.codec:
                from commd.codecs import parse_choice

                parse_choice(self.codec)[0].round_in_place(want)  # what a lossy codec delivers (lossless: nothing)
            return {"buf" if self.op == "broadcast" else "out": want.astype(np.float64)}
        if self.op == "broadcast":
            return {"buf": pattern(ROOT, 0, c)}
        if self.op == "allgather":
            return {"out": np.concatenate([pattern(j, j * c, c) for j in range(n)])}
        if self.op == "reduce_scatter":
            return {"out": sum(pattern(j, r * c, c) for j in range(n))}
        if self.op == "alltoall":
            return {"out": np.concatenate([pattern(j, r * c, c) for j in range(n)])}
        if self.op == "alltoallv":  # rank j's block to r starts after its blocks to ranks 0..r-1
            s = self.splits
            return {"out": np.concatenate([pattern(j, sum(s[j][:r]), s[j][r]) for j in range(n)])}
        if self.op == "alltonext":  # rank 0's output is left as it was
            return {"out": pattern(r - 1, 0, c) if r else np.full(c, float(SENTINEL))}
        if self.op == "sendrecv" and r in (ROOT, self.last):
            return {"recv": pattern(ROOT, 0, c)}  # the last rank receives it, rank 0 gets it echoed back
        return {}

    def check(self, label: str) -> str | None:
        """None if every checked buffer equals the reference, else a message naming op, size, path, rank."""
        for name, want in self.expected().items():
            got = self.view[name].astype(np.float64)
            bad = np.flatnonzero(np.abs(got - want) > self.tolerance()) if self.op == "allreduce" and self.model_data \
                else np.flatnonzero(got != want)
            if bad.size:
                i = int(bad[0])
                return (f"wrong result: {self.op} S={self.nbytes} B path {label} on rank {self.rank}: "
                        f"{bad.size} of {want.size} elements of '{name}' differ from the NumPy reference, "
                        f"first at index {i}: {got[i]:g} != {want[i]:g}")
        return None

    def tolerance(self) -> np.ndarray:
        """How far a float32 all-reduce of model-like data may be from the exact sum, per element: one
        rounding per hop of float32's and of the codec's (relative to the sum of magnitudes), and the
        codec's absolute bound per hop."""
        n, c = self.world, self.count
        rel, absolute = 0.0, 0.0
        if self.codec:
            from commd.codecs import parse_choice

            rel, absolute = parse_choice(self.codec)[0].error_bound("float32")
        magnitudes = sum(np.abs(model_like(c, j).astype(np.float64)) for j in range(n))
        return n * (rel + 2.0 ** -23) * magnitudes + n * absolute

    def prepare_timing(self) -> None:
        """Reductions run in place over and over: start them from zeros so the values stay finite (but a
        compressed one from its model-like data: zeros would code to nothing; n^iterations stays finite)."""
        if self.op in ("allreduce", "reduce") and not self.model_data:
            self.view["buf"][:] = 0


def make_case(op: str, nbytes: int, rank: int, world: int, itemsize: int, alloc: Alloc,
              codec: str | None = None, model: bool = False) -> Case | None:
    """Buffers for ``op`` at requested size ``nbytes``; None if the size holds less than one element per rank
    (alltoallv: per unit of its skew)."""
    if op == "barrier":
        return Case(op, rank, world, 0, 0)
    if op == "alltoallv":
        splits = alltoallv_splits(world, nbytes // itemsize)
        if splits is None:
            return None
        mine = sum(splits[rank])
        case = Case(op, rank, world, mine, nbytes // itemsize * itemsize, splits=splits)
        for name, n in (("in", mine), ("out", sum(row[rank] for row in splits))):
            case.native[name], case.view[name] = alloc(n)
        return case
    per_rank = op in ("allgather", "reduce_scatter", "alltoall")
    count = nbytes // itemsize // (world if per_rank else 1)
    if count < 1:
        return None
    total = count * world if per_rank else count
    case = Case(op, rank, world, count, total * itemsize, codec=codec, model=model)
    if op in ("allreduce", "reduce", "broadcast"):
        names = {"buf": count}
    elif op == "allgather":
        names = {"in": count, "out": total}
    elif op in ("reduce_scatter", "alltoall"):
        names = {"in": total, "out": count if op == "reduce_scatter" else total}
    elif op == "sendrecv":
        names = {"send": count, "recv": count}
    elif op == "alltonext":
        names = {"in": count, "out": count}
    else:  # pragma: no cover - spec validated the op
        raise ValueError(f"unknown op {op!r}")
    for name, n in names.items():
        case.native[name], case.view[name] = alloc(n)
    return case
