"""One rank of `commd replay`: a recorded job's ops (PARAM comms traces) replayed through torch.distributed.

    commd launch --nproc-per-node 2 -m commd.bench.replay_worker --trace DIR --backend commd \\
        --out 'result-{rank}.json'

Every rank reads every rank's trace (it needs the whole job's groups, and each
collective's peers to know what its result must be), creates every group in
ascending pg_id order (a group of the whole job is the default group), allocates
one tensor per distinct dtype and size (another only while one is still in flight),
and replays its entries ``--warmup`` + ``--iters`` times:

- an op whose ``wait`` comes later is issued non-blocking and waited there; an op
  with a request id and no later wait (DDP's bucket all-reduces, read through
  futures) is waited at the next step boundary (the first entry of a later step) or
  at the end; an op without a request id blocks;
- ``--compute recorded`` reproduces each gap between two calls as busy CPU work that
  releases the GIL, as torch's kernels do (the process's helper threads keep running);
  ``--compute none`` runs the calls back to back;
- per iteration it records the wall time, each step's wall time and the
  communication time (inside op calls and waits).  The first iteration fills every
  op's input with a known pattern and checks results against NumPy; that work is
  left out of its times.

Each rank writes its figures to ``--out`` (``{rank}`` replaced), the recorded
per-step figures beside them.  The plan and the timing loop (``build_plan``,
``Replayer``) are shared with the MPI executor (``replay_mpi``); this module imports
torch only inside the torch executor.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from commd.bench.cases import pattern
from commd.protocol.param_trace import (
    DTYPES,
    CommEntry,
    GroupKey,
    TraceError,
    group_key,
    groups,
    load_dir,
    match_collectives,
    splits_of,
)

#: Exit codes: a failed op, a setup problem, a wrong result, a path this fabric cannot run.
EXIT_FAILED = 1
EXIT_SETUP = 2
EXIT_CHECK = 3
EXIT_SKIPPED = 4
#: Ops moving more elements than this (on any of their ranks) are replayed but not checked: the
#: NumPy reference would cost more than the replay.
CHECK_MAX_ELEMENTS = 1 << 22
#: At most this many checked ops per rank (the first ones).
MAX_CHECKS = 64
#: Comparison tolerance per stored float dtype (sums of small integers are exact; products may round).
RTOL = {"float64": 1e-9, "float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
#: Marks output elements not yet written, so an op that never delivered fails its check.
SENTINEL = -1.0
COMPUTE_CHOICES = ("recorded", "none")
BACKENDS = ("commd", "gloo")
LANES = ("tcp", "gloo", "mpi")
DEFAULT_OP_TIMEOUT_S = 120.0


class ReplayError(Exception):
    """The replay cannot start (bad options, a trace for another world, a lane this fabric lacks)."""


class CheckError(Exception):
    """A wrong result; the message names the op, its entry and the rank."""


# ---- the plan: what one rank does, computed once --------------------------------------------
@dataclass
class Action:
    """One entry of the rank's trace as the replay runs it."""

    index: int  # the entry's index in the rank's trace file
    entry: CommEntry
    group: GroupKey | None = None  # ops: the group it runs on
    #: ops: "blocking" (no request id), "async" (a later wait names it), "deferred" (waited at the next
    #: step boundary or the end); waits: "wait"
    mode: str = "blocking"
    target: int | None = None  # a wait: the position of the op it waits for (None: nothing in flight)
    gap_s: float = 0.0  # the recorded compute before this call
    buffers: dict[str, int] = field(default_factory=dict)  # role ("buf", "in", "out") -> buffer id
    counts: dict[str, int] = field(default_factory=dict)  # role -> elements
    peers: tuple[CommEntry, ...] | None = None  # a collective: every member's entry, in group order
    fill: bool = False  # the first iteration fills its inputs with the pattern (all its ranks do)
    check: bool = False  # ... and checks its result


@dataclass
class Plan:
    """One rank's replay: its actions, the groups every rank creates, the buffers it needs."""

    rank: int
    world: int
    groups: list[GroupKey]  # created in this order on every rank (groups of the whole job excluded)
    actions: list[Action]
    buffers: list[tuple[str, int]]  # (PARAM dtype, elements) per buffer id
    steps: list[int]
    recorded: list[dict[str, float]]  # per step: {"step", "wall_s", "comm_s"} from the trace

    @property
    def ops(self) -> int:
        return sum(1 for a in self.actions if a.mode != "wait")

    def group_ranks(self, key: GroupKey | None) -> tuple[int, ...]:
        return tuple(range(self.world)) if key is None else key[1]


