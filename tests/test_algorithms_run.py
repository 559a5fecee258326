"""Running programs: the layout of uneven counts, one step's semantics, the simulator, the
interpreter over in-memory transports, and ``commd algo``.

References are independent of the code under test: NumPy reductions written out here,
hand-computed layouts and step effects, and the third-party MSCCL files of shared/msccl
(whose meaning their README states).  The interpreter runs one thread per rank over the
fake transport of test_lane_transport (FIFO per peer, ``done`` inside ``wait``, a deadline).
"""

from __future__ import annotations

import functools
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import msccl_files_dir
from test_lane_transport import network, on_nodes, run_ok

from commd.algorithms import library, mscclxml
from commd.algorithms.errors import ProgramError
from commd.algorithms.execute import Wiring, run_step, tiles
from commd.algorithms.interpreter import Plan, run
from commd.algorithms.ir import Algorithm, Rank, Step, StepType, Threadblock
from commd.algorithms.layout import rank_layout
from commd.algorithms.simulator import TraceRecord, format_trace, simulate
from commd.cli.main import main
from commd.lanes.base import TransportError
from commd.lanes.tcp.algorithms import ring_allreduce as native_ring_allreduce
from commd.lanes.tcp.handshake import MeshConnector, listen
from commd.lanes.tcp.transport import Exchange, Mesh

T = StepType




MSCCL_DIR = msccl_files_dir()
needs_files = pytest.mark.skipif(MSCCL_DIR is None, reason="the third-party MSCCL files (shared/msccl) are not here")
#: The files their README marks accept (the one marked reject starts with NEG_).
ACCEPTED = sorted(p.name for p in MSCCL_DIR.glob("*.xml") if not p.name.startswith("NEG_")) if MSCCL_DIR else []
UFUNCS = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


# --- hand-made programs --------------------------------------------------------------------------


def ring_allreduce(nranks: int) -> Algorithm:
    """In-place ring all-reduce, one chunk per rank, fused steps (s, rrcs…, rcs…, r)."""
    ranks = []
    for r in range(nranks):
        seq = [(T.SEND, r)]
        seq += [(T.RECV_REDUCE_COPY_SEND, (r - j) % nranks) for j in range(1, nranks)]
        seq += [(T.RECV_COPY_SEND, (r + 1 - m) % nranks) for m in range(1, nranks - 1)]
        seq.append((T.RECV, (r + 2) % nranks))
        steps = tuple(Step(s, t, "i", c, "i", c, 1) for s, (t, c) in enumerate(seq))
        ranks.append(Rank(r, nranks, 0, 0, (Threadblock(0, (r + 1) % nranks, (r - 1) % nranks, 0, steps),)))
    return Algorithm(f"ring{nranks}", "allreduce", nranks, nranks, 1, True, tuple(ranks))


def scratch_allreduce_2r() -> Algorithm:
    """Out-of-place 2-rank all-reduce: send both chunks at once (cnt=2), receive them into scratch
    on another threadblock, then reduce into the output on a third that depends on the receive."""
    ranks = []
    for r in range(2):
        peer = 1 - r
        tbs = (Threadblock(0, peer, -1, 0, (Step(0, T.SEND, "i", 0, "i", 0, 2),)),
               Threadblock(1, -1, peer, 0, (Step(0, T.RECV, "i", 0, "s", 0, 2),)),
               Threadblock(2, -1, -1, 0, (Step(0, T.COPY, "i", 0, "o", 0, 2),
                                          Step(1, T.REDUCE, "s", 0, "o", 0, 2, depid=1, deps=0))))
        ranks.append(Rank(r, 2, 2, 2, tbs))
    return Algorithm("scratch2", "allreduce", 2, 2, 1, False, tuple(ranks))


def swap_2r(first: StepType = T.SEND) -> Algorithm:
    """Each rank sends chunk 0 to the other and receives the other's into it: not an all-reduce.
    With ``first=RECV`` both ranks receive before they send: a deadlock."""
    ranks = []
    for r in range(2):
        send, recv = Step(0, T.SEND, "i", 0, "i", 0, 1), Step(0, T.RECV, "i", 0, "i", 0, 1)
        steps = (send, Step(1, T.RECV, "i", 0, "i", 0, 1)) if first is T.SEND else (recv, Step(1, T.SEND, "i", 0,
                                                                                               "i", 0, 1))
        ranks.append(Rank(r, 1, 0, 0, (Threadblock(0, 1 - r, 1 - r, 0, steps),)))
    return Algorithm("swap", "allreduce", 2, 1, 1, True, tuple(ranks))


def ring_reducescatter(nranks: int, inplace: bool) -> Algorithm:
    """Ring reduce-scatter: chunk c starts at rank c+1 and is reduced on its way to rank c with
    ``rrs`` (reduce and pass on, no local write), finished by ``rrc``: into ``i[r]`` in place,
    else into ``o[0]``."""
    ranks = []
    for r in range(nranks):
        steps = [Step(0, T.SEND, "i", (r - 1) % nranks, "i", (r - 1) % nranks, 1)]
        for j in range(1, nranks):
            c = (r - 1 - j) % nranks
            last = j == nranks - 1
            kind = T.RECV_REDUCE_COPY if last else T.RECV_REDUCE_SEND
            dst = ("i", r) if inplace or not last else ("o", 0)
            steps.append(Step(j, kind, "i", c, dst[0], dst[1], 1))
        ranks.append(Rank(r, nranks, 0 if inplace else 1, 0,
                          (Threadblock(0, (r + 1) % nranks, (r - 1) % nranks, 0, tuple(steps)),)))
    return Algorithm("rs", "reducescatter", nranks, nranks, 1, inplace, tuple(ranks))


def ring_allgather_in_place(nranks: int) -> Algorithm:
    """In-place ring all-gather: rank r's input already sits at ``o[r]`` (s, rcs…, r)."""
    ranks = []
    for r in range(nranks):
        seq = [(T.SEND, r)] + [(T.RECV_COPY_SEND, (r - j) % nranks) for j in range(1, nranks - 1)]
        seq.append((T.RECV, (r + 1) % nranks))
        steps = tuple(Step(s, t, "o", c, "o", c, 1) for s, (t, c) in enumerate(seq))
        ranks.append(Rank(r, 0, nranks, 0, (Threadblock(0, (r + 1) % nranks, (r - 1) % nranks, 0, steps),)))
    return Algorithm("ag", "allgather", nranks, nranks, 1, True, tuple(ranks))


