"""The checker: hand-made broken programs refused at the right place, correct ones accepted.

Programs are built here as IR (independent of any compiler): :func:`tb` numbers its steps,
:func:`ring_allreduce` and :func:`direct_allreduce` write the textbook algorithms by hand.
The third-party MSCCL files in ``shared/msccl`` beside the checkout (their README says which to accept)
are checked through the XML reader.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from itertools import combinations, permutations
from pathlib import Path

import numpy as np
import pytest
from helpers import msccl_files_dir

from commd.algorithms import checker, mscclxml, postcondition
from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import Algorithm, Rank, Step, StepType, Threadblock
from commd.algorithms.postcondition import ChunkRef, Postcondition
from commd.algorithms.symbolic import StepRef

MSCCL = msccl_files_dir()
needs_files = pytest.mark.skipif(MSCCL is None, reason="the third-party MSCCL files (shared/msccl) are not here")
#: The files their README marks accept (the NEG one is the only reject).
ACCEPT = ["a2a_allpairs_4r.xml", "a2a_twostep_2x2.xml", "ag_2r_handwritten.xml", "ag_syccl_4r_outofplace.xml",
          "alltonext_fwd_2x8_16r.xml", "ar_allpairs_4r_scratch.xml", "ar_bintree_4r_2chunks.xml",
          "ar_hierarchical_2x2.xml", "ar_rdh_4r.xml", "ar_ring_4r_fused.xml", "custom_3r_fanout.xml"]


# --- building programs by hand --------------------------------------------------------------------


def st(kind: str, src: tuple[str, int] = ("i", 0), dst: tuple[str, int] | None = None, cnt: int = 1,
       dep: tuple[int, int] | None = None) -> Step:
    """A step (its index is set by :func:`tb`); ``dst`` defaults to ``src``."""
    dst = dst or src
    if kind == "nop":
        src, dst, cnt = ("i", -1), ("o", -1), 0
    depid, deps = dep if dep is not None else (-1, -1)
    return Step(0, StepType(kind), src[0], src[1], dst[0], dst[1], cnt, depid, deps)


def tb(id: int, send: int, recv: int, *steps: Step, chan: int = 0) -> Threadblock:
    return Threadblock(id, send, recv, chan, tuple(dataclasses.replace(s, s=n) for n, s in enumerate(steps)))


def rank(id: int, chunks: tuple[int, int, int], *tbs: Threadblock) -> Rank:
    return Rank(id, *chunks, tuple(tbs))


def program(coll: str, nchunks: int, ranks: list[Rank], inplace: bool = True, nchannels: int = 1) -> Algorithm:
    return Algorithm("handmade", coll, len(ranks), nchunks, nchannels, inplace, tuple(ranks))


def ring_allreduce(n: int) -> Algorithm:
    """In-place ring all-reduce, chunk c reduced along c → c+1 → … and then passed around.

    Rank r, step k of the reduce-scatter, handles chunk (r−k) mod n: k = 0 sends its own,
    then ``rrs`` (add and pass on), then ``rrcs`` (the final sum, kept and passed on);
    the all-gather forwards (``rcs``) and the last arrival is a plain ``r``.
    """
    ranks = []
    for r in range(n):
        steps = [st("s", ("i", r))]
        steps += [st("rrs", ("i", (r - k) % n)) for k in range(1, n - 1)]
        steps.append(st("rrcs", ("i", (r + 1) % n)))
        steps += [st("rcs", ("i", (r + 1 - a) % n)) for a in range(1, n - 1)]
        steps.append(st("r", ("i", (r + 2) % n)))
        ranks.append(rank(r, (n, 0, 0), tb(0, (r + 1) % n, (r - 1) % n, *steps)))
    return program("allreduce", n, ranks)


def direct_allreduce(orders: list[list[int]]) -> Algorithm:
    """Out-of-place all-reduce of one chunk: every rank sends its input to every other, then
    adds the inputs into its output one by one, in ``orders[r]`` (a permutation of the ranks).

    Rank r: tb 2q sends i0 to q, tb 2q+1 receives q's input into s[q]; tb 2r adds them up.
    """
    n = len(orders)
    ranks = []
    for r, order in enumerate(orders):
        tbs = []
        for q in range(n):
            if q != r:
                tbs.append(tb(2 * q, q, -1, st("s", ("i", 0))))
                tbs.append(tb(2 * q + 1, -1, q, st("r", ("i", 0), ("s", q))))
        operand = {q: ("i", 0) if q == r else ("s", q) for q in range(n)}
        ready = {q: None if q == r else (2 * q + 1, 0) for q in range(n)}
        adds = [st("cpy", operand[order[0]], ("o", 0), dep=ready[order[0]])]
        adds += [st("re", operand[q], ("o", 0), dep=ready[q]) for q in order[1:]]
        tbs.append(tb(2 * r, -1, -1, *adds))
        ranks.append(rank(r, (1, 1, n), *sorted(tbs, key=lambda t: t.id)))
    return program("allreduce", 1, ranks, inplace=False)


def two_rank_allreduce() -> Algorithm:
    """In-place all-reduce of 2 chunks on 2 ranks: rank r owns chunk r (reduce-scatter, all-gather)."""
    ranks = []
    for r in range(2):
        other = 1 - r
        ranks.append(rank(r, (2, 0, 0), tb(0, other, other,
                                           st("s", ("i", other)),  # my part of the peer's chunk
                                           st("rrc", ("i", r)),  # mine ⊕ the peer's part
                                           st("s", ("i", r)),  # the sum back
                                           st("r", ("i", other)))))  # the peer's sum
    return program("allreduce", 2, ranks)


def with_step(algo: Algorithm, r: int, t: int, pos: int, **changes: object) -> Algorithm:
    """``algo`` with step ``pos`` of threadblock ``t`` (position) on rank ``r`` changed."""
    ranks = list(algo.ranks)
    tbs = list(ranks[r].threadblocks)
    steps = list(tbs[t].steps)
    steps[pos] = dataclasses.replace(steps[pos], **changes)
    tbs[t] = dataclasses.replace(tbs[t], steps=tuple(steps))
    ranks[r] = dataclasses.replace(ranks[r], threadblocks=tuple(tbs))
    return dataclasses.replace(algo, ranks=tuple(ranks))


def with_tb(algo: Algorithm, r: int, t: int, **changes: object) -> Algorithm:
    ranks = list(algo.ranks)
    tbs = list(ranks[r].threadblocks)
    tbs[t] = dataclasses.replace(tbs[t], **changes)
    ranks[r] = dataclasses.replace(ranks[r], threadblocks=tuple(tbs))
    return dataclasses.replace(algo, ranks=tuple(ranks))


def refusal(algo: Algorithm, post: Postcondition | None = None) -> ProgramError:
    with pytest.raises(ProgramError) as info:
        checker.check(algo, post, source="prog.xml")
    assert info.value.source == "prog.xml"
    return info.value


# --- accepted -------------------------------------------------------------------------------------


def test_two_rank_allreduce_accepted_and_its_analysis() -> None:
    analysis = checker.analyze(two_rank_allreduce())
    # 2 transfers each way, the k-th send meeting the k-th receive
    pairs = {(t.send, t.recv) for t in analysis.transfers}
    assert pairs == {(StepRef(0, 0, 0), StepRef(1, 0, 1)), (StepRef(0, 0, 2), StepRef(1, 0, 3)),
                     (StepRef(1, 0, 0), StepRef(0, 0, 1)), (StepRef(1, 0, 2), StepRef(0, 0, 3))}
    # the order is a linear extension of happens-before: tb order and send-before-receive
    pos = {ref: n for n, ref in enumerate(analysis.order)}
    assert len(pos) == 8
    for t in analysis.transfers:
        assert pos[t.send] < pos[t.recv]
    for r in range(2):
        assert [pos[StepRef(r, 0, s)] for s in range(4)] == sorted(pos[StepRef(r, 0, s)] for s in range(4))
    # both ranks end with the same tree per chunk: chunk c is reduced once, on rank c
    for c in range(2):
        trees = {analysis.outputs[ChunkRef(r, "i", c)] for r in range(2)}
        assert len(trees) == 1
        assert next(iter(trees)).render() in (f"(r0.i{c}+r1.i{c})", f"(r1.i{c}+r0.i{c})")


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_allreduce_accepted(n: int) -> None:
    analysis = checker.analyze(ring_allreduce(n))
    assert len(analysis.transfers) == n * (2 * n - 2)
    # chunk c is summed along c, c+1, …: a left-deep tree, the same on every rank
    for c in range(n):
        trees = {analysis.outputs[ChunkRef(r, "i", c)] for r in range(n)}
        assert len(trees) == 1
        (tree,) = trees
        assert tree.size == n
        depth, node = 0, tree
        while not node.is_leaf:
            leaves = [ch for ch in node.children if ch.is_leaf]
            assert leaves, "a ring sums one new input at a time"
            node = next(ch for ch in node.children if ch is not leaves[0]) if len(leaves) == 1 else leaves[0]
            depth += 1
        assert depth == n - 1


def test_direct_allreduce_in_one_order_accepted() -> None:
    # rank 0 adds 0,1,2; rank 1 adds 1,0,2 (same tree: (a+b) commutes); rank 2 adds 0,1,2 too
    determinism = checker.check(direct_allreduce([[0, 1, 2], [1, 0, 2], [0, 1, 2]]))
    assert determinism.kind == "bitwise" and determinism.bitwise and determinism.differences == ()


def test_happens_before_is_transitive_across_ranks() -> None:
    """Rank 0 sends i0 (a read) on tb 0 and overwrites i0 on tb 1 with no dependency between them:
    ordered all the same, because rank 1 receives the send before it sends what tb 1 receives."""
    algo = program("custom", 1, [
        rank(0, (1, 0, 0), tb(0, 1, -1, st("s")), tb(1, -1, 1, st("r"), chan=1)),
        rank(1, (1, 0, 1), tb(0, -1, 0, st("r", ("i", 0), ("s", 0))), tb(1, 0, -1, st("s", ("i", 0)), chan=1)),
    ], nchannels=2)
    # tb 1 of rank 1 must wait for the receive, else nothing orders it: first refused ...
    post = Postcondition({ChunkRef(0, "i", 0): frozenset({ChunkRef(1, "i", 0)}),
                          ChunkRef(1, "s", 0): frozenset({ChunkRef(0, "i", 0)})})
    err = refusal(algo, post)
    assert "data race on r0.i0" in err.reason and race(err) == {(0, 0, 0), (0, 1, 0)}
    # ... then accepted once rank 1 sends after it received
    fixed = with_step(algo, 1, 1, 0, depid=0, deps=0)
    checker.check(fixed, post)


# --- refused, one kind at a time -------------------------------------------------------------------


def test_unmatched_send() -> None:
    algo = two_rank_allreduce()
    steps = algo.ranks[0].threadblocks[0].steps + (dataclasses.replace(st("s", ("i", 0)), s=4),)
    err = refusal(with_tb(algo, 0, 0, steps=steps))
    assert (err.rank, err.threadblock, err.step) == (0, 0, 4)
    assert "unmatched send" in err.reason and "send #3 to rank 1 on channel 0" in err.reason


def test_unmatched_receive() -> None:
    algo = two_rank_allreduce()
    steps = algo.ranks[1].threadblocks[0].steps + (dataclasses.replace(st("r", ("i", 0)), s=4),)
    err = refusal(with_tb(algo, 1, 0, steps=steps))
    assert (err.rank, err.threadblock, err.step) == (1, 0, 4)
    assert "unmatched receive" in err.reason and "from rank 0" in err.reason


def test_size_mismatch() -> None:
    # rank 0's second send carries 2 chunks; rank 1's matching receive expects 1
    algo = with_step(two_rank_allreduce(), 0, 0, 2, srcoff=0, cnt=2)
    err = refusal(algo)
    assert (err.rank, err.threadblock, err.step) == (1, 0, 3)
    assert "receives 1 chunk(s) from rank 0" in err.reason and "sends 2" in err.reason


def test_cycle_of_receives_is_a_deadlock() -> None:
    # both ranks receive before they send: each waits for the other's send
    ranks = [rank(r, (1, 1, 0), tb(0, 1 - r, 1 - r, st("r", ("i", 0), ("o", 0)), st("s", ("i", 0))))
             for r in range(2)]
    err = refusal(program("custom", 1, ranks), Postcondition({}))
    assert err.reason.startswith("deadlock")
    for r in range(2):
        assert f"rank {r} tb 0 step 0 (r) waits for its matched send, rank {1 - r} tb 0 step 1" in err.reason
        assert f"rank {r} tb 0 step 1 (s) waits for the previous step of its threadblock" in err.reason


def test_dependency_cycle() -> None:
    # tb 0 step 1 waits for tb 1 step 0, which waits for tb 0 step 1
    r0 = rank(0, (2, 0, 0), tb(0, -1, -1, st("nop"), st("cpy", ("i", 0), ("i", 1), dep=(1, 0))),
              tb(1, -1, -1, st("nop", dep=(0, 1))))
    err = refusal(program("custom", 2, [r0]), Postcondition({}))
    assert err.reason.startswith("deadlock") and "waits for its dependency" in err.reason
    assert err.rank == 0 and (err.threadblock, err.step) in ((0, 1), (1, 0))


def race(err: ProgramError) -> set[tuple[int, int, int]]:
    """The two steps a race report names: its location and the step in its reason."""
    m = re.search(r"rank (\d+) tb (\d+) step (\d+)", err.reason)
    assert m is not None and err.rank is not None and err.threadblock is not None and err.step is not None
    return {(err.rank, err.threadblock, err.step), tuple(int(g) for g in m.groups())}  # type: ignore[misc]


def test_race_between_threadblocks() -> None:
    # a second threadblock copies i0 to scratch while the first one reduces into i0, unordered
    algo = two_rank_allreduce()
    r0 = dataclasses.replace(algo.ranks[0], s_chunks=1,
                             threadblocks=algo.ranks[0].threadblocks + (tb(1, -1, -1, st("cpy", ("i", 0), ("s", 0))),))
    found = checker.problems(dataclasses.replace(algo, ranks=(r0, algo.ranks[1])))
    # unordered with every step of tb 0: only the rrc (step 1) writes i0; the send (step 2) only reads it
    assert [race(p) for p in found] == [{(0, 0, 1), (0, 1, 0)}]
    assert found[0].reason.startswith("data race on r0.i0: this step")
    assert "writes" in found[0].reason and "reads" in found[0].reason
    # ordered after the final receive of tb 0 (step 3), it is no race and the program is right
    r0 = dataclasses.replace(r0, threadblocks=algo.ranks[0].threadblocks + (
        tb(1, -1, -1, st("cpy", ("i", 0), ("s", 0), dep=(0, 3))),))
    checker.check(dataclasses.replace(algo, ranks=(r0, algo.ranks[1])))


def test_race_two_writes() -> None:
    # rank 0 receives the final sum of chunk 1 on tb 0 while tb 1 copies chunk 0 over chunk 1
    algo = two_rank_allreduce()
    r0 = dataclasses.replace(algo.ranks[0], threadblocks=algo.ranks[0].threadblocks + (
        tb(1, -1, -1, st("cpy", ("i", 0), ("i", 1), dep=(0, 2))),))
    found = checker.problems(dataclasses.replace(algo, ranks=(r0, algo.ranks[1])))
    assert [race(p) for p in found] == [{(0, 0, 3), (0, 1, 0)}]
    assert found[0].reason.startswith("data race on r0.i1") and found[0].reason.count("writes it") == 2


def test_wrong_postcondition_copy() -> None:
    # rank 0 sends back the unreduced chunk 1 instead of its sum of chunk 0
    err = refusal(with_step(two_rank_allreduce(), 0, 0, 2, srcoff=1, dstoff=1))
    assert (err.rank, err.threadblock, err.step) == (1, 0, 3)
    assert "r1.i0 must hold the reduction of r0.i0, r1.i0, each once, but holds r0.i1" in err.reason


def test_wrong_postcondition_reduced_twice() -> None:
    # rank 0 reduces the received part into chunk 0 and then adds its own input again
    algo = two_rank_allreduce()
    steps = list(algo.ranks[0].threadblocks[0].steps)
    steps.insert(2, st("re", ("i", 0), ("i", 0)))  # i0 ← i0 ⊕ i0
    steps = [dataclasses.replace(s, s=n) for n, s in enumerate(steps)]
    err = refusal(with_tb(algo, 0, 0, steps=tuple(steps)))
    assert err.rank == 0 and "r0.i0 must hold the reduction of r0.i0, r1.i0, each once" in err.reason
    assert (err.threadblock, err.step) == (0, 2)


def test_output_never_written() -> None:
    # out-of-place broadcast where rank 1 never writes its output
    ranks = [rank(0, (1, 1, 0), tb(0, 1, -1, st("s")), tb(1, -1, -1, st("cpy", ("i", 0), ("o", 0)))),
             rank(1, (1, 1, 0), tb(0, -1, 0, st("r", ("i", 0), ("i", 0))))]
    err = refusal(program("broadcast", 1, ranks, inplace=False))
    assert err.rank == 1 and err.threadblock is None
    assert "r1.o0 must hold r0.i0, but holds r1.o0 (never written: its initial value)" in err.reason


def test_out_of_range_offset() -> None:
    err = refusal(with_step(two_rank_allreduce(), 1, 0, 1, srcoff=2, dstoff=2))
    assert (err.rank, err.threadblock, err.step) == (1, 0, 1)
    assert "src chunks [2, 3) of buffer 'i' outside its 2 chunks on rank 1" in err.reason


def test_cnt_past_the_end() -> None:
    err = refusal(with_step(two_rank_allreduce(), 0, 0, 3, cnt=2))
    assert (err.rank, err.threadblock, err.step) == (0, 0, 3)
    assert "dst chunks [1, 3)" in err.reason


def test_peer_is_self() -> None:
    err = refusal(with_tb(two_rank_allreduce(), 1, 0, send=1))
    assert (err.rank, err.threadblock, err.step) == (1, 0, None)
    assert "send peer 1 is the rank itself" in err.reason


def test_two_threadblocks_on_one_peer_and_channel() -> None:
    algo = two_rank_allreduce()
    r0 = dataclasses.replace(algo.ranks[0], threadblocks=algo.ranks[0].threadblocks + (tb(1, 1, -1),))
    err = refusal(dataclasses.replace(algo, ranks=(r0, algo.ranks[1])))
    assert (err.rank, err.threadblock) == (0, 1)
    assert "threadblocks 0 and 1 both send to rank 1 on channel 0" in err.reason
    # on another channel the same threadblock is fine
    r0 = dataclasses.replace(algo.ranks[0], threadblocks=algo.ranks[0].threadblocks + (tb(1, 1, -1, chan=1),))
    checker.check(dataclasses.replace(algo, ranks=(r0, algo.ranks[1]), nchannels=2))


def test_different_reduction_orders_are_accepted_as_order_dependent() -> None:
    # rank 0 computes (a+b)+c, rank 1 (c+a)+b: the same multiset, different float results (once refused)
    determinism = checker.check(direct_allreduce([[0, 1, 2], [2, 0, 1], [0, 1, 2]]), source="prog.xml")
    assert determinism.kind == "order-dependent" and not determinism.bitwise
    (diff,) = determinism.differences
    assert diff.sources == {ChunkRef(r, "i", 0) for r in range(3)} and diff.ranks == (0, 1, 2)
    assert diff.trees == (("((r0.i0+r1.i0)+r2.i0)", (ChunkRef(0, "o", 0), ChunkRef(2, "o", 0))),
                          ("((r0.i0+r2.i0)+r1.i0)", (ChunkRef(1, "o", 0),)))
    said = "\n".join(determinism.explain())
    assert "r0.o0, r2.o0 = ((r0.i0+r1.i0)+r2.i0); r1.o0 = ((r0.i0+r2.i0)+r1.i0)" in said


def test_associativity_is_not_assumed() -> None:
    # rank 1 computes (b+c)+a = a+(b+c), not (a+b)+c
    determinism = checker.check(direct_allreduce([[0, 1, 2], [1, 2, 0], [0, 1, 2]]))
    assert determinism.kind == "order-dependent"
    assert "r1.o0 = ((r1.i0+r2.i0)+r0.i0)" in determinism.differences[0].describe()


# --- well-formed details ----------------------------------------------------------------------------


def test_problems_lists_every_problem_of_the_stage() -> None:
    algo = with_tb(with_step(two_rank_allreduce(), 1, 0, 1, srcoff=5), 0, 0, chan=3)
    found = checker.problems(algo, source="prog.xml")
    reasons = [p.reason for p in found]
    assert any("channel 3 outside 0..0" in r for r in reasons)
    assert any("src chunks [5, 6)" in r for r in reasons)
    assert all(p.source == "prog.xml" for p in found)
    assert checker.problems(two_rank_allreduce()) == []


@pytest.mark.parametrize(("change", "where", "words"), [
    (lambda a: with_step(a, 0, 0, 1, depid=7, deps=0), (0, 0, 1), "depends on threadblock 7"),
    (lambda a: with_step(a, 0, 0, 1, depid=0, deps=9), (0, 0, 1), "depends on step 9 of threadblock 0"),
    (lambda a: with_step(a, 0, 0, 1, depid=0, deps=1), (0, 0, 1), "depends on itself"),
    (lambda a: with_step(a, 0, 0, 1, cnt=0), (0, 0, 1), "cnt=0"),
    (lambda a: with_step(a, 0, 0, 1, s=5), (0, 0, 1), "s=5 at position 1"),
    (lambda a: with_step(a, 0, 0, 1, srcbuf="x"), (0, 0, 1), "buffer 'x'"),
    (lambda a: with_tb(a, 0, 0, recv=-1), (0, 0, 1), "receives but the threadblock has no receive peer"),
    (lambda a: with_tb(a, 1, 0, send=-1), (1, 0, 0), "sends but the threadblock has no send peer"),
    (lambda a: with_tb(a, 1, 0, recv=2), (1, 0, None), "recv peer 2 is outside 0..1"),
    (lambda a: dataclasses.replace(a, ngpus=3), (None, None, None), "ngpus=3 but the program has 2 ranks"),
])
def test_well_formed(change, where, words) -> None:  # type: ignore[no-untyped-def]
    err = refusal(change(two_rank_allreduce()))
    assert (err.rank, err.threadblock, err.step) == where
    assert words in err.reason


def test_chunk_count_against_the_collective() -> None:
    # labelled all-gather for 8 ranks with 2 output chunks: a pairwise exchange, not an all-gather
    ranks = [rank(r, (0, 2, 0)) for r in range(8)]
    err = refusal(program("allgather", 2, ranks))
    assert "o_chunks=2" in err.reason and "rank count 8" in err.reason
    # in-place all-reduce keeps its result in i: an output buffer is a contradiction
    algo = two_rank_allreduce()
    err = refusal(dataclasses.replace(algo, ranks=(dataclasses.replace(algo.ranks[0], o_chunks=2), algo.ranks[1])))
    assert err.rank == 0 and "needs o_chunks=0, got 2" in err.reason


def test_reducing_a_chunk_with_itself_stays_cheap() -> None:
    # 300 doublings: a tree of 2**300 leaves, checked in linear time and refused for its count
    steps = [st("re", ("i", 0), ("i", 0)) for _ in range(300)]
    algo = program("allreduce", 1, [rank(0, (1, 0, 0), tb(0, -1, -1, *steps))])
    t0 = time.perf_counter()
    err = refusal(algo)
    assert time.perf_counter() - t0 < 1.0
    assert "r0.i0 must hold r0.i0" in err.reason and (err.threadblock, err.step) == (0, 299)
    assert len(err.reason) < 400  # the tree is shown cut short


def test_a_program_too_large_to_check_is_refused_at_once() -> None:
    # one step over two billion chunks: refused before anything walks them
    huge = program("allreduce", 1, [rank(0, (2**31 - 1, 0, 0), tb(0, -1, -1, st("re", cnt=2**31 - 1)))])
    t0 = time.perf_counter()
    err = refusal(huge)
    assert time.perf_counter() - t0 < 0.1 and err.reason.startswith("too large to check")
    many = program("custom", 1, [rank(0, (1, 0, 0), tb(0, -1, -1, *[st("nop")] * (checker.MAX_STEPS + 1)))])
    assert f"{checker.MAX_STEPS + 1} steps" in refusal(many, Postcondition({})).reason


# --- postconditions ---------------------------------------------------------------------------------


def refs(*items: tuple[int, str, int]) -> frozenset[ChunkRef]:
    return frozenset(ChunkRef(*i) for i in items)


def test_builtin_postconditions_by_hand() -> None:
    def algo(coll: str, c: int, shape: tuple[int, int, int], inplace: bool, n: int = 2) -> Algorithm:
        return program(coll, c, [rank(r, shape) for r in range(n)], inplace=inplace)

    # alltoall, 2 ranks, 4 chunks (k = 2): o[r][q·2+j] = i[q][r·2+j]
    post = postcondition.for_algorithm(algo("alltoall", 4, (4, 4, 0), False)).expect
    assert len(post) == 8
    assert post[ChunkRef(0, "o", 1)] == refs((0, "i", 1))
    assert post[ChunkRef(0, "o", 2)] == refs((1, "i", 0))
    assert post[ChunkRef(1, "o", 1)] == refs((0, "i", 3))
    assert post[ChunkRef(1, "o", 3)] == refs((1, "i", 3))
    # in-place all-gather, 2 ranks, k = 1: o[r][q] = initial o[q][q]
    post = postcondition.for_algorithm(algo("allgather", 2, (0, 2, 0), True)).expect
    assert post[ChunkRef(0, "o", 1)] == refs((1, "o", 1)) and post[ChunkRef(1, "o", 1)] == refs((1, "o", 1))
    # out-of-place all-gather, 2 ranks, k = 2: o[r][q·2+j] = i[q][j]
    post = postcondition.for_algorithm(algo("allgather", 4, (2, 4, 0), False)).expect
    assert post[ChunkRef(0, "o", 3)] == refs((1, "i", 1))
    # reduce-scatter, 3 ranks, 3 chunks, out-of-place: o[r][0] = ⊕_q i[q][r]
    post = postcondition.for_algorithm(algo("reducescatter", 3, (3, 1, 0), False, n=3)).expect
    assert post == {ChunkRef(r, "o", 0): refs(*((q, "i", r) for q in range(3))) for r in range(3)}
    # in-place reduce-scatter: i[r][r] = ⊕_q i[q][r], nothing else specified
    post = postcondition.for_algorithm(algo("reducescatter", 3, (3, 0, 0), True, n=3)).expect
    assert post == {ChunkRef(r, "i", r): refs(*((q, "i", r) for q in range(3))) for r in range(3)}
    # broadcast from rank 0, in-place
    post = postcondition.for_algorithm(algo("broadcast", 2, (2, 0, 0), True)).expect
    assert post == {ChunkRef(r, "i", c): refs((0, "i", c)) for r in range(2) for c in range(2)}
    # all-reduce out-of-place
    post = postcondition.for_algorithm(algo("allreduce", 1, (1, 1, 0), False)).expect
    assert post == {ChunkRef(r, "o", 0): refs((0, "i", 0), (1, "i", 0)) for r in range(2)}


def fanout() -> Algorithm:
    """Rank 0's input to ranks 1 and 2 (a custom collective)."""
    return program("custom", 1, [
        rank(0, (1, 0, 0), tb(0, 1, -1, st("s")), tb(1, 2, -1, st("s"), chan=1)),
        rank(1, (0, 1, 0), tb(0, -1, 0, st("r", ("o", 0)))),
        rank(2, (0, 1, 0), tb(0, -1, 0, st("r", ("o", 0)), chan=1)),
    ], inplace=False, nchannels=2)


