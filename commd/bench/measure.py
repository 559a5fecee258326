"""The timing loop of one (op, size, path) cell, shared by every path so their rows compare.

Per cell: one checked op (every rank compares its result with NumPy, and all
ranks learn of any failure so they stop together), one timed warm-up whose
slowest-rank time sets the iteration count when a time budget is given (all
ranks must run the same count), the remaining warm-ups, then the timed
iterations.  Per iteration the slowest rank's time counts (an op is done when
its last rank is); the row gives the median and p95 of those.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from typing import Any

from commd.bench.cases import Case, CheckError
from commd.bench.paths import BenchPath, Sync
from commd.bench.spec import BenchSpec, busbw_factor

#: Seeds the per-iteration order of interleaved paths (identical on every rank).
SHUFFLE_SEED = 20261122
#: With --time-per-size, at least this many timed iterations.
MIN_ADAPTIVE_ITERS = 3


def iteration_plan(spec: BenchSpec, first_s: float) -> tuple[int, int]:
    """(extra warm-ups, timed iterations) after a first warm-up that took ``first_s`` on the slowest rank."""
    warm = max(0, spec.warmup - 1)
    if spec.time_per_size is None:
        return warm, spec.iters
    per = max(first_s, 1e-7)
    iters = max(MIN_ADAPTIVE_ITERS, min(spec.iters, int(spec.time_per_size / per)))
    warm = min(warm, int(0.25 * spec.time_per_size / per))
    return warm, iters


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def summarize(op: str, nbytes: int, world: int, slowest: list[float]) -> dict[str, Any]:
    """Median/p95 of the slowest-rank times, algbw = S/t and busbw = algbw x the op's factor (GB/s, 1e9)."""
    if op == "sendrecv":
        slowest = [t / 2 for t in slowest]  # a round trip moves S twice: report one way, as OSU's latency does
    t = statistics.median(slowest)
    factor = busbw_factor(op, world)
    algbw = nbytes / t / 1e9 if nbytes else 0.0
    return {"median_us": t * 1e6, "p95_us": p95(slowest) * 1e6, "algbw_gbs": algbw, "busbw_gbs": algbw * factor,
            "factor": factor}


def measure_cell(path: BenchPath, sync: Sync, case: Case, spec: BenchSpec,
                 corrupt: bool = False) -> dict[str, Any]:
    """Check, warm up, time; returns the row (raises CheckError on every rank if any rank's check failed)."""
    case.fill()
    sync.barrier()
    path.run(case)
    if corrupt and case.expected():
        name = next(iter(case.expected()))
        case.view[name][0] += 1  # a stand-in for a wrong delivery, to prove the check catches it
    errors = sync.gather_errors(case.check(path.label))
    if errors:
        raise CheckError("\n".join(errors))
    case.prepare_timing()
    t0 = time.perf_counter()
    path.run(case)
    first = sync.max_each([time.perf_counter() - t0])[0]
    warm, iters = iteration_plan(spec, first)
    for _ in range(warm):
        path.run(case)
    path.barrier()
    clock = time.perf_counter
    times = []
    for _ in range(iters):
        t0 = clock()
        path.run(case)
        times.append(clock() - t0)
    slowest = sync.max_each(times)
    return {**row_of(path, case, iters, warm), **summarize(case.op, case.nbytes, case.world, slowest)}


def row_of(path: BenchPath, case: Case, iters: int, warm: int) -> dict[str, Any]:
    """A measured cell's identity and counts (its figures are added by ``summarize``)."""
    return {"op": case.op, "bytes": case.nbytes, "via": path.via, "lane": path.lane, "path": path.label,
            "algorithm": getattr(path, "algorithm", None), "codec": getattr(path, "compression", None),
            "world": case.world, "iters": iters, "warmup": 1 + warm, "check": "ok"}


def measure_interleaved(cells: list[tuple[BenchPath, Case]], sync: Sync, spec: BenchSpec,
                        corrupt: Any = None) -> list[dict[str, Any]]:
    """Several paths of one (op, size), timed in alternation: iteration i runs every path once, in a
    shuffled order.

    Paths compared against each other (a lane hint against the daemons' own
    choice, commd against Gloo) then see the same machine load iteration by
    iteration; back-to-back blocks of iterations let a load change of a few
    seconds decide a comparison on a 2-core machine.  ``corrupt(path)`` says
    whether to spoil that path's checked result (tests).
    """
    for path, case in cells:
        case.fill()
        sync.barrier()
        path.run(case)
        if corrupt is not None and corrupt(path) and case.expected():
            name = next(iter(case.expected()))
            case.view[name][0] += 1
        errors = sync.gather_errors(case.check(path.label))
        if errors:
            raise CheckError("\n".join(errors))
    firsts = []
    for path, case in cells:
        case.prepare_timing()
        t0 = time.perf_counter()
        path.run(case)
        firsts.append(time.perf_counter() - t0)
    warm, iters = iteration_plan(spec, max(sync.max_each(firsts)))
    for path, case in cells:
        for _ in range(warm):
            path.run(case)
        path.barrier()
    clock = time.perf_counter
    times: list[list[float]] = [[] for _ in cells]
    order = list(range(len(cells)))
    for i in range(iters):
        # A fresh order each iteration, the same on every rank (the ops are collective): no path always
        # runs first, or always right after the same other path.
        random.Random(SHUFFLE_SEED + i).shuffle(order)
        for k in order:
            path, case = cells[k]
            t0 = clock()
            path.run(case)
            times[k].append(clock() - t0)
    rows = []
    for (path, case), mine in zip(cells, times, strict=True):
        rows.append({**row_of(path, case, iters, warm), "interleaved": True,
                     **summarize(case.op, case.nbytes, case.world, sync.max_each(mine))})
    return rows
