"""Hand-made programs for the wire tests (written here from the IR's stated semantics, so that the
tests do not depend on the DSL compiler): an all-pairs two-shot all-reduce for n ranks.

Rank r owns chunk r: it sends chunk j to rank j, reduces the chunks it receives into its own
(in a chain of dependencies, so one order on the one node that computes it: every node ends
with the same bits), then sends its reduced chunk to every rank and receives theirs.
"""

from __future__ import annotations

from commd.algorithms.ir import Algorithm, Rank, Step, StepType, Threadblock


def twoshot_allreduce(n: int, name: str = "handmade_twoshot") -> Algorithm:
    ranks = []
    for r in range(n):
        peers = [j for j in range(n) if j != r]
        last = len(peers) - 1
        tbs = []
        for k, j in enumerate(peers):
            steps = (
                Step(0, StepType.SEND, "i", j, "i", j, 1),
                # i[r] ← i[r] ⊕ received: after the previous peer's reduction (one order)
                Step(1, StepType.RECV_REDUCE_COPY, "i", r, "i", r, 1, *((k - 1, 1) if k else (-1, -1)),
                     hasdep=True),
                # the reduced chunk leaves once the last reduction is done
                Step(2, StepType.SEND, "i", r, "i", r, 1, *((last, 1) if k != last else (-1, -1))),
                Step(3, StepType.RECV, "i", j, "i", j, 1),
            )
            tbs.append(Threadblock(k, j, j, 0, steps))
        ranks.append(Rank(r, n, 0, 0, tuple(tbs)))
    return Algorithm(name=name, coll="allreduce", ngpus=n, nchunksperloop=n, nchannels=1, inplace=True,
                     ranks=tuple(ranks), outofplace=False, min_bytes=0, max_bytes=0)