def write_sidecar(path: Path, expect: list[dict[str, object]], **extra: object) -> Path:
    path.write_text(json.dumps({"file": "fan.xml", "meaning": "test", "expect": expect, **extra}))
    return path


def entry(r: int, buf: str, index: int, src: object) -> dict[str, object]:
    return {"rank": r, "buf": buf, "index": index, "from": src}


def src(r: int, buf: str = "i", index: int = 0) -> dict[str, object]:
    return {"rank": r, "buf": buf, "index": index}


def test_custom_with_sidecar_beside_the_file(tmp_path: Path) -> None:
    xml = tmp_path / "fan.xml"
    xml.write_text("<algo/>")  # the program is given as IR; the file only places the sidecar
    side = write_sidecar(tmp_path / "fan.post.json", [entry(1, "o", 0, src(0)), entry(2, "o", 0, src(0))])
    assert postcondition.sidecar_path(xml) == side
    checker.check(fanout(), source=str(xml))
    # a sidecar that asks for more than the program does is refused where the slot is written
    write_sidecar(side, [entry(1, "o", 0, [src(0), src(2, "o")])])
    with pytest.raises(ProgramError) as info:
        checker.check(fanout(), source=str(xml))
    assert info.value.rank == 1 and "must hold the reduction of r0.i0, r2.o0, each once" in info.value.reason


