"""Randomized schedules of collectives and faults, their outcomes as a single-process model says, and
the rank side that runs them through the torch backend (tests/test_path_equivalence.py).

A schedule is a few all-reduces, each of a size (tiny, a ring entry, a ring's large slot, past the
ring: the daemon path), a dtype, sync or async (async ops are waited in a random order), and at most
one fault: a rank's count or dtype differs, a rank broadcasts instead (another kind), or a rank
arrives after the op's timeout (then every op of the schedule is sync: an async op submitted behind a
late one would time out too, on every path alike, which tests nothing more).  Faults that send one
rank's op to the daemon while the others' take a ring (another kind; a changed size at a ring's
limit) make a group leave its ring for good, so they come only in the last tenth of the schedules:
the ring runs the rest, faults and all.  Every rank draws the
same schedules from one seed, runs them back to back (a barrier before each), and records each op's
outcome: its result's digest, or its error's kind, collective number and the global ranks a timeout
names.  The model (``expected``) is the daemon path's contract; every path configuration must give
exactly it, so no path ever returns a value that mixes two ops, or fails differently.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

#: Element counts: tiny, a ring entry (64 KiB of float32), a rank-bridged ring's large slot (of
#: float32), a large slot, past every ring (daemon path).
SIZES = (1, 10, 1000, 16384, 100_000, 300_000, 1_100_000)
#: The sizes at a ring's limit (a bridged ring's entry; a rank-bridged ring's largest op): one element
#: more, or a wider dtype, leaves it.
LIMIT_SIZES = (16384, 100_000)
DTYPES = ("float32", "float64", "int64")
FAULTS = ("count", "dtype", "kind", "late")
#: The group's op timeout, and how long a late rank sleeps before it submits (past the timeout, and
#: short enough that the others' next op, submitted when theirs failed, still meets it).
TIMEOUT_S = 1.0
LATE_S = 1.5
#: One schedule in this many has a late rank (each costs ``LATE_S``: most of a run's time).
LATE_EVERY = 100


@dataclass(frozen=True)
class Op:
    size: int
    dtype: str
    fault: str | None  # one of FAULTS
    faulty: int  # the rank at fault
    waited_async: bool


def schedules(seed: int, count: int, world: int, repeat: int = 1) -> list[list[Op]]:
    """``count`` schedules drawn from ``seed`` (the same on every rank).  ``repeat``: schedules come
    in blocks of that many with the same ops (sizes, dtypes, waits), faults only in a block's last
    one: a loop that repeats itself, so that the fabric's schedule path takes it, and then deviates."""
    rng = np.random.default_rng(seed)
    out: list[list[Op]] = []
    for i in range(count):
        if repeat > 1 and i % repeat:
            last = i % repeat == repeat - 1
            shapes = out[i - i % repeat]
            ops = []
            for op in shapes:
                fault = str(rng.choice(FAULTS[:3])) if last and rng.random() < 0.25 else None
                if i < count * 0.9 and (fault == "kind" or (fault is not None and op.size in LIMIT_SIZES)):
                    fault = None
                ops.append(Op(op.size, op.dtype, fault, int(rng.integers(world)), op.waited_async))
            if last and i % LATE_EVERY == LATE_EVERY - 1:  # a late rank too, all ops then waited in turn
                ops = [Op(op.size, op.dtype, "late" if k == 0 else None, op.faulty, False)
                       for k, op in enumerate(ops)]
            out.append(ops)
            continue
        late_one = i % LATE_EVERY == LATE_EVERY - 1
        ops: list[Op] = []
        n = int(rng.integers(1, 6))
        late_at = int(rng.integers(n)) if late_one else -1
        for k in range(n):
            fault: str | None = None
            if k == late_at:
                fault = "late"
            elif rng.random() < 0.25:
                fault = str(rng.choice(FAULTS[:3]))
            size = int(rng.choice(SIZES))
            if i < count * 0.9 and (fault == "kind" or (fault is not None and size in LIMIT_SIZES)):
                fault = None  # it would move the group off its ring (see the module doc)
            if repeat > 1:
                fault = None  # (a block's first schedule: faults come in its last)
            ops.append(Op(size, str(rng.choice(DTYPES)), fault, int(rng.integers(world)),
                          not late_one and bool(rng.random() < 0.4)))
        out.append(ops)
    return out


def inputs(schedule: int, k: int, rank: int, size: int, dtype: str) -> np.ndarray:
    """A rank's input to op ``k`` of a schedule: small integers, exact in every dtype, unique per op and
    rank, so a result that mixes two ops' inputs cannot equal the right one."""
    base = 1 + rank + 8 * (k + 8 * (schedule % 1000))
    return (base + np.arange(size) % 5).astype(dtype)


def digest(array: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(array).view(np.uint8)).hexdigest()[:16]


