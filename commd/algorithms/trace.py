"""What a DSL program records: operations on slots of the ranks' buffers (the compiler's input).

Kept apart from ``dsl`` so that the compiler stages read the trace without importing the
language that produces it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ThreadblockPolicy(enum.Enum):
    """``auto``: the compiler assigns threadblocks (hints honoured); ``manual``: every transfer names its own."""

    auto = "auto"
    manual = "manual"


@dataclass(frozen=True)
class Slots:
    """Chunks ``[index, index + size)`` of buffer ``buffer`` on ``rank`` (in-place aliasing resolved)."""

    rank: int
    buffer: str
    index: int
    size: int

    @property
    def end(self) -> int:
        return self.index + self.size

    def overlaps(self, other: Slots) -> bool:
        return (self.rank == other.rank and self.buffer == other.buffer
                and self.index < other.end and other.index < self.end)


@dataclass(frozen=True)
class Operation:
    """One traced operation: ``copy`` (dst ← src) or ``reduce`` (dst ← dst ⊕ src), with its hints."""

    kind: str  # "copy" or "reduce"
    src: Slots
    dst: Slots
    sendtb: int
    recvtb: int
    ch: int
    where: str  # the program line that asked for it