def buffer_roles(entry: CommEntry, rank: int) -> dict[str, int]:
    """The buffers an op needs on ``rank`` (role -> elements): one in-place buffer, or an input and an
    output (a gather's output and a scatter's input on the root only)."""
    c, i, o = entry.comms, entry.in_msg_size, entry.out_msg_size
    if c in ("all_reduce", "broadcast", "reduce", "send", "recv"):
        return {"buf": i}
    if c == "barrier":
        return {}
    if c == "gather":
        return {"in": i, **({"out": o} if rank == entry.root else {})}
    if c == "scatter":
        return {"out": o, **({"in": i} if rank == entry.root else {})}
    return {"in": i, "out": o}


def replay_groups(traces: dict[int, list[CommEntry]]) -> list[GroupKey]:
    """Every group of the job except the whole job's: ascending pg_id, then groups named by ranks only."""
    table, world = groups(traces), len(traces)
    keys = {(pg, ranks) for pg, ranks in table.items() if len(ranks) != world}
    for entries in traces.values():
        for e in entries:
            if e.comms not in ("init", "wait"):
                key = group_key(e, table, world)
                if key[0] is not None or len(key[1]) != world:
                    keys.add(key)
    return sorted(keys, key=lambda k: (k[0] is None, k[0] or 0, k[1]))


def build_plan(traces: dict[int, list[CommEntry]], rank: int,
               matched: dict[tuple[int, int], tuple[CommEntry, ...]] | None = None) -> Plan:
    """``rank``'s replay of the job ``traces``; TraceError if the traces do not replay together.
    ``matched``: ``match_collectives(traces)``, when the caller has it already (planning every rank)."""
    if matched is None:
        matched = match_collectives(traces)
    table, world = groups(traces), len(traces)
    actions: list[Action] = []
    pending: dict[int, int] = {}  # req -> position of the op not yet waited
    previous: CommEntry | None = None
    for i, e in enumerate(traces[rank]):
        if e.comms == "init":
            continue
        gap_ns = 0 if previous is None else e.start_ns - (previous.start_ns + previous.duration_ns)
        previous = e
        action = Action(index=i, entry=e, gap_s=max(0, gap_ns) / 1e9)
        if e.comms == "wait":
            action.mode = "wait"
            action.target = pending.pop(e.req, None) if e.req is not None else None
            if action.target is not None:
                actions[action.target].mode = "async"
        else:
            action.group = group_key(e, table, world)
            action.peers = matched.get((rank, i))
            action.counts = buffer_roles(e, rank)
            if e.req is not None:
                if e.req in pending:  # the request id is reused before a wait: the earlier op is deferred
                    actions[pending[e.req]].mode = "deferred"
                pending[e.req] = len(actions)
                action.mode = "deferred"  # until a later wait names it
        actions.append(action)
    buffers = assign_buffers(actions)
    _choose_checks(actions)
    steps = list(dict.fromkeys(a.entry.step for a in actions))
    return Plan(rank, world, replay_groups(traces), actions, buffers, steps, recorded_steps(actions))


def release_points(actions: list[Action]) -> list[int]:
    """Per action, the position before which its buffers are free again: after the call (blocking), after
    its wait (async), at the next step boundary or the end (deferred)."""
    out = [p + 1 for p in range(len(actions))]
    for p, a in enumerate(actions):
        if a.mode == "wait" and a.target is not None:
            out[a.target] = p + 1
    for p, a in enumerate(actions):
        if a.mode == "deferred":
            later = next((q for q in range(p + 1, len(actions)) if actions[q].entry.step > a.entry.step), None)
            out[p] = len(actions) if later is None else later
    return out


def assign_buffers(actions: list[Action]) -> list[tuple[str, int]]:
    """Sets each action's buffer ids: one buffer per (dtype, size), and another only where all of that
    shape are still in flight.  Returns the buffers' (dtype, elements) by id."""
    buffers: list[tuple[str, int]] = []
    free: dict[tuple[str, int], list[int]] = {}
    releases: dict[int, list[int]] = {}
    ends = release_points(actions)
    for p, a in enumerate(actions):
        for buf in releases.pop(p, []):
            free.setdefault(buffers[buf], []).append(buf)
        for role, count in a.counts.items():
            shape = (str(a.entry.dtype), count)
            pool = free.get(shape)
            if pool:
                buf = pool.pop()
            else:
                buf = len(buffers)
                buffers.append(shape)
            a.buffers[role] = buf
            releases.setdefault(ends[p], []).append(buf)
    return buffers


