"""commd.ft under randomized fault injection: every run ends recovered or failed loudly on every
surviving rank within a bound, never hung, never diverged.

Each seed picks a run of 4 spawned ranks on one node training ``ft_workers.mlp`` for 8 guarded
steps: which store (one the test hosts, so any rank may die; or rank 0's, a ``tcp://`` init),
1 or 2 victims, and for each the step and the point where it SIGKILLs itself: before its forward,
in its backward (one DDP bucket submitted), after the commit, after its optimizer step, or (the
second victim only) during the survivors' recovery, before or after the n-th call of the guard's
agreement all-reduce or state check (optimizer states).  Every surviving rank must then either finish,
with parameters equal (bitwise) to the other finishers' and close to a single process trained
with the membership they saw, or raise ``UnrecoverableError``; all within ``RUN_BOUND_S``.

Out of ``make test`` (slow): ``make test-ft-random`` runs 20 seeds; ``COMMD_FT_SEEDS`` (a count,
default 8) and ``COMMD_FT_SEED_BASE`` pick others; ``COMMD_FT_RANDOM_LOG`` names a file each run
appends its outcome to (one JSON line).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import signal
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

WORLD = 4
STEPS = 8
RECOVER_TIMEOUT_S = 30.0
#: Bound on one run, from the ranks' start to the last one's exit: an unrecoverable run ends
#: within the recovery timeout (plus one attempt) of the failure; a recovery takes well under 1 s.
RUN_BOUND_S = 120.0
SEEDS = range(int(os.environ.get("COMMD_FT_SEED_BASE", "0")),
              int(os.environ.get("COMMD_FT_SEED_BASE", "0")) + int(os.environ.get("COMMD_FT_SEEDS", "8")))
RECOVERY_HOOKS = ("_union_of_views", "_check_states")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(RUN_BOUND_S) + 60)]


def plan_of(seed: int) -> tuple[str, dict[int, dict[str, Any]]]:
    """The seed's run: the store's host ("test" or "rank0") and each victim's kill point."""
    from ft_workers import KILL_POINTS

    rng = random.Random(seed)
    store = "test" if rng.random() < 0.75 else "rank0"
    victims = rng.sample(range(WORLD), 1 if rng.random() < 0.4 else 2)
    first = {"point": rng.choice(KILL_POINTS[:-1]), "step": rng.randrange(STEPS)}
    plans = {victims[0]: first}
    if len(victims) == 2:  # a second death: during the recovery 40% of the time, else in the same step half the time
        second = {"point": "recovery" if rng.random() < 0.4 else rng.choice(KILL_POINTS[:-1]),
                  "step": first["step"] if rng.random() < 0.5 else rng.randrange(STEPS)}
        if second["point"] == "recovery":  # (the n-th call of the hook, counted over the run)
            second.update(hook=rng.choice(RECOVERY_HOOKS), nth=rng.choice([1, 1, 1, 2]),
                          when=rng.choice(["before", "after"]))
            del second["step"]
            if first["point"] in ("commit", "optimizer") and first["step"] == STEPS - 1:
                first["step"] = rng.randrange(STEPS - 1)  # a death after the last commit needs no recovery
        plans[victims[1]] = second
    return store, plans


def describe(store: str, plans: dict[int, dict[str, Any]]) -> str:
    parts = [f"store@{store}"]
    for rank, plan in plans.items():
        if plan["point"] == "recovery":
            parts.append(f"r{rank}:{plan['when']}{plan['hook']}#{plan['nth']}")
        else:
            parts.append(f"r{rank}:{plan['point']}@{plan['step']}")
    return ",".join(parts)


