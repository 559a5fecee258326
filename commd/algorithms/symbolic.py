"""One symbolic run of a program at chunk granularity: what each chunk ends up holding, as a tree.

The runtime runs the same program on every tile of the op, so following whole chunks is
enough.  A value is an expression: a leaf (a chunk of the initial state) or the reduction
of two values.  Expressions are interned in one :class:`Expressions` table per run, up to
commutativity only — a reduce node's children are ordered by their ids — so two chunks hold
bit-identical results on every runtime exactly when they hold the same :class:`Expr`
object.  Associativity is deliberately not used: for floats ``(a+b)+c`` and ``a+(b+c)``
differ in their last bits.

Interning keeps the cost linear in the steps even for a program that reduces a chunk with
itself over and over (its tree doubles at each step; its table entry does not).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from commd.algorithms.ir import Algorithm, Step, StepType
from commd.algorithms.postcondition import ChunkRef


class StepRef(NamedTuple):
    """A step of a program: (rank, threadblock id, step index)."""

    rank: int
    tb: int
    step: int

    def short(self) -> str:
        return f"rank {self.rank} tb {self.tb} step {self.step}"


class Expr:
    """A value: a leaf (``source``) or the reduction of ``children`` (ordered by id: canonical).

    ``mask`` has one bit per distinct leaf (bit positions from the table), ``size`` counts
    the leaves with repetition: the value is a reduction of distinct leaves each taken once
    exactly when ``size`` equals the number of bits in ``mask``.
    """

    __slots__ = ("id", "source", "children", "mask", "size", "first")

    def __init__(self, id: int, source: ChunkRef | None, children: tuple[Expr, ...], mask: int, size: int) -> None:
        self.id = id
        self.source = source
        self.children = children
        self.mask = mask
        self.size = size
        #: the smallest leaf: with ``size``, orders a node's children when shown (ids depend on the run)
        self.first: ChunkRef = source if source is not None else min(c.first for c in children)

    @property
    def is_leaf(self) -> bool:
        return self.source is not None

    def render(self, limit: int = 160) -> str:
        """The canonical form as text (``r0.i3`` a leaf, ``(x+y)`` a reduction), cut at ``limit``.

        Of two children the larger is shown first (then the one with the smaller leaf), so a
        left-deep sum reads ``((a+b)+c)`` whatever order the run built it in.
        """
        out: list[str] = []
        budget = [limit]

        def walk(e: Expr) -> None:
            if budget[0] <= 0:
                return
            if e.source is not None:
                piece = e.source.short()
                out.append(piece)
                budget[0] -= len(piece)
                return
            a, b = sorted(e.children, key=lambda c: (-c.size, c.first))
            out.append("(")
            walk(a)
            out.append("+")
            walk(b)
            out.append(")")
            budget[0] -= 3

        walk(self)
        text = "".join(out)
        return text if budget[0] > 0 and len(text) <= limit else text[:limit] + "…"

    def __repr__(self) -> str:
        return f"Expr({self.render()})"


class Expressions:
    """The intern table of one run: equal canonical trees are the same object."""

    def __init__(self) -> None:
        self._leaves: dict[ChunkRef, Expr] = {}
        self._reduces: dict[tuple[int, int], Expr] = {}
        self._bit: dict[ChunkRef, int] = {}
        self._count = 0

    def leaf(self, ref: ChunkRef) -> Expr:
        e = self._leaves.get(ref)
        if e is None:
            bit = self._bit.setdefault(ref, len(self._bit))
            e = self._leaves[ref] = Expr(self._next(), ref, (), 1 << bit, 1)
        return e

    def reduce(self, a: Expr, b: Expr) -> Expr:
        if a.id > b.id:
            a, b = b, a
        e = self._reduces.get((a.id, b.id))
        if e is None:
            e = self._reduces[(a.id, b.id)] = Expr(self._next(), None, (a, b), a.mask | b.mask, a.size + b.size)
        return e

    def mask_of(self, refs: Iterable[ChunkRef]) -> int:
        """The leaf mask of a set of initial chunks (a chunk no value ever used gets a fresh bit)."""
        m = 0
        for ref in refs:
            m |= 1 << self._bit.setdefault(ref, len(self._bit))
        return m

    def _next(self) -> int:
        self._count += 1
        return self._count


@dataclass(frozen=True)
class SymbolicState:
    """The end of the run: the value of every chunk that was written, and its last writer."""

    table: Expressions
    values: Mapping[ChunkRef, Expr]
    last_writer: Mapping[ChunkRef, StepRef]

    def value(self, ref: ChunkRef) -> Expr:
        """What ``ref`` holds at the end (its initial value if no step wrote it)."""
        got = self.values.get(ref)
        return got if got is not None else self.table.leaf(ref)


def run(algo: Algorithm, order: Sequence[StepRef], received_from: Mapping[StepRef, StepRef]) -> SymbolicState:
    """Run the steps of ``algo`` in ``order`` (a topological order of happens-before).

    ``received_from`` maps every receiving step to its matched send; the send comes first
    in ``order``, so the values it sent are known when the receive runs.
    """
    table = Expressions()
    values: dict[ChunkRef, Expr] = {}
    last_writer: dict[ChunkRef, StepRef] = {}
    sent: dict[StepRef, list[Expr]] = {}
    tbs = {(rank.id, tb.id): tb for rank in algo.ranks for tb in rank.threadblocks}

    def read(rank: int, buf: str, off: int, cnt: int) -> list[Expr]:
        out = []
        for c in range(off, off + cnt):
            ref = ChunkRef(rank, buf, c)
            got = values.get(ref)
            out.append(got if got is not None else table.leaf(ref))
        return out

    for ref in order:
        step: Step = tbs[(ref.rank, ref.tb)].steps[ref.step]
        t = step.type
        if t is StepType.NOP:
            continue
        r = ref.rank
        received = sent[received_from[ref]] if t.receives else None
        local = read(r, step.srcbuf, step.srcoff, step.cnt) if t.reads_src else None
        if t is StepType.REDUCE:
            assert local is not None
            dst = read(r, step.dstbuf, step.dstoff, step.cnt)
            result = [table.reduce(d, s) for d, s in zip(dst, local, strict=True)]
        elif t.reduces:
            assert local is not None and received is not None
            result = [table.reduce(s, x) for s, x in zip(local, received, strict=True)]
        elif received is not None:
            result = received
        else:
            assert local is not None
            result = local
        if t.sends:
            sent[ref] = result
        if t.writes_dst:
            for c, value in enumerate(result, start=step.dstoff):
                slot = ChunkRef(r, step.dstbuf, c)
                values[slot] = value
                last_writer[slot] = ref
    return SymbolicState(table, values, last_writer)
