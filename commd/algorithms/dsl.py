"""MSCCLang-compatible programs: a program moves chunks between ranks' buffers, and is compiled to the IR.

The names and signatures are MSCCLang's (``MSCCLProgram``, ``chunk``, ``Buffer``,
``Ref.copy``/``reduce``/``split``/``group``, ``XML()``, ``Check()``, ``fully_connected``,
the collectives), so a program written for msccl-tools runs here once its imports name
this module.  Running a program only *records* what it does (the trace, with the
symbolic value of every chunk so that ``Check()`` can test the postcondition); the
compiler stages (``dag`` → ``fusion`` → ``schedule`` → ``instances`` → ``lower``) turn
the trace into an :class:`~commd.algorithms.ir.Algorithm`.  Misuse — a rank or an index
outside the buffers, sizes that differ, a copy onto itself — is a ProgramError naming
the program and the line of the program that did it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from commd.algorithms.collectives import (
    AllGather,
    AllReduce,
    AllToAll,
    AllToNext,
    Broadcast,
    Buffer,
    Chunk,
    Collective,
    Custom,
    ReduceChunk,
    ReduceScatter,
    Value,
)
from commd.algorithms.compiler import compile_program
from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import Algorithm
from commd.algorithms.trace import Operation, Slots, ThreadblockPolicy

__all__ = [
    "AllGather", "AllReduce", "AllToAll", "AllToNext", "Broadcast", "Buffer", "Check", "Chunk", "Collective",
    "Custom", "MSCCLProgram", "Operation", "ReduceChunk", "ReduceScatter", "Ref", "Slots", "ThreadblockPolicy",
    "Topology", "XML", "chunk", "create_scratch", "fully_connected",
]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class Topology:
    """Which ranks have a link (MSCCLang's topology argument; commd's nodes are fully connected)."""

    def __init__(self, name: str, links: list[list[int]]) -> None:
        self.name = name
        self.links = links

    def num_nodes(self) -> int:
        return len(self.links)

    def link(self, src: int, dst: int) -> int:
        return self.links[dst][src]


def fully_connected(num_nodes: int) -> Topology:
    """Every rank linked to every other one."""
    return Topology(f"fully_connected({num_nodes})",
                    [[0 if a == b else 1 for b in range(num_nodes)] for a in range(num_nodes)])


def buffer_name(buffer: Any) -> str:
    """The trace's name of a buffer: "i", "o", or a scratch buffer's name ("s" for Buffer.scratch)."""
    if isinstance(buffer, Buffer):
        return buffer.value
    return str(buffer)


_current: MSCCLProgram | None = None
_collected: list[MSCCLProgram] | None = None  # set by compiler.compile_file while it runs a file


def _call_site() -> str:
    """``file:line`` of the innermost frame outside this package: the program line being run."""
    frame = inspect.currentframe()
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR:
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


@contextlib.contextmanager
def collecting() -> Iterator[list[MSCCLProgram]]:
    """Collect every program that closes without error while the block runs (for running program files)."""
    global _collected, _current
    saved, _collected = _collected, []
    try:
        yield _collected
    finally:
        _collected, _current = saved, None


def _curr() -> MSCCLProgram:
    if _current is None:
        raise ProgramError(f"no MSCCLProgram is open (use `with MSCCLProgram(...):`) at {_call_site()}",
                           source="<dsl>")
    return _current


class MSCCLProgram:
    """A program: a context in which ``chunk(...)`` refs are moved; ``compile()`` lowers it to the IR."""

    def __init__(self, name: str, topo: Topology, collective: Collective, instances: int, protocol: str = "Simple",
                 threadblock_policy: ThreadblockPolicy = ThreadblockPolicy.auto, interleaved_replication: bool = True,
                 instr_fusion: bool = True, check_xml: bool = True, dependence_nop: bool = False) -> None:
        self.name = name
        self.source = name
        self.topo = topo
        self.collective = collective
        self.num_ranks = topo.num_nodes()
        self.instances = instances
        self.protocol = protocol
        self.threadblock_policy = threadblock_policy
        self.interleaved_replication = interleaved_replication
        self.instr_fusion = instr_fusion
        self.check_xml = check_xml
        self.dependence_nop = dependence_nop
        self.trace: list[Operation] = []
        if protocol not in ("Simple", "LL", "LL128"):
            self.fail(f"protocol {protocol!r}: must be Simple, LL or LL128")
        if not isinstance(instances, int) or instances < 1:
            self.fail(f"instances {instances!r}: must be a whole number ≥ 1")
        if collective.num_ranks != self.num_ranks:
            self.fail(f"the collective has {collective.num_ranks} ranks, the topology {self.num_ranks}")
        if not isinstance(collective.chunk_factor, int) or collective.chunk_factor < 1:
            self.fail(f"chunk factor {collective.chunk_factor!r}: must be a whole number ≥ 1")
        self.buffers: list[dict[Any, list[Value]]] = collective.init_buffers()
        if len(self.buffers) != self.num_ranks:
            self.fail(f"the collective's precondition has {len(self.buffers)} ranks, not {self.num_ranks}")
        self._algorithm: Algorithm | None = None

    def fail(self, reason: str, rank: int | None = None) -> None:
        raise ProgramError(f"{reason} (at {_call_site()})", source=self.source, rank=rank)

    def __enter__(self) -> MSCCLProgram:
        global _current
        if _current is not None:
            raise ProgramError(f"program {_current.name!r} is still open: programs cannot nest (at {_call_site()})",
                               source=self.source)
        _current = self
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        global _current
        _current = None
        if exc_type is None and _collected is not None:
            _collected.append(self)

    # -- buffers ---------------------------------------------------------------------------------

    def slots_of(self, rank: int, buffer: Any) -> list[Value]:
        """The symbolic chunks of a buffer (a scratch buffer is created on first use)."""
        bufs = self.buffers[rank]
        if buffer in bufs:
            return bufs[buffer]
        if buffer in (Buffer.input, Buffer.output):
            return []
        return bufs.setdefault(buffer_name(buffer), [])

    def resolve(self, rank: int, buffer: Any, index: int, size: int, *, growing: bool = False,
                alias_rank: int | None = None) -> Slots:
        """Validated Slots for (rank, buffer, index, size), in-place aliasing applied.

        ``alias_rank`` is the rank whose view of the buffers the (buffer, index) is in: a copy
        names its destination as the source sees it, as in MSCCLang (in an in-place
        all-gather, "input chunk i" of another rank is where this rank's input sits there).
        """
        if not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            self.fail(f"rank {rank!r} is outside 0..{self.num_ranks - 1}")
        if not isinstance(size, int) or size < 1:
            self.fail(f"size {size!r}: a ref covers at least one chunk", rank)
        if not isinstance(buffer, (Buffer, str)):
            self.fail(f"buffer {buffer!r}: must be Buffer.input, Buffer.output, Buffer.scratch or a name", rank)
        buffer, index = self.collective.get_buffer_index(rank if alias_rank is None else alias_rank, buffer, index)
        if not isinstance(index, int) or index < 0:
            self.fail(f"index {index!r} in buffer {buffer_name(buffer)!r}: must be a whole number ≥ 0", rank)
        slots = self.slots_of(rank, buffer)
        is_scratch = buffer_name(buffer) not in ("i", "o")
        if index + size > len(slots) and not (growing and is_scratch):
            self.fail(f"chunks [{index}, {index + size}) are outside buffer {buffer_name(buffer)!r} of rank {rank} "
                      f"({len(slots)} chunks)", rank)
        return Slots(rank, buffer_name(buffer), index, size)

    def values(self, s: Slots) -> list[Value]:
        key = {"i": Buffer.input, "o": Buffer.output}.get(s.buffer, s.buffer)
        return self.slots_of(s.rank, key)[s.index:s.end]

    def store(self, s: Slots, values: list[Value]) -> None:
        key = {"i": Buffer.input, "o": Buffer.output}.get(s.buffer, s.buffer)
        slots = self.slots_of(s.rank, key)
        if len(slots) < s.end:
            slots.extend([None] * (s.end - len(slots)))
        slots[s.index:s.end] = values

    def defined(self, s: Slots, what: str) -> list[Value]:
        values = self.values(s)
        missing = [s.index + i for i, v in enumerate(values) if v is None]
        if missing:
            self.fail(f"{what} chunk(s) {missing} of buffer {s.buffer!r} on rank {s.rank}, which hold no data", s.rank)
        return values

    def get_ref(self, rank: int, buffer: Any, index: int, size: int) -> Ref:
        s = self.resolve(rank, buffer, index, size)
        return Ref(s.rank, {"i": Buffer.input, "o": Buffer.output}.get(s.buffer, s.buffer), s.index, s.size, self)

    def check_link(self, src: int, dst: int) -> None:
        if src != dst and not self.topo.link(src, dst):
            self.fail(f"no link from rank {src} to rank {dst} in topology {self.topo.name}", src)

    def check_hints(self, rank: int, sendtb: Any, recvtb: Any, ch: Any) -> None:
        for name, value in (("sendtb", sendtb), ("recvtb", recvtb), ("ch", ch)):
            if not isinstance(value, int) or value < -1:
                self.fail(f"{name}={value!r}: must be -1 (automatic) or a whole number ≥ 0", rank)

    def record(self, kind: str, src: Slots, dst: Slots, sendtb: int, recvtb: int, ch: int) -> None:
        self.trace.append(Operation(kind, src, dst, sendtb, recvtb, ch, _call_site()))
        self._algorithm = None

    # -- results ---------------------------------------------------------------------------------

    def check(self) -> bool:
        return bool(self.collective.check(self))

    def compile(self) -> Algorithm:
        """The program lowered to the IR (cached until the program records more)."""
        if self._algorithm is None:
            self._algorithm = compile_program(self)
        return self._algorithm

    lower = compile

    def sidecar(self, file: str = "") -> dict[str, Any] | None:
        """The postcondition as a ``FILE.post.json`` sidecar, for a collective that states it (None otherwise)."""
        post = self.collective.sidecar(file)
        return post if post["expect"] else None

    def generate_xml(self) -> str:
        from commd.algorithms import mscclxml
        return mscclxml.dumps(self.compile())


@dataclass
class Ref:
    """A reference to ``size`` chunks of one rank's buffer, as MSCCLang's ``chunk()`` returns."""

    rank: int
    buffer: Any
    index: int
    size: int
    prog: MSCCLProgram

    def __repr__(self) -> str:
        return f"Ref(Buffer:{self.buffer}, Index:{self.index}, Size:{self.size}, Rank:{self.rank})"

    def slots(self) -> Slots:
        return Slots(self.rank, buffer_name(self.buffer), self.index, self.size)

    def split(self, num: int) -> list[Ref]:
        """``num`` refs of equal size covering this one."""
        if not isinstance(num, int) or num < 1 or self.size % num:
            self.prog.fail(f"cannot split a ref of {self.size} chunks into {num!r} equal parts", self.rank)
        part = self.size // num
        return [Ref(self.rank, self.buffer, self.index + i * part, part, self.prog) for i in range(num)]

    def group(self, other: Ref) -> Ref:
        """One ref covering this one and ``other`` (same rank and buffer, no gap between them)."""
        if other.rank != self.rank:
            self.prog.fail(f"cannot group chunks of rank {self.rank} with chunks of rank {other.rank}", self.rank)
        if buffer_name(other.buffer) != buffer_name(self.buffer):
            self.prog.fail(f"cannot group chunks of buffer {buffer_name(self.buffer)!r} with chunks of "
                           f"{buffer_name(other.buffer)!r}", self.rank)
        first, second = (self, other) if self.index <= other.index else (other, self)
        if second.index > first.index + first.size:
            self.prog.fail(f"cannot group [{first.index}, {first.index + first.size}) and "
                           f"[{second.index}, {second.index + second.size}): there is a gap", self.rank)
        end = max(first.index + first.size, second.index + second.size)
        return Ref(self.rank, self.buffer, first.index, end - first.index, self.prog)

    def copy(self, dst: int, buffer: Any = None, index: int = -1, sendtb: int = -1, recvtb: int = -1,
             ch: int = -1) -> Ref:
        """Copy these chunks to rank ``dst``'s (buffer, index) — same place when neither is given."""
        prog = self.prog
        prog.check_hints(self.rank, sendtb, recvtb, ch)
        if buffer is None and index == -1:
            buffer, index = self.buffer, self.index
        elif buffer is None:
            buffer = self.buffer
        elif index == -1:
            if buffer_name(buffer) in ("i", "o"):
                prog.fail(f"copy to buffer {buffer_name(buffer)!r} needs an index", self.rank)
            index = len(prog.slots_of(dst, buffer)) if 0 <= dst < prog.num_ranks else 0
        target = prog.resolve(dst, buffer, index, self.size, growing=True, alias_rank=self.rank)
        source = self.slots()
        if target == source:
            prog.fail(f"copy of {self!r} onto itself", self.rank)
        if target.overlaps(source):
            prog.fail(f"copy of {self!r} onto chunks [{target.index}, {target.end}) that overlap it", self.rank)
        prog.check_link(self.rank, dst)
        prog.store(target, list(prog.defined(source, "copies")))
        prog.record("copy", source, target, sendtb, recvtb, ch)
        key = {"i": Buffer.input, "o": Buffer.output}.get(target.buffer, target.buffer)
        return Ref(target.rank, key, target.index, target.size, prog)

    def reduce(self, other_chunkref: Ref, sendtb: int = -1, recvtb: int = -1, ch: int = -1) -> Ref:
        """These chunks ← these ⊕ ``other_chunkref``'s (received from its rank when it is another)."""
        prog, other = self.prog, other_chunkref
        prog.check_hints(self.rank, sendtb, recvtb, ch)
        if not isinstance(other, Ref):
            prog.fail(f"reduce needs a ref, got {other!r}", self.rank)
        if other.size != self.size:
            prog.fail(f"size mismatch: reducing {other.size} chunk(s) of {other!r} into {self.size} of {self!r}",
                      self.rank)
        mine, theirs = self.slots(), other.slots()
        if mine == theirs:
            prog.fail(f"reduce of {self!r} with itself", self.rank)
        if mine.overlaps(theirs):
            prog.fail(f"reduce of {self!r} with {other!r}, which overlaps it", self.rank)
        prog.check_link(other.rank, self.rank)
        acc = prog.defined(mine, "reduces into")
        add = prog.defined(theirs, "reduces")
        prog.store(mine, [a.reduce(self.rank, b) for a, b in zip(acc, add, strict=True)])  # type: ignore[union-attr]
        prog.record("reduce", theirs, mine, sendtb, recvtb, ch)
        return self

    def _chunk(self, index: int) -> Value:
        return self.prog.values(self.slots())[index]

    def get_origin_index(self, index: int = 0) -> int:
        return self._chunk(index).origin_index  # type: ignore[union-attr]

    def get_origin_rank(self, index: int = 0) -> int:
        return self._chunk(index).origin_rank  # type: ignore[union-attr]

    def get_dst_index(self, index: int = 0) -> int:
        return self._chunk(index).dst_index  # type: ignore[union-attr]

    def get_dst_rank(self, index: int = 0) -> int:
        return self._chunk(index).dst_rank  # type: ignore[union-attr]


def chunk(rank: int, buffer: Any, index: int, size: int = 1) -> Ref | None:
    """A ref to chunks [index, index + size) of ``rank``'s buffer; None when they hold nothing (as MSCCLang)."""
    prog = _curr()
    ref = prog.get_ref(rank, buffer, index, size)
    if prog.values(ref.slots())[0] is None:
        return None
    return ref


def create_scratch(rank: int, name: str) -> str:
    """Declare a named scratch buffer on ``rank`` (MSCCLang's; buffers are also created on first use)."""
    prog = _curr()
    prog.resolve(rank, Buffer.scratch, 0, 1, growing=True)
    prog.slots_of(rank, name)
    return name


def XML() -> None:  # noqa: N802 - MSCCLang's name
    """Print the current program's MSCCL XML."""
    print(_curr().generate_xml())


def Check() -> bool:  # noqa: N802 - MSCCLang's name
    """Whether the current program's final buffers satisfy its collective's postcondition."""
    return _curr().check()