def _rank_main(rank: int, out_dir: str, store: tuple[str, int], plan: dict[str, Any] | None) -> None:
    log = os.open(f"{out_dir}/rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    from ft_workers import faulted_training

    try:
        out = faulted_training(rank, WORLD, store, STEPS, plan, RECOVER_TIMEOUT_S)
    except BaseException as exc:  # reported to the test, which judges it
        import traceback

        traceback.print_exc()
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["ended_at"] = time.time()
    torch.save(out, f"{out_dir}/rank{rank}.part")
    os.rename(f"{out_dir}/rank{rank}.part", f"{out_dir}/rank{rank}.pt")
    os._exit(0)  # without exit handlers: the failed group's client may not close cleanly


def _logs(out_dir: Path, lines: int = 25) -> str:
    out = []
    for rank in range(WORLD):
        path = out_dir / f"rank{rank}.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
        out.append(f"--- rank {rank} ---\n" + "\n".join(text))
    return "\n".join(out)


def _killed_at(out_dir: Path, rank: int) -> float | None:
    """When ``rank`` logged that it SIGKILLs itself (time.time()), or None."""
    path = out_dir / f"rank{rank}.log"
    if not path.exists():
        return None
    for line in path.read_text(errors="replace").splitlines():
        if "ft-random: SIGKILL self" in line:
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def _proc_states(pid: int) -> dict[str, str]:
    """Each thread's state and kernel wait channel, from /proc (what a process that does not die waits on)."""
    states = {}
    try:
        for task in sorted(os.listdir(f"/proc/{pid}/task")):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                stat = f.read()
            name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
            try:
                with open(f"/proc/{pid}/task/{task}/wchan") as f:
                    wchan = f.read().strip()
            except OSError:
                wchan = "?"
            states[task] = f"{name} {state} {wchan}"
    except OSError as exc:
        states["error"] = str(exc)
    return states


def _wait(procs: list[Any], out_dir: Path, deadline: float) -> tuple[dict[int, float], dict[int, Any]]:
    """Wait (bounded) for every rank to exit, reaping each as it does.  Returns when each exited
    (time.time()) and, for a victim still there 2 s after its SIGKILL, its threads' states then."""
    exits: dict[int, float] = {}
    dying: dict[int, Any] = {}
    while len(exits) < len(procs) and time.monotonic() < deadline:
        running = {proc.sentinel: rank for rank, proc in enumerate(procs) if rank not in exits}
        for sentinel in mp.connection.wait(list(running), timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
            rank = running[sentinel]
            procs[rank].join(timeout=5)
            exits[rank] = time.time()
        for rank, proc in enumerate(procs):
            if rank in exits or rank in dying:
                continue
            killed = _killed_at(out_dir, rank)
            if killed is not None and time.time() - killed > 2.0:
                dying[rank] = {"after_s": round(time.time() - killed, 1), "threads": _proc_states(proc.pid)}
    for rank, info in dying.items():
        if rank in exits:
            info["exited_s_after_kill"] = round(exits[rank] - (_killed_at(out_dir, rank) or exits[rank]), 1)
    return exits, dying


def _record(outcome: dict[str, Any]) -> None:
    path = os.environ.get("COMMD_FT_RANDOM_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(outcome) + "\n")


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}-{describe(*plan_of(s))}")
def test_every_run_ends_recovered_or_failed_loudly_on_every_survivor(backend_env, tmp_path: Path, seed: int) -> None:
    from ft_workers import reference_of

    store_host, plans = plan_of(seed)
    server = None
    if store_host == "test":  # any rank may die: the job's store is not one of them
        server = torch.distributed.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False,
                                            timeout=timedelta(seconds=RUN_BOUND_S))
        store = ("client", server.port)
    else:
        from cluster import free_port

        store = ("tcp", free_port())
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path), store, plans.get(r))) for r in range(WORLD)]
    started = time.monotonic()
    for proc in procs:
        proc.start()
    exits, dying = _wait(procs, tmp_path, started + RUN_BOUND_S)
    kills = {rank: _killed_at(tmp_path, rank) for rank in plans}
    seconds = time.monotonic() - started
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    outcome: dict[str, Any] = {"seed": seed, "run": describe(store_host, plans), "seconds": round(seconds, 1)}
    outcome["victims_exit_s"] = {rank: round(exits[rank] - at, 2) for rank, at in kills.items()
                                 if at is not None and rank in exits}  # from each SIGKILL to its process's end
    if dying:  # a victim's process outlived its SIGKILL (what the daemon and its peers saw of it differs then)
        outcome["slow_deaths"] = dying
    context = f"seed {seed} ({outcome['run']})"
    if hung:
        _record(dict(outcome, outcome="HUNG", hung=hung))
        pytest.fail(f"{context}: ranks {hung} did not end within {RUN_BOUND_S:.0f}s\n{_logs(tmp_path)}", pytrace=False)

    results = {rank: torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)
               if (tmp_path / f"rank{rank}.pt").exists()}
    killed = sorted(r for r, proc in enumerate(procs) if proc.exitcode == -signal.SIGKILL)
    outcome["killed"] = killed
    problems = []
    if not set(killed) <= set(plans):
        problems.append(f"ranks {killed} were killed, victims planned: {sorted(plans)}")
    silent = [r for r in range(WORLD) if r not in results and r not in killed]
    if silent:
        problems.append(f"ranks {silent} died without a result (exit codes {[procs[r].exitcode for r in silent]})")
    finished = {r: out for r, out in results.items() if "params" in out}
    errors = {r: out["error"] for r, out in results.items() if "error" in out}
    outcome.update(finished=sorted(finished), errors=errors,
                   recoveries={r: [(s, g, k, round(sec, 2)) for s, g, k, sec, _err in out["recoveries"]]
                               for r, out in finished.items()})
    if results:
        ends = [out["ended_at"] for out in results.values()]
        outcome["spread_s"] = round(max(ends) - min(ends), 2)  # from the first rank's end to the last's
    loud = [r for r, e in errors.items() if not e.startswith("UnrecoverableError")]
    if loud:
        problems.append(f"ranks {loud} raised something other than UnrecoverableError")
    if finished:
        schedules = {r: [(s, list(k)) for s, _g, k, _sec, _err in out["recoveries"]] for r, out in finished.items()}
        if len({json.dumps(s) for s in schedules.values()}) > 1:
            problems.append(f"the finishers saw different recoveries: {schedules}")
        ref_rank = min(finished)
        final = schedules[ref_rank][-1][1] if schedules[ref_rank] else list(range(WORLD))
        # a survivor that gave up while the others finished: only if they went on without it, and it says why
        if errors and not all("counted among the lost ranks" in e and r not in final for r, e in errors.items()):
            problems.append(f"a mix: ranks {sorted(finished)} finished, ranks {sorted(errors)} gave up")
        for rank, out in finished.items():
            for i, (a, b) in enumerate(zip(finished[ref_rank]["params"], out["params"], strict=True)):
                if not torch.equal(a, b):
                    problems.append(f"finishers {ref_rank} and {rank} differ in parameter {i} "
                                    f"(max |diff| {float((a - b).abs().max()):.3g})")
                    break
        if not set(finished) <= set(final) or not set(final) - set(finished) <= set(killed):
            problems.append(f"the finishers {sorted(finished)} ended on group {final} (killed: {killed})")
        expected = reference_of(STEPS, WORLD, schedules[ref_rank])
        for i, (got, want) in enumerate(zip(finished[ref_rank]["params"], expected, strict=True)):
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                problems.append(f"finisher {ref_rank} differs from the single-process reference of its membership "
                                f"{schedules[ref_rank]} in parameter {i} (max |diff| {float((got - want).abs().max()):.3g})")
                break
    if problems:
        outcome["outcome"] = "BAD"
    elif errors:
        outcome["outcome"] = "unrecoverable"
    elif any(out["recoveries"] for out in finished.values()):
        outcome["outcome"] = "recovered"
    else:
        outcome["outcome"] = "no recovery needed"
    outcome["problems"] = problems
    _record(outcome)
    print(json.dumps(outcome))
    if problems:
        pytest.fail(f"{context}:\n" + "\n".join(problems) + f"\nerrors: {errors}\n"
                    f"recoveries: {outcome['recoveries']}\n{_logs(tmp_path)}", pytrace=False)
    if server is not None:
        del server
