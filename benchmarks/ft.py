"""commd.ft: what a rank's (or a node's) death costs a guarded DDP job, what a replacement's return
costs, how that compares with torchrun's restart from a checkpoint, and what the guard costs a job
that never fails.

Every commd run is `commd launch --keep-going` (`--max-restarts 1` with --rejoin) with --nproc ranks
per node training the model `commd demo` trains, under ``commd.ft.Guard``.  ``--nodes N`` runs N
launchers on this machine as N nodes (``--nnodes N --node-rank i --master 127.0.0.1:PORT
--node-name node<i>``, one COMMD_SECRET, a runtime directory each), so survivors span nodes.

* **Injections.**  For each point and each of --injections runs, a random rank SIGKILLs itself at a
  random step.  Points: ``forward`` (before the victim's forward), ``backward`` (when its first layer's
  gradient is computed, the later layers' bucket already in flight), ``optimizer`` (in its optimizer
  step, after the commit), and with --nodes >= 2 ``node``: a rank of a node other than node 0 (whose
  daemon coordinates the fabric: its loss is unrecoverable by design) SIGKILLs its node's daemon and
  then itself; that node's other ranks fail with their daemon, the other nodes' ranks go on.  A
  daemon SIGKILLed on a live host has its connections closed by the kernel, so the other daemons
  hear of it at once; the peer timeout (COMMD_PEER_TIMEOUT, 10 s by default; --peer-timeout sets
  it in the launchers' environment, and the run prints the value used) bounds only a silent loss,
  which two more points make (never by default: each takes --outage seconds and more): ``stop``, a
  rank of a node other than node 0 SIGSTOPs its node's daemon for --outage seconds (20 by default)
  and goes on; ``link`` (with --sim: every node a simulated host, network namespaces, root), the
  benchmark pulls that node's cable for --outage seconds.  Either way node 0's side hears nothing,
  declares the node dead at the peer timeout and goes on without its ranks, and those ranks raise
  (their node is cut off from the job).  Per run: the time from the kill (the
  victim's clock just before it; the cable pulled) to the error on each survivor (the last one's is reported), to
  the last survivor's rebuilt group, to the last survivor's first completed step after it, the
  step redone; the survivors' parameter digests must be equal.
* **--rejoin.**  The launchers run with ``--max-restarts 1`` and the guard gets the plain module:
  the victim's replacement rejoins (not at the ``node`` point, which runs as without --rejoin: a
  node cannot come back).  The running ranks call ``guard.take_back(timeout=120)`` 3 steps before
  the end, so they never finish before the replacement has asked.  Per run, from wall times the
  ranks record: kill -> full size again (the last running rank's admission done), the
  replacement's start -> joined, its build time (process start -> model and optimizer built:
  interpreter, torch, process group, model, optimizer: its first one imports torch._dynamo) and
  start -> full size minus it, the running ranks' stall (their largest Join.seconds) against the
  median step, the bytes of state sent, whether it came in at a commit or at the take_back (and
  how long the running ranks waited there), and every rank's (the replacement's too) digest.
* **--torchrun.**  The same model and faults in --compare-steps-long runs (~10-30 s here):
  commd.ft shrinking, commd.ft shrinking then taking the replacement back, and
  ``torchrun --standalone --max-restarts 1 --nproc-per-node <all ranks>`` with plain DDP (the
  backend of --torchrun-backend) and a checkpoint (rank 0's torch.save of model and optimizer)
  every --checkpoint-every steps, from which the restarted job goes on (torchrun's runs get
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the store shared across restarts, torch 2.13's
  restarted ranks read the first round's keys and fail, pytorch/pytorch#135712).  Time lost per
  fault = the faulted run's wall time - the median wall time of the unfaulted runs of the same
  kind (one of each per round, interleaved); and, less exposed to a load that changes between
  runs, an in-run estimate: kill -> the last rank's end, less the steps left at the kill at the
  run's median step time.  The commd rejoin runs wait in take_back for the replacement, so a
  late kill costs them the replacement's start-up.
* **Overhead.**  --repeats interleaved runs of --steps plain DDP steps and as many guarded ones
  (the commit: one tiny all-reduce per step); the median step time of each and their ratio.

Any run that fails or looks wrong (missing results, unequal digests, a missing recovery or join)
is named with its launchers' log tails; the tables are printed anyway and the exit status is 1.
--logs DIR keeps every launcher's output; --json FILE writes every figure.

    python benchmarks/ft.py                            # 1 node x 4: 3 points x 5 injections, overhead
    python benchmarks/ft.py --nodes 2 --nproc 2 --rejoin --repeats 0    # 4 points, replacements rejoin
    python benchmarks/ft.py --torchrun --injections 0 --repeats 0 --compare-injections 3
    python benchmarks/ft.py --injections 20 --json ft.json
    sudo python benchmarks/ft.py --nodes 2 --nproc 2 --sim --points stop,link --repeats 0   # silent losses
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp import demo_model

from commd.runtime import free_port, new_secret
from commd.sim.hosts import SimulatedHosts

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_ft_worker.py"
RANK_POINTS = ("forward", "backward", "optimizer")
#: Points that take a whole node other than node 0 out: its daemon SIGKILLed, SIGSTOPped or its link down.
NODE_POINTS = ("node", "stop", "link")
POINTS = (*RANK_POINTS, *NODE_POINTS)
#: Bound on one launch (its ranks start torch, train, maybe recover, and maybe wait for a replacement).
RUN_TIMEOUT_S = 300.0
#: How long the running ranks wait in take_back for the replacement to ask.
TAKE_BACK_TIMEOUT_S = 120.0
#: The guard's take_back runs this many steps before the end.
TAKE_BACK_BEFORE_END = 3
#: The issue's targets (p99 over the injections).
TARGET_ERROR_S, TARGET_FIRST_STEP_S, TARGET_FULL_S, TARGET_STALL_STEPS = 1.0, 5.0, 30.0, 1.0


@dataclass
class Run:
    """One job: what each rank process wrote (``rank<R>`` or ``rank<R>.restart<K>``), the kill, the launchers."""

    results: dict[str, dict[str, Any]]
    kill: dict[str, Any] | None
    codes: list[int]
    wall_s: float
    load: float
    logs: list[str] = field(default_factory=list)  # each launcher's output, the last lines

    def tails(self, chars: int = 2500) -> str:
        return "\n".join(f"--- launcher {i} (exit {code}):\n{log[-chars:]}"
                         for i, (code, log) in enumerate(zip(self.codes, self.logs, strict=True)))


class RunFailed(Exception):
    """A run that gave no usable figures (the message names it and carries its logs)."""


def base_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    env.pop("COMMD_JOB", None)
    if args.peer_timeout is not None:
        env["COMMD_PEER_TIMEOUT"] = repr(args.peer_timeout)
    return env


def peer_timeout_note(args: argparse.Namespace) -> str:
    if args.peer_timeout is not None:
        return f"COMMD_PEER_TIMEOUT={args.peer_timeout:g} s (set by --peer-timeout in the launchers' environment)"
    if os.environ.get("COMMD_PEER_TIMEOUT"):
        return f"COMMD_PEER_TIMEOUT={os.environ['COMMD_PEER_TIMEOUT']} s (from this environment)"
    return "COMMD_PEER_TIMEOUT not set: the daemons' default, 10 s"


def launch(args: argparse.Namespace, cfg: dict[str, Any], tag: str, *, restarts: int = 0,
           torchrun: bool = False) -> Run:
    """One job: --nodes `commd launch` processes (or one torchrun), waited for (bounded); with --logs,
    their output is kept there as ``<tag>.launcher<i>.log``."""
    with tempfile.TemporaryDirectory(prefix="commd-ft-") as tmp:
        root = Path(tmp)
        out = root / "out"
        out.mkdir()
        env = base_env(args)
        tail = [str(WORKER), json.dumps(cfg), str(out)]
        commands: list[tuple[list[str], dict[str, str]]] = []
        if torchrun:
            world = args.nodes * args.nproc
            (root / "rt").mkdir()
            # torch 2.x shares its rendezvous store with the workers across restarts, and the restarted
            # ranks read the first round's keys (Gloo connects to dead ports; pytorch/pytorch#135712):
            # a store of their own each round, as torch's issue advises
            commands.append(([sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "1",
                              "--nproc-per-node", str(world), *tail],
                             dict(env, COMMD_RUNTIME_DIR=str(root / "rt"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")))
        else:
            port, secret = free_port(), new_secret()
            master = args.sim[0].ip if args.sim else "127.0.0.1"
            for i in range(args.nodes):
                argv = [sys.executable, "-m", "commd", "launch", "--no-prefix", "--nproc-per-node", str(args.nproc)]
                argv += ["--max-restarts", str(restarts)] if restarts else ["--keep-going"]
                node_env = dict(env, COMMD_RUNTIME_DIR=str(root / f"node{i}"), COMMD_NODE=f"node{i}")
                (root / f"node{i}").mkdir()
                if args.nodes > 1:
                    argv += ["--nnodes", str(args.nodes), "--node-rank", str(i), "--master", f"{master}:{port}",
                             "--node-name", f"node{i}"]
                    node_env["COMMD_SECRET"] = secret
                argv = [*argv, *tail]
                commands.append((args.sim[i].argv(argv) if args.sim else argv, node_env))
        logs = [root / f"launcher{i}.log" for i in range(len(commands))]
        procs = []
        started = time.monotonic()
        for (argv, cmd_env), log in zip(commands, logs, strict=True):
            with open(log, "w") as sink:
                procs.append(subprocess.Popen(argv, env=cmd_env, stdout=sink, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = started + RUN_TIMEOUT_S
        cut = None
        try:
            if cfg.get("where") == "link":
                cut = pull_cable(args, procs, out, deadline)
            for proc in procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop(procs, out)
            keep_logs(args, logs, tag)
            texts = [log.read_text(errors="replace") for log in logs]
            raise RunFailed(f"no end within {RUN_TIMEOUT_S:.0f}s\n" + "\n".join(
                f"--- launcher {i}:\n{text[-2500:]}" for i, text in enumerate(texts))) from None
        wall = time.monotonic() - started
        keep_logs(args, logs + sorted(root.glob("node*/*/daemon.log")), tag)
        results = {p.stem: json.loads(p.read_text()) for p in out.glob("rank*.json")}
        kill = json.loads((out / "kill.json").read_text()) if (out / "kill.json").exists() else None
        if kill is not None and cut is not None:
            kill["time"] = cut  # the fault is the cable pulled, a moment after the victim asked
        return Run(results, kill, [p.returncode for p in procs], wall, os.getloadavg()[0],
                   [log.read_text(errors="replace")[-6000:] for log in logs])


def pull_cable(args: argparse.Namespace, procs: list[subprocess.Popen], out: Path, deadline: float) -> float | None:
    """The ``link`` point: once the victim asks (kill.json), pull its node's cable for --outage seconds,
    then plug it back.  Returns when the cable was pulled (time.time()), None if nobody asked."""
    request = out / "kill.json"
    while not request.exists():
        if all(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            return None
        time.sleep(0.02)
    time.sleep(0.02)  # (the victim's write has landed)
    node = node_of(args, json.loads(request.read_text())["rank"])
    args.sim.set_link(node, up=False)
    cut = time.time()
    try:
        time.sleep(args.outage)
    finally:
        args.sim.set_link(node, up=True)
    return cut


def keep_logs(args: argparse.Namespace, logs: list[Path], tag: str) -> None:
    """With --logs: the launchers' output as ``<tag>.launcher<i>.log``, a daemon's log as ``<tag>.<node>.daemon.log``."""
    if args.logs:
        for i, log in enumerate(logs):
            name = f"{log.parents[1].name}.daemon.log" if log.name == "daemon.log" else f"launcher{i}.log"
            (Path(args.logs) / f"{tag}.{name}").write_bytes(log.read_bytes())


def stop(procs: list[subprocess.Popen], out: Path) -> None:
    """After a timeout: SIGTERM the launchers (they stop their workers and daemons), then SIGKILL what is
    left of them and of the workers they started (the pids the workers wrote)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    for path in out.glob("pid.*"):
        try:
            os.kill(int(path.name[4:]), signal.SIGKILL)
        except (ProcessLookupError, ValueError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def node_of(args: argparse.Namespace, rank: int) -> int:
    return rank // args.nproc


def pick_victim(args: argparse.Namespace, rng: random.Random, point: str) -> int:
    world = args.nodes * args.nproc
    if point in NODE_POINTS:  # never node 0: its daemon coordinates the fabric
        return rng.randrange(args.nproc, world)
    return rng.randrange(world)


def analyse(args: argparse.Namespace, point: str, run: Run, victim: int, rejoin: bool,
            take_back_step: int | None) -> dict[str, Any]:
    """One injection's figures; raises RunFailed when the run did not go as it should."""
    world = args.nodes * args.nproc
    if point in NODE_POINTS:
        lost = [r for r in range(world) if node_of(args, r) == node_of(args, victim)]
    elif args.fsdp:  # the victim's replica leaves with it
        lost = [r for r in range(world) if r // args.shards == victim // args.shards]
    else:
        lost = [victim]
    survivors = [r for r in range(world) if r not in lost]
    expected = {f"rank{r}" for r in survivors} | ({f"rank{r}.restart1" for r in lost} if rejoin else set())
    # a launcher whose ranks were all lost, or (shrinking) one with a rank that left with its replica, fails
    failing = {node_of(args, r) for r in lost} if point in NODE_POINTS or (args.fsdp and not rejoin) else set()
    bad_codes = [code for i, code in enumerate(run.codes) if code != 0 and i not in failing]
    if run.kill is None or set(run.results) != expected or bad_codes:
        raise RunFailed(f"expected results {sorted(expected)} and the kill, got {sorted(run.results)}, kill "
                        f"{run.kill}, launcher exits {run.codes}\n{run.tails()}")
    kill = run.kill["time"]
    running = [run.results[f"rank{r}"] for r in survivors]
    recoveries = [r["recoveries"] for r in running]
    gone = {g for rec in recoveries for rc in rec for g in rc["gone"]}
    if any(not rec for rec in recoveries) or gone != set(lost):
        raise RunFailed(f"expected each survivor to recover from the loss of {lost}, got {recoveries}\n{run.tails()}")
    digests = {name: r["digest"] for name, r in run.results.items()}
    if len(set(digests.values())) != 1:
        raise RunFailed(f"the ranks' parameters differ: {digests}\n{run.tails()}")
    errors = [rec[0]["failed_at"] - kill for rec in recoveries]
    step_times = sorted(t for r in running for t in r["step_times"])
    row: dict[str, Any] = {
        "victim": victim, "kill_step": run.kill.get("step"), "lost": lost, "load": run.load, "wall_s": run.wall_s,
        "error_s": max(errors), "errors_s": errors,
        "rebuilt_s": max(rec[-1]["failed_at"] + rec[-1]["seconds"] for rec in recoveries) - kill,
        "first_step_s": max(r["first_step_after_failure"] for r in running) - kill,
        "redone": sorted({rec[0]["step"] for rec in recoveries}), "recoveries": max(len(rec) for rec in recoveries),
        "median_step_s": statistics.median(step_times), "digest": next(iter(digests.values())),
    }
    if not rejoin:
        return row
    replacement = run.results[f"rank{victim}.restart1"]
    joins = [r["joins"] for r in running] + [run.results[f"rank{r}.restart1"]["joins"] for r in lost]
    if any(len(j) != 1 or j[0]["joined"] != lost for j in joins) or any(len(r["join_done"]) != 1 for r in running):
        raise RunFailed(f"expected one join of ranks {lost} on every rank, got {joins}\n{run.tails()}")
    full = max(r["join_done"][0] for r in running)
    wall = replacement["wall"]
    stall = max(r["joins"][0]["seconds"] for r in running)
    take_backs = [r["take_back"] for r in running]
    via_take_back = any(t and t["joined_here"] for t in take_backs)
    row.update({
        "kill_to_full_s": full - kill, "kill_to_replacement_start_s": wall["start"] - kill,
        "start_to_joined_s": wall["guard"] - wall["start"], "build_s": wall["model"] - wall["start"],
        "replacement_torch_s": wall["torch"] - wall["start"], "replacement_init_s": wall["init"] - wall["torch"],
        "replacement_optimizer_s": wall["model"] - wall["module"],
        "start_to_full_s": full - wall["start"], "full_minus_build_s": full - wall["model"],
        "replacement_join_s": replacement["joins"][0]["seconds"], "stall_s": stall,
        "stall_steps": stall / row["median_step_s"], "state_bytes": max(j[0]["state_bytes"] for j in joins),
        "join_step": running[0]["joins"][0]["step"], "take_back_step": take_back_step,
        "via": "take_back" if via_take_back else "commit",
        "take_back_wait_s": max((t["seconds"] for t in take_backs if t), default=0.0) - (stall if via_take_back else 0),
    })
    return row


def describe(row: dict[str, Any]) -> str:
    text = (f"redone {row['redone']}; error {row['error_s'] * 1e3:7.1f} ms, rebuilt {row['rebuilt_s'] * 1e3:7.1f} ms, "
            f"first step {row['first_step_s'] * 1e3:7.1f} ms")
    if "kill_to_full_s" in row:
        text += (f"; replacement started +{row['kill_to_replacement_start_s']:.1f} s, built in {row['build_s']:.1f} s, "
                 f"joined {row['start_to_joined_s']:.1f} s after its start (via {row['via']}, step "
                 f"{row['join_step']}), full size {row['kill_to_full_s']:.1f} s after the kill; stall "
                 f"{row['stall_s'] * 1e3:.0f} ms = {row['stall_steps']:.1f} steps; {row['state_bytes']} B")
    return text + f" (load {row['load']:.1f}, {row['wall_s']:.0f} s)"


def injections(args: argparse.Namespace, model: dict[str, int], batch: int,
               failures: list[str]) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(args.seed)
    rows: dict[str, list[dict[str, Any]]] = {point: [] for point in args.point_list}
    for run_no in range(args.injections):
        for point in args.point_list:
            rejoin = args.rejoin and point not in NODE_POINTS
            take_back_step = args.inject_steps - TAKE_BACK_BEFORE_END if rejoin else None
            victim = pick_victim(args, rng, point)
            step = rng.randrange(3, (take_back_step - 2) if rejoin else args.inject_steps - 3)
            cfg = {"model": model, "batch": batch, "steps": args.inject_steps, "guard": True, "victim": victim,
                   "where": point, "kill_step": step, "rejoin": rejoin, "take_back_step": take_back_step,
                   "take_back_timeout": TAKE_BACK_TIMEOUT_S, "outage_s": args.outage, "fsdp": args.fsdp,
                   "shards": args.shards}
            what = f"{point} run {run_no}: rank {victim} (node {node_of(args, victim)}) killed at step {step}"
            try:
                run = launch(args, cfg, f"{point}-{run_no}", restarts=1 if rejoin else 0)
                row = analyse(args, point, run, victim, rejoin, take_back_step)
            except RunFailed as exc:
                failures.append(f"{what}: {exc}")
                print(f"  {what}: FAILED (details at the end)", flush=True)
                continue
            row["kill_step"] = step
            rows[point].append(row)
            print(f"  {what}; {describe(row)}", flush=True)
    return rows


def comparison(args: argparse.Namespace, model: dict[str, int], batch: int,
               failures: list[str]) -> dict[str, Any]:
    """Time lost per fault: commd.ft shrinking, shrinking and rejoining, and torchrun restarting."""
    rng = random.Random(args.seed + 1)
    steps, take_back_step = args.compare_steps, args.compare_steps - TAKE_BACK_BEFORE_END
    base = {"model": model, "batch": batch, "steps": steps}
    kinds = {
        "commd": ({**base, "guard": True, "rejoin": True}, {"restarts": 0}),
        "torchrun": ({**base, "launcher": "torchrun", "backend": args.torchrun_backend,
                      "checkpoint_every": args.checkpoint_every}, {"torchrun": True}),
    }
    baselines: dict[str, list[float]] = {"commd": [], "torchrun": []}
    digests: dict[str, set[int]] = {"commd": set(), "torchrun": set()}
    faulted: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for run_no in range(args.compare_injections):
        for kind, (cfg, how) in kinds.items():
            try:
                run = launch(args, cfg, f"compare-{run_no}-{kind}-unfaulted", **how)
                if any(run.codes) or len(run.results) != args.nodes * args.nproc:
                    raise RunFailed(f"launcher exits {run.codes}, results {sorted(run.results)}\n{run.tails()}")
            except RunFailed as exc:
                failures.append(f"comparison round {run_no}, {kind} unfaulted: {exc}")
                print(f"  comparison round {run_no}: {kind} unfaulted FAILED", flush=True)
                continue
            baselines[kind].append(run.wall_s)
            digests[kind] |= {r["digest"] for r in run.results.values()}
            print(f"  comparison round {run_no}: {kind} unfaulted {run.wall_s:.1f} s (load {run.load:.1f})", flush=True)
        for point in args.compare_points:
            victim, step = pick_victim(args, rng, point), rng.randrange(3, take_back_step - 2)
            kill = {"victim": victim, "where": point, "kill_step": step}
            settings = {
                "commd shrink": ({**kinds["commd"][0], **kill, "rejoin": False}, {"restarts": 0}),
                "commd rejoin": ({**kinds["commd"][0], **kill, "take_back_step": take_back_step,
                                  "take_back_timeout": TAKE_BACK_TIMEOUT_S}, {"restarts": 1}),
                "torchrun": ({**kinds["torchrun"][0], **kill}, {"torchrun": True}),
            }
            for name, (cfg, how) in settings.items():
                what = f"comparison round {run_no}, {point}, {name}: rank {victim} killed at step {step}"
                try:
                    run = launch(args, cfg, f"compare-{run_no}-{point}-{name.replace(' ', '-')}", **how)
                    row = fault_row(args, name, point, run, victim, take_back_step)
                except RunFailed as exc:
                    failures.append(f"{what}: {exc}")
                    print(f"  {what}: FAILED", flush=True)
                    continue
                row.update(kill_step=step, victim=victim)
                faulted.setdefault(point, {}).setdefault(name, []).append(row)
                extra = (f", restarted from step {row['restart_from']} (redid {row['redone_steps']} steps)"
                         if name == "torchrun" else f", via {row['via']}" if "via" in row else "")
                print(f"  {what}: {run.wall_s:.1f} s, in-run loss {row['in_run_lost_s']:.1f} s{extra} "
                      f"(load {run.load:.1f})", flush=True)
    for point_rows in faulted.values():
        for name, rows in point_rows.items():
            kind = "torchrun" if name == "torchrun" else "commd"
            if baselines[kind]:
                reference = statistics.median(baselines[kind])
                for row in rows:
                    row["lost_s"] = row["wall_s"] - reference
            if name == "torchrun":
                for row in rows:
                    row["digest_as_unfaulted"] = row["digest"] in digests["torchrun"]
    return {"steps": steps, "checkpoint_every": args.checkpoint_every, "backend": args.torchrun_backend,
            "baselines": baselines, "faulted": faulted,
            "unfaulted_digests_equal": {k: len(v) == 1 for k, v in digests.items()}}


def in_run_loss(run: Run, steps: int) -> float:
    """The time lost measured inside the faulted run (less exposed than the wall times to a load that
    changes between runs): kill -> last rank's end, less the steps left at the kill at the run's median
    step time."""
    assert run.kill is not None
    end = max(r["wall"]["end"] for r in run.results.values())
    median = statistics.median(t for r in run.results.values() for t in r["step_times"])
    return end - run.kill["time"] - (steps - run.kill["step"]) * median


def fault_row(args: argparse.Namespace, name: str, point: str, run: Run, victim: int,
              take_back_step: int) -> dict[str, Any]:
    if name != "torchrun":
        row = analyse(args, point, run, victim, name == "commd rejoin", take_back_step if name == "commd rejoin" else None)
        row.update(wall_s=run.wall_s, in_run_lost_s=in_run_loss(run, args.compare_steps))
        return row
    world = args.nodes * args.nproc
    if run.codes != [0] or sorted(run.results) != [f"rank{r}.restart1" for r in range(world)] or run.kill is None:
        raise RunFailed(f"expected every rank's result from torchrun's second round and the kill, got "
                        f"{sorted(run.results)}, kill {run.kill}, exit {run.codes}\n{run.tails()}")
    digests = {r["digest"] for r in run.results.values()}
    if len(digests) != 1:
        raise RunFailed(f"the ranks' parameters differ: {digests}\n{run.tails()}")
    first = {r["first_step"] for r in run.results.values()}
    kill_step = run.kill.get("step")
    starts = [r["wall"]["start"] for r in run.results.values()]
    return {"wall_s": run.wall_s, "load": run.load, "restart_from": min(first), "digest": digests.pop(),
            "kill_to_restart_s": min(starts) - run.kill["time"],
            "kill_to_training_s": min(r["wall"]["guard"] for r in run.results.values()) - run.kill["time"],
            "redone_steps": (kill_step if kill_step is not None else 0) - min(first),
            "checkpoint_s": max(r.get("checkpoint_s", 0.0) for r in run.results.values()),
            "in_run_lost_s": in_run_loss(run, args.compare_steps)}


def overhead(args: argparse.Namespace, model: dict[str, int], batch: int, failures: list[str]) -> dict[str, list[float]]:
    """Interleaved plain and guarded runs: each run's median step, and (guarded) the commit's mean time
    per step on the rank that reaches it last, the guard's own cost measured inside the step."""
    medians: dict[str, list[float]] = {"plain": [], "guard": [], "commit": []}
    for repeat in range(args.repeats):
        order = ("plain", "guard") if repeat % 2 == 0 else ("guard", "plain")
        for name in order:
            cfg = {"model": model, "batch": batch, "steps": args.steps, "guard": name == "guard"}
            try:
                run = launch(args, cfg, f"overhead-{repeat}-{name}")
                if any(run.codes) or len(run.results) != args.nodes * args.nproc:
                    raise RunFailed(f"launcher exits {run.codes}, results {sorted(run.results)}\n{run.tails()}")
            except RunFailed as exc:
                failures.append(f"overhead run {repeat} {name}: {exc}")
                continue
            per_step = [max(r["step_times"][i] for r in run.results.values()) for i in range(args.warmup, args.steps)]
            medians[name].append(statistics.median(per_step))
            if name == "guard":
                # the rank that reaches the commit last waits only for the op itself: that is what the
                # commit adds to the step (the others' wait is the ranks' skew, which the next step's
                # first all-reduce would absorb anyway)
                medians["commit"].append(min(r["commit_s"] for r in run.results.values()))
            print(f"  overhead run {repeat} {name:5s}: median step {medians[name][-1] * 1e3:.3f} ms "
                  f"(load {run.load:.1f})", flush=True)
    return medians


def cell(values: list[float], scale: float = 1e3, unit: str = "ms", digits: int = 0) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * scale:.{digits}f} / {percentile(values, 0.99) * scale:.{digits}f} {unit}"


def report(args: argparse.Namespace, rows: dict[str, list[dict[str, Any]]], compare: dict[str, Any] | None,
           medians: dict[str, list[float]]) -> None:
    if any(rows.values()):
        print("\n| point | runs | error on every survivor (last one), median / p99 | rebuilt, median / p99 | "
              "first step after, median / p99 | step redone (kill step + 0/1) |")
        print("|---|---|---|---|---|---|")
        for point, runs in rows.items():
            if runs:
                offsets = sorted({s - r["kill_step"] for r in runs for s in r["redone"]})
                print(f"| {point} | {len(runs)} | {cell([r['error_s'] for r in runs])} | "
                      f"{cell([r['rebuilt_s'] for r in runs])} | {cell([r['first_step_s'] for r in runs])} | "
                      f"+{', +'.join(map(str, offsets))} |")
    joined = {point: [r for r in runs if "kill_to_full_s" in r] for point, runs in rows.items()}
    if any(joined.values()):
        print("\n| point | runs | kill -> full size | replacement start -> joined | its build (start -> model) | "
              "start -> full size minus build | running ranks' stall | stall / median step | state | via |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for point, runs in joined.items():
            if runs:
                via = {v: sum(r["via"] == v for r in runs) for v in ("commit", "take_back")}
                print(f"| {point} | {len(runs)} | {cell([r['kill_to_full_s'] for r in runs], 1, 's', 1)} | "
                      f"{cell([r['start_to_joined_s'] for r in runs], 1, 's', 1)} | "
                      f"{cell([r['build_s'] for r in runs], 1, 's', 1)} | "
                      f"{cell([r['full_minus_build_s'] for r in runs], 1, 's', 1)} | "
                      f"{cell([r['stall_s'] for r in runs])} | {cell([r['stall_steps'] for r in runs], 1, 'steps', 1)} | "
                      f"{statistics.median(r['state_bytes'] for r in runs) / 1e6:.2f} MB | "
                      f"{via['commit']} commit, {via['take_back']} take_back |")
    every = [r for runs in rows.values() for r in runs]
    if every:
        print("\n| target (p99 over the runs above) | measured | met |")
        print("|---|---|---|")
        checks = [("every survivor errors <= 1 s after the kill", [r["error_s"] for r in every], TARGET_ERROR_S, "s"),
                  ("survivors' first completed step <= 5 s after the kill", [r["first_step_s"] for r in every],
                   TARGET_FIRST_STEP_S, "s")]
        with_join = [r for r in every if "kill_to_full_s" in r]
        if with_join:
            checks += [("full size <= 30 s after the replacement starts, plus its build",
                        [r["full_minus_build_s"] for r in with_join], TARGET_FULL_S, "s"),
                       ("the others stalled <= 1 step", [r["stall_steps"] for r in with_join], TARGET_STALL_STEPS,
                        "steps")]
        for name, values, bound, unit in checks:
            p99 = percentile(values, 0.99)
            print(f"| {name} | {p99:.2f} {unit} | {'yes' if p99 <= bound else 'NO'} |")
    if compare and compare["faulted"]:
        base = compare["baselines"]
        print(f"\ntime lost per fault, {compare['steps']}-step runs (unfaulted wall: commd.ft "
              f"{cell(base['commd'], 1, 's', 1)}, torchrun with a checkpoint every {compare['checkpoint_every']} "
              f"steps {cell(base['torchrun'], 1, 's', 1)}, median / p99 of {len(base['commd'])} and "
              f"{len(base['torchrun'])} runs; min-max {spread(base['commd'])} and {spread(base['torchrun'])}):")
        print("\n| point | setting | runs | faulted wall, median | time lost, median / p99 | in-run estimate, "
              "median / p99 | notes |")
        print("|---|---|---|---|---|---|---|")
        for point, settings in compare["faulted"].items():
            for name, runs in settings.items():
                lost = [r["lost_s"] for r in runs if "lost_s" in r]
                if name == "torchrun":
                    note = (f"redid {statistics.median(r['redone_steps'] for r in runs):.0f} steps (median); kill -> "
                            f"restarted ranks' first line {cell([r['kill_to_restart_s'] for r in runs], 1, 's', 1)}; "
                            f"digest as unfaulted in {sum(r['digest_as_unfaulted'] for r in runs)}/{len(runs)}")
                elif name == "commd rejoin":
                    note = (f"kill -> full size {cell([r['kill_to_full_s'] for r in runs], 1, 's', 1)}; "
                            f"{sum(r['via'] == 'take_back' for r in runs)}/{len(runs)} via take_back, waiting there "
                            f"{cell([r['take_back_wait_s'] for r in runs], 1, 's', 1)} for the replacement")
                else:
                    note = f"first step after {cell([r['first_step_s'] for r in runs])}"
                print(f"| {point} | {name} | {len(runs)} | {statistics.median(r['wall_s'] for r in runs):.1f} s | "
                      f"{cell(lost, 1, 's', 2)} | {cell([r['in_run_lost_s'] for r in runs], 1, 's', 2)} | {note} |")
    if medians.get("plain") and medians.get("guard"):
        plain, guard = statistics.median(medians["plain"]), statistics.median(medians["guard"])
        print(f"\nfailure-free step: plain DDP {plain * 1e3:.3f} ms, guarded {guard * 1e3:.3f} ms "
              f"(medians of {len(medians['plain'])} and {len(medians['guard'])} runs' medians): guard / plain = "
              f"{guard / plain:.3f}")
        if medians.get("commit"):
            commit = statistics.median(medians["commit"])
            print(f"the commit inside a guarded step: {commit * 1e3:.3f} ms (the mean on the rank that reaches it last, median of "
                  f"{len(medians['commit'])} runs) = {commit / guard * 100:.2f}% of the guarded step")


def spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f} s" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1, help="commd launchers on this machine, one per node (default 1)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks per node (default 4)")
    parser.add_argument("--injections", type=int, default=5, help="runs per point of a step (default 5)")
    parser.add_argument("--points", default=None,
                        help=f"comma-separated, of {', '.join(POINTS)} (default: the rank points, and node with "
                             "--nodes >= 2; stop and link only when asked)")
    parser.add_argument("--outage", type=float, default=20.0,
                        help="seconds a stop point's daemon stays stopped and a link point's cable pulled (default 20)")
    parser.add_argument("--sim", action="store_true",
                        help="run each node as a simulated host (network namespaces; needs root), as the link point must")
    parser.add_argument("--fsdp", action="store_true",
                        help="the model as HSDP (FSDP2 within replicas) under commd.ft.ShardedGuard: a rank's death "
                             "takes its replica out (injections only: with --repeats 0, without --torchrun)")
    parser.add_argument("--shards", type=int, default=2, help="with --fsdp: ranks per replica (default 2)")
    parser.add_argument("--inject-steps", type=int, default=20, help="steps of an injection run (default 20)")
    parser.add_argument("--rejoin", action="store_true",
                        help="--max-restarts 1: the victim's replacement rejoins (not at the node point)")
    parser.add_argument("--peer-timeout", type=float, default=None,
                        help="COMMD_PEER_TIMEOUT for the daemons, seconds (default: the environment's, else 10)")
    parser.add_argument("--torchrun", action="store_true",
                        help="compare the time lost per fault with torchrun --max-restarts 1 and checkpoints")
    parser.add_argument("--compare-injections", type=int, default=None,
                        help="rounds of the --torchrun comparison (default: --injections)")
    parser.add_argument("--compare-steps", type=int, default=200, help="steps of a comparison run (default 200)")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="torchrun's checkpoint interval (default 50)")
    parser.add_argument("--torchrun-backend", default="commd", choices=("commd", "gloo"),
                        help="the backend of the torchrun runs (default commd)")
    parser.add_argument("--steps", type=int, default=300, help="steps of an overhead run (default 300)")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="overhead runs of each kind (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--logs", default=None, metavar="DIR", help="keep every launcher's output and daemon log in DIR")
    args = parser.parse_args()
    if args.points is None:
        args.points = ",".join((*RANK_POINTS, "node") if args.nodes >= 2 else RANK_POINTS)
    args.point_list = [p for p in args.points.split(",") if p]
    args.compare_points = [p for p in args.point_list if p not in NODE_POINTS]
    if args.compare_injections is None:
        args.compare_injections = args.injections if args.torchrun else 0
    if (not set(args.point_list) <= set(POINTS) or args.nodes < 1 or args.nproc < 1 or args.nodes * args.nproc < 2
            or args.inject_steps < 12 or args.warmup >= args.steps or args.compare_steps < 20
            or args.checkpoint_every < 1):
        parser.error(f"--points from {POINTS}, --nodes and --nproc >= 1 with >= 2 ranks in all, --inject-steps >= 12, "
                     "--warmup < --steps, --compare-steps >= 20, --checkpoint-every >= 1")
    if set(NODE_POINTS) & set(args.point_list) and args.nodes < 2:
        parser.error("the node, stop and link points need --nodes >= 2 (node 0 is never the victim)")
    if "link" in args.point_list and not args.sim:
        parser.error("the link point needs --sim: a node's own link exists only on simulated hosts")
    if args.outage <= 0:
        parser.error("--outage must be > 0")
    if args.fsdp and (args.repeats or args.torchrun or (args.nodes * args.nproc) % args.shards
                      or args.nodes * args.nproc == args.shards or args.nproc % args.shards and
                      set(NODE_POINTS) & set(args.point_list)):
        parser.error("--fsdp: injections only (--repeats 0, no --torchrun), --shards dividing the ranks into "
                     "at least 2 replicas, and a node's ranks whole replicas for the node points")
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    if args.sim:
        args.sim = SimulatedHosts(args.nodes).up()
    try:
        run_all(args)
    finally:
        if args.sim:
            args.sim.down()