def test_custom_without_sidecar_names_the_expected_path(tmp_path: Path) -> None:
    (tmp_path / "fan.xml").write_text("<algo/>")  # only its name matters here
    with pytest.raises(ProgramError) as info:
        checker.check(fanout(), source=str(tmp_path / "fan.xml"))
    assert str(tmp_path / "fan.post.json") in info.value.reason
    # a program that is no file (compiled in memory) is told to give its postcondition
    with pytest.raises(ProgramError, match="needs its postcondition"):
        checker.check(fanout(), source="fanout-program")


@pytest.mark.parametrize(("expect", "words"), [
    ([entry(1, "o", 0, src(0)), entry(1, "o", 0, src(0))], "listed twice"),
    ([entry(1, "o", 0, [src(0), src(0)])], "source r0.i0 is listed twice"),
    ([entry(1, "o", 0, [])], "empty list"),
    ([entry(3, "o", 0, src(0))], "rank 3 outside 0..2"),
    ([entry(1, "o", 1, src(0))], "index 1 outside buffer 'o' of 1 chunks"),
    ([entry(1, "o", 0, src(1))], "index 0 outside buffer 'i' of 0 chunks"),
    ([entry(1, "x", 0, src(0))], "buf must be one of i, o, s"),
    ([entry(True, "o", 0, src(0))], "rank must be a non-negative integer"),
    ([entry(1, "o", -1, src(0))], "index must be a non-negative integer"),
    ([entry(1, "o", 0, src(0, "s"))], "scratch chunk"),
    ([{"rank": 1, "buf": "o", "index": 0}], "exactly rank, buf, index and from"),
    ([entry(1, "o", 0, {"rank": 0, "buf": "i", "index": 0, "x": 1})], "exactly rank, buf and index"),
])
def test_sidecar_validation(tmp_path: Path, expect: list[dict[str, object]], words: str) -> None:
    side = write_sidecar(tmp_path / "fan.post.json", expect)
    with pytest.raises(ProgramError) as info:
        postcondition.for_algorithm(fanout(), side, source=str(tmp_path / "fan.xml"))
    assert words in info.value.reason
    assert info.value.source == str(side)


