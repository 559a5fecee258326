"""Built-in all-reduce programs, one DSL rank per node, all in place on the input buffer.

Every node must end with the same bits (commd's lane contract), so each chunk is either
reduced once and then copied (ring, two-shot, halving-doubling), or reduced by every node
in one fixed order (one-shot): a left fold over the ranks, ``((x0 ⊕ x1) ⊕ x2) ⊕ …``.
"""

from __future__ import annotations

from commd.algorithms.dsl import AllReduce, Buffer, MSCCLProgram, chunk, fully_connected
from commd.algorithms.ir import Algorithm


def oneshot(n: int, instances: int = 1) -> Algorithm:
    """Every node sends its whole buffer to every other one, then each folds all n in rank order."""
    with MSCCLProgram(f"oneshot_allreduce_{n}", fully_connected(n), AllReduce(n, 1, True), instances) as prog:
        for r in range(n):
            for q in range(n):
                if q != r:
                    chunk(q, Buffer.input, 0).copy(r, "gathered", q)
        for r in range(n):
            if r == 0:
                acc = chunk(0, Buffer.input, 0)
            else:
                acc = chunk(r, "gathered", 0)
            for q in range(1, n):
                acc.reduce(chunk(r, Buffer.input, 0) if q == r else chunk(r, "gathered", q))
            if r != 0:
                acc.copy(r, Buffer.input, 0)
    return prog.compile()


def twoshot(n: int, instances: int = 1) -> Algorithm:
    """All-pairs reduce-scatter (chunk k reduced at node k), then all-pairs all-gather of the reduced chunks."""
    with MSCCLProgram(f"twoshot_allreduce_{n}", fully_connected(n), AllReduce(n, n, True), instances) as prog:
        for k in range(n):
            for q in range(n):
                if q != k:
                    chunk(k, Buffer.input, k).reduce(chunk(q, Buffer.input, k))
        for k in range(n):
            for q in range(n):
                if q != k:
                    chunk(k, Buffer.input, k).copy(q, Buffer.input, k)
    return prog.compile()


def halving_doubling(n: int, instances: int = 1) -> Algorithm:
    """Recursive halving reduce-scatter and doubling all-gather over the largest power of two p ≤ n.

    The n − p extra nodes first fold their buffer into a partner (node p + t into node t)
    and get the result back from it at the end.
    """
    p = 1
    while p * 2 <= n:
        p *= 2
    with MSCCLProgram(f"halving_doubling_allreduce_{n}", fully_connected(n), AllReduce(n, p, True),
                      instances) as prog:
        for t in range(n - p):
            chunk(t, Buffer.input, 0, p).reduce(chunk(p + t, Buffer.input, 0, p))
        span = {r: (0, p) for r in range(p)}
        d = p // 2
        while d >= 1:  # halving: keep one half, send the other to the partner, which reduces it
            nxt = {}
            for r in range(p):
                lo, hi = span[r]
                mid = (lo + hi) // 2
                nxt[r] = (lo, mid) if r & d == 0 else (mid, hi)
            for r in range(p):
                lo, hi = nxt[r ^ d]
                chunk(r ^ d, Buffer.input, lo, hi - lo).reduce(chunk(r, Buffer.input, lo, hi - lo))
            span, d = nxt, d // 2
        d = 1
        while d < p:  # doubling: exchange what each holds, the spans merge
            for r in range(p):
                lo, hi = span[r]
                chunk(r, Buffer.input, lo, hi - lo).copy(r ^ d, Buffer.input, lo)
            span = {r: (min(span[r][0], span[r ^ d][0]), max(span[r][1], span[r ^ d][1])) for r in range(p)}
            d *= 2
        for t in range(n - p):
            chunk(t, Buffer.input, 0, p).copy(p + t, Buffer.input, 0)
    return prog.compile()


def ring(n: int, instances: int = 1) -> Algorithm:
    """The native ring's twin: chunk k is reduced along k, k+1, …, k−1, then goes round from k−1.

    Node k+1 computes local ⊕ received, as the native ring's combine does, so each
    element is reduced by the same tree and the result has the same bits.
    """
    with MSCCLProgram(f"ring_allreduce_{n}", fully_connected(n), AllReduce(n, n, True), instances) as prog:
        for k in range(n):
            c = chunk(k, Buffer.input, k)
            for step in range(1, n):
                c = chunk((k + step) % n, Buffer.input, k).reduce(c)
            for step in range(n - 1):
                c = c.copy((k + step) % n, Buffer.input, k)
    return prog.compile()