def chain_broadcast(nranks: int) -> Algorithm:
    """Out-of-place chain broadcast from rank 0 (copy, s; rcs…; r), two chunks per step."""
    ranks = [Rank(0, 2, 2, 0, (Threadblock(0, 1, -1, 0, (Step(0, T.SEND, "i", 0, "i", 0, 2),)),
                               Threadblock(1, -1, -1, 0, (Step(0, T.COPY, "i", 0, "o", 0, 2),))))]
    for r in range(1, nranks):
        kind, send = (T.RECV_COPY_SEND, r + 1) if r < nranks - 1 else (T.RECV, -1)
        ranks.append(Rank(r, 2, 2, 0, (Threadblock(0, send, r - 1, 0, (Step(0, kind, "i", 0, "o", 0, 2),)),)))
    return Algorithm("bc", "broadcast", nranks, 2, 1, False, tuple(ranks))


def reduce_all(arrays: list[np.ndarray], op: str) -> np.ndarray:
    return functools.reduce(UFUNCS[op], arrays[1:], arrays[0].copy())


def expected_outputs(algo: Algorithm, inputs: list[np.ndarray], op: str) -> list[np.ndarray | None]:
    """NumPy's answer per rank (None where the collective leaves a rank's output open)."""
    n = algo.ngpus
    if algo.coll == "allreduce":
        return [reduce_all(inputs, op)] * n
    if algo.coll == "allgather":
        return [np.concatenate(inputs)] * n
    if algo.coll == "alltoall":
        b = inputs[0].size // n
        return [np.concatenate([inputs[s][r * b:(r + 1) * b] for s in range(n)]) for r in range(n)]
    raise AssertionError(algo.coll)


def custom_expectation(name: str, inputs: list[np.ndarray], count: int) -> dict[int, np.ndarray]:
    """Rank -> expected output, read straight from the sidecar JSON: every file here maps output
    chunk c of a rank to one input chunk of another; ``count`` is split over nchunksperloop
    chunks as the native ring splits a tensor (the first count % C chunks one element longer)."""
    doc = json.loads((MSCCL_DIR / name.replace(".xml", ".post.json")).read_text())
    algo = mscclxml.load(MSCCL_DIR / name)
    base, rem = divmod(count, algo.nchunksperloop)

    def span(c: int) -> slice:
        return slice(c * base + min(c, rem), (c + 1) * base + min(c + 1, rem))

    outputs: dict[int, np.ndarray] = {}
    for entry in doc["expect"]:
        src = entry["from"]
        assert isinstance(src, dict) and src["buf"] == "i" and entry["buf"] == "o"
        size = span(algo.ranks[entry["rank"]].o_chunks - 1).stop
        out = outputs.setdefault(entry["rank"], np.zeros(size, inputs[0].dtype))
        out[span(entry["index"])] = inputs[src["rank"]][span(src["index"])]
    return outputs