def test_sidecar_document_errors(tmp_path: Path) -> None:
    bad = tmp_path / "x.post.json"
    for text, words in (("[1]", "JSON object"), ("{", "not JSON"), ('{"expect": {}}', "'expect' must be a list"),
                        ('{"expect": [], "extra": 1}', "unknown sidecar fields")):
        bad.write_text(text)
        with pytest.raises(ProgramError, match=words):
            postcondition.load_sidecar(bad)
    with pytest.raises(ProgramError, match="cannot read"):
        postcondition.load_sidecar(tmp_path / "missing.post.json")
    # a hand-made postcondition naming a buffer that does not exist is refused, not a KeyError
    with pytest.raises(ProgramError, match="buffer 'x' is not one of i, o, s"):
        checker.check(fanout(), Postcondition({ChunkRef(1, "x", 0): refs((0, "i", 0))}))
    # a sidecar written for another file
    write_sidecar(bad, [entry(1, "o", 0, src(0))])
    with pytest.raises(ProgramError, match="describes 'fan.xml', not 'x.xml'"):
        postcondition.for_algorithm(fanout(), bad, source=str(tmp_path / "x.xml"))


# --- the third-party files ------------------------------------------------------------------------


@needs_files
def test_every_accepted_file_is_accepted_quickly(capsys: pytest.CaptureFixture[str]) -> None:
    assert MSCCL is not None
    assert sorted(p.name for p in MSCCL.glob("*.xml") if not p.name.startswith("NEG")) == sorted(ACCEPT)
    timings = []
    for name in ACCEPT:
        algo = mscclxml.load(MSCCL / name)
        t0 = time.perf_counter()
        found = checker.problems(algo, source=str(MSCCL / name))  # custom files: sidecar found beside
        elapsed = time.perf_counter() - t0
        assert found == [], (name, found)
        timings.append((name, elapsed))
        assert elapsed < 0.5, (name, elapsed)
    with capsys.disabled():
        print("\nchecker time per file: " + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in timings))


