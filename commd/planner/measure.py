"""``commd plan --measure``: run a plan and its baselines on simulated hosts and set the measured step beside the predicted.

Each setting (the plan, its ``data_parallel`` and ``megatron`` baselines) is one job: ``commd launch
-m commd.planner.measure_worker`` on every simulated host (a network namespace per node, shaped by
``--rate``/``--delay-ms``), each rank building the model with the plan's ``model_factory``, applying
the setting's layers and timing SGD steps (see measure_worker for how).  Settings are interleaved over
``--repeats`` so a drift in the machine's load touches them all; a setting's figure is the median of
its runs' medians.  A baseline whose layers are the plan's own (the plan *is* data parallel) is the
same job, so it is run once and its figures shown for both: two runs of one setting differ only by the
machine's noise, which would read as one being faster.  Only plans of traced models
(``MODULE:FACTORY``) can be measured: a layer list or an example has no model to run.  The daemons run without a tuning table unless ``COMMD_TUNING`` says
otherwise, so every setting sees the same lanes.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from commd.planner.plan import PlanError

#: The key suffix of an overhead line measured on a group of one node's ranks (see torch_path_overheads).
NODE_SUFFIX = "@node"
CROSS_SUFFIX = "@cross"
#: The settings measured, in order: the plan itself, then its baselines (by plan.json's keys).
SETTINGS = ("plan", "data_parallel", "megatron")
WORKER = "commd.planner.measure_worker"


def check(plan: dict[str, Any], hosts: int, nproc_per_node: int) -> None:
    """PlanError when ``plan`` cannot be measured on ``hosts`` x ``nproc_per_node`` ranks."""
    if not plan.get("model_factory"):
        raise PlanError("the plan has no model_factory: only plans of a traced model (MODULE:FACTORY) can be "
                        "measured; plans made from --layers or --example have no model to run")
    if hosts < 1 or nproc_per_node < 1:
        raise PlanError("--hosts and --nproc-per-node must be positive")
    shape = plan["mesh"]["shape"]
    if hosts * nproc_per_node != math.prod(shape):
        raise PlanError(f"--hosts {hosts} x --nproc-per-node {nproc_per_node} = {hosts * nproc_per_node} ranks, "
                        f"but the plan's mesh {'x'.join(map(str, shape))} has {math.prod(shape)}")
    if plan["mesh"].get("nproc_per_node") not in (None, nproc_per_node):
        print(f"commd plan --measure: note: the plan was priced for {plan['mesh']['nproc_per_node']} ranks per "
              f"node, measured with {nproc_per_node}", file=sys.stderr)


def settings(plan: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(name → (predicted figures, plan with that setting's layers, the earlier setting with the very same
    layers or None), names skipped with why)."""
    out: dict[str, dict[str, Any]] = {"plan": {"predicted": plan["predicted"], "plan": plan, "same_as": None}}
    skipped = []
    for name in SETTINGS[1:]:
        base = (plan.get("baselines") or {}).get(name)
        if base is None:
            skipped.append(f"{name}: the plan has no such baseline (null: it does not fit or does not apply)")
            continue
        same = next((earlier for earlier, row in out.items() if row["plan"]["layers"] == base["layers"]), None)
        setting = {k: v for k, v in plan.items() if k != "ddp_buckets"}  # (the plan's own DDP buckets)
        setting.update(layers=base["layers"], **({"ddp_buckets": base["ddp_buckets"]} if "ddp_buckets" in base else {}))
        out[name] = {"predicted": base, "plan": setting, "same_as": same}
    return out, skipped


def interleaved(names: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, setting) in run order: every repeat runs every setting, the leading one rotating."""
    return [(rep, name) for rep in range(repeats) for name in names[rep % len(names):] + names[:rep % len(names)]]


def summary(plan_settings: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per setting predicted and measured step seconds and their ratio, and the fastest measured."""
    rows = {}
    for name, setting in plan_settings.items():
        predicted = setting["predicted"]["step_s"]
        measured = statistics.median(r["median_s"] for r in runs[name])
        rows[name] = {"predicted_step_s": predicted, "measured_step_s": measured,
                      "measured_over_predicted": measured / predicted if predicted > 0 else None,
                      "runs_median_s": [r["median_s"] for r in runs[name]], "same_as": setting.get("same_as")}
    fastest = min(rows, key=lambda n: rows[n]["measured_step_s"])
    return {"settings": rows, "fastest": fastest}