def make_inputs(algo: Algorithm, count: int, dtype: str, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    layouts = [rank_layout(algo, r, count) for r in range(algo.ngpus)]
    if np.dtype(dtype).kind == "f":
        return [rng.uniform(-1, 1, lay.input_elements).astype(dtype) for lay in layouts]
    return [rng.integers(-1000, 1000, lay.input_elements).astype(dtype) for lay in layouts]


def interpret(algo: Algorithm, inputs: list[np.ndarray], op: str = "sum", tile_bytes: int = 1 << 20,
              count: int | None = None, wait_s: float = 10.0) -> tuple[list[np.ndarray], list, list[Plan]]:
    """Every rank on a thread of its own over the fake transport; (outputs, transports, plans)."""
    n = algo.ngpus
    count = inputs[0].size if count is None else count
    plans = [Plan.build(algo, r, count, inputs[0].dtype, tile_bytes) for r in range(n)]
    outputs = [np.zeros(p.layout.output_elements, inputs[0].dtype) for p in plans]
    transports = network(n, wait_s=wait_s)
    run_ok([lambda r=r: run(plans[r], transports[r], list(range(n)), inputs[r], outputs[r], op)
            for r in range(n)])
    return outputs, transports, plans


# --- layout -------------------------------------------------------------------------------------


def test_layout_of_uneven_and_scaled_counts_by_hand() -> None:
    four = Algorithm("a", "allreduce", 2, 4, 1, False, (Rank(0, 4, 4, 1, ()), Rank(1, 4, 4, 1, ())))
    lay = rank_layout(four, 0, 10)  # 10 elements in 4 chunks: 3 3 2 2, each in q = 3 working elements
    assert (lay.q, lay.i.working_elements, lay.i.padded, lay.s.working_elements, lay.alias) == (3, 12, True, 3, None)
    assert [lay.i.chunk_range(c) for c in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    working = np.full(12, -1)
    lay.i.load(np.arange(10), working)
    assert working.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, -1, 8, 9, -1]
    back = np.zeros(10, int)
    lay.i.store(working, back)
    assert back.tolist() == list(range(10))
    lay = rank_layout(four, 1, 2)  # fewer elements than chunks: 1 1 0 0
    assert (lay.q, lay.o.working_elements, lay.o.user_elements, lay.o.chunk_range(3)) == (1, 4, 2, (2, 0))
    assert not rank_layout(four, 0, 12).i.padded  # 12 = 4 × 3: the user's memory is used as is

    ag = Algorithm("g", "allgather", 3, 3, 1, False, tuple(Rank(r, 1, 3, 0, ()) for r in range(3)))
    lay = rank_layout(ag, 2, 5)
    assert (lay.i.user_elements, lay.o.user_elements, lay.o.chunk_range(2), lay.o.padded) == (5, 15, (10, 5), False)
    ag_in_place = Algorithm("g", "allgather", 3, 3, 1, True, tuple(Rank(r, 0, 3, 0, ()) for r in range(3)))
    assert rank_layout(ag_in_place, 2, 5).alias == ("i", "o", 2)  # the input sits at o[2·k …]

    a2a = Algorithm("t", "alltoall", 4, 8, 1, False, tuple(Rank(r, 8, 8, 0, ()) for r in range(4)))
    lay = rank_layout(a2a, 0, 12)  # 4 blocks of 3 elements, 2 chunks each (2 + 1), q = 2
    assert (lay.q, lay.i.blocks, lay.i.chunk_range(6), lay.i.chunk_range(7)) == (2, 4, (9, 2), (11, 1))
    working = np.zeros(16, int)
    lay.i.load(np.arange(1, 13), working)
    assert working.tolist() == [1, 2, 3, 0, 4, 5, 6, 0, 7, 8, 9, 0, 10, 11, 12, 0]
    with pytest.raises(ProgramError, match="divisible by 4, got 9"):
        rank_layout(a2a, 0, 9)


def test_uneven_all_to_all_blocks_land_whole_in_padded_chunks() -> None:
    # 4 ranks, 2 chunks per block, 3 elements per block: q = 2, each block's last chunk half padding
    ranks = []
    for r in range(4):
        steps = [Threadblock(p, p, p, 0, (Step(0, T.SEND, "i", 2 * p, "i", 2 * p, 2),
                                          Step(1, T.RECV, "o", 2 * p, "o", 2 * p, 2))) for p in range(4) if p != r]
        steps.append(Threadblock(4, -1, -1, 0, (Step(0, T.COPY, "i", 2 * r, "o", 2 * r, 2),)))
        ranks.append(Rank(r, 8, 8, 0, tuple(steps)))
    algo = Algorithm("a2a", "alltoall", 4, 8, 1, False, tuple(ranks))
    inputs = make_inputs(algo, 12, "int64")
    for got, want in zip(simulate(algo, inputs, tile_elements=1), expected_outputs(algo, inputs, "sum"), strict=True):
        np.testing.assert_array_equal(got, want)


# --- one step -----------------------------------------------------------------------------------


def test_each_step_type_on_one_tile_by_hand() -> None:
    def bufs() -> dict[str, np.ndarray]:  # q = 3: chunks of i are [0 1 2] [3 4 5]
        return {"i": np.arange(6, dtype=np.int64), "o": np.full(6, 100, np.int64), "s": np.zeros(3, np.int64)}

    got = np.array([[10, 20]])
    cases = [  # (type, src, dst, received) -> (sent, i, o)
        (T.SEND, ("i", 1), ("o", 0), None, [[4, 5]], None),
        (T.RECV, ("i", 0), ("o", 1), got, None, [100, 100, 100, 100, 10, 20]),
        (T.RECV_COPY_SEND, ("i", 0), ("o", 1), got, [[10, 20]], [100, 100, 100, 100, 10, 20]),
        (T.RECV_REDUCE_COPY, ("i", 1), ("o", 0), got, None, [100, 14, 25, 100, 100, 100]),
        (T.RECV_REDUCE_SEND, ("i", 1), ("o", 0), got, [[14, 25]], [100] * 6),
        (T.RECV_REDUCE_COPY_SEND, ("i", 1), ("o", 0), got, [[14, 25]], [100, 14, 25, 100, 100, 100]),
        (T.REDUCE, ("i", 1), ("o", 0), None, None, [100, 104, 105, 100, 100, 100]),
        (T.COPY, ("i", 1), ("o", 1), None, None, [100, 100, 100, 100, 4, 5]),
        (T.NOP, ("i", 1), ("o", 1), None, None, [100] * 6),
    ]
    for kind, (sb, so), (db, do), received, sent, out in cases:
        b = bufs()
        result = run_step(Step(0, kind, sb, so, db, do, 1), b, 3, 1, 3, "sum", received)  # tile [1, 3)
        assert (result is None) == (sent is None), kind
        if sent is not None:
            np.testing.assert_array_equal(result, sent, err_msg=str(kind))
        np.testing.assert_array_equal(b["o"], out if out is not None else [100] * 6, err_msg=str(kind))
        np.testing.assert_array_equal(b["i"], np.arange(6), err_msg=f"{kind} wrote its source")
    # a send's data is a copy: writing the source afterwards does not change what was sent
    b = bufs()
    sent = run_step(Step(0, T.SEND, "i", 0, "i", 0, 2), b, 3, 0, 2, "sum")
    b["i"][:] = -1
    np.testing.assert_array_equal(sent, [[0, 1], [3, 4]])


def test_tiles_cover_a_chunk_exactly() -> None:
    assert tiles(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert tiles(10, None) == [(0, 10)] and tiles(0, 4) == []


# --- the simulator ------------------------------------------------------------------------------


@pytest.mark.parametrize("op", sorted(UFUNCS))
@pytest.mark.parametrize("nranks", [2, 3, 5])
def test_simulated_ring_equals_numpy_for_every_op_and_uneven_count(op: str, nranks: int) -> None:
    algo = ring_allreduce(nranks)
    for count in (1, nranks - 1, 7, 100):  # fewer elements than chunks, uneven, several tiles
        inputs = make_inputs(algo, count, "int64")
        if op == "product":  # small factors: a product of 5 stays exact
            inputs = [a % 7 + 1 for a in inputs]
        want = reduce_all(inputs, op)
        copies = [a.copy() for a in inputs]
        for got in simulate(algo, inputs, op, tile_elements=3):
            np.testing.assert_array_equal(got, want, err_msg=f"{op} count {count}")
        for a, b in zip(inputs, copies, strict=True):  # the program writes i: the user's input is copied first
            np.testing.assert_array_equal(a, b)


def test_scratch_dependencies_and_multi_chunk_steps() -> None:
    algo = scratch_allreduce_2r()
    inputs = make_inputs(algo, 9, "float32")
    copies = [a.copy() for a in inputs]
    outs = simulate(algo, inputs, tile_elements=2)
    np.testing.assert_allclose(outs[0], inputs[0] + inputs[1], rtol=1e-6)
    assert np.array_equal(outs[0], outs[1])  # a + b == b + a, bit for bit
    assert all(np.array_equal(a, b) for a, b in zip(inputs, copies, strict=True)), "the inputs were written"


def test_trace_is_one_record_per_step_and_tile_with_dataflow_time() -> None:
    trace: list[TraceRecord] = []
    simulate(ring_allreduce(3), make_inputs(ring_allreduce(3), 6, "int64"), tile_elements=1, trace=trace)
    assert len(trace) == 3 * 5 * 2  # 3 ranks × 5 steps × 2 tiles (q = 2)
    # a ring step waits for the one before it on the previous rank: step s runs at time s + 1
    assert all(t.time == t.step + 1 for t in trace)
    first = [t for t in trace if t.tile == 0 and t.rank == 1]
    assert [(t.type, t.send_to, t.recv_from) for t in first] == [
        ("s", 2, -1), ("rrcs", 2, 0), ("rrcs", 2, 0), ("rcs", 2, 0), ("r", -1, 0)]
    text = format_trace(trace)
    assert text.splitlines()[0].startswith("t=1") and "rrcs  <- 0 -> 2" in text


def test_a_deadlock_names_every_blocked_step_and_what_it_waits_for() -> None:
    algo = swap_2r(first=T.RECV)
    with pytest.raises(ProgramError) as info:
        simulate(algo, make_inputs(algo, 4, "int64"))
    message = str(info.value)
    assert "deadlock" in message
    for r in (0, 1):
        assert (f"rank {r} threadblock 0 step 0 (r) waits for receive #0 on channel 0 from rank {1 - r} "
                f"(threadblock 0 step 1)") in message
    assert (info.value.rank, info.value.threadblock, info.value.step) == (0, 0, 0)
    with pytest.raises(ProgramError, match="cycle"):
        Plan.build(algo, 0, 4, "int64")


def test_broken_programs_are_program_errors_naming_the_step() -> None:
    ring = ring_allreduce(2)
    r0 = ring.ranks[0]
    tb = r0.threadblocks[0]

    def with_rank0_steps(steps: tuple[Step, ...], send: int = 1) -> Algorithm:
        rank = Rank(0, r0.i_chunks, 0, 0, (Threadblock(0, send, tb.recv, 0, steps),))
        return Algorithm("broken", "allreduce", 2, 2, 1, True, (rank, ring.ranks[1]))

    out_of_range = with_rank0_steps(tb.steps[:1] + (Step(1, T.RECV_REDUCE_COPY_SEND, "i", 1, "i", 1, 2),)
                                    + tb.steps[2:])
    unmatched = with_rank0_steps(tb.steps + (Step(3, T.SEND, "i", 0, "i", 0, 1),))
    to_itself = with_rank0_steps(tb.steps, send=0)
    dangling = with_rank0_steps(tb.steps[:2] + (Step(2, T.RECV, "i", 0, "i", 0, 1, depid=5, deps=0),))
    cases = [(out_of_range, "rank 0, threadblock 0, step 1: .*outside its 2 chunks"),
             (unmatched, "rank 0, threadblock 0, step 3: send #2 .* never received"),
             (to_itself, "rank 0, threadblock 0, step 0: s sends but the threadblock's peer is 0"),
             (dangling, "rank 0, threadblock 0, step 2: depends on threadblock 5 step 0")]
    for algo, pattern in cases:
        with pytest.raises(ProgramError, match=pattern):
            simulate(algo, make_inputs(ring, 4, "int64"))
        with pytest.raises(ProgramError, match=pattern):
            Plan.build(algo, 1, 4, "int64")


@needs_files
@pytest.mark.parametrize("name", ACCEPTED)
def test_simulating_every_accepted_msccl_file_equals_numpy(name: str) -> None:
    algo = mscclxml.load(MSCCL_DIR / name)
    n = algo.ngpus
    for count in (n * 4 * 3, n, 7 * n, 1000):  # even, one element per rank, uneven
        if algo.coll == "alltoall" and count % n:
            continue
        for dtype in ("int64", "float32"):
            inputs = make_inputs(algo, count, dtype)
            got = simulate(algo, inputs, tile_elements=5, count=count)
            if algo.coll == "custom":
                for r, want in custom_expectation(name, inputs, count).items():
                    np.testing.assert_array_equal(got[r], want, err_msg=f"rank {r} count {count}")
                continue
            for r, want in enumerate(expected_outputs(algo, inputs, "sum")):
                if dtype == "int64":
                    np.testing.assert_array_equal(got[r], want, err_msg=f"rank {r} count {count}")
                else:
                    np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-5, err_msg=f"rank {r}")
            if algo.coll == "allreduce" and dtype == "float32":  # every file here is deterministic
                assert all(np.array_equal(g, got[0]) for g in got), "ranks differ bit-wise"


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_reduce_scatter_all_gather_and_broadcast_in_and_out_of_place(nranks: int) -> None:
    for count in (1, 7, 64):
        for inplace in (False, True):
            algo = ring_reducescatter(nranks, inplace)
            inputs = make_inputs(algo, count, "int64")  # R·count each: block r is rank r's result
            assert inputs[0].size == nranks * count
            total = np.sum(inputs, axis=0)
            for r, got in enumerate(simulate(algo, inputs, tile_elements=4)):
                np.testing.assert_array_equal(got, total[r * count:(r + 1) * count], err_msg=f"in place {inplace}")
            outputs, _, _ = interpret(algo, inputs, tile_bytes=16, count=count)
            for r, got in enumerate(outputs):
                np.testing.assert_array_equal(got, total[r * count:(r + 1) * count], err_msg=f"in place {inplace}")
        algo = ring_allgather_in_place(nranks)
        inputs = make_inputs(algo, count, "int64")
        for got in simulate(algo, inputs, tile_elements=4) + interpret(algo, inputs, tile_bytes=16)[0]:
            np.testing.assert_array_equal(got, np.concatenate(inputs))
        algo = chain_broadcast(nranks)
        inputs = make_inputs(algo, count, "float32")
        for got in simulate(algo, inputs, tile_elements=4) + interpret(algo, inputs, tile_bytes=16)[0]:
            assert np.array_equal(got, inputs[0])


# --- the interpreter ----------------------------------------------------------------------------


@pytest.mark.parametrize("algo", [ring_allreduce(2), ring_allreduce(3), scratch_allreduce_2r()],
                         ids=["ring2", "ring3", "scratch2"])
def test_interpreted_hand_made_programs_equal_numpy_and_the_simulator(algo: Algorithm) -> None:
    for count in (1, 5, 1000):
        for dtype, op in (("int64", "sum"), ("int64", "max"), ("float32", "sum")):
            inputs = make_inputs(algo, count, dtype)
            outputs, _, _ = interpret(algo, inputs, op, tile_bytes=64)
            want = reduce_all(inputs, op)
            simulated = simulate(algo, inputs, op)
            for r, got in enumerate(outputs):
                np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"rank {r}")
                assert np.array_equal(got, simulated[r]), f"rank {r}: interpreter and simulator differ"
                assert np.array_equal(got, outputs[0]), f"rank {r} differs bit-wise from rank 0"


