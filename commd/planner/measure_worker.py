"""One rank of ``commd plan --measure``: a setting's layers applied to the plan's model, trained and timed.

Run by ``commd launch -m commd.planner.measure_worker CONFIG.json`` on every simulated host (see
``commd.planner.measure``); ``import commd`` registers the backend, which is the only part of commd
below the planner it touches.  The config names the model factory, the global batch, the plan (its
``mesh`` and the setting's ``layers``), the step counts and the file rank 0 writes.

With ``"mode": "layers"`` in the config a job instead times what the planner prices compute and the
torch path with (``layer_job``): every rank at once, so each sees the load it will train under.

Timing: all ranks pass one ``dist.barrier()`` after the warm-up steps, then run the timed steps
(``trace.sgd_step``: forward, backward, SGD step) back to back with no barrier among them.  Each rank
notes when it finishes each step, counted from its exit from the barrier; the job has finished a step
when its slowest rank has (the largest of those times, an all-reduce after the last step), and a
step's time is the time from the job finishing the step before.  The largest of the ranks' own step
durations would read high where ranks are loosely coupled: they take turns being slow (one rank of a
plan with one all-reduce a step took 27 and 78 ms on alternate steps of a 51 ms period), and the
largest duration of every step is a slow turn.  A plan without collectives (replicated) is timed as
its ranks run it, independently.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any


def local_shape(plan: dict[str, Any], batch: list[int]) -> tuple[int, ...]:
    """This rank's share of the global ``batch``: divided along every mesh dimension its input layer splits."""
    from commd.planner.layouts import split_dim

    row = next(r for r in plan["layers"] if r["kind"] == "input")
    shape = list(batch)
    for size, layout in zip(plan["mesh"]["shape"], row["output"], strict=True):
        k = split_dim(layout)
        if k is not None:
            if shape[k] % size:
                raise ValueError(f"input dimension {k} of size {shape[k]} does not split over {size} ranks")
            shape[k] //= size
    return tuple(shape)


def batches(shape: tuple[int, ...], dtype: str, count: int, rank: int, seed: int) -> list[Any]:
    """``count`` seeded random inputs of ``shape`` (token ids 0 or 1 for integer dtypes), different per rank."""
    import torch

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed * 100_003 + rank)
    if dt.is_floating_point:
        return [torch.randn(shape, generator=gen).to(dt) for _ in range(count)]
    return [torch.randint(0, 2, shape, generator=gen, dtype=dt) for _ in range(count)]


#: Bytes of the collectives ``layer_job`` times the torch path with (a layout conversion's size).
#: Per-rank bytes of the collectives ``layer_job`` times the torch path with — a layout conversion's
#: size, and a gradient's (above the size at which a fresh tensor is registered, not staged) — and how
#: many times each (the first is not counted).
PROBES = ((64 * 1024, 11), (4 * 1024 * 1024, 5))


