"""All ranks of a program in one process, on NumPy: the debugger for a program.

The run is a dataflow run with the runtime's semantics (``execute``): per tile, a step
runs when the previous step of its threadblock and its dependency are done and, if it
receives, when its matched send (the k-th send of (sender, receiver, channel)) has
produced its data.  Ranks and threadblocks are visited round-robin in id order, so a run
is deterministic.  If nothing can progress before everything is done, the ProgramError
names every blocked step and what it waits for — what a hang on real hardware never says.
:func:`reference` is what NumPy says each rank must end with; :func:`spread` how far a
run's results lie from it and from each other (in ulps: an order-dependent program's float
results differ between ranks by a few).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from commd.algorithms.errors import ProgramError
from commd.algorithms.execute import REDUCE_OPS, StepId, Wiring, run_step, tiles
from commd.algorithms.ir import Algorithm
from commd.algorithms.layout import allocate, check_ranks, finish, layouts_for, writes_input
from commd.algorithms.postcondition import Postcondition


@dataclass(frozen=True)
class TraceRecord:
    """One executed step: ``time`` is its logical time (its depth in the dataflow of its tile)."""

    tile: int
    rank: int
    threadblock: int
    step: int
    type: str
    send_to: int  # -1: the step sends nothing
    recv_from: int  # -1: the step receives nothing
    time: int

    def __str__(self) -> str:
        peers = []
        if self.recv_from >= 0:
            peers.append(f"<- {self.recv_from}")
        if self.send_to >= 0:
            peers.append(f"-> {self.send_to}")
        return (f"t={self.time:<4} tile {self.tile:<3} rank {self.rank:<3} tb {self.threadblock:<3} "
                f"step {self.step:<4} {self.type:<5} {' '.join(peers)}").rstrip()


def format_trace(records: list[TraceRecord]) -> str:
    """A per-step timeline: records sorted by (tile, logical time, rank, threadblock, step)."""
    ordered = sorted(records, key=lambda t: (t.tile, t.time, t.rank, t.threadblock, t.step))
    return "\n".join(str(t) for t in ordered)


def op_count(algo: Algorithm, inputs: list[np.ndarray], source: str = "<program>") -> int:
    """The op's per-rank count (as torch defines it) from the ranks' inputs."""
    lengths = {int(np.asarray(a).size) for a in inputs}
    if len(lengths) != 1 and algo.coll != "custom":
        raise ProgramError(f"every rank's input must have the same length, got {sorted(lengths)}", source=source)
    if algo.coll == "reducescatter":
        (n,) = lengths
        if n % algo.ngpus:
            raise ProgramError(f"a reduce-scatter input over {algo.ngpus} ranks must divide by {algo.ngpus}, "
                               f"got {n}", source=source)
        return n // algo.ngpus
    if algo.coll == "custom":
        full = {int(np.asarray(a).size) for a, r in zip(inputs, algo.ranks, strict=True)
                if r.i_chunks == algo.nchunksperloop}
        if len(full) != 1:
            raise ProgramError("a custom collective's count is the input length of a rank whose input has "
                               f"nchunksperloop = {algo.nchunksperloop} chunks; pass count= explicitly",
                               source=source)
        return full.pop()
    return lengths.pop()


def simulate(algo: Algorithm, inputs: list[np.ndarray], op: str = "sum", *, tile_elements: int | None = None,
             trace: list[TraceRecord] | None = None, count: int | None = None,
             source: str = "<program>") -> list[np.ndarray]:
    """Run ``algo`` on every rank's ``inputs``; one output per rank, shaped as the collective defines.

    ``tile_elements`` cuts each chunk into tiles of at most that many elements (each tile is
    its own dataflow run, as the interpreter pipelines them); ``trace`` receives one
    :class:`TraceRecord` per executed step; ``count`` is needed only for a custom collective
    whose count no rank's input shows."""
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not one of {sorted(REDUCE_OPS)}")
    check_ranks(algo, source)
    if len(inputs) != algo.ngpus:
        raise ProgramError(f"{len(inputs)} inputs for a program of {algo.ngpus} ranks", source=source)
    arrays = [np.ascontiguousarray(np.asarray(a)).reshape(-1) for a in inputs]
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) != 1:
        raise ValueError(f"inputs of different dtypes {sorted(map(str, dtypes))}")
    dtype = arrays[0].dtype
    if count is None:
        count = op_count(algo, arrays, source)
    layouts = layouts_for(algo, count, source)
    for r, a in enumerate(arrays):
        if a.size != layouts[r].input_elements:
            raise ProgramError(f"rank {r}'s input has {a.size} elements, the collective wants "
                               f"{layouts[r].input_elements} for count {count}", source=source, rank=r)
    wiring = Wiring(algo, layouts, source)
    outputs = [np.zeros(layouts[r].output_elements, dtype) for r in range(algo.ngpus)]
    work, stores = {}, []
    for r in range(algo.ngpus):
        work[r], rank_stores = allocate(layouts[r], dtype, arrays[r], outputs[r], writes_input(algo, r))
        stores.extend(rank_stores)
    q = layouts[0].q if layouts else 0
    for index, (lo, hi) in enumerate(tiles(q, tile_elements)):
        _run_tile(algo, wiring, work, q, lo, hi, op, index, trace)
    finish(stores)
    return outputs