def test_tiles_pipeline_one_transfer_per_step_and_tile() -> None:
    algo = ring_allreduce(3)
    inputs = make_inputs(algo, 1000, "int64")
    outputs, transports, plans = interpret(algo, inputs, tile_bytes=64)  # 8 int64 per tile
    assert len(plans[0].tiles) == 42  # q = ceil(1000 / 3) = 334 elements, 42 tiles of at most 8
    assert all(t.posted == 8 * 42 for t in transports)  # 4 sends + 4 receives per rank and tile
    # the two reducing receives land in the landing area; the all-gather's (rcs, r) straight in place
    assert plans[0].landing_elements == 2 * 334
    direct = {slot.transfer.recv[2]: slot.direct for slots in plans[0].recvs.values() for slot in slots}
    assert direct == {1: False, 2: False, 3: True, 4: True}  # ring3 rank 0's steps: s, rrcs, rrcs, rcs, r
    for got in outputs:
        np.testing.assert_array_equal(got, np.sum(inputs, axis=0))


@needs_files
@pytest.mark.parametrize("name", ACCEPTED)
def test_interpreting_every_accepted_msccl_file(name: str) -> None:
    """One thread per rank (16 for AllToNext), several tiles per chunk, uneven counts."""
    algo = mscclxml.load(MSCCL_DIR / name)
    n = algo.ngpus
    for count in (n * 12, 7 * n, 4096):
        if algo.coll == "alltoall" and count % n:
            continue
        for dtype in ("int64", "float32"):
            inputs = make_inputs(algo, count, dtype)
            outputs, _, _ = interpret(algo, inputs, tile_bytes=128, count=count)
            simulated = simulate(algo, inputs, count=count)
            if algo.coll == "custom":
                for r, want in custom_expectation(name, inputs, count).items():
                    np.testing.assert_array_equal(outputs[r], want, err_msg=f"rank {r}")
                continue
            for r, want in enumerate(expected_outputs(algo, inputs, "sum")):
                if dtype == "int64":
                    np.testing.assert_array_equal(outputs[r], want, err_msg=f"rank {r} count {count}")
                else:
                    np.testing.assert_allclose(outputs[r], want, rtol=1e-5, atol=1e-5)
                    assert np.array_equal(outputs[r], simulated[r]), f"rank {r}: interpreter and simulator differ"
            if algo.coll == "allreduce":  # every accepted file reduces each chunk one way for all ranks
                assert all(np.array_equal(o, outputs[0]) for o in outputs), "ranks differ bit-wise"


