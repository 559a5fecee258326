"""Built-in programs that move data without reducing it: all-to-all and AllToNext."""

from __future__ import annotations

from commd.algorithms.dsl import AllToAll, AllToNext, Buffer, MSCCLProgram, chunk, fully_connected
from commd.algorithms.ir import Algorithm


def alltoall(n: int, instances: int = 1) -> Algorithm:
    """Direct all-to-all: every node sends block j of its input straight to node j (its own block: a local copy)."""
    with MSCCLProgram(f"direct_alltoall_{n}", fully_connected(n), AllToAll(n, 1, False), instances) as prog:
        for r in range(n):
            for j in range(n):
                chunk(r, Buffer.input, j).copy(j, Buffer.output, r)
    return prog.compile()


def alltonext(n: int, instances: int = 1) -> Algorithm:
    """Node r's buffer to node r + 1 (the last node's input unused, node 0's output untouched)."""
    with MSCCLProgram(f"alltonext_{n}", fully_connected(n), AllToNext(n, 1), instances) as prog:
        for r in range(n - 1):
            chunk(r, Buffer.input, 0).copy(r + 1, Buffer.output, 0)
    return prog.compile()