def run_all(args: argparse.Namespace) -> None:
    """Every part asked for, its tables, and the JSON; exit status 1 if a run failed or looked wrong."""
    model, batch = demo_model()
    where = "simulated hosts" if args.sim else "launchers on this machine"
    if args.fsdp:
        where += f"; HSDP under ShardedGuard, {args.shards} ranks per replica"
    print(f"commd.ft on {args.nodes} node(s) x {args.nproc} ranks ({where}), the demo model "
          f"({model}, batch {batch}); {peer_timeout_note(args)}; load {os.getloadavg()[0]:.1f}", flush=True)
    started = time.monotonic()
    failures: list[str] = []
    rows = injections(args, model, batch, failures) if args.injections else {}
    compare = comparison(args, model, batch, failures) if args.torchrun and args.compare_injections else None
    medians = overhead(args, model, batch, failures) if args.repeats else {}
    report(args, rows, compare, medians)
    print(f"({time.monotonic() - started:.0f} s; load {os.getloadavg()[0]:.1f} at the end)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "nodes": args.nodes, "nproc": args.nproc, "model": model, "batch": batch,
            "peer_timeout": peer_timeout_note(args), "rejoin": args.rejoin, "outage_s": args.outage,
            "simulated_hosts": bool(args.sim), "fsdp": args.fsdp, "shards": args.shards, "injections": rows,
            "comparison": compare, "overhead": medians, "failures": failures}, indent=1))
    if failures:
        print(f"\n{len(failures)} run(s) failed or looked wrong:", file=sys.stderr)
        for text in failures:
            print(f"\n== {text}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