def test_a_send_still_in_flight_keeps_its_source_from_being_overwritten() -> None:
    # rank 0 sends i[0] straight from its working memory (no copy), then overwrites i[0] with
    # i[1]; the fake transport sends only inside wait, after both steps could have run
    r0 = Rank(0, 2, 0, 0, (Threadblock(0, 1, -1, 0, (Step(0, T.SEND, "i", 0, "i", 0, 1),)),
                           Threadblock(1, -1, -1, 0, (Step(0, T.COPY, "i", 1, "i", 0, 1, depid=0, deps=0),))))
    r1 = Rank(1, 0, 2, 0, (Threadblock(0, -1, 0, 0, (Step(0, T.RECV, "i", 0, "o", 0, 1),)),))
    algo = Algorithm("overwrite", "custom", 2, 2, 1, False, (r0, r1))
    inputs = [np.arange(1, 9, dtype=np.int64), np.zeros(0, np.int64)]
    outputs, _, _ = interpret(algo, inputs, count=8, tile_bytes=16)  # q = 4, two tiles per chunk
    np.testing.assert_array_equal(outputs[1][:4], [1, 2, 3, 4])
    np.testing.assert_array_equal(outputs[1][:4], simulate(algo, inputs, count=8)[1][:4])
    np.testing.assert_array_equal(inputs[0], np.arange(1, 9))  # and the caller's input is untouched


def test_in_place_run_with_input_as_output() -> None:
    algo = ring_allreduce(3)
    inputs = make_inputs(algo, 10, "int64")
    want = np.sum(inputs, axis=0)
    plans = [Plan.build(algo, r, 10, "int64") for r in range(3)]
    transports = network(3)
    run_ok([lambda r=r: run(plans[r], transports[r], [0, 1, 2], inputs[r], inputs[r], "sum") for r in range(3)])
    for buf in inputs:
        np.testing.assert_array_equal(buf, want)


def test_zero_elements_move_nothing() -> None:
    algo = ring_allreduce(3)
    empty = [np.zeros(0, np.float32) for _ in range(3)]
    assert [a.size for a in simulate(algo, empty)] == [0, 0, 0]
    outputs, transports, plans = interpret(algo, empty)
    assert [a.size for a in outputs] == [0, 0, 0] and plans[0].tiles == ()
    assert all(t.posted == 0 for t in transports)


def test_peers_are_node_ids_not_program_ranks() -> None:
    algo = ring_allreduce(2)
    inputs = make_inputs(algo, 6, "int64")
    outputs = [np.zeros(6, np.int64) for _ in range(2)]
    transports = network(4)  # program ranks 0, 1 run on nodes 3 and 1
    plans = [Plan.build(algo, r, 6, "int64") for r in range(2)]
    run_ok([lambda: run(plans[0], transports[3], [3, 1], inputs[0], outputs[0], "sum"),
            lambda: run(plans[1], transports[1], [3, 1], inputs[1], outputs[1], "sum")])
    for got in outputs:
        np.testing.assert_array_equal(got, inputs[0] + inputs[1])


def test_a_peer_that_never_sends_is_a_transport_error_within_the_deadline() -> None:
    algo = ring_allreduce(3)
    inputs = make_inputs(algo, 300, "float32")
    plans = [Plan.build(algo, r, 300, "float32") for r in range(3)]
    outputs = [np.zeros(300, np.float32) for _ in range(3)]
    transports = network(3, wait_s=0.5)
    start = time.monotonic()
    results = on_nodes([lambda r=r: run(plans[r], transports[r], [0, 1, 2], inputs[r], outputs[r], "sum")
                        for r in range(2)])  # rank 2 never comes
    assert time.monotonic() - start < 5.0
    for r, result in enumerate(results):
        assert isinstance(result, TransportError) and result.code == "timeout", f"rank {r}: {result!r}"
    with pytest.raises(TransportError, match="deadline passed"):
        run(plans[0], network(3)[0], [0, 1, 2], inputs[0], outputs[0], "sum", deadline=time.monotonic() - 1)


