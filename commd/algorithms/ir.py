"""The intermediate representation of a collective algorithm: what every stage hands the next.

The IR is MSCCL's (the XML that msccl-tools emits and the MSCCL runtime loads), held
as frozen dataclasses: an :class:`Algorithm` has one :class:`Rank` per participant
(MSCCL's ``<gpu>``; in commd one rank is one node's daemon), each with threadblocks
(:class:`Threadblock`: a sequence of :class:`Step` run in order, sending to at most one
peer and receiving from at most one, on one channel).  ``mscclxml.py`` reads and writes
it; the compiler produces it; the checker proves it; the simulator and the interpreter run
it.  Nothing here does I/O.

Semantics (the MSCCL runtime's, which third-party files rely on):

- buffers are ``i`` (input), ``o`` (output) and ``s`` (scratch), each a whole number of
  chunks (``Rank.i_chunks`` …); a step touches chunks ``[off, off + cnt)`` of a buffer;
- the k-th send of (src → dst, channel) meets the k-th receive of (dst ← src, channel);
- ``s``: send local(src); ``r``: dst ← received; ``rcs``: dst ← received, and send it on;
  ``rrc``: dst ← local(src) ⊕ received; ``rrs``: send local(src) ⊕ received (no local
  write); ``rrcs``: dst ← local(src) ⊕ received, and send that; ``re``: dst ← dst ⊕ src;
  ``cpy``: dst ← src; ``nop``: only waits for its dependency.  For a step that receives,
  its src fields of a plain ``r``/``rcs`` only repeat the sender's address;
- a step waits for the previous step of its threadblock and for its dependency
  (``depid``/``deps``: step ``deps`` of threadblock ``depid`` on the same rank);
- in-place all-reduce uses only ``i``; in-place all-gather uses only ``o`` (rank r's input
  sits at ``o[r·k …]``); all-gather, reduce-scatter and all-to-all scale their per-rank
  buffers by the rank count.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StepType(enum.Enum):
    """An MSCCL step's ``type`` attribute."""

    SEND = "s"
    RECV = "r"
    RECV_COPY_SEND = "rcs"
    RECV_REDUCE_COPY = "rrc"
    RECV_REDUCE_SEND = "rrs"
    RECV_REDUCE_COPY_SEND = "rrcs"
    REDUCE = "re"
    COPY = "cpy"
    NOP = "nop"

    @property
    def sends(self) -> bool:
        return self in _SENDS

    @property
    def receives(self) -> bool:
        return self in _RECEIVES

    @property
    def reduces(self) -> bool:
        """Whether the step combines two values with the reduce operator."""
        return self in _REDUCES

    @property
    def reads_src(self) -> bool:
        """Whether the step reads its local ``src`` chunks (a receive's src only names the sender's)."""
        return self in _READS_SRC

    @property
    def writes_dst(self) -> bool:
        """Whether the step writes its local ``dst`` chunks."""
        return self in _WRITES_DST

    @property
    def reads_dst(self) -> bool:
        """Whether the step reads its ``dst`` before writing it (``re``: dst ← dst ⊕ src)."""
        return self is StepType.REDUCE


_SENDS = frozenset({StepType.SEND, StepType.RECV_COPY_SEND, StepType.RECV_REDUCE_SEND, StepType.RECV_REDUCE_COPY_SEND})
_RECEIVES = frozenset({StepType.RECV, StepType.RECV_COPY_SEND, StepType.RECV_REDUCE_COPY, StepType.RECV_REDUCE_SEND,
                       StepType.RECV_REDUCE_COPY_SEND})
_REDUCES = frozenset({StepType.RECV_REDUCE_COPY, StepType.RECV_REDUCE_SEND, StepType.RECV_REDUCE_COPY_SEND,
                      StepType.REDUCE})
_READS_SRC = frozenset({StepType.SEND, StepType.RECV_REDUCE_COPY, StepType.RECV_REDUCE_SEND,
                        StepType.RECV_REDUCE_COPY_SEND, StepType.REDUCE, StepType.COPY})
_WRITES_DST = frozenset({StepType.RECV, StepType.RECV_COPY_SEND, StepType.RECV_REDUCE_COPY,
                         StepType.RECV_REDUCE_COPY_SEND, StepType.REDUCE, StepType.COPY})