def expected(seed: int, count: int, world: int, group_every: int | None = None,
             repeat: int = 1) -> list[list[list[Any]]]:
    """Per rank, per op (schedules flattened), the outcome the daemon path's contract gives, and
    each error's collective number as if the group's first collective were the first barrier
    (``divergences`` allows for the group's collectives before it).  ``group_every``: the schedules
    run on a new group every that many (its numbers start again)."""
    out: list[list[list[Any]]] = [[] for _ in range(world)]
    number = -1
    for i, ops in enumerate(schedules(seed, count, world, repeat)):
        if group_every and i % group_every == 0:
            number = -1
        number += 1  # the schedule's barrier
        for k, op in enumerate(ops):
            for rank in range(world):
                if op.fault == "late":
                    outcome = ["timeout", number, [op.faulty]]
                elif op.fault is not None:
                    outcome = ["mismatch", number]
                else:
                    total = sum(inputs(i, k, r, op.size, op.dtype) for r in range(world))
                    outcome = ["ok", digest(np.asarray(total, op.dtype))]
                out[rank].append(outcome)
            number += 1
    return out


_NUMBER = re.compile(r"#(\d+) on group")
_GLOBAL = re.compile(r"\(global ranks \[([0-9, ]*)\]\)")


def outcome_of(exc: BaseException) -> list[Any]:
    """An op's error as the model words outcomes: its kind, collective number, the ranks it names."""
    text = str(exc)
    number = _NUMBER.search(text)
    n = int(number.group(1)) if number else None
    if "timed out" in text:
        named = _GLOBAL.search(text)
        return ["timeout", n, [int(r) for r in named.group(1).split(",") if r.strip()] if named else None]
    if "mismatched" in text:
        return ["mismatch", n]
    return ["other", f"{type(exc).__name__}: {text[:300]}"]


def run(rank: int, world: int, seed: int, count: int, dist: Any, torch: Any,
        group_every: int | None = None, repeat: int = 1) -> dict[str, Any]:
    """Run the schedules on the default group (its timeout ``TIMEOUT_S``), or on a new group every
    ``group_every`` schedules (a bridged ring is left at a group's first fault: each new group has a
    ring again); each op's outcome, its group's index, and how many of this rank's all-reduces took
    an exchange ring."""
    from commd.client.fastring import RingHandle

    outcomes: list[list[Any]] = []
    groups: list[int] = []
    on_ring = 0
    group = None
    started = time.monotonic()
    for i, ops in enumerate(schedules(seed, count, world, repeat)):
        if group_every and i % group_every == 0:
            group = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
        dist.barrier(group=group)
        pending = []
        for k, op in enumerate(ops):
            mine = op.fault is not None and rank == op.faulty
            size = op.size + (1 if mine and op.fault == "count" else 0)
            dtype = ("int64" if op.dtype != "int64" else "float64") if mine and op.fault == "dtype" else op.dtype
            x = torch.from_numpy(inputs(i, k, rank, size, dtype))
            if mine and op.fault == "late":
                time.sleep(LATE_S)
            slot = len(outcomes)
            outcomes.append(None)
            groups.append(i // group_every if group_every else 0)
            try:
                if mine and op.fault == "kind":
                    work = dist.broadcast(x, src=0, group=group, async_op=True)
                else:
                    work = dist.all_reduce(x, group=group, async_op=True)
                    on_ring += isinstance(work.handles[0], RingHandle)
                if op.waited_async:
                    pending.append((slot, work, x))
                    continue
                work.wait()
                outcomes[slot] = ["ok", digest(x.numpy())]
            except Exception as exc:  # the op's failure is its outcome
                outcomes[slot] = outcome_of(exc)
        for j in np.random.default_rng(seed + i).permutation(len(pending)):
            slot, work, x = pending[j]
            try:
                if j % 2:
                    work.get_future().wait()  # DDP's way
                else:
                    work.wait()
                outcomes[slot] = ["ok", digest(x.numpy())]
            except Exception as exc:
                outcomes[slot] = outcome_of(exc)
    return {"outcomes": outcomes, "groups": groups, "on_ring": on_ring, "seconds": time.monotonic() - started}


def divergences(got: list[list[Any]], groups: list[int], want: list[list[Any]], seed: int, count: int,
                world: int, repeat: int = 1) -> list[str]:
    """Where one rank's outcomes differ from the model's, as readable lines (empty: none).

    The model numbers each group's first schedule's barrier 0; the group's collectives before it
    (what ``init_process_group`` ran) shift every number of the group alike: that shift is read off
    the group's first numbered error and must then hold for every other one."""
    where = [(i, k, op) for i, ops in enumerate(schedules(seed, count, world, repeat)) for k, op in enumerate(ops)]
    shifts: dict[int, int] = {}
    for g, w, group in zip(got, want, groups, strict=False):
        if g[0] == w[0] and g[0] in ("timeout", "mismatch") and g[1] is not None:
            shifts.setdefault(group, g[1] - w[1])
    want = [[w[0], w[1] + shifts.get(group, 0), *w[2:]] if w[0] in ("timeout", "mismatch") else w
            for w, group in zip(want, groups, strict=False)]
    lines = []
    for slot, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            i, k, op = where[slot]
            lines.append(f"schedule {i} op {k} ({op}): got {g}, want {w}")
    if len(got) != len(want):
        lines.append(f"{len(got)} outcomes, the model has {len(want)}")
    return lines