def test_nodes_that_disagree_on_the_count_fail_naming_the_peer() -> None:
    algo = ring_allreduce(2)
    counts = (10, 12)  # node 1 runs a bigger op: its transfers are longer than node 0 posted
    plans = [Plan.build(algo, r, counts[r], "int64") for r in range(2)]
    transports = network(2, wait_s=0.5)
    results = on_nodes([lambda r=r: run(plans[r], transports[r], [0, 1], np.ones(counts[r], np.int64),
                                        np.zeros(counts[r], np.int64), "sum") for r in range(2)])
    assert all(isinstance(result, TransportError) for result in results), results
    assert results[0].peer == 1 and "sent 48 bytes" in str(results[0])  # 6 int64 where 5 were expected


def test_plans_are_cached_and_arguments_checked() -> None:
    algo = ring_allreduce(3)
    assert Plan.build(algo, 1, 100, "float32") is Plan.build(algo, 1, 100, np.float32)
    assert Plan.build(algo, 1, 100, "float32") is not Plan.build(algo, 1, 101, "float32")
    plan = Plan.build(algo, 0, 10, "int64")
    with pytest.raises(ValueError, match="flat contiguous int64"):
        run(plan, network(3)[0], [0, 1, 2], np.zeros(10, np.int32), np.zeros(10, np.int64), "sum")
    with pytest.raises(ValueError, match="3 ranks"):
        run(plan, network(3)[0], [0, 1], np.zeros(10, np.int64), np.zeros(10, np.int64), "sum")
    with pytest.raises(ValueError, match="avg"):
        run(plan, network(3)[0], [0, 1, 2], np.zeros(10, np.int64), np.zeros(10, np.int64), "avg")


def test_wire_order_is_a_topological_order_both_ends_agree_on() -> None:
    algo = scratch_allreduce_2r()
    plans = [Plan.build(algo, r, 9, "int64", tile_bytes=16) for r in range(2)]
    for r in range(2):  # what rank r sends to its peer is, in the same order, what the peer receives
        sent = [(s.tile, s.transfer) for s in plans[r].sends[1 - r]]
        received = [(s.tile, s.transfer) for s in plans[1 - r].recvs[r]]
        assert sent == received and len(sent) == 3  # q = 5 elements, tiles of 2: 3 tiles
    wiring = Wiring(algo)
    for sid in wiring.steps:
        assert all(wiring.depth[p] < wiring.depth[sid] for p in wiring.predecessors(sid))


LIBRARY_NAMES = library.names()


@pytest.mark.parametrize("name", LIBRARY_NAMES)
def test_interpreted_library_programs_on_two_to_five_nodes_equal_numpy(name: str) -> None:
    for n in (2, 3, 4, 5):
        algo = library.get(name, n)
        for count in (6 * n, 7):
            if algo.coll == "alltoall" and count % n:
                continue
            for dtype, op in (("int64", "sum"), ("int64", "min"), ("float32", "sum")):
                inputs = make_inputs(algo, count, dtype)
                outputs, _, _ = interpret(algo, inputs, op, tile_bytes=32, count=count)
                if name == "alltonext":  # node r's buffer goes to node r + 1
                    for r in range(1, n):
                        np.testing.assert_array_equal(outputs[r], inputs[r - 1], err_msg=f"{n} nodes, node {r}")
                    continue
                for r, want in enumerate(expected_outputs(algo, inputs, op)):
                    np.testing.assert_allclose(outputs[r], want, rtol=1e-5, atol=1e-5, err_msg=f"{n} nodes")
                if algo.coll == "allreduce":
                    assert all(np.array_equal(o, outputs[0]) for o in outputs), f"{n} nodes: ranks differ bit-wise"


class OneThreadNetwork:
    """Every rank's end in one thread: a send is copied into its matched receive at once; the
    completions run when the test drains them (what ``interpreter.start`` leaves to its caller)."""

    def __init__(self) -> None:
        self.streams: dict[tuple[int, int], tuple[list, list]] = {}
        self.completions: list = []

    def end(self, me: int) -> Any:
        network = self

        class End:
            chunk_bytes = 1 << 20

            def post_send(self, peer: int, view: memoryview, done: Any = None) -> None:
                network.post((me, peer), 0, view, done)

            def post_recv(self, peer: int, view: memoryview, done: Any = None) -> None:
                network.post((peer, me), 1, view, done)

            def wait(self) -> None:
                raise AssertionError("a started run is driven by its caller, not by wait()")
        return End()

    def post(self, stream: tuple[int, int], side: int, view: memoryview, done: Any) -> None:
        queues = self.streams.setdefault(stream, ([], []))
        queues[side].append((view, done))
        while queues[0] and queues[1]:
            (data, sent), (into, received) = queues[0].pop(0), queues[1].pop(0)
            into[:] = data
            self.completions += [d for d in (sent, received) if d is not None]

    def drain(self) -> None:
        while self.completions:
            self.completions.pop(0)()


@pytest.mark.parametrize(("name", "count"), [("oneshot", 4000), ("twoshot", 7), ("halving_doubling", 1001),
                                             ("alltonext", 301)])
def test_started_runs_reuse_their_plans_memory_and_stay_numpy_exact(name: str, count: int) -> None:
    """``start`` on every rank in one thread, then ``finish``: the same plans run five times in a
    row on fresh inputs (their kept landing, scratch and padded working memory reused), each run
    equal to NumPy, including programs with scratch (oneshot, alltonext) and padded counts."""
    from commd.algorithms.interpreter import start

    n = 3
    algo = library.get(name, n)
    plans = [Plan.build(algo, r, count, np.int64, tile_bytes=1 << 20) for r in range(n)]
    for seed in range(5):
        inputs = make_inputs(algo, count, "int64", seed=seed)
        outputs = [np.full(p.layout.output_elements, -7, np.int64) for p in plans]
        network = OneThreadNetwork()
        running = [start(plans[r], network.end(r), list(range(n)), inputs[r], outputs[r], "sum") for r in range(n)]
        network.drain()
        for r in running:
            r.finish()
        if name == "alltonext":
            for r in range(1, n):
                np.testing.assert_array_equal(outputs[r], inputs[r - 1], err_msg=f"run {seed}, node {r}")
        else:
            for r in range(n):
                np.testing.assert_array_equal(outputs[r], reduce_all(inputs, "sum"), err_msg=f"run {seed}, rank {r}")