@needs_files
def test_the_negative_file_is_refused_for_its_output_chunk_count() -> None:
    assert MSCCL is not None
    path = MSCCL / "NEG_ns3_peer2peer_8r_labelled_allgather.xml"
    found = checker.problems(mscclxml.load(path), source=str(path))
    assert len(found) == 1 and found[0].source == str(path)
    assert "allgather over 8 ranks: o_chunks=2" in found[0].reason and "rank count 8" in found[0].reason


@needs_files
def test_accepted_files_analysis_matches_their_shape() -> None:
    """Every receive of the file is matched, and the output trees follow the collective."""
    assert MSCCL is not None
    for name in ACCEPT:
        algo = mscclxml.load(MSCCL / name)
        analysis = checker.analyze(algo, source=str(MSCCL / name))
        assert analysis.determinism.kind == "bitwise", name  # every published file reduces in one order
        receives = sum(s.type.receives for r in algo.ranks for t in r.threadblocks for s in t.steps)
        assert len(analysis.transfers) == receives
        assert len(analysis.order) == sum(len(t.steps) for r in algo.ranks for t in r.threadblocks)
        for slot, sources in analysis.post:
            tree = analysis.outputs[slot]
            assert tree.size == len(sources)
            assert tree.is_leaf == (len(sources) == 1)


