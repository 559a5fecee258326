"""The DSL's collectives: what each rank's buffers hold before a program runs, and what they must hold after.

A collective is named as in MSCCLang (``AllReduce(num_ranks, chunk_factor, inplace)`` …) so
that programs written for msccl-tools port by changing their imports; a program may also
subclass :class:`Collective` as MSCCLang programs do (``init_buffers`` and ``check``), or
state its postcondition explicitly with :class:`Custom`.  Chunk values are symbolic:
:class:`Chunk` is one rank's input chunk, :class:`ReduceChunk` the reduction of several.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class Buffer(enum.StrEnum):
    """The three buffers of MSCCLang; any other string names a scratch buffer of its own."""

    input = "i"
    output = "o"
    scratch = "s"


@dataclass
class Chunk:
    """Input chunk ``origin_index`` of rank ``origin_rank`` (MSCCLang's precondition value)."""

    origin_rank: int
    origin_index: int
    dst_rank: int = -1
    dst_index: int = -1

    def reduce(self, dst: int, chunk: Chunk | ReduceChunk) -> ReduceChunk:
        if isinstance(chunk, ReduceChunk):
            return chunk.reduce(dst, self)
        return ReduceChunk(dst, [self, chunk])

    def key(self) -> tuple[int, int]:
        return (self.origin_rank, self.origin_index)

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Chunk) and self.key() == other.key()

    def __lt__(self, other: Chunk) -> bool:
        return self.key() < other.key()