def layer_job(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Per layer (fixed, whole) training seconds (``trace.measure_in_step`` on the whole batch and on
    one rank's share of it, every rank at once; the median over ranks; ``in_step``: the factors the
    layers' own times were scaled by to add up to a whole step's) and, per collective kind and
    ``PROBES`` size, the seconds a collective takes on all ranks (``collectives``) and, with several
    nodes of several ranks, on the ranks of one node (``node_collectives``: where a 2-D mesh's ``tp``
    converts) and on one rank of each node, a node's ranks each in such a group at once
    (``cross_collectives``: where a 2-D mesh's ``dp`` syncs) — through ``torch.distributed`` directly
    (``plain``: FSDP2's gradient sync) and through functional collectives (``functional``: DTensor's
    conversions), each between products of matrices sized like the model's mean layer on a share
    (``probe_compute``: see ``_probes``), and what each wrapper ``apply`` puts on a layer costs of its own
    (``wrappers``; ``wrapper_collectives``: the tiny collectives taken out of it), and FSDP2's ``replicate``
    at a layer's sizes on each kind of group it may run on (``replicate_steps``).  Rank 0's return value;
    None on the others."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    from commd.planner.trace import fixed_and_whole, load_factory, measure_in_step

    world, rank = dist.get_world_size(), dist.get_rank()
    factory, shape = load_factory(cfg["factory"]), tuple(cfg["input"])
    batch = int(cfg.get("batch_dim", 0))  # (1: a sequence-first model's batch)
    share_shape = (*shape[:batch], max(1, shape[batch] // world), *shape[batch + 1:])
    threads, repeats = int(cfg.get("threads", 1)), int(cfg.get("repeats", 5))
    dist.barrier()
    whole, whole_factor = measure_in_step(factory, shape, cfg["input_dtype"], repeats, threads)
    dist.barrier()
    part, part_factor = measure_in_step(factory, share_shape, cfg["input_dtype"], repeats, threads)
    layers = fixed_and_whole(whole, part, share_shape[batch] / shape[batch])

    nproc = int(cfg.get("nproc_per_node", world))
    scopes = {"collectives": (dist.group.WORLD, world)}
    if 1 < nproc < world and world % nproc == 0:  # the conversions of a dimension inside a node run on these
        node_groups = [dist.new_group(list(range(n * nproc, (n + 1) * nproc))) for n in range(world // nproc)]
        scopes["node_collectives"] = (node_groups[rank // nproc], nproc)
        # one rank of each node, every node's ranks in a group of their own at once: a 2-D mesh's dp groups
        # (FSDP2's gradient sync runs on them), whose collectives share each node's link
        cross_groups = [dist.new_group(list(range(r, world, nproc))) for r in range(nproc)]
        scopes["cross_collectives"] = (cross_groups[rank % nproc], world // nproc)
    chunk, side = _compute_chunk(dist, sum(part.values()) / max(1, len(part)))
    probed: dict[str, dict[str, dict[str, list[list[float]]]]] = {}
    for key, (group, size) in scopes.items():
        collectives = probed.setdefault(key, {})
        for nbytes, calls in PROBES:
            for path, kind, table_bytes, seconds in _probes(dist, fc, group, size, nbytes // 4, calls, chunk):
                collectives.setdefault(path, {}).setdefault(kind, []).append([table_bytes, seconds])
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    tp = nproc if "node_collectives" in scopes else world  # (one node's ranks; all, with one node or one rank each)
    grid = DeviceMesh("cpu", torch.arange(world).view(world // tp, tp), mesh_dim_names=("cross", "node"))
    wrappers, wrapper_collectives = _wrapper_overheads(dist, fc, grid, repeats * 2 + 1)
    replicate_steps = _replicate_steps(dist, grid, repeats * 2 + 1, chunk)
    gathered: list[Any] = [None] * world
    chunk_s = _job_seconds(dist, chunk, 5)
    dist.all_gather_object(gathered, {"layers": layers, "wrappers": wrappers, "in_step": [whole_factor, part_factor],
                                      "chunk_s": chunk_s, "replicate_steps": replicate_steps, **probed})
    if rank != 0:
        return None
    out: dict[str, Any] = {
        "layers": {name: [statistics.median(g["layers"][name][0] for g in gathered),
                          statistics.median(g["layers"][name][1] for g in gathered)] for name in layers},
        "world": world, "threads": threads, "input": list(shape), "share_input": list(share_shape),
        "in_step": [statistics.median(g["in_step"][i] for g in gathered) for i in range(2)],
        "probe_compute": {"matmul_side": side, "seconds": statistics.median(g["chunk_s"] for g in gathered)}}
    for key, collectives in probed.items():
        out[key] = {path: {kind: [[point[0], statistics.median(g[key][path][kind][i][1] for g in gathered)]
                                  for i, point in enumerate(points)]
                           for kind, points in kinds.items()} for path, kinds in collectives.items()}
    if "node_collectives" in out:
        out["node_ranks"] = nproc
    out["wrappers"] = {name: statistics.median(g["wrappers"][name] for g in gathered) for name in wrappers}
    out["wrapper_collectives"] = wrapper_collectives
    out["replicate_steps"] = {scope: [[point[0], statistics.median(g["replicate_steps"][scope][i][1] for g in gathered)]
                                      for i, point in enumerate(points)]
                              for scope, points in replicate_steps.items()}
    return out


#: The wrappers ``apply`` puts on a layer whose own cost the job measures (``_wrapper_overheads``).
WRAPPERS = ("replicate", "fully_shard", "col", "row")
#: Rounds of the wrappers' timing; each wrapper's cost is their median.
WRAPPER_ROUNDS = 3


def _wrapper_overheads(dist: Any, fc: Any, grid: Any, repeats: int) -> tuple[dict[str, float], dict[str, int]]:
    """Per wrapper ``apply`` puts on a layer — FSDP2's ``replicate`` and ``fully_shard``, DTensor's
    ``ColwiseParallel`` and ``RowwiseParallel`` — the seconds a training step of a tiny linear layer takes
    beyond the same layer unwrapped and beyond the tiny collectives the wrapper issues (timed here too):
    the Python of its hooks, of DTensor's dispatch and of its optimizer step, which the plan charges per
    wrapped layer; and per wrapper the collectives that step issued.  Every wrapper runs on ``grid``'s
    ``node`` groups (one node's ranks, where the job has several nodes, every node at once): a tiny collective across nodes,
    taken off the step, varied by more than the wrapper's own cost from job to job.  The median over
    ``WRAPPER_ROUNDS`` rounds, each timing the plain layer, the tiny collectives and the wrappers anew."""
    import torch
    from torch import nn
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    width = 16
    node = grid["node"]
    node_group, tp = node.get_group(), node.size()

    def timed(step: Any) -> float:
        return _step_seconds(dist, step, repeats)

    x = torch.randn(8, width)
    # (wrap, input, the tiny collectives one step issues: FSDP2's through torch.distributed, counted here —
    # replicate's all-reduce; fully_shard's all-gather in the forward and the backward and reduce-scatter —,
    # DTensor's counted as it runs: RowwiseParallel all-reduces its output, ColwiseParallel on an input that
    # needs no gradient issues none)
    made = {"replicate": (lambda m: replicate(m, mesh=node), x, 1),
            "fully_shard": (lambda m: fully_shard(m, mesh=node, reshard_after_forward=True), x, 3),
            "col": (lambda m: parallelize_module(m, node, ColwiseParallel()), x, None),
            "row": (lambda m: parallelize_module(m, node, RowwiseParallel()), torch.randn(8, width // tp), None)}
    steps, counts = {}, {}
    for name in WRAPPERS:
        wrap, given, issued = made[name]
        model = nn.Linear(width, width)
        wrap(model)
        steps[name] = _training_step(model, given)
        if issued is None:
            with CommDebugMode() as mode:
                steps[name]()
            issued = mode.get_total_counts()
        counts[name] = issued
    plain_step = _training_step(nn.Linear(width, width), x)
    tiny_calls = {"plain": lambda: dist.all_reduce(torch.randn(width * width), group=node_group),
                  "functional": lambda: fc.wait_tensor(fc.all_reduce(torch.randn(8 * width), "sum", node_group))}
    rounds: dict[str, list[float]] = {name: [] for name in WRAPPERS}
    for _ in range(WRAPPER_ROUNDS):
        plain = timed(plain_step)
        tiny = {path: timed(call) for path, call in tiny_calls.items()}
        for name in WRAPPERS:
            one = tiny["functional"] if name in ("col", "row") else tiny["plain"]
            rounds[name].append(timed(steps[name]) - plain - counts[name] * one)
    return {name: max(0.0, statistics.median(r)) for name, r in rounds.items()}, counts


#: Widths of the square linear layers ``_replicate_steps`` times FSDP2's ``replicate`` on: gradients of about
#: 1 KiB, 64 KiB and 1 MiB (a layer's, from a tiny one to the model's), and the rows of their input.
REPLICATE_WIDTHS = (16, 128, 512)
REPLICATE_ROWS = 64


def _replicate_steps(dist: Any, grid: Any, repeats: int, chunk: Callable[[], Any]) -> dict[str, list[list[float]]]:
    """Per group FSDP2's ``replicate`` may synchronise a layer on — all ranks (``world``), and where ``grid``
    has several nodes of several ranks one node's (``node``, every node at once) and one rank of each node
    (``cross``, a node's ranks each in such a group at once: a 2-D mesh's dp groups) — and per ``REPLICATE_WIDTHS`` layer,
    [its gradient's bytes, the seconds a training step of the layer wrapped in ``replicate`` takes beyond
    the same step unwrapped]: its all-reduce of the gradient with what FSDP2 does around it (copies into
    and out of a flat buffer, the division, its hooks).  Measured at a layer's size because that
    machinery grows with the bytes and with the group: on 2 simulated hosts x 2 ranks at 1 Gbit/s,
    beyond the same all-reduce timed alone, it took 0.9 ms (1 KiB) to 3.6 ms (1 MiB) inside a node and
    1.3 ms to 6.5 ms on the cross groups, where the tiny wrapper timing had charged about 1 ms for every
    size.  The median over ``WRAPPER_ROUNDS`` rounds, each timing the unwrapped and wrapped steps anew."""
    import torch
    from torch import nn
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import DeviceMesh

    meshes = {"world": DeviceMesh("cpu", torch.arange(grid.size()))}
    if grid["node"].size() > 1 and grid["cross"].size() > 1:
        meshes.update(node=grid["node"], cross=grid["cross"])
    out: dict[str, list[list[float]]] = {scope: [] for scope in meshes}
    for width in REPLICATE_WIDTHS:
        x = torch.randn(REPLICATE_ROWS, width)
        plain = _after(chunk, _training_step(nn.Linear(width, width), x))
        wrapped = {}
        for scope, mesh in meshes.items():
            layer = nn.Linear(width, width)
            replicate(layer, mesh=mesh)
            wrapped[scope] = _after(chunk, _training_step(layer, x))
        rounds: dict[str, list[float]] = {scope: [] for scope in meshes}
        for _ in range(WRAPPER_ROUNDS):
            alone = _step_seconds(dist, plain, repeats)
            for scope, step in wrapped.items():
                rounds[scope].append(_step_seconds(dist, step, repeats) - alone)
        for scope, seconds in rounds.items():
            out[scope].append([(width * width + width) * 4, max(0.0, statistics.median(seconds))])
    return out


def _after(first: Callable[[], Any], then: Callable[[], None]) -> Callable[[], None]:
    """``then`` with ``first`` run before it each time (a step after the probes' compute, as in a model's step)."""
    def both() -> None:
        first()
        then()
    return both


def _training_step(model: Any, x: Any) -> Callable[[], None]:
    """One SGD training step of ``model`` on ``x`` (the sum as the loss)."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).sum().backward()
        optimizer.step()
    return step


def _step_seconds(dist: Any, step: Callable[[], None], repeats: int) -> float:
    """The median seconds of ``step`` over ``repeats`` calls after two, every rank leaving a barrier before each."""
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        began = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


#: Bounds of the seconds of the matrix product every rank runs before each probe call (``_compute_chunk``).
CHUNK_BOUNDS_S = (1e-3, 20e-3)
#: Rounds of each probe loop; a probe's figure is their median.
PROBE_ROUNDS = 3


def _compute_chunk(dist: Any, target_s: float) -> tuple[Any, int]:
    """(a callable, its side) — a product of two square matrices, every rank the same size (rank 0's
    choice), sized to take about ``target_s`` (within ``CHUNK_BOUNDS_S``) with every rank running it:
    ``layer_job`` asks for its mean layer's training seconds on a share, the compute a step runs between
    two conversions when every layer converts."""
    import torch

    target_s = min(max(target_s, CHUNK_BOUNDS_S[0]), CHUNK_BOUNDS_S[1])
    side = 256
    a, b = torch.randn(side, side), torch.randn(side, side)
    times = []
    for _ in range(5):
        began = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - began)
    chosen = torch.tensor([int(side * (target_s / max(min(times), 1e-7)) ** (1 / 3))])
    dist.broadcast(chosen, 0)
    side = min(max(int(chosen.item()), 16), 4096)
    a, b = torch.randn(side, side), torch.randn(side, side)
    return (lambda: torch.mm(a, b)), side


def job_ends(dist: Any, runs: Iterable[Callable[[], Any]]) -> tuple[list[float], list[float]]:
    """(the job's, this rank's) time at the end of each of ``runs``, every rank running its own back to
    back, counted from its exit from one barrier: the job has ended a run when its slowest rank has."""
    import torch

    dist.barrier()
    began = time.perf_counter()
    ends = []
    for run in runs:
        run()
        ends.append(time.perf_counter() - began)
    slowest = torch.tensor(ends, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist(), ends


def _job_seconds(dist: Any, body: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``calls`` runs of ``body`` on every rank at once (``job_ends``)."""
    return job_ends(dist, [body] * calls)[0][-1] / calls


def under_compute(with_calls: list[float], compute_only: list[float], making: float) -> float:
    """A collective's seconds inside a step: the median over rounds of what the loop of compute and the
    collective took per call beyond the same loop of compute alone, less what making its input costs."""
    return max(0.0, statistics.median(w - c for w, c in zip(with_calls, compute_only, strict=True)) - making)


def _probes(dist: Any, fc: Any, group: Any, world: int, n: int, repeats: int,
            chunk: Any) -> list[tuple[str, str, int, float]]:
    """(path, kind, bytes as the tuning table counts them, seconds) of each probe collective of ``n``
    float32 per rank on ``group`` (``world`` ranks), every call on fresh tensors (as the gradients FSDP2
    syncs and the activations DTensor converts are) and after a ``chunk`` of compute on every rank (as
    in a step, where a rank meets the others in a collective when its compute is done and the
    collective's copies and reductions share the cores with the others' compute): ``under_compute``.
    A probe timed alone, every rank arriving together from a barrier, read 2-3 times less than the same
    collective between matrix products (a 2 MiB all-reduce inside a node: 3.6 ms and 5.6-8 ms)."""
    import torch

    rs_n = max(1, n // world) * world
    calls: dict[str, dict[str, Any]] = {
        "plain": {"allreduce": lambda: dist.all_reduce(torch.randn(n), group=group),
                  "allgather": lambda: dist.all_gather_into_tensor(torch.empty(n * world), torch.randn(n), group=group),
                  "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(rs_n // world), torch.randn(rs_n),
                                                                       group=group)},
        "functional": {"allreduce": lambda: fc.wait_tensor(fc.all_reduce(torch.randn(n), "sum", group)),
                       "allgather": lambda: fc.wait_tensor(fc.all_gather_tensor(torch.randn(n), 0, group)),
                       "reduce_scatter": lambda: fc.wait_tensor(
                           fc.reduce_scatter_tensor(torch.randn(rs_n), "sum", 0, group))},
    }
    table_bytes = {"allreduce": n * 4, "allgather": n * world * 4, "reduce_scatter": rs_n * 4}
    began = time.perf_counter()
    for _ in range(repeats):
        torch.randn(n)  # (every call makes one input of n, or rs_n <= n, values; its output buffer is empty)
    making = (time.perf_counter() - began) / repeats
    out = []
    for path, kinds in calls.items():
        for kind, call in kinds.items():
            dist.barrier()
            call()  # (the first call of a kind and size sets up what later calls reuse)
            with_calls, compute_only = [], []
            for _ in range(PROBE_ROUNDS):
                compute_only.append(_job_seconds(dist, chunk, repeats))
                with_calls.append(_job_seconds(dist, lambda call=call: (chunk(), call()), repeats))
            out.append((path, kind, table_bytes[kind], under_compute(with_calls, compute_only, making)))
    return out


def step_times(ends: list[float]) -> list[float]:
    """Each step's seconds from the times its end and the steps before it were reached (from 0)."""
    return [end - before for before, end in zip([0.0, *ends], ends, strict=False)]


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import commd  # noqa: F401 - registers the "commd" backend
    from commd.planner.apply import apply
    from commd.planner.trace import load_factory, sgd_step

    cfg = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    for entry in reversed(cfg.get("sys_path", [])):  # where the caller imports the model factory from
        if entry not in sys.path:
            sys.path.insert(0, entry)
    torch.set_num_threads(int(cfg.get("threads", 1)))
    dist.init_process_group("commd")
    rank = dist.get_rank()
    if cfg.get("mode") == "layers":
        result = layer_job(cfg)
        if result is not None:
            Path(cfg["out"]).write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
        return 0
    plan = cfg["plan"]
    shape = tuple(plan["mesh"]["shape"])
    if math.prod(shape) != dist.get_world_size():
        raise SystemExit(f"the plan's mesh {list(shape)} is not the job's {dist.get_world_size()} ranks")
    names = ("dp", "tp") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(cfg.get("seed", 0))  # every rank builds the same model
    model = apply(load_factory(cfg["factory"])(), plan, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=float(cfg.get("lr", 1e-3)))
    warmup, steps = int(cfg["warmup"]), int(cfg["steps"])
    inputs = batches(local_shape(plan, cfg["input"]), cfg["input_dtype"], warmup + steps, rank, cfg.get("seed", 0))

    for x in inputs[:warmup]:
        sgd_step(model, optimizer, x)
    slowest, ends = job_ends(dist, [partial(sgd_step, model, optimizer, x) for x in inputs[warmup:]])
    if rank == 0:
        per_step = step_times(slowest)
        out = {"median_s": statistics.median(per_step), "step_s": per_step, "rank0_step_s": step_times(ends),
               "world": dist.get_world_size(), "local_input": list(inputs[0].shape), "threads": torch.get_num_threads()}
        Path(cfg["out"]).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