def _run_tile(algo: Algorithm, wiring: Wiring, work: dict[int, dict[str, np.ndarray]], q: int, lo: int, hi: int,
              op: str, tile: int, trace: list[TraceRecord] | None) -> None:
    nxt = {key: 0 for key in wiring.lengths}
    time: dict[StepId, int] = {}
    mailbox: dict[StepId, tuple[np.ndarray, int]] = {}  # receive step -> (matched send's data, its time)
    remaining = sum(wiring.lengths.values())
    order = [(r.id, tb.id) for r in algo.ranks for tb in r.threadblocks]
    while remaining:
        progressed = False
        for key in order:
            s = nxt[key]
            if s >= wiring.lengths[key]:
                continue
            sid = (key[0], key[1], s)
            step = wiring.steps[sid]
            dep = step.dependency
            if dep is not None and nxt[(key[0], dep[0])] <= dep[1]:
                continue
            if step.type.receives and sid not in mailbox:
                continue
            received, sent_at = mailbox.pop(sid) if step.type.receives else (None, 0)
            start = max(time.get((key[0], key[1], s - 1), 0), time.get((key[0], dep[0], dep[1]), 0) if dep else 0,
                        sent_at)
            time[sid] = start + 1
            data = run_step(step, work[key[0]], q, lo, hi, op, received)
            if step.type.sends:
                mailbox[wiring.transfer_of_send[sid].recv] = (data, time[sid])
            send_to, recv_from, _ = wiring.threadblock_peers[key]
            if trace is not None:
                trace.append(TraceRecord(tile, key[0], key[1], s, step.type.value,
                                         send_to if step.type.sends else -1,
                                         recv_from if step.type.receives else -1, time[sid]))
            nxt[key] = s + 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise _blocked(wiring, nxt, mailbox)


def _blocked(wiring: Wiring, nxt: dict[tuple[int, int], int], mailbox: dict[StepId, object]) -> ProgramError:
    """The deadlock report: every threadblock's next step and what it waits for."""
    lines = []
    first: StepId | None = None
    for (r, tb), s in sorted(nxt.items()):
        if s >= wiring.lengths[(r, tb)]:
            continue
        sid = (r, tb, s)
        first = first or sid
        step = wiring.steps[sid]
        waits = []
        dep = step.dependency
        if dep is not None and nxt[(r, dep[0])] <= dep[1]:
            waits.append(f"its dependency threadblock {dep[0]} step {dep[1]}")
        if step.type.receives and sid not in mailbox:
            t = wiring.transfer_of_recv[sid]
            waits.append(f"receive #{t.index} on channel {t.channel[2]} from rank {t.send[0]} "
                         f"(threadblock {t.send[1]} step {t.send[2]})")
        lines.append(f"rank {r} threadblock {tb} step {s} ({step.type.value}) waits for {' and '.join(waits)}")
    assert first is not None
    return ProgramError("deadlock: no step can run; blocked: " + "; ".join(lines), source=wiring.source,
                        rank=first[0], threadblock=first[1], step=first[2])


#: Collectives whose every rank ends with the same output: their ranks' results can be compared.
SAME_OUTPUT_EVERYWHERE = frozenset({"allreduce", "allgather", "broadcast"})