#: Every dtype a program runs (the lanes' dtypes that NumPy has: all but bfloat16).
PROGRAM_DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
                  "complex64", "complex128")
#: Bool reductions as the lanes define them (commd/kernels/small.py's table, written out again).
BOOL_UFUNCS = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or, "product": np.logical_and,
               "min": np.logical_and, "band": np.logical_and, "bxor": np.logical_xor}


def small_values(dtype: str, count: int, seed: int) -> np.ndarray:
    """Small whole numbers (complex: both parts): every reduction order gives the same bits, even in
    float16, and integer overflow wraps the same whatever the order."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(bool)
    low = 0 if dtype == "uint8" else -3
    values = rng.integers(low, 4, count)
    if dtype.startswith("complex"):
        return (values + 1j * rng.integers(-3, 4, count)).astype(dtype)
    return values.astype(dtype)


@pytest.mark.parametrize("name", [n for n in LIBRARY_NAMES if library.get(n, 2).coll == "allreduce"])
def test_library_all_reduces_equal_numpy_for_every_reduce_op_and_dtype_they_admit(name: str) -> None:
    """Every all-reduce program of the library, on 2-5 nodes, for every lane reduce op and every
    dtype the lanes admit for it (commd.kernels.dtypes): NumPy's result (integers and bools bit for
    bit, floats value for value), the same bits on every rank, on an uneven and an even count — run
    by the interpreter, every rank in one thread."""
    from commd.algorithms.interpreter import start
    from commd.kernels.dtypes import UnsupportedReduction, check_supported
    from commd.lanes.base import LANE_REDUCE_OPS

    ran = 0
    for n in (2, 3, 4, 5):
        algo = library.get(name, n)
        for dtype in PROGRAM_DTYPES:
            for op in sorted(LANE_REDUCE_OPS):
                try:
                    check_supported(op, dtype)
                except UnsupportedReduction:
                    continue
                ufunc = BOOL_UFUNCS[op] if dtype == "bool" else UFUNCS[op]
                for count in (2 * n + 1, 4 * n):
                    inputs = [small_values(dtype, count, seed=31 * n + r) for r in range(n)]
                    want = functools.reduce(ufunc, inputs)
                    outputs = [np.empty_like(a) for a in inputs]
                    plans = [Plan.build(algo, r, count, np.dtype(dtype), tile_bytes=8) for r in range(n)]
                    network = OneThreadNetwork()
                    running = [start(plans[r], network.end(r), list(range(n)), inputs[r], outputs[r], op)
                               for r in range(n)]
                    network.drain()
                    for r in running:
                        r.finish()
                    where = (name, n, dtype, op, count)
                    if np.dtype(dtype).kind in "fc":  # exact values; a zero's sign may follow the tree's order
                        np.testing.assert_array_equal(outputs[0], want.astype(dtype), err_msg=str(where))
                    else:
                        assert outputs[0].tobytes() == want.astype(dtype).tobytes(), where
                    assert all(out.tobytes() == outputs[0].tobytes() for out in outputs), f"{where}: ranks differ"
                    ran += 1
    assert ran >= 4 * 2 * 40  # every node count, both counts, the ~40 admitted (dtype, op) pairs


@pytest.mark.parametrize("nranks", [2, 3, 4, 5])
def test_interpreted_library_ring_is_the_native_ring_bit_for_bit(nranks: int) -> None:
    algo = library.get("ring", nranks)
    for count in (10_001, 3, 64 * nranks):  # uneven (the native split: first blocks one longer), short, even
        inputs = make_inputs(algo, count, "float32", seed=nranks)
        outputs, _, _ = interpret(algo, inputs, tile_bytes=4096)
        native = [torch.from_numpy(a.copy()) for a in inputs]
        transports = network(nranks, chunk_bytes=4096)
        run_ok([functools.partial(native_ring_allreduce, transports[r], tuple(range(nranks)), r, native[r], "sum")
                for r in range(nranks)])
        for r in range(nranks):
            assert np.array_equal(outputs[r], native[r].numpy()), f"count {count}, node {r}: DSL and native differ"


@pytest.fixture(scope="module")
def tcp_meshes() -> Iterator[Callable[[int], list[Mesh]]]:
    """Connected loopback TCP meshes of the tcp lane (its real transport), one set per node count."""
    made: dict[int, list[Mesh]] = {}
    sockets: list[socket.socket] = []

    def get(n: int) -> list[Mesh]:
        if n in made:
            return made[n]
        listeners = [listen("127.0.0.1", 0, n) for _ in range(n)]
        wakes = [socket.socketpair() for _ in range(n)]
        sockets.extend(s for pair in wakes for s in pair)
        meshes = [Mesh(r, 1 << 16, wakes[r][0]) for r in range(n)]
        endpoints = [sock.getsockname()[:2] for sock in listeners]
        run_ok([functools.partial(MeshConnector(r, n, b"secret", listeners[r], wakes[r][0], meshes[r]).run,
                                  endpoints, time.monotonic() + 10.0, 10.0) for r in range(n)])
        for sock in listeners:
            sock.close()
        made[n] = meshes
        return meshes

    yield get
    for meshes in made.values():
        for mesh in meshes:
            mesh.close()
    for sock in sockets:
        sock.close()


@needs_files
@pytest.mark.parametrize("name", ACCEPTED)
def test_accepted_files_of_at_most_four_ranks_over_the_tcp_lanes_transport(
        name: str, tcp_meshes: Callable[[int], list[Mesh]]) -> None:
    algo = mscclxml.load(MSCCL_DIR / name)
    n = algo.ngpus
    if n > 4:
        pytest.skip(f"{n} ranks")
    meshes = tcp_meshes(n)
    count = 40_000 if algo.coll != "alltoall" else 40_000 - 40_000 % n  # several tiles, a few chunks of the mesh
    for dtype in ("int64", "float32"):
        inputs = make_inputs(algo, count, dtype)
        plans = [Plan.build(algo, r, count, dtype, tile_bytes=32 << 10) for r in range(n)]
        outputs = [np.zeros(p.layout.output_elements, dtype) for p in plans]
        deadline = time.monotonic() + 20.0
        run_ok([functools.partial(run, plans[r], Exchange(meshes[r], "allreduce", deadline, 20.0, 1 << 16),
                                  list(range(n)), inputs[r], outputs[r], "sum", deadline) for r in range(n)])
        simulated = simulate(algo, inputs, count=count)
        for r in range(n):
            assert np.array_equal(outputs[r], simulated[r]), f"rank {r}: over tcp and simulated differ"
        if algo.coll == "custom":
            for r, want in custom_expectation(name, inputs, count).items():
                np.testing.assert_array_equal(outputs[r], want, err_msg=f"rank {r}")
        else:
            for r, want in enumerate(expected_outputs(algo, inputs, "sum")):
                np.testing.assert_allclose(outputs[r], want, rtol=1e-5, atol=1e-5, err_msg=f"rank {r}")


# --- commd algo ---------------------------------------------------------------------------------


@needs_files
def test_cli_check_accepts_and_refuses_the_shared_files(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["algo", "check", str(MSCCL_DIR / "ar_ring_4r_fused.xml")]) == 0
    assert "accepted" in capsys.readouterr().out
    assert main(["algo", "check", str(MSCCL_DIR / "NEG_ns3_peer2peer_8r_labelled_allgather.xml")]) == 1
    out = capsys.readouterr().out
    assert "refused" in out and "NEG_ns3_peer2peer_8r_labelled_allgather.xml" in out and "o_chunks=2" in out
    assert main(["algo", "check", str(MSCCL_DIR / "no_such_file.xml")]) == 2


@needs_files
def test_cli_check_takes_a_custom_collectives_postcondition(capsys: pytest.CaptureFixture[str]) -> None:
    fanout = str(MSCCL_DIR / "custom_3r_fanout.xml")
    assert main(["algo", "check", fanout, "--post", str(MSCCL_DIR / "custom_3r_fanout.post.json")]) == 0
    assert main(["algo", "check", fanout, "--post", str(MSCCL_DIR / "alltonext_fwd_2x8_16r.post.json")]) == 1
    assert "refused" in capsys.readouterr().out


def test_cli_check_names_rank_threadblock_and_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "deadlock.xml"
    mscclxml.dump(swap_2r(first=T.RECV), path)
    assert main(["algo", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "refused" in out and f"{path}, rank 0, threadblock 0, step" in out


@needs_files
@pytest.mark.parametrize(("name", "dtype", "op"), [("ar_rdh_4r.xml", "int64", "max"),
                                                   ("a2a_twostep_2x2.xml", "float32", "sum"),
                                                   ("custom_3r_fanout.xml", "int32", "sum")])
def test_cli_simulate_matches_numpy(name: str, dtype: str, op: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["algo", "simulate", str(MSCCL_DIR / name), "--count", "20", "--dtype", dtype, "--op", op]) == 0
    assert "match" in capsys.readouterr().out


def test_cli_simulate_reports_a_mismatch_a_deadlock_and_a_trace(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    swap = tmp_path / "swap.xml"
    mscclxml.dump(swap_2r(), swap)  # runs, but swaps instead of reducing
    assert main(["algo", "simulate", str(swap), "--count", "4", "--dtype", "int64"]) == 1
    assert "mismatch" in capsys.readouterr().out
    dead = tmp_path / "dead.xml"
    mscclxml.dump(swap_2r(first=T.RECV), dead)
    assert main(["algo", "simulate", str(dead), "--count", "4", "--dtype", "int64"]) == 1
    assert "deadlock" in capsys.readouterr().out
    ring = tmp_path / "ring.xml"
    mscclxml.dump(ring_allreduce(3), ring)
    assert main(["algo", "simulate", str(ring), "--count", "9", "--dtype", "float64", "--trace"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # the trace, the verdict, then how the ranks compare (with NumPy, with each other) and the class
    assert len(lines) == 3 * 5 + 4 and lines[0].startswith("t=1") and lines[15].startswith("match")
    assert [line.split(":")[0] for line in lines[16:]] == ["  against NumPy", "  between ranks", "  determinism"]
    assert main(["algo", "simulate", str(ring), "--count", "9", "--dtype", "float32", "--op", "bxor"]) == 2


@needs_files
def test_cli_list_shows_a_directory_with_each_file_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["algo", "list", "--dir", str(MSCCL_DIR)]) == 0
    out = capsys.readouterr().out
    assert "ag_syccl_4r_outofplace.xml: syn_allgather_4gpu_4194304 (allgather, 4 ranks, sizes 0 B to unbounded) " \
           "accepted" in out
    assert "NEG_ns3_peer2peer_8r_labelled_allgather.xml" in out and "refused" in out
    for name in library.names():
        assert f"\n  {name} (" in out, name
    assert "twoshot (allreduce, 2+ nodes, sizes 16384 B to 4194304 B): two-shot" in out


def test_a_receive_lands_in_place_only_where_nothing_else_can_touch_its_destination_meanwhile() -> None:
    """Data lands when it arrives, maybe before its receive step runs.  In the ring's all-gather every
    earlier access to the chunk precedes the peer's send, so it lands in place; in ``swap_2r`` a rank's
    own send of chunk 0 may still be reading it when the peer's chunk arrives (nothing orders the
    two sends), so it lands in the landing area and is copied when the receive runs."""
    def direct_receives(algo: Algorithm, count: int) -> list[bool]:
        plan = Plan.build(algo, 0, count, "int64")
        return [slot.direct for slots in plan.recvs.values() for slot in slots]

    assert direct_receives(swap_2r(), 10) == [False]
    assert direct_receives(ring_allreduce(4), 40).count(True) == 3  # rcs, rcs, r
    assert direct_receives(scratch_allreduce_2r(), 10) == [True]  # into scratch nothing else touches first
    for algo in (swap_2r(), ring_allreduce(4), scratch_allreduce_2r()):
        inputs = make_inputs(algo, 4 * algo.nchunksperloop + 3, "int64")
        outputs, _, _ = interpret(algo, inputs, tile_bytes=16)
        for r, got in enumerate(outputs):
            np.testing.assert_array_equal(got, simulate(algo, inputs)[r], err_msg=f"{algo.name} rank {r}")