@dataclass
class ReduceChunk:
    """The reduction of ``chunks`` (equal when the same multiset of input chunks is reduced)."""

    creation_rank: int
    chunks: list[Chunk] = field(default_factory=list)

    def reduce(self, dst: int, chunk: Chunk | ReduceChunk) -> ReduceChunk:
        more = chunk.chunks if isinstance(chunk, ReduceChunk) else [chunk]
        return ReduceChunk(self.creation_rank, self.chunks + list(more))

    def sort(self) -> None:
        self.chunks.sort()

    def __hash__(self) -> int:
        return hash(tuple(sorted(c.key() for c in self.chunks)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReduceChunk) and Counter(c.key() for c in self.chunks) == Counter(
            c.key() for c in other.chunks)


Value = Chunk | ReduceChunk | None


def reduction(chunks: Sequence[Chunk]) -> ReduceChunk:
    """The value a reduction of ``chunks`` must end with (order does not matter)."""
    return ReduceChunk(-1, list(chunks))


def _sources(value: Value) -> list[dict[str, Any]] | dict[str, Any] | None:
    if isinstance(value, Chunk):
        return {"rank": value.origin_rank, "buf": "i", "index": value.origin_index}
    if isinstance(value, ReduceChunk):
        return [{"rank": c.origin_rank, "buf": "i", "index": c.origin_index} for c in value.chunks]
    return None


class Collective:
    """A collective: the buffers' initial values (``init_buffers``) and the expected final ones.

    Subclasses state ``expected()``: for each (rank, buffer, index) that the collective
    defines, the value it must end with; ``check`` compares the program's final buffers
    with it.  MSCCLang-style subclasses may instead override ``check(prog)`` themselves.
    """

    #: The IR's name for the collective (``ir.COLLECTIVES``).
    ir_name = "custom"

    def __init__(self, num_ranks: int, chunk_factor: int, inplace: bool) -> None:
        self.num_ranks = num_ranks
        self.chunk_factor = chunk_factor
        self.inplace = inplace
        self.name = "custom"

    def init_buffers(self) -> list[dict[Any, list[Value]]]:
        """Per rank, ``{Buffer.input: [...], Buffer.output: [...]}`` (None: holds nothing yet)."""
        raise NotImplementedError

    def expected(self) -> dict[tuple[int, str, int], Value]:
        """(rank, "i"/"o", index) → the value it must hold at the end (in IR buffer names)."""
        return {}

    def get_buffer_index(self, rank: int, buffer: Any, index: int) -> tuple[Any, int]:
        """Where a (buffer, index) really lives: in-place collectives alias one buffer into another."""
        return buffer, index

    def check(self, prog: Any) -> bool:
        """Whether ``prog``'s final buffers satisfy the postcondition; prints each mismatch."""
        correct = True
        for (rank, buf, index), want in sorted(self.expected().items()):
            name = Buffer.input if buf == "i" else Buffer.output
            slots = prog.buffers[rank].get(name) or []
            got = slots[index] if index < len(slots) else None
            if got is None or got != want:
                print(f"Rank {rank} {name.name} chunk {index} is {got}, should be {want}")
                correct = False
        return correct

    def sidecar(self, file: str = "") -> dict[str, Any]:
        """The postcondition in the sidecar format (``FILE.post.json``) that custom MSCCL files carry."""
        expect = []
        for (rank, buf, index), want in sorted(self.expected().items()):
            sources = _sources(want)
            if sources is not None:
                expect.append({"rank": rank, "buf": buf, "index": index, "from": sources})
        return {"file": file, "meaning": f"postcondition of the {self.name} collective", "expect": expect}


class AllReduce(Collective):
    """Every rank's chunk c ends as the reduction of all ranks' chunk c."""

    ir_name = "allreduce"

    def __init__(self, num_ranks: int, chunk_factor: int, inplace: bool) -> None:
        super().__init__(num_ranks, chunk_factor, inplace)
        self.name = "allreduce"

    def init_buffers(self) -> list[dict[Any, list[Value]]]:
        out = []
        for r in range(self.num_ranks):
            inp: list[Value] = [Chunk(r, c, -1, c) for c in range(self.chunk_factor)]
            out.append({Buffer.input: inp, Buffer.output: inp if self.inplace else [None] * self.chunk_factor})
        return out

    def expected(self) -> dict[tuple[int, str, int], Value]:
        buf = "i" if self.inplace else "o"
        return {(r, buf, c): reduction([Chunk(q, c) for q in range(self.num_ranks)])
                for r in range(self.num_ranks) for c in range(self.chunk_factor)}

    def get_buffer_index(self, rank: int, buffer: Any, index: int) -> tuple[Any, int]:
        if self.inplace and buffer == Buffer.output:
            return Buffer.input, index
        return buffer, index


class AllGather(Collective):
    """Rank q's input chunk c ends in every rank's output chunk q·chunk_factor + c."""

    ir_name = "allgather"

    def __init__(self, num_ranks: int, chunk_factor: int, inplace: bool) -> None:
        super().__init__(num_ranks, chunk_factor, inplace)
        self.name = "allgather"

    def init_buffers(self) -> list[dict[Any, list[Value]]]:
        k, out = self.chunk_factor, []
        for r in range(self.num_ranks):
            output: list[Value] = [None] * (self.num_ranks * k)
            mine: list[Value] = [Chunk(r, c, -1, r * k + c) for c in range(k)]
            if self.inplace:
                output[r * k:(r + 1) * k] = mine
                out.append({Buffer.input: output[r * k:(r + 1) * k], Buffer.output: output})
            else:
                out.append({Buffer.input: mine, Buffer.output: output})
        return out

    def expected(self) -> dict[tuple[int, str, int], Value]:
        k = self.chunk_factor
        return {(r, "o", q * k + c): Chunk(q, c) for r in range(self.num_ranks)
                for q in range(self.num_ranks) for c in range(k)}

    def get_buffer_index(self, rank: int, buffer: Any, index: int) -> tuple[Any, int]:
        if self.inplace and buffer == Buffer.input:
            return Buffer.output, index + rank * self.chunk_factor
        return buffer, index


class ReduceScatter(Collective):
    """Rank r's output chunk c ends as the reduction of all ranks' input chunk r·chunk_factor + c."""

    ir_name = "reducescatter"

    def __init__(self, num_ranks: int, chunk_factor: int, inplace: bool) -> None:
        super().__init__(num_ranks, chunk_factor, inplace)
        self.name = "reduce_scatter"

    def init_buffers(self) -> list[dict[Any, list[Value]]]:
        k, out = self.chunk_factor, []
        for r in range(self.num_ranks):
            inp: list[Value] = [Chunk(r, i, i // k, i % k) for i in range(self.num_ranks * k)]
            out.append({Buffer.input: inp} if self.inplace else {Buffer.input: inp, Buffer.output: [None] * k})
        return out

    def expected(self) -> dict[tuple[int, str, int], Value]:
        k, n = self.chunk_factor, self.num_ranks
        return {(r, "i" if self.inplace else "o", r * k + c if self.inplace else c):
                reduction([Chunk(q, r * k + c) for q in range(n)]) for r in range(n) for c in range(k)}

    def get_buffer_index(self, rank: int, buffer: Any, index: int) -> tuple[Any, int]:
        if self.inplace and buffer == Buffer.output:
            return Buffer.input, index + rank * self.chunk_factor
        return buffer, index


class AllToAll(Collective):
    """Rank q's input chunk r·chunk_factor + c ends in rank r's output chunk q·chunk_factor + c."""

    ir_name = "alltoall"

    def __init__(self, num_ranks: int, chunk_factor: int, inplace: bool) -> None:
        super().__init__(num_ranks, chunk_factor, inplace)
        self.name = "alltoall"

    def init_buffers(self) -> list[dict[Any, list[Value]]]:
        k, n, out = self.chunk_factor, self.num_ranks, []
        for r in range(n):
            inp: list[Value] = [Chunk(r, i, i // k, i % k + r * k) for i in range(n * k)]
            out.append({Buffer.input: inp, Buffer.output: inp if self.inplace else [None] * (n * k)})
        return out

    def expected(self) -> dict[tuple[int, str, int], Value]:
        k, n = self.chunk_factor, self.num_ranks
        buf = "i" if self.inplace else "o"
        return {(r, buf, q * k + c): Chunk(q, r * k + c) for r in range(n) for q in range(n) for c in range(k)}

    def get_buffer_index(self, rank: int, buffer: Any, index: int) -> tuple[Any, int]:
        if self.inplace and buffer == Buffer.output:
            return Buffer.input, index
        return buffer, index


class Broadcast(Collective):
    """The root's input chunk c ends in every rank's output chunk c (in place: in their input)."""

    ir_name = "broadcast"

    def __init__(self, num_ranks: int, chunk_factor: int, inplace: bool, root: int = 0) -> None:
        super().__init__(num_ranks, chunk_factor, inplace)
        self.name = "broadcast"
        self.root = root

    def init_buffers(self) -> list[dict[Any, list[Value]]]:
        k, out = self.chunk_factor, []
        for r in range(self.num_ranks):
            inp: list[Value] = [Chunk(r, c, -1, c) if r == self.root else None for c in range(k)]
            out.append({Buffer.input: inp, Buffer.output: inp if self.inplace else [None] * k})
        return out

    def expected(self) -> dict[tuple[int, str, int], Value]:
        buf = "i" if self.inplace else "o"
        return {(r, buf, c): Chunk(self.root, c) for r in range(self.num_ranks) for c in range(self.chunk_factor)}

    def get_buffer_index(self, rank: int, buffer: Any, index: int) -> tuple[Any, int]:
        if self.inplace and buffer == Buffer.output:
            return Buffer.input, index
        return buffer, index


class Custom(Collective):
    """A collective given by its pre- and postcondition.

    ``inputs[r]`` is how many input chunks rank r holds (chunk c is ``Chunk(r, c)``),
    ``outputs[r]`` the size of its output buffer, and ``expect`` maps (rank, "i"/"o", index)
    to the value that chunk must end with: a :class:`Chunk`, or a list of them meaning their
    reduction.  Chunks not named are unspecified.
    """

    def __init__(self, num_ranks: int, chunk_factor: int, inplace: bool, *, inputs: Sequence[int],
                 outputs: Sequence[int], expect: Mapping[tuple[int, str, int], Chunk | Sequence[Chunk]],
                 name: str = "custom") -> None:
        super().__init__(num_ranks, chunk_factor, inplace)
        self.name = name
        self.inputs, self.outputs = list(inputs), list(outputs)
        self._expect: dict[tuple[int, str, int], Value] = {
            key: value if isinstance(value, Chunk) else reduction(list(value)) for key, value in expect.items()}

    def init_buffers(self) -> list[dict[Any, list[Value]]]:
        return [{Buffer.input: [Chunk(r, c) for c in range(self.inputs[r])],
                 Buffer.output: [None] * self.outputs[r]} for r in range(self.num_ranks)]

    def expected(self) -> dict[tuple[int, str, int], Value]:
        return dict(self._expect)

    def declared_chunks(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s (input, output) chunk counts, as declared (every rank's buffers exist, used or not)."""
        return self.inputs[rank], self.outputs[rank]


class AllToNext(Custom):
    """Rank r's input ends in rank r + 1's output; rank 0's output is unspecified, the last input unused."""

    def __init__(self, num_ranks: int, chunk_factor: int = 1) -> None:
        k = chunk_factor
        super().__init__(num_ranks, k, False, inputs=[k] * num_ranks, outputs=[k] * num_ranks,
                         expect={(r, "o", c): Chunk(r - 1, c) for r in range(1, num_ranks) for c in range(k)},
                         name="alltonext")