def _choose_checks(actions: list[Action]) -> None:
    """Ops small enough on every rank are filled with the pattern in the first iteration (every member
    decides alike, from the entries of the whole group), and the first ``MAX_CHECKS`` are checked."""
    checked = 0
    for a in actions:
        if a.mode == "wait":
            continue
        row = a.peers or (a.entry,)
        a.fill = max(e.in_msg_size + e.out_msg_size for e in row) <= CHECK_MAX_ELEMENTS
        if a.fill and checked < MAX_CHECKS and a.entry.dtype != "bool" and a.entry.comms not in ("send", "barrier"):
            a.check = True
            checked += 1


def recorded_steps(actions: list[Action]) -> list[dict[str, float]]:
    """Per step, as recorded: its wall time (each call's gap before it plus its duration) and its
    communication time (the durations of its calls and waits)."""
    out: dict[int, dict[str, float]] = {}
    for a in actions:
        row = out.setdefault(a.entry.step, {"step": a.entry.step, "wall_s": 0.0, "comm_s": 0.0})
        row["wall_s"] += a.gap_s + a.entry.duration_ns / 1e9
        row["comm_s"] += a.entry.duration_ns / 1e9
    return list(out.values())


# ---- what a result must be -------------------------------------------------------------------
def kind_of(storage: str) -> str:
    """"float", "int" or "bool" for a stored dtype (numpy's names, and "bfloat16")."""
    if storage == "bfloat16":
        return "float"
    dtype = np.dtype(storage)
    return "bool" if dtype == np.bool_ else "float" if dtype.kind == "f" else "int"


def inputs_of(rank: int, start: int, count: int, storage: str) -> np.ndarray:
    """Rank ``rank``'s input elements [start, start+count) as stored (integers wrapped to the dtype), as
    float64 or int64 for arithmetic."""
    values = pattern(rank, start, count)
    if kind_of(storage) == "int":
        return values.astype(np.int64).astype(storage).astype(np.int64)
    return values


def _reduce(stack: np.ndarray, op: str) -> np.ndarray:
    if op == "sum":
        return stack.sum(axis=0)
    if op == "avg":
        return stack.sum(axis=0) / stack.shape[0]
    if op == "product":
        return np.prod(stack, axis=0)
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    ufunc = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    return ufunc.reduce(stack, axis=0)


def expected(a: Action, rank: int, ranks: tuple[int, ...], storage: str, reduce_op: str) -> dict[str, np.ndarray]:
    """What ``a``'s buffers hold on ``rank`` once it completed, by role (roles whose content the op
    leaves unspecified on this rank are absent)."""
    e, n = a.entry, len(ranks)
    me = ranks.index(rank)
    c = e.comms

    def block(r: int, start: int, count: int) -> np.ndarray:
        return inputs_of(r, start, count, storage)

    def reduced(count: int) -> np.ndarray:
        out = _reduce(np.stack([block(r, 0, count) for r in ranks]), reduce_op)
        return out.astype(np.int64).astype(storage).astype(np.int64) if kind_of(storage) == "int" else out

    if c == "all_reduce" or (c == "reduce" and rank == e.root):
        return {"buf": reduced(e.in_msg_size)}
    if c == "broadcast":
        return {"buf": block(e.root, 0, e.in_msg_size)}  # type: ignore[arg-type]
    if c == "recv":
        return {"buf": block(e.src_rank, 0, e.in_msg_size)}  # type: ignore[arg-type]
    if c in ("all_gather", "all_gather_base") or (c == "gather" and rank == e.root):
        return {"out": np.concatenate([block(r, 0, e.in_msg_size) for r in ranks])}
    if c in ("reduce_scatter", "reduce_scatter_base"):
        return {"out": reduced(e.in_msg_size)[me * e.out_msg_size:(me + 1) * e.out_msg_size]}
    if c == "scatter":
        return {"out": block(e.root, me * e.out_msg_size, e.out_msg_size)}  # type: ignore[arg-type]
    if c in ("all_to_allv", "all_to_all") and a.peers is not None:
        parts = []
        for j, peer in enumerate(a.peers):
            sends = splits_of(peer, n)[0]
            parts.append(block(ranks[j], sum(sends[:me]), sends[me]))
        return {"out": np.concatenate(parts) if parts else np.zeros(0)}
    return {}