@needs_files
def test_a_wrong_sidecar_on_a_real_file_is_refused(tmp_path: Path) -> None:
    assert MSCCL is not None
    doc = json.loads((MSCCL / "alltonext_fwd_2x8_16r.post.json").read_text())
    for e in doc["expect"]:
        if (e["rank"], e["index"]) == (2, 3):
            e["from"] = {"rank": 0, "buf": "i", "index": 3}  # rank 2 gets rank 1's input, not rank 0's
    side = tmp_path / "alltonext_fwd_2x8_16r.post.json"
    side.write_text(json.dumps(doc))
    algo = mscclxml.load(MSCCL / "alltonext_fwd_2x8_16r.xml")
    with pytest.raises(ProgramError) as info:
        checker.check(algo, postcondition.load_sidecar(side), source=str(MSCCL / "alltonext_fwd_2x8_16r.xml"))
    err = info.value
    assert err.rank == 2 and "r2.o3 must hold r0.i3, but holds r1.i3" in err.reason


@needs_files
def test_a_ring_whose_ranks_all_receive_first_deadlocks() -> None:
    assert MSCCL is not None
    algo = mscclxml.load(MSCCL / "ar_ring_4r_fused.xml")
    for r in range(4):  # swap each rank's first two steps: 's' then 'rrs' becomes 'rrs' then 's'
        steps = algo.ranks[r].threadblocks[0].steps
        swapped = (dataclasses.replace(steps[1], s=0), dataclasses.replace(steps[0], s=1), *steps[2:])
        algo = with_tb(algo, r, 0, steps=swapped)
    err = refusal(algo)
    assert err.reason.startswith("deadlock")
    assert all(f"rank {r} tb 0 step 0 (rrs) waits for its matched send" in err.reason for r in range(4))