def table(result: dict[str, Any]) -> str:
    """The summary for people."""
    lines = [f"{'setting':<16} {'predicted ms':>13} {'measured ms':>12} {'meas/pred':>10}"]
    for name, row in result["settings"].items():
        ratio = row["measured_over_predicted"]
        same = f"  (the same layers as {row['same_as']}: run once)" if row.get("same_as") else ""
        lines.append(f"{name:<16} {row['predicted_step_s'] * 1e3:13.3f} {row['measured_step_s'] * 1e3:12.3f} "
                     f"{(f'{ratio:.2f}x' if ratio is not None else '-'):>10}{same}")
    lines.append(f"fastest measured: {result['fastest']}")
    lines.extend(f"skipped {s}" for s in result.get("skipped", []))
    return "\n".join(lines)


def run_job(sim: Any, cfg: dict[str, Any], work: Path, tag: str, nproc: int, timeout: float) -> dict[str, Any]:
    """Rank 0's result of one job of the worker on every simulated host; SystemExit naming the logs on failure."""
    out, cfg_path = work / f"{tag}.json", work / f"{tag}-cfg.json"
    cfg_path.write_text(json.dumps(dict(cfg, out=str(out))))
    env = {**os.environ, "COMMD_SECRET": secrets.token_hex(32)}  # the job's secret, the same on every host
    env.setdefault("COMMD_TUNING", "off")
    env.pop("COMMD_JOB", None)
    master = f"{sim.hosts[0].ip}:{random.randint(20000, 40000)}"
    procs = []
    for i, host in enumerate(sim.hosts):
        argv = [sys.executable, "-m", "commd", "launch", "--nproc-per-node", str(nproc), "--nnodes",
                str(len(sim.hosts)), "--node-rank", str(i), "--master", master, "--node-name", host.name,
                "-m", WORKER, str(cfg_path)]
        # the host's own COMMD_NODE and COMMD_RUNTIME_DIR win: the hosts' daemons must not share sockets
        with open(work / f"{tag}-n{i}.log", "w") as log:
            procs.append(host.popen(argv, env={**env, **host.env}, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise SystemExit(f"{tag}: no result within {timeout:.0f}s\n{_tails(work, tag)}") from None
        if code != 0:
            for p in procs:
                p.kill()
            raise SystemExit(f"{tag}: a launcher exited with {code}\n{_tails(work, tag)}")
    return json.loads(out.read_text())


def _tails(work: Path, tag: str, lines: int = 15) -> str:
    """The last lines of every host's log of one job (the folder goes with the simulated hosts)."""
    parts = []
    for log in sorted(work.glob(f"{tag}-n*.log")):
        parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(parts)


def _simulated_hosts_ready(delay_ms: float | None, rate: str | None) -> None:
    from commd.sim.hosts import netns_unavailable, shaping_unavailable

    if os.geteuid() != 0:
        raise PlanError("simulated hosts need root (network namespaces)")
    reason = netns_unavailable() or shaping_unavailable(delay_ms, rate)
    if reason:
        raise PlanError(f"simulated hosts: {reason}")


def _base_config(factory: dict[str, Any], ranks: int) -> dict[str, Any]:
    """What every job's config holds: the model, where to import it from, a rank's threads."""
    return {"factory": factory["factory"], "input": factory["input"], "input_dtype": factory["input_dtype"],
            "batch_dim": factory.get("batch_dim", 0), "seed": 0, "sys_path": [os.getcwd(), *sys.path],
            "threads": max(1, (os.cpu_count() or 1) // ranks)}


def job_compute(factory: dict[str, Any], hosts: int, nproc_per_node: int, rate: str | None = None,
                delay_ms: float | None = None, repeats: int = 5, timeout: float = 300.0,
                log: Any = sys.stderr) -> dict[str, Any]:
    """The layer and torch-path times a plan is priced with, measured inside a job launched like the
    one that will train (``measure_worker.layer_job``): every rank of ``hosts`` x ``nproc_per_node``
    at once, on as many threads as a training rank, with the daemons and the link shaping running."""
    from commd.sim.hosts import SimulatedHosts

    if hosts < 1 or nproc_per_node < 1:
        raise PlanError("--hosts and --nproc-per-node must be positive")
    _simulated_hosts_ready(delay_ms, rate)
    cfg = dict(_base_config(factory, hosts * nproc_per_node), mode="layers", repeats=repeats,
               nproc_per_node=nproc_per_node)
    print(f"timing layers and collectives inside a job on {hosts} simulated hosts x {nproc_per_node} ranks ...",
          file=log, flush=True)
    with tempfile.TemporaryDirectory(prefix="commd-plan-compute-") as tmp, \
            SimulatedHosts(hosts, delay_ms=delay_ms, rate=rate) as sim:
        result = run_job(sim, cfg, Path(tmp), "layers", nproc_per_node, timeout)
    result.update(hosts=hosts, nproc_per_node=nproc_per_node, rate=rate, delay_ms=delay_ms)
    return result


def torch_path_overheads(job: dict[str, Any], costs: Any) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(conversion, sync) per collective kind: [a, b] of the seconds a + b * bytes that the torch path adds
    to the measured price — the probes' times inside the job minus what ``costs`` say the same
    collectives cost on the same group (never below zero), as a line through the probe sizes.  Keyed by
    the kind for the group of all ranks, and ``KIND@node`` for a group of one node's ranks where the job
    probed one, and ``KIND@cross`` for one rank of each node, as many such groups side by side as a node
    has ranks (priced as ``CollectiveCosts.side_by_side``, as ``plan.MeshDim.seconds`` prices them;
    ``plan._extra`` picks by the group)."""
    groups = job_groups(job)
    scopes = [("collectives", "", *groups[""])]
    if "node_collectives" in job:
        scopes.append(("node_collectives", NODE_SUFFIX, *groups[NODE_SUFFIX]))
    if "cross_collectives" in job:
        scopes.append(("cross_collectives", CROSS_SUFFIX, *groups[CROSS_SUFFIX]))
    out: list[dict[str, list[float]]] = [{}, {}]
    for key, suffix, group_nodes, size, sharing in scopes:
        for lines, path in zip(out, ("functional", "plain"), strict=True):
            for kind, points in job[key][path].items():
                lines[kind + suffix] = line_through(
                    [(int(b), t - costs.side_by_side(kind, int(b), group_nodes, size, sharing)) for b, t in points])
    return out[0], out[1]


def job_groups(job: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    """Per suffix of the overhead lines, the groups a job measured on as ``CollectiveCosts.side_by_side``
    takes them — (nodes a group spans, its ranks, such groups side by side on each node's link): all
    ranks (``""``), one node's ranks (``@node``), one rank of each node (``@cross``)."""
    nodes, world = int(job["hosts"]), int(job["world"])
    node_ranks = int(job.get("node_ranks", world))
    return {"": (nodes, world, 1), NODE_SUFFIX: (1, node_ranks, 1), CROSS_SUFFIX: (nodes, nodes, node_ranks)}


def line_through(points: list[tuple[int, float]]) -> list[float]:
    """[a, b] of the line a + b * bytes through the smallest and the largest of ``points`` (bytes, seconds),
    neither below zero."""
    ordered = sorted((b, max(0.0, t)) for b, t in points)
    (b0, e0), (b1, e1) = ordered[0], ordered[-1]
    slope = max(0.0, (e1 - e0) / (b1 - b0)) if b1 > b0 else 0.0
    return [max(0.0, e0 - slope * b0), slope]


#: A job's ``replicate_steps`` groups, and the suffix of the overhead lines priced on groups like them.
REPLICATE_SCOPES = {"world": "", "node": NODE_SUFFIX, "cross": CROSS_SUFFIX}


def replicate_curves(job: dict[str, Any], costs: Any,
                     sync_overhead: dict[str, list[float]]) -> dict[str, list[list[float]]]:
    """Per kind of group (``replicate`` for all ranks, ``replicate@node``, ``replicate@cross``), points
    [bytes, seconds] of what FSDP2's ``replicate`` adds to a layer's step for a gradient of that many bytes
    beyond what the plan charges for its all-reduce: the job's ``replicate_steps`` less the all-reduce's
    price on those groups (``CollectiveCosts.side_by_side``) and its ``sync_overhead`` line, never below
    zero.  Points, not a line: measured, the addition was largest at a mid-sized gradient and none at
    1 MiB, where the table's price is already above the wrapped step's."""
    groups = job_groups(job)
    out = {}
    steps = job.get("replicate_steps", {})
    if not isinstance(steps, dict):
        raise PlanError(f"the job measurement's replicate_steps is {type(steps).__name__}, not a mapping of groups")
    for scope, points in steps.items():
        if scope not in REPLICATE_SCOPES:
            raise PlanError(f"the job measurement's replicate_steps has group {scope!r}: not one of "
                            f"{', '.join(REPLICATE_SCOPES)}")
        points = _byte_points(points, f"replicate_steps[{scope!r}]")
        if not points:
            continue
        suffix = REPLICATE_SCOPES[scope]
        group_nodes, size, sharing = groups[suffix]
        a, b = sync_overhead.get("allreduce" + suffix) or sync_overhead.get("allreduce") or (0.0, 0.0)
        out["replicate" + suffix] = sorted(
            [n, max(0.0, t - costs.side_by_side("allreduce", n, group_nodes, size, sharing) - (a + b * n))]
            for n, t in points)
    return out


def _byte_points(value: Any, where: str) -> list[tuple[int, float]]:
    """``value`` as points (bytes >= 1, seconds >= 0 and finite); PlanError naming ``where`` if it is not."""
    if not isinstance(value, list):
        raise PlanError(f"the job measurement's {where} is {type(value).__name__}, not a list of [bytes, seconds]")
    out = []
    for point in value:
        ok = (isinstance(point, list | tuple) and len(point) == 2 and all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in point))
        if not ok or not 1 <= point[0] < math.inf or point[0] != int(point[0]) or not 0 <= point[1] < math.inf:
            raise PlanError(f"the job measurement's {where} has {point!r}: not [bytes >= 1, seconds >= 0]")
        out.append((int(point[0]), float(point[1])))
    return out


def measure(plan: dict[str, Any], hosts: int, nproc_per_node: int, rate: str | None = None,
            delay_ms: float | None = None, steps: int = 20, warmup: int = 5, repeats: int = 1,
            timeout: float = 300.0, log: Any = sys.stderr) -> dict[str, Any]:
    """Every setting of ``plan`` run and timed on ``hosts`` simulated hosts; the summary (see ``summary``)."""
    from commd.sim.hosts import SimulatedHosts

    check(plan, hosts, nproc_per_node)
    if steps < 1 or warmup < 0 or repeats < 1:
        raise PlanError("--steps and --repeats must be positive, --warmup not negative")
    _simulated_hosts_ready(delay_ms, rate)
    plan_settings, skipped = settings(plan)
    factory = plan["model_factory"]
    base = dict(_base_config(factory, hosts * nproc_per_node), steps=steps, warmup=warmup)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in plan_settings}
    with tempfile.TemporaryDirectory(prefix="commd-plan-measure-") as tmp, \
            SimulatedHosts(hosts, delay_ms=delay_ms, rate=rate) as sim:
        distinct = [name for name, setting in plan_settings.items() if setting["same_as"] is None]
        for rep, name in interleaved(distinct, repeats):
            print(f"[{rep + 1}/{repeats}] {name} ...", file=log, flush=True)
            cfg = dict(base, plan=plan_settings[name]["plan"])
            runs[name].append(run_job(sim, cfg, Path(tmp), f"{name}-{rep}", nproc_per_node, timeout))
    for name, setting in plan_settings.items():
        if setting["same_as"] is not None:
            runs[name] = runs[setting["same_as"]]
    result = summary(plan_settings, runs)
    result.update(skipped=skipped, runs=runs,
                  config={"hosts": hosts, "nproc_per_node": nproc_per_node, "rate": rate, "delay_ms": delay_ms,
                          "steps": steps, "warmup": warmup, "repeats": repeats, "threads": base["threads"],
                          "model_factory": factory, "mesh": plan["mesh"]["shape"]},
                  load=os.getloadavg())
    return result