#: Buffer names in the IR (the DSL's named scratch buffers are lowered into ``s``).
BUFFERS = ("i", "o", "s")

#: Collectives the IR names (``coll``), and ``custom`` (postcondition from a sidecar file).
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "custom")
#: Other spellings of a collective that files and programs from outside use, and the IR's name for
#: each: the SCCL-era MSCCL runtime's parser and older msccl-tools spell reduce-scatter
#: ``reduce_scatter``, the newer runtime ``reducescatter`` (which the writer keeps).
COLLECTIVE_ALIASES = {"reduce_scatter": "reducescatter"}


def collective_name(name: str) -> str | None:
    """The IR's name for a collective as a file or program spells it (None: not a collective).

    Every reader of a name from outside goes through here, so the stages after it see one
    spelling only."""
    if name in COLLECTIVES:
        return name
    return COLLECTIVE_ALIASES.get(name)


def collective_spellings() -> str:
    """The accepted spellings, for refusals (``reducescatter (or reduce_scatter)``)."""
    aliases: dict[str, list[str]] = {}
    for alias, name in COLLECTIVE_ALIASES.items():
        aliases.setdefault(name, []).append(alias)
    return ", ".join(f"{c} (or {' or '.join(aliases[c])})" if c in aliases else c for c in COLLECTIVES)


#: A checked program's determinism class (``checker.Determinism``).  ``bitwise``: every rank holding
#: a result reduces its sources in the same order (the same tree up to commutativity), so every
#: node gets the same bits for any dtype and reduce op.  ``order-dependent``: some ranks reduce the
#: same sources in different orders: exact for integers and min/max/band/bor/bxor, but float sums,
#: products and averages may differ between nodes in the last bits (``core.ops.order_sensitive``).
BITWISE = "bitwise"
ORDER_DEPENDENT = "order-dependent"

#: Collectives whose per-rank buffers are the rank count times the op's count.
SCALED_BY_RANKS = frozenset({"allgather", "reducescatter", "alltoall"})


@dataclass(frozen=True)
class Step:
    """One step of a threadblock: ``type`` on chunks ``[off, off + cnt)``."""

    s: int  # the step's index in its threadblock
    type: StepType
    srcbuf: str
    srcoff: int
    dstbuf: str
    dstoff: int
    cnt: int
    depid: int = -1  # threadblock of the step this one waits for, or -1
    deps: int = -1  # that step's index, or -1
    hasdep: bool = False  # some step waits for this one (written as MSCCL does; recomputed by the compiler)

    @property
    def dependency(self) -> tuple[int, int] | None:
        """(threadblock, step) this step waits for, or None."""
        return (self.depid, self.deps) if self.depid >= 0 else None


@dataclass(frozen=True)
class Threadblock:
    """Steps run in order; sends go to ``send``, receives come from ``recv`` (-1: none), on ``chan``."""

    id: int
    send: int
    recv: int
    chan: int
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Rank:
    """One participant (MSCCL's ``<gpu>``): its buffers' chunk counts and its threadblocks."""

    id: int
    i_chunks: int
    o_chunks: int
    s_chunks: int
    threadblocks: tuple[Threadblock, ...]

    def chunks(self, buf: str) -> int:
        """How many chunks buffer ``buf`` has on this rank."""
        return {"i": self.i_chunks, "o": self.o_chunks, "s": self.s_chunks}[buf]


@dataclass(frozen=True)
class Algorithm:
    """A whole program, as MSCCL's ``<algo>`` element.

    ``outofplace``, ``min_bytes`` and ``max_bytes`` are None when the file does not carry
    the attribute (older MSCCL files); ``max_bytes == 0`` means unbounded on newer runtimes.
    """

    name: str
    coll: str
    ngpus: int
    nchunksperloop: int
    nchannels: int
    inplace: bool
    ranks: tuple[Rank, ...]
    proto: str = "Simple"
    outofplace: bool | None = None
    min_bytes: int | None = None
    max_bytes: int | None = None

    def rank(self, r: int) -> Rank:
        return self.ranks[r]