def brute_force_race(algo: Algorithm) -> bool:
    """An independent reference: the happens-before closure by DFS, then every pair of accesses."""
    steps = {(r.id, t.id, n): (t, s) for r in algo.ranks for t in r.threadblocks for n, s in enumerate(t.steps)}
    succ: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {k: [] for k in steps}
    sends: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
    recvs: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
    for (r, t, n), (block, step) in steps.items():
        if n:
            succ[(r, t, n - 1)].append((r, t, n))
        if step.depid >= 0:
            succ[(r, step.depid, step.deps)].append((r, t, n))
        if step.type.sends:
            sends.setdefault((r, block.send, block.chan), []).append((r, t, n))
        if step.type.receives:
            recvs.setdefault((block.recv, r, block.chan), []).append((r, t, n))
    for key, ss in sends.items():
        for a, b in zip(ss, recvs[key], strict=True):
            succ[a].append(b)

    def reach(a: tuple[int, int, int]) -> set[tuple[int, int, int]]:
        seen, todo = set(), [a]
        while todo:
            for nxt in succ[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    after = {k: reach(k) for k in steps}
    touch: dict[tuple[int, int, int], list[tuple[int, str, int, bool]]] = {}
    for (r, t, n), (_, step) in steps.items():
        acc = []
        if step.type.reads_src:
            acc += [(r, step.srcbuf, c, False) for c in range(step.srcoff, step.srcoff + step.cnt)]
        if step.type.writes_dst:
            acc += [(r, step.dstbuf, c, True) for c in range(step.dstoff, step.dstoff + step.cnt)]
        touch[(r, t, n)] = acc
    for a, b in combinations(steps, 2):
        for ra, ba, ca, wa in touch[a]:
            for rb, bb, cb, wb in touch[b]:
                if (ra, ba, ca) == (rb, bb, cb) and (wa or wb) and b not in after[a] and a not in after[b]:
                    return True
    return False


@needs_files
@pytest.mark.parametrize("name", ["ar_bintree_4r_2chunks.xml", "ar_hierarchical_2x2.xml", "ar_rdh_4r.xml",
                                  "a2a_twostep_2x2.xml", "ag_syccl_4r_outofplace.xml"])
def test_races_agree_with_brute_force_when_a_dependency_is_dropped(name: str) -> None:
    """Drop each dependency of a real file in turn: the checker finds a race exactly when the
    all-pairs reference does (some dependencies are implied through other ranks; those are no race)."""
    assert MSCCL is not None
    algo = mscclxml.load(MSCCL / name)
    assert not brute_force_race(algo)
    verdicts = []
    for r, rank_ in enumerate(algo.ranks):
        for t, block in enumerate(rank_.threadblocks):
            for n, step in enumerate(block.steps):
                if step.depid < 0:
                    continue
                mutant = with_step(algo, r, t, n, depid=-1, deps=-1)
                found = checker.problems(mutant)
                raced = bool(found) and found[0].reason.startswith("data race")
                assert raced == brute_force_race(mutant), (r, t, n, found[:1])
                assert raced or not found, found[:1]  # no race: then the program is still right
                verdicts.append(raced)
    assert any(verdicts)


def test_an_oversized_sidecar_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postcondition, "MAX_SIDECAR_BYTES", 100)
    side = write_sidecar(tmp_path / "fan.post.json", [entry(1, "o", 0, src(0)), entry(2, "o", 0, src(0))])
    with pytest.raises(ProgramError, match="limit on sidecar files"):
        postcondition.load_sidecar(side)