def fill_values(a: Action, rank: int, storage: str) -> dict[str, np.ndarray]:
    """What the first iteration writes into ``a``'s buffers before issuing it: the pattern into inputs
    (and in-place buffers), the sentinel into outputs and receive buffers."""
    out: dict[str, np.ndarray] = {}
    for role, count in a.counts.items():
        if role == "out" or a.entry.comms == "recv":
            out[role] = np.full(count, SENTINEL)
        else:
            out[role] = inputs_of(rank, 0, count, storage)
    return out


def compare(got: np.ndarray, want: np.ndarray, storage: str) -> str | None:
    """None if ``got`` is ``want``; else where they first differ."""
    if got.shape != want.shape:
        return f"{got.size} elements, expected {want.size}"
    if kind_of(storage) == "int":
        bad = np.flatnonzero(got != want)
    else:
        close = np.isclose(got, want, rtol=RTOL.get(storage, 1e-5), atol=0.0, equal_nan=True)
        bad = np.flatnonzero(~close)
    if bad.size == 0:
        return None
    k = int(bad[0])
    return f"element {k} is {got[k]!r}, expected {want[k]!r} ({bad.size} of {got.size} differ)"


# ---- the timing loop, shared by the executors --------------------------------------------------
class Executor(Protocol):
    """What the replay loop needs of a library (torch.distributed, mpi4py)."""

    notes: list[str]

    def storage(self, dtype: str) -> str: ...  # the dtype a PARAM dtype is stored as (numpy's name)
    def reduce_name(self, op: str) -> str: ...  # the reduction actually run for a trace's reduce_op
    def issue(self, position: int, action: Action, nonblocking: bool) -> Any: ...
    def wait(self, handle: Any) -> None: ...
    def fill(self, buffer: int, values: np.ndarray) -> None: ...
    def read(self, buffer: int) -> np.ndarray: ...  # float64 or int64 copy
    def barrier(self) -> None: ...  # outside the replay (the side channel)


class Spinner:
    """Busy CPU work until a deadline, in NumPy calls that release the GIL (as torch's kernels do), so
    a library's helper threads in this process keep running while the 'compute' occupies the core."""

    def __init__(self) -> None:
        self.work = np.ones(4096, dtype=np.float32)

    def until(self, deadline: float, now: Callable[[], float]) -> None:
        work = self.work
        while now() < deadline:
            np.multiply(work, 1.0, out=work)