@dataclass(frozen=True)
class Spread:
    """How far one array's elements lie from another's: the elements compared, how many differ in
    their bits, and the largest gap in units in the last place (an integer's unit is 1) and absolute.

    What ``simulate`` shows for an order-dependent program: its float results may differ
    between ranks (and from NumPy's order) by a few ulps, its integer results not at all."""

    compared: int
    differing: int
    max_ulp: float
    max_abs: float


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per element, how many representable floats separate ``a`` and ``b`` (0: equal, +0 and -0 alike;
    inf where one is NaN and the other not); a complex pair counts its farther part."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "c":
        return np.maximum(ulp_distance(a.real, b.real), ulp_distance(a.imag, b.imag))
    if a.dtype.kind != "f":
        raise ValueError(f"ulp_distance needs floats, got {a.dtype}")
    ints = np.dtype(f"int{8 * a.dtype.itemsize}")

    def key(x: np.ndarray) -> np.ndarray:
        """The float's position on the line of representable values (sign-magnitude to two's complement)."""
        raw = np.ascontiguousarray(x).view(ints).astype(np.int64)
        return np.where(raw < 0, np.int64(np.iinfo(ints).min) - raw, raw)

    gap = key(a).view(np.uint64) - key(b).view(np.uint64)  # modulo 2^64: |gap| below 2^63 is exact
    out = np.minimum(gap, np.uint64(0) - gap).astype(np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    out[nan_a & nan_b] = 0.0
    out[nan_a ^ nan_b] = np.inf
    return out


def spread(got: np.ndarray, want: np.ndarray, mask: np.ndarray | None = None) -> Spread:
    """How far ``got`` lies from ``want`` over the elements ``mask`` selects (all by default)."""
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if mask is not None:
        got, want = got[mask], want[mask]
    if got.size == 0:
        return Spread(0, 0, 0.0, 0.0)
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    bits = (got.view(np.uint8).reshape(got.size, -1) != want.view(np.uint8).reshape(want.size, -1)).any(axis=1)
    differing = int(np.count_nonzero(bits))
    if got.dtype.kind in "fc":
        with np.errstate(invalid="ignore", over="ignore"):
            gaps = np.abs(got.astype(np.complex128 if got.dtype.kind == "c" else np.float64) - want)
        ulps = ulp_distance(got, want)
        return Spread(got.size, differing, float(ulps.max()), float(np.nan_to_num(gaps, nan=np.inf).max()))
    if got.dtype.kind in "iu":
        gap = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max())
        return Spread(got.size, differing, gap, gap)
    return Spread(got.size, differing, float(differing > 0), float(differing > 0))


#: NumPy's own element-wise operators, for references independent of ``commd.kernels``.
_UFUNCS = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
           "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def reference(algo: Algorithm, inputs: list[np.ndarray], op: str = "sum", *, count: int | None = None,
              post: Postcondition | None = None, source: str = "<program>") -> list[tuple[np.ndarray, np.ndarray]]:
    """What NumPy says each rank's output must be: ``(expected, specified)`` per rank, where
    ``specified`` masks the elements the collective defines (all of them, except for a custom
    collective's chunks its postcondition ``post`` leaves open).  Broadcast's root is rank 0."""
    ufunc = _UFUNCS[op]
    arrays = [np.asarray(a).reshape(-1) for a in inputs]
    nranks = algo.ngpus

    def combine(parts: list[np.ndarray]) -> np.ndarray:
        return functools.reduce(lambda a, b: ufunc(a, b), parts[1:], parts[0].copy())

    if algo.coll == "custom":
        if post is None:
            raise ProgramError("a custom collective's reference needs its postcondition", source=source)
        layouts = layouts_for(algo, op_count(algo, arrays, source) if count is None else count, source)
        results = [(np.zeros(layouts[r].output_elements, arrays[0].dtype),
                    np.zeros(layouts[r].output_elements, bool)) for r in range(nranks)]
        for slot, sources in post:
            if slot.buf != "o" or any(src.buf != "i" for src in sources):
                raise ProgramError(f"the reference compares outputs with inputs; {slot.short()} names other buffers",
                                   source=source, rank=slot.rank)
            lo, n = layouts[slot.rank].o.chunk_range(slot.index)
            parts = []
            for src in sorted(sources):
                start, length = layouts[src.rank].i.chunk_range(src.index)
                if length != n:
                    raise ProgramError(f"{slot.short()} ({n} elements) cannot hold {src.short()} ({length})",
                                       source=source, rank=slot.rank)
                parts.append(arrays[src.rank][start:start + length])
            expected, specified = results[slot.rank]
            expected[lo:lo + n] = combine(parts)
            specified[lo:lo + n] = True
        return results
    if algo.coll == "allreduce":
        outs = [combine(arrays)] * nranks
    elif algo.coll == "broadcast":
        outs = [arrays[0]] * nranks
    elif algo.coll == "allgather":
        outs = [np.concatenate(arrays)] * nranks
    elif algo.coll == "reducescatter":
        total, n = combine(arrays), arrays[0].size // nranks
        outs = [total[r * n:(r + 1) * n] for r in range(nranks)]
    elif algo.coll == "alltoall":
        n = arrays[0].size // nranks
        outs = [np.concatenate([arrays[src][r * n:(r + 1) * n] for src in range(nranks)]) for r in range(nranks)]
    else:
        raise ProgramError(f"no reference for collective {algo.coll!r}", source=source)
    return [(out.copy(), np.ones(out.size, bool)) for out in outs]