def run_numbers(algo: Algorithm, rng: np.random.Generator, leaves: dict[ChunkRef, np.float32]) -> dict[ChunkRef, np.float32]:
    """An independent chunk-level run in float32: a random ready step at a time (any schedule)."""
    state = dict(leaves)
    nxt = {(r.id, t.id): 0 for r in algo.ranks for t in r.threadblocks}
    blocks = {(r.id, t.id): t for r in algo.ranks for t in r.threadblocks}
    queues: dict[tuple[int, int, int], list[list[np.float32]]] = {}  # (src, dst, chan) → data in flight
    while True:
        ready = []
        for (r, t), s in nxt.items():
            block = blocks[(r, t)]
            if s == len(block.steps):
                continue
            step = block.steps[s]
            if step.depid >= 0 and nxt[(r, step.depid)] <= step.deps:
                continue
            if step.type.receives and not queues.get((block.recv, r, block.chan)):
                continue
            ready.append((r, t))
        if not ready:
            break
        r, t = ready[rng.integers(len(ready))]
        block = blocks[(r, t)]
        step = block.steps[nxt[(r, t)]]
        nxt[(r, t)] += 1
        kind = step.type
        src = [state[ChunkRef(r, step.srcbuf, step.srcoff + k)] for k in range(step.cnt)] if kind.reads_src else None
        got = queues[(block.recv, r, block.chan)].pop(0) if kind.receives else None
        if kind is StepType.REDUCE:
            out = [np.float32(state[ChunkRef(r, step.dstbuf, step.dstoff + k)] + v) for k, v in enumerate(src)]
        elif kind.reduces:
            out = [np.float32(a + b) for a, b in zip(src, got, strict=True)]
        else:
            out = got if got is not None else src
        if kind.sends:
            queues.setdefault((r, block.send, block.chan), []).append(out)
        if kind.writes_dst:
            for k, v in enumerate(out):
                state[ChunkRef(r, step.dstbuf, step.dstoff + k)] = v
    assert all(s == len(blocks[key].steps) for key, s in nxt.items()), "the run stopped early"
    return state


def evaluate(tree, leaves: dict[ChunkRef, np.float32]) -> np.float32:  # type: ignore[no-untyped-def]
    if tree.is_leaf:
        return leaves[tree.source]
    a, b = (evaluate(c, leaves) for c in tree.children)
    return np.float32(a + b)


@needs_files
@pytest.mark.parametrize("name", ACCEPT)
def test_trees_predict_the_float_bits_of_every_schedule(name: str) -> None:
    """Run each accepted file in float32 under random schedules: every output equals its tree
    evaluated in float32, bit for bit, whatever the schedule (no race, and the tree is the order
    the runtime adds in); and all ranks holding one sum hold the same bits."""
    assert MSCCL is not None
    algo = mscclxml.load(MSCCL / name)
    analysis = checker.analyze(algo, source=str(MSCCL / name))
    rng = np.random.default_rng(12)
    leaves = {ChunkRef(r.id, b, c): np.float32(rng.standard_normal())
              for r in algo.ranks for b in ("i", "o", "s") for c in range(r.chunks(b))}
    for _ in range(3):
        state = run_numbers(algo, rng, leaves)
        for slot, tree in analysis.outputs.items():
            assert state[slot].tobytes() == evaluate(tree, leaves).tobytes(), (slot, tree)
    sums: dict[frozenset[ChunkRef], set[bytes]] = {}
    for slot, sources in analysis.post:
        sums.setdefault(sources, set()).add(state[slot].tobytes())
    assert all(len(bits) == 1 for bits in sums.values())
    # the test has teeth: with these leaves the order of the additions shows in the bits
    if algo.coll == "allreduce":
        def fold(order: tuple[ChunkRef, ...]) -> bytes:
            acc = leaves[order[0]]
            for ref in order[1:]:
                acc = np.float32(acc + leaves[ref])
            return acc.tobytes()

        assert any(len({fold(p) for p in permutations(sorted(sources))}) > 1 for sources in sums)