class Replayer:
    """Runs a plan's iterations through an executor and times them."""

    def __init__(self, plan: Plan, executor: Executor, compute: bool) -> None:
        self.plan, self.ex, self.compute = plan, executor, compute
        self.spinner = Spinner()
        self.checked = 0
        self.excluded = 0.0  # seconds of this iteration spent filling and checking (not replaying)

    def now(self) -> float:
        """The iteration's clock: the time spent filling and checking taken out."""
        return time.perf_counter() - self.excluded

    def iteration(self, check: bool) -> dict[str, Any]:
        """One pass over the actions; ``check``: fill and check (that time is left out of the figures)."""
        ex, actions, now = self.ex, self.plan.actions, self.now
        self.excluded = 0.0
        handles: dict[int, Any] = {}
        deferred: list[int] = []
        steps: list[dict[str, float]] = []
        comm = step_comm = 0.0
        start = last_end = step_start = now()
        step = actions[0].entry.step if actions else 0
        for pos, a in enumerate(actions):
            if a.entry.step != step:  # a step boundary: the deferred ops complete in the step they belong to
                spent = self._drain(deferred, handles, check)
                comm, step_comm = comm + spent, step_comm + spent
                last_end = now()
                steps.append({"step": step, "wall_s": last_end - step_start, "comm_s": step_comm})
                step, step_start, step_comm = a.entry.step, last_end, 0.0
            if self.compute and a.gap_s > 0:
                self.spinner.until(last_end + a.gap_s, now)
            if check and a.fill and a.counts:
                self._untimed(lambda a=a: self._fill(a))
            t0 = now()
            done: int | None = None
            if a.mode == "wait":
                if a.target is not None and a.target in handles:
                    ex.wait(handles.pop(a.target))
                    done = a.target
            elif a.mode == "blocking":
                ex.issue(pos, a, nonblocking=False)
                done = pos
            else:
                handles[pos] = ex.issue(pos, a, nonblocking=True)
                if a.mode == "deferred":
                    deferred.append(pos)
            last_end = now()
            comm += last_end - t0
            step_comm += last_end - t0
            if check and done is not None and actions[done].check:
                self._untimed(lambda done=done: self._check(actions[done]))
        spent = self._drain(deferred, handles, check)
        comm, step_comm = comm + spent, step_comm + spent
        if handles:  # pragma: no cover - every async op has its wait, every other one is deferred
            raise RuntimeError(f"ops left in flight at the end of the iteration: {sorted(handles)}")
        end = now()
        steps.append({"step": step, "wall_s": end - step_start, "comm_s": step_comm})
        return {"wall_s": end - start, "comm_s": comm, "steps": steps}

    def _drain(self, deferred: list[int], handles: dict[int, Any], check: bool) -> float:
        """Wait for the deferred ops (at a step boundary or the end); the time that took.  Checked before
        their buffers serve later ops."""
        t0 = self.now()
        for pos in deferred:
            self.ex.wait(handles.pop(pos))
        spent = self.now() - t0
        if check:
            for pos in deferred:
                if self.plan.actions[pos].check:
                    self._untimed(lambda pos=pos: self._check(self.plan.actions[pos]))
        deferred.clear()
        return spent

    def _untimed(self, work: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            work()
        finally:
            self.excluded += time.perf_counter() - t0

    def _fill(self, a: Action) -> None:
        for role, values in fill_values(a, self.plan.rank, self.ex.storage(str(a.entry.dtype))).items():
            self.ex.fill(a.buffers[role], values)

    def _check(self, a: Action) -> None:
        e = a.entry
        storage = self.ex.storage(str(e.dtype))
        ranks = self.plan.group_ranks(a.group)
        want = expected(a, self.plan.rank, ranks, storage, self.ex.reduce_name(e.reduce_op or "sum"))
        if not want:  # the op leaves nothing defined here (a reduce's or a gather's non-root ranks)
            return
        for role, values in want.items():
            problem = compare(self.ex.read(a.buffers[role]), values, storage)
            if problem is not None:
                raise CheckError(f"wrong result on rank {self.plan.rank}: {e.comms} of trace entry {a.index} "
                                 f"({e.dtype}, {e.in_msg_size} -> {e.out_msg_size} elements, group {list(ranks)}), "
                                 f"{'buffer' if role == 'buf' else role + 'put'}: {problem}")
        self.checked += 1


def run_iterations(replayer: Replayer, executor: Executor, warmup: int, iters: int,
                   between: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """``warmup`` + ``iters`` iterations, each after a side-channel barrier (the first one checks);
    ``between(i)`` runs before iteration i's barrier.  Returns the timed ones."""
    timed = []
    for i in range(warmup + iters):
        if between is not None:
            between(i)
        executor.barrier()
        result = replayer.iteration(check=i == 0)
        if i >= warmup:
            timed.append(result)
    return timed


def result_record(plan: Plan, backend: str, lane: str | None, args: argparse.Namespace, timed: list[dict[str, Any]],
                  checked: int, notes: list[str], **extra: Any) -> dict[str, Any]:
    """One rank's result file."""
    return {"rank": plan.rank, "world": plan.world, "node": node_name(), "backend": backend, "lane": lane,
            "compute": args.compute, "warmup": args.warmup, "iters": args.iters, "ops": plan.ops,
            "steps": plan.steps, "iterations": timed, "recorded": plan.recorded, "checked": checked,
            "notes": notes, **extra}


def write_result(pattern_path: str, rank: int, record: dict[str, Any]) -> None:
    path = Path(pattern_path.replace("{rank}", str(rank)))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)


def node_name() -> str:
    return os.environ.get("COMMD_NODE") or socket.gethostname()


# ---- options ----------------------------------------------------------------------------------
def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both executors take."""
    parser.add_argument("--trace", required=True, metavar="DIR", help="the directory of per-rank traces")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations over the trace (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first (default 1)")
    parser.add_argument("--compute", choices=COMPUTE_CHOICES, default="recorded",
                        help="recorded: busy CPU work in each recorded gap between calls; none: calls back to back")
    parser.add_argument("--out", required=True, metavar="PATTERN",
                        help="where each rank writes its figures (JSON); {rank} is replaced by the rank")
    parser.add_argument("--op-timeout", type=float, default=DEFAULT_OP_TIMEOUT_S,
                        help=f"seconds an op may take (default {DEFAULT_OP_TIMEOUT_S:g})")


def check_replay_arguments(args: argparse.Namespace) -> None:
    if "{rank}" not in args.out:
        raise ReplayError(f"--out {args.out!r} must contain {{rank}} (each rank writes its own file)")
    if not Path(args.out.replace("{rank}", "0")).parent.is_dir():
        raise ReplayError(f"--out {args.out!r}: no directory {Path(args.out).parent}")
    check_passes(args)


def check_passes(args: argparse.Namespace) -> None:
    """``--iters``, ``--warmup`` and ``--op-timeout`` in their ranges (the command's and each worker's)."""
    if not 1 <= args.iters <= 100_000:
        raise ReplayError(f"--iters {args.iters} must lie in [1, 100000]")
    if not 0 <= args.warmup <= 100_000:
        raise ReplayError(f"--warmup {args.warmup} must lie in [0, 100000]")
    if not 0 < args.op_timeout <= 7 * 24 * 3600:
        raise ReplayError(f"--op-timeout {args.op_timeout} must lie in (0, 604800] seconds")


def load_plan(trace: str, rank: int, world: int) -> Plan:
    """The rank's plan of the traces in ``trace``, for a job of ``world`` ranks."""
    try:
        traces = load_dir(trace)
        if len(traces) != world:
            raise ReplayError(f"the trace in {trace} has {len(traces)} ranks, but this job has {world}")
        return build_plan(traces, rank)
    except TraceError as exc:
        raise ReplayError(f"bad trace: {exc}") from None


# ---- torch.distributed ------------------------------------------------------------------------
class TorchExecutor:
    """torch.distributed on the commd backend (its groups optionally pinned to a lane) or on Gloo."""

    def __init__(self, plan: Plan, backend: str, lane: str | None) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.plan, self.backend, self.lane = torch, dist, plan, backend, lane
        #: torch 2.13's names for the tensor forms (the older ones warn that they are deprecated)
        self.gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        self.scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        self.notes: list[str] = []
        self.groups: dict[GroupKey, Any] = {}
        self.tensors: list[Any] = []
        self.views: dict[int, list[Any]] = {}  # position -> the list views a list-shaped op takes
        self.sync: Any = None
        ops = {e.entry.reduce_op or "sum" for e in plan.actions if e.mode != "wait"}
        if backend == "gloo" and "avg" in ops:
            self.notes.append("gloo has no average: all-reduces with reduce_op avg ran as sums")

    def options(self) -> Any:
        if self.backend != "commd" or self.lane is None:
            return None
        from commd.torch_backend.process_group import Options

        return Options(lane=self.lane)

    def setup(self, rank: int, world: int, timeout_s: float) -> None:
        """The default group, every group of the trace in order, the side channel, the buffers."""
        dist, torch = self.dist, self.torch
        timeout = timedelta(seconds=timeout_s)
        if self.backend == "commd":
            import commd  # noqa: F401 - registers the backend

            dist.init_process_group("commd", rank=rank, world_size=world, timeout=timeout, pg_options=self.options())
        else:
            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=timeout)
        for key in self.plan.groups:
            self.groups[key] = dist.new_group(list(key[1]), timeout=timeout, pg_options=self.options())
        self.sync = dist.new_group(backend="gloo", timeout=timeout)  # outside the replayed (and recorded) ops
        for dtype, count in self.plan.buffers:
            self.tensors.append(torch.zeros(count, dtype=getattr(torch, DTYPES[dtype])))
        for pos, a in enumerate(self.plan.actions):
            e, t = a.entry, self.tensors
            if e.comms == "all_gather":
                self.views[pos] = list(t[a.buffers["out"]].split(e.in_msg_size))
            elif e.comms == "reduce_scatter":
                self.views[pos] = list(t[a.buffers["in"]].split(e.out_msg_size))
            elif e.comms == "gather" and "out" in a.buffers:
                self.views[pos] = list(t[a.buffers["out"]].split(e.in_msg_size))
            elif e.comms == "scatter" and "in" in a.buffers:
                self.views[pos] = list(t[a.buffers["in"]].split(e.out_msg_size))

    def group(self, key: GroupKey | None) -> Any:
        return None if key is None or key[0] is None and len(key[1]) == self.plan.world else self.groups[key]

    def storage(self, dtype: str) -> str:
        return DTYPES[dtype]

    def reduce_name(self, op: str) -> str:
        return "sum" if op == "avg" and self.backend == "gloo" else op

    def _op(self, name: str | None) -> Any:
        return getattr(self.dist.ReduceOp, self.reduce_name(name or "sum").upper())

    def issue(self, position: int, action: Action, nonblocking: bool) -> Any:
        d, e, b = self.dist, action.entry, action.buffers
        t = self.tensors
        kw: dict[str, Any] = {"group": self.group(action.group), "async_op": nonblocking}
        c = e.comms
        if c == "all_reduce":
            return d.all_reduce(t[b["buf"]], op=self._op(e.reduce_op), **kw)
        if c == "reduce":
            return d.reduce(t[b["buf"]], dst=e.root, op=self._op(e.reduce_op), **kw)
        if c == "broadcast":
            return d.broadcast(t[b["buf"]], src=e.root, **kw)
        if c in ("all_to_allv", "all_to_all"):
            n = len(self.plan.group_ranks(action.group))
            ins, outs = splits_of(e, n)
            if c == "all_to_all" and len(set(ins)) == 1 and len(set(outs)) == 1:
                return d.all_to_all_single(t[b["out"]], t[b["in"]], **kw)
            return d.all_to_all_single(t[b["out"]], t[b["in"]], output_split_sizes=list(outs),
                                       input_split_sizes=list(ins), **kw)
        if c == "all_gather":
            return d.all_gather(self.views[position], t[b["in"]], **kw)
        if c == "all_gather_base":
            return self.gather_single(t[b["out"]], t[b["in"]], **kw)
        if c == "reduce_scatter":
            return d.reduce_scatter(t[b["out"]], self.views[position], op=self._op(e.reduce_op), **kw)
        if c == "reduce_scatter_base":
            return self.scatter_single(t[b["out"]], t[b["in"]], op=self._op(e.reduce_op), **kw)
        if c == "gather":
            return d.gather(t[b["in"]], gather_list=self.views.get(position), dst=e.root, **kw)
        if c == "scatter":
            return d.scatter(t[b["out"]], scatter_list=self.views.get(position), src=e.root, **kw)
        if c == "barrier":
            return d.barrier(**kw)
        if c == "send":
            if nonblocking:
                return d.isend(t[b["buf"]], dst=e.dst_rank, group=kw["group"])
            return d.send(t[b["buf"]], dst=e.dst_rank, group=kw["group"])
        if c == "recv":
            if nonblocking:
                return d.irecv(t[b["buf"]], src=e.src_rank, group=kw["group"])
            return d.recv(t[b["buf"]], src=e.src_rank, group=kw["group"])
        raise ValueError(f"cannot replay {c!r}")  # pragma: no cover - the trace was validated

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.wait()

    def fill(self, buffer: int, values: np.ndarray) -> None:
        self.tensors[buffer].copy_(self.torch.from_numpy(values))

    def read(self, buffer: int) -> np.ndarray:
        t = self.tensors[buffer]
        wide = self.torch.float64 if t.is_floating_point() else self.torch.int64
        return t.to(wide).numpy().copy()

    def barrier(self) -> None:
        self.dist.barrier(group=self.sync)

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank (through the side channel)."""
        box = [value]
        self.dist.broadcast_object_list(box, src=0, group=self.sync)
        return box[0]

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def daemon_status() -> dict[str, Any]:
    """This process's commd daemon's status map (the client's job)."""
    from commd.client.status import query_status
    from commd.torch_backend.process_group import current_client

    return query_status(current_client().paths, timeout=20.0)


def lane_counts(status: dict[str, Any]) -> dict[str, dict[str, dict[str, int]]]:
    """Ops per kind and lane so far ("ring": all-reduces the exchange rings ran without the daemon)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for kind, row in (status.get("ops_by_lane") or {}).items():
        out[kind] = {lane: {"ops": int(v.get("ops", 0)), "bytes": int(v.get("bytes", 0))} for lane, v in row.items()}
    ring_ops = sum(int(r.get("ops", 0)) for r in (status.get("rings") or {}).values())
    if ring_ops:
        out.setdefault("allreduce", {})["ring"] = {"ops": ring_ops, "bytes": 0}
    return out


def lane_difference(before: dict[str, dict[str, dict[str, int]]],
                    after: dict[str, dict[str, dict[str, int]]]) -> dict[str, dict[str, dict[str, int]]]:
    """The ops per kind and lane between two ``lane_counts``."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for kind, row in after.items():
        for lane, v in row.items():
            was = before.get(kind, {}).get(lane, {"ops": 0, "bytes": 0})
            ops = v["ops"] - was["ops"]
            if ops > 0:
                out.setdefault(kind, {})[lane] = {"ops": ops, "bytes": v["bytes"] - was["bytes"]}
    return out


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        raise ReplayError(f"${name} is not set: run this under `commd launch` or torchrun (or use `commd replay`)")
    return int(value)


def _lane_decision(executor: TorchExecutor, lane: str | None) -> dict[str, Any]:
    """Rank 0 asks its daemon for the fabric's lanes: a pinned lane the fabric lacks skips the path."""
    try:
        status = daemon_status()
    except Exception as exc:  # noqa: BLE001 - the status is an extra; say why it is missing
        return {"fabric_lanes": None, "note": f"the daemon's status is unavailable ({exc}): no lane counts"}
    fabric = status.get("fabric")
    lanes = sorted((fabric or {}).get("lanes") or [])
    if fabric and lane is not None and lane not in lanes:
        hint = " (the MPI lane needs daemons started under mpiexec)" if lane == "mpi" else ""
        return {"fabric_lanes": lanes, "skip": f"this fabric has no lane {lane!r}; it has {','.join(lanes)}{hint}"}
    note = None
    if not fabric and lane is not None:
        note = f"one node: every op is local, so the {lane} lane is never used"
    return {"fabric_lanes": lanes, "note": note}


def run(args: argparse.Namespace) -> int:
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    plan = load_plan(args.trace, rank, world)
    executor = TorchExecutor(plan, args.backend, args.lane)
    record: dict[str, Any] = {}
    try:
        executor.setup(rank, world, args.op_timeout)
        decision: dict[str, Any] = {}
        if args.backend == "commd":
            decision = executor.agree(_lane_decision(executor, args.lane) if rank == 0 else None)
        if decision.get("note"):
            executor.notes.append(decision["note"])
        if decision.get("skip"):
            write_result(args.out, rank, {"rank": rank, "skipped": decision["skip"]})
            if rank == 0:
                print(f"commd replay: skipped: {decision['skip']}", file=sys.stderr)
            return EXIT_SKIPPED
        replayer = Replayer(plan, executor, args.compute == "recorded")
        counted = args.backend == "commd" and rank == 0 and decision.get("fabric_lanes") is not None
        before: list[Any] = [None]

        def between(i: int) -> None:
            if counted and i == args.warmup:
                before[0] = lane_counts(daemon_status())

        timed = run_iterations(replayer, executor, args.warmup, args.iters, between)
        if counted:
            record["lanes"] = lane_difference(before[0] or {}, lane_counts(daemon_status()))
            record["fabric_lanes"] = decision.get("fabric_lanes")
        write_result(args.out, rank, result_record(plan, args.backend, args.lane, args, timed, replayer.checked,
                                                   executor.notes, **record))
        executor.barrier()  # nobody leaves (and takes the store down) before everyone wrote
    except CheckError as exc:
        write_result(args.out, rank, {"rank": rank, "error": str(exc)})
        print(f"commd replay: {exc}", file=sys.stderr)
        return EXIT_CHECK
    except Exception as exc:  # a failed op (a peer gone, a timeout, an op the backend lacks): name it
        message = f"rank {rank}: {type(exc).__name__}: {exc}"
        write_result(args.out, rank, {"rank": rank, "error": message})
        print(f"commd replay: {message}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        executor.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m commd.bench.replay_worker",
                                     description="one rank of `commd replay` through torch.distributed; run it "
                                                 "under `commd launch` (or torchrun)")
    add_replay_arguments(parser)
    parser.add_argument("--backend", choices=BACKENDS, default="commd", help="the torch.distributed backend")
    parser.add_argument("--lane", choices=LANES, default=None,
                        help="commd: create every group with Options(lane=LANE) (default: the daemons choose)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_replay_arguments(args)
        if args.lane is not None and args.backend != "commd":
            raise ReplayError("--lane pins commd's groups to a lane: it needs --backend commd")
        return run(args)
    except ReplayError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"commd replay: {exc}", file=sys.stderr)
        return EXIT_SETUP


if __name__ == "__main__":
    sys.exit(main())
