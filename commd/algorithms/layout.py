"""Where an op's elements sit in a program's chunked buffers (uneven counts included).

A program speaks of chunks; the user hands tensors of ``count`` elements (``count`` as
torch defines it per collective: all_reduce and broadcast the tensor, all_gather the
input, reduce_scatter the output, all_to_all the input, cut in R blocks of count/R).
Each buffer of a rank is ``blocks`` user blocks (R = ngpus for the buffers
``ir.SCALED_BY_RANKS`` scales, else 1), each ``k`` chunks.

A block of ``n`` elements is split as the native ring splits a tensor: with ``base, rem =
divmod(n, k)``, its first ``rem`` chunks hold ``base + 1`` elements and the others
``base``, in order.  (So the ring program equals the native ring bit for bit at every
count, and no chunk is more than one element short of another.)  In *working* memory every
chunk has the same size ``q = ceil(n / k)``, so that a tile ``[lo, hi)`` of a chunk means
the same element range on every rank and in every buffer, and a transfer between chunks of
different indices always has matching sizes; a short chunk's tail is padding that no result
is read from.  When ``q·k == n`` nothing is padded and the user's memory itself can be the
working buffer (no copy); otherwise the user's blocks are copied in and out.

In-place programs alias their two buffers: all-reduce, broadcast and all-to-all use ``i``
as ``o``; reduce-scatter's ``o`` is block ``r`` of ``i`` (where NCCL puts an in-place
reduce-scatter's output); all-gather's ``i`` is block ``r`` of ``o``.  Custom collectives
have one block per buffer and split ``count`` over ``nchunksperloop`` chunks the same way
(``q = ceil(count / nchunksperloop)``); a buffer of ``C`` chunks holds the first ``C``
chunks of that split, and their buffers are never aliased (their postcondition names ``i``
and ``o`` apart).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import SCALED_BY_RANKS, Algorithm

#: Per collective: (input blocks scale with R, output blocks scale with R).
_SCALED = {"allreduce": (False, False), "broadcast": (False, False), "allgather": (False, True),
           "reducescatter": (True, False), "alltoall": (True, True)}


@dataclass(frozen=True)
class BufferLayout:
    """One buffer of one rank: ``chunks`` chunks of ``q`` working elements, ``blocks`` user blocks;
    in each block the first ``rem`` chunks hold ``base + 1`` user elements, the others ``base``."""

    chunks: int
    blocks: int
    base: int
    rem: int
    q: int

    @property
    def k(self) -> int:
        """Chunks per user block."""
        return self.chunks // self.blocks if self.blocks else 0

    @property
    def block_elements(self) -> int:
        return self.k * self.base + min(self.k, self.rem)

    @property
    def working_elements(self) -> int:
        return self.chunks * self.q

    @property
    def user_elements(self) -> int:
        return self.blocks * self.block_elements

    @property
    def padded(self) -> bool:
        """Whether the working buffer differs from the user's memory (then it is copied in and out)."""
        return self.k * self.q != self.block_elements

    def chunk_range(self, c: int) -> tuple[int, int]:
        """(user offset, elements) of chunk ``c`` of the buffer."""
        j, i = divmod(c, self.k)
        return j * self.block_elements + i * self.base + min(i, self.rem), self.base + (i < self.rem)

    def _pieces(self, user: np.ndarray, working: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """(user view, working view) pairs: the long chunks, then the short ones, of every block."""
        k, long = self.k, min(self.k, self.rem)
        if not self.blocks or not k:
            return []
        users = user.reshape(self.blocks, self.block_elements)
        works = working.reshape(self.blocks, k, self.q)
        cut = long * (self.base + 1)
        pieces = []
        if long:
            pieces.append((users[:, :cut].reshape(self.blocks, long, self.base + 1), works[:, :long, :self.base + 1]))
        if k > long:
            pieces.append((users[:, cut:].reshape(self.blocks, k - long, self.base), works[:, long:, :self.base]))
        return pieces

    def load(self, user: np.ndarray, working: np.ndarray) -> None:
        """Copy the user's elements into a (padded) working buffer."""
        for u, w in self._pieces(user, working):
            w[...] = u

    def store(self, working: np.ndarray, user: np.ndarray) -> None:
        """Copy a (padded) working buffer's elements back into the user's memory."""
        for u, w in self._pieces(user, working):
            u[...] = w


@dataclass(frozen=True)
class RankLayout:
    """How one rank's user input and output map onto its working ``i``, ``o`` and ``s``.

    ``alias`` is None (three separate buffers) or ``(inner, outer, chunk_offset)``: buffer
    ``inner`` is the chunks ``[chunk_offset, chunk_offset + inner.chunks)`` of ``outer``.
    """

    coll: str
    rank: int
    count: int
    q: int
    i: BufferLayout
    o: BufferLayout
    s: BufferLayout
    alias: tuple[str, str, int] | None

    def buffer(self, name: str) -> BufferLayout:
        return {"i": self.i, "o": self.o, "s": self.s}[name]

    @property
    def input_elements(self) -> int:
        return self.i.user_elements

    @property
    def output_elements(self) -> int:
        return self.o.user_elements


def _block_elements(coll: str, count: int, nranks: int, source: str) -> int:
    if coll == "alltoall":  # torch's count is the whole input, R blocks of count/R
        if count % nranks:
            raise ProgramError(f"an all-to-all over {nranks} ranks needs a count divisible by {nranks}, got {count}",
                               source=source)
        return count // nranks
    return count


def rank_layout(algo: Algorithm, rank: int, count: int, source: str = "<program>") -> RankLayout:
    """The layout of rank ``rank`` for an op of ``count`` elements; ProgramError if the program's
    chunk counts do not fit its collective."""
    if count < 0:
        raise ProgramError(f"count must be non-negative, got {count}", source=source)
    if not 0 <= rank < len(algo.ranks):
        raise ProgramError(f"no rank {rank} in a program of {len(algo.ranks)} ranks", source=source)
    decl = algo.ranks[rank]
    nranks = algo.ngpus
    if algo.coll == "custom":
        if algo.nchunksperloop <= 0:
            raise ProgramError(f"nchunksperloop must be positive, got {algo.nchunksperloop}", source=source)
        base, rem = divmod(count, algo.nchunksperloop)
        q = base + (rem > 0)
        bufs = [BufferLayout(c, 1, base, rem, q) for c in (decl.i_chunks, decl.o_chunks)]
        return RankLayout(algo.coll, rank, count, q, bufs[0], bufs[1], BufferLayout(decl.s_chunks, 1, 0, 0, q), None)
    if algo.coll not in _SCALED:
        raise ProgramError(f"unknown collective {algo.coll!r}", source=source)
    scaled_i, scaled_o = _SCALED[algo.coll]
    assert (scaled_i or scaled_o) == (algo.coll in SCALED_BY_RANKS)
    blocks_i, blocks_o = (nranks if scaled_i else 1), (nranks if scaled_o else 1)
    ks = set()
    for name, declared, blocks in (("i", decl.i_chunks, blocks_i), ("o", decl.o_chunks, blocks_o)):
        if declared:
            if declared % blocks:
                raise ProgramError(f"{algo.coll} over {nranks} ranks needs {name}_chunks divisible by {blocks}, "
                                   f"got {declared}", source=source, rank=rank)
            ks.add(declared // blocks)
    if len(ks) != 1:
        raise ProgramError(f"{algo.coll}: i_chunks {decl.i_chunks} and o_chunks {decl.o_chunks} do not give one "
                           f"chunk count per block (input blocks {blocks_i}, output blocks {blocks_o})",
                           source=source, rank=rank)
    k = ks.pop()
    block_elements = _block_elements(algo.coll, count, nranks, source)
    base, rem = divmod(block_elements, k)
    q = base + (rem > 0)
    i = BufferLayout(blocks_i * k, blocks_i, base, rem, q)
    o = BufferLayout(blocks_o * k, blocks_o, base, rem, q)
    s = BufferLayout(decl.s_chunks, 1, 0, 0, q)
    alias: tuple[str, str, int] | None = None
    if algo.inplace:
        if algo.coll == "allgather":
            alias = ("i", "o", rank * k)
        elif algo.coll == "reducescatter":
            alias = ("o", "i", rank * k)
        else:
            alias = ("o", "i", 0)
    return RankLayout(algo.coll, rank, count, q, i, o, s, alias)


def check_ranks(algo: Algorithm, source: str) -> None:
    """ProgramError unless the ranks are numbered 0..ngpus-1 in order (positions are rank ids)."""
    if algo.ngpus != len(algo.ranks) or [r.id for r in algo.ranks] != list(range(len(algo.ranks))):
        raise ProgramError(f"ngpus={algo.ngpus} but the ranks are {[r.id for r in algo.ranks]} (want 0..ngpus-1)",
                           source=source)


def layouts_for(algo: Algorithm, count: int, source: str = "<program>") -> dict[int, RankLayout]:
    """Every rank's layout; ProgramError unless all chunks hold the same number of elements."""
    check_ranks(algo, source)
    layouts = {r.id: rank_layout(algo, r.id, count, source) for r in algo.ranks}
    qs = {lay.q for lay in layouts.values()}
    if len(qs) > 1:
        raise ProgramError(f"ranks disagree on the chunk size ({sorted(qs)} elements for count {count}): their "
                           "chunk counts do not describe the same collective", source=source)
    return layouts


def writes_input(algo: Algorithm, rank: int) -> bool:
    """Whether any step of ``rank`` writes its ``i`` buffer (then the user's input is copied first)."""
    return any(step.type.writes_dst and step.dstbuf == "i"
               for tb in algo.ranks[rank].threadblocks for step in tb.steps)


def working_bound(layout: RankLayout) -> int:
    """The most elements :func:`allocate` asks its ``zeros`` for in one run (scratch and the
    working copies it may need), so that a caller can keep that much between runs."""
    if layout.alias is None:
        return layout.s.working_elements + layout.i.working_elements + layout.o.working_elements
    return layout.s.working_elements + layout.buffer(layout.alias[1]).working_elements


def allocate(layout: RankLayout, dtype: np.dtype, inp: np.ndarray, out: np.ndarray,
             writes_input: bool, zeros: Callable[[int], np.ndarray] | None = None,
             ) -> tuple[dict[str, np.ndarray], list[tuple[BufferLayout, np.ndarray, np.ndarray]]]:
    """Working buffers for one run, loaded with the user's input: ``({"i", "o", "s": array},
    stores)``, where each ``(buffer, working, user)`` of ``stores`` is copied back into the
    user's memory once the run is over.  The user's memory is used directly where no padding
    is needed; ``inp`` is never written (a copy is made if the program writes ``i``, or if an
    out-of-place program is handed one array as both input and output).

    ``zeros(n)``: a zero-filled array of ``n`` elements of ``dtype`` (default: a fresh one; the
    interpreter hands out memory it keeps between runs, already faulted in, at most
    :func:`working_bound` elements in all)."""
    if inp.shape != (layout.input_elements,) or out.shape != (layout.output_elements,):
        raise ValueError(f"rank {layout.rank}: input/output of {inp.shape}/{out.shape} elements, the layout wants "
                         f"({layout.input_elements},)/({layout.output_elements},)")
    if zeros is None:
        def zeros(n: int) -> np.ndarray:
            return np.zeros(n, dtype)
    stores: list[tuple[BufferLayout, np.ndarray, np.ndarray]] = []
    scratch = zeros(layout.s.working_elements)
    if layout.alias is None:
        if layout.i.padded or (layout.i.user_elements and (writes_input or np.shares_memory(inp, out))):
            work_i = zeros(layout.i.working_elements)
            layout.i.load(inp, work_i)
        else:
            work_i = inp
        if layout.o.padded:
            work_o = zeros(layout.o.working_elements)
            stores.append((layout.o, work_o, out))
        else:
            work_o = out
        return {"i": work_i, "o": work_o, "s": scratch}, stores
    inner, outer, offset = layout.alias
    outer_layout = layout.buffer(outer)
    view = slice(offset * layout.q, (offset + layout.buffer(inner).chunks) * layout.q)
    # compute in the user's output itself when it is the whole aliased buffer, unpadded
    # (all-gather's output; all-reduce's, broadcast's and all-to-all's, the size of the input)
    if not outer_layout.padded and (outer == "o" or (offset == 0 and outer_layout.user_elements == out.size)):
        big = out
    else:
        big = zeros(outer_layout.working_elements)
    work = {outer: big, inner: big[view], "s": scratch}
    if not _same_memory(inp, work["i"]):
        layout.i.load(inp, work["i"])
    if big is not out:
        stores.append((layout.o, work["o"], out))
    return work, stores


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same elements (an in-place call: nothing to copy)."""
    return a.size == b.size and a.dtype == b.dtype and (a.size == 0 or address(a) == address(b))


def address(a: np.ndarray) -> int:
    """The address of ``a``'s first element (``a.ctypes.data`` costs a ctypes object per call)."""
    return a.__array_interface__["data"][0]


def finish(stores: list[tuple[BufferLayout, np.ndarray, np.ndarray]]) -> None:
    """Copy the padded working buffers' results into the user's memory."""
    for buffer, working, user in stores:
        buffer.store(working, user)
