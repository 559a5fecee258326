"""Why a program is refused: one exception that names the file, rank, threadblock and step."""

from __future__ import annotations


class ProgramError(ValueError):
    """A program (an MSCCL file, a DSL program, a compiled IR) that commd refuses to run.

    Every refusal says where: the file (or program name), and as far as known the rank,
    the threadblock and the step, then the reason.
    """

    def __init__(self, reason: str, *, source: str = "<program>", rank: int | None = None,
                 threadblock: int | None = None, step: int | None = None) -> None:
        self.reason = reason
        self.source = source
        self.rank = rank
        self.threadblock = threadblock
        self.step = step
        super().__init__(f"{self.where()}: {reason}")

    def where(self) -> str:
        parts = [self.source]
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.threadblock is not None:
            parts.append(f"threadblock {self.threadblock}")
        if self.step is not None:
            parts.append(f"step {self.step}")
        return ", ".join(parts)
