"""``commd plan``: plan a model's parallelization from a layer list and measured costs, or show a plan.

    commd plan mypkg.models:build_gpt --input 8x512 --input-dtype int64 --mesh 2x2 --nproc-per-node 2 --table t.json
    commd plan --layers model.json --mesh 2x2 --nproc-per-node 2 --table tuning.json --costs local.json -o plan.json
    commd plan --example gpt --mesh 4 --nproc-per-node 2 --costs costs.json --search both
    commd plan --show plan.json
    commd plan --measure plan.json --hosts 2 --nproc-per-node 2 --rate 1gbit --delay-ms 0.2 --json measured.json
    commd plan calibrate --nproc-per-node 2 -o costs.json   # groups inside a node, and the compute rate
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from commd.planner import examples
from commd.planner import plan as planner
from commd.planner.costs import CollectiveCosts, CostError
from commd.planner.graph import GraphError, LayerGraph

#: The benchmark's model families at their default sizes (``--example``).
EXAMPLES = {
    "wide-mlp": lambda: examples.mlp(batch=32, width=4096, depth=4),
    "narrow-mlp": lambda: examples.mlp(batch=8192, width=256, depth=4),
    "cnn": lambda: examples.cnn(batch=64),
    "gpt": lambda: examples.gpt(batch=8, seq=128, hidden=512, heads=8, blocks=4, vocab=8192),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", nargs="?", metavar="MODULE:FACTORY | calibrate",
                   help="the model, built by FACTORY (a function or class of MODULE) and traced on the meta device "
                        "(with --input); or calibrate: time collectives among this node's ranks and the compute rate "
                        "(a costs file)")
    p.add_argument("--input", metavar="SHAPE", help="the traced model's input batch, e.g. 8x128 or 64x3x32x32")
    p.add_argument("--input-dtype", default="float32", help="its dtype (token ids: int64; default float32)")
    p.add_argument("--compute", choices=("job", "measured", "flops"), default=None,
                   help="layer compute times: job = measured inside a job launched on --hosts simulated hosts x "
                        "--nproc-per-node ranks (root; the default for MODULE:FACTORY when --hosts is given; also "
                        "measures what the torch path adds to each collective); measured = here, on a rank's share "
                        "of the cores (the default for MODULE:FACTORY otherwise); flops = FLOPs at the costs' "
                        "flops_per_s (the fast estimate, and the only way for --layers and --example)")
    p.add_argument("--compute-from", type=Path, metavar="FILE",
                   help="reuse the job measurement of an earlier plan.json (or of --compute-out) instead of "
                        "launching a job")
    p.add_argument("--compute-out", type=Path, metavar="FILE", help="also write the job measurement here")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--layers", type=Path, help="the model as a JSON layer list (format commd-layers)")
    model.add_argument("--example", choices=sorted(EXAMPLES), help="one of the benchmark's model families")
    model.add_argument("--show", type=Path, metavar="PLAN", help="print a plan.json for people and stop")
    model.add_argument("--measure", type=Path, metavar="PLAN",
                       help="train a traced model's plan and its baselines on simulated hosts (root) and print the "
                            "measured step beside the predicted")
    p.add_argument("--hosts", type=int, default=None,
                   help="measure, --compute job: simulated hosts (x --nproc-per-node = the mesh; default 2)")
    p.add_argument("--rate", help="measure, --compute job: each host's bandwidth, e.g. 1gbit (default unshaped)")
    p.add_argument("--delay-ms", type=float, help="measure, --compute job: one-way delay added per host link")
    p.add_argument("--steps", type=int, default=20, help="measure: timed steps per setting (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="measure: untimed steps first (default 5)")
    p.add_argument("--repeats", type=int, default=1, help="measure: runs per setting, interleaved (default 1)")
    p.add_argument("--json", type=Path, metavar="FILE", help="measure: write the figures and every run here")
    p.add_argument("--mesh", default=None, help="ranks as N (1-D) or DPxTP (2-D), e.g. 4 or 2x2")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per node (plan default: all on one node; calibrate default: 2)")
    p.add_argument("--max-bytes", default="16M", help="calibrate: the largest message timed (default 16M)")
    p.add_argument("--iters", type=int, default=10, help="calibrate: timed iterations per size (default 10)")
    p.add_argument("--matrix", type=int, default=1024, help="calibrate: side of the timed matrix products")
    p.add_argument("--table", type=Path, help="a tuning table (`commd tune`): costs of groups across nodes")
    p.add_argument("--costs", type=Path, help="a costs file: groups inside a node, and flops_per_s")
    p.add_argument("--flops-per-s", type=float, help="the compute rate (overrides the costs file's)")
    p.add_argument("--search", choices=planner.SEARCHES, default="descent",
                   help="descent (default), exact, or both (fails when descent is >1%% worse than exact)")
    p.add_argument("--mem-gb", type=float, help="memory per rank: strategies that do not fit are left out")
    p.add_argument("--min-gain", type=float, default=planner.Options.min_gain,
                   help="the faster baseline (plain data parallel or Megatron) stays the plan unless the search's is "
                        "predicted at least this fraction faster (default %(default)s: the predictions' error on the "
                        "benchmark)")
    p.add_argument("--optimizer-states", type=int, default=2,
                   help="parameter-sized optimizer tensors (Adam 2, SGD+momentum 1, SGD 0; default 2)")
    p.add_argument("--gpu", action="store_true", help="a GPU mesh: S(i)->S(j) conversions as all-to-alls")
    p.add_argument("--write-layers", type=Path, metavar="FILE", help="also write the model's layer list")
    p.add_argument("-o", "--out", type=Path, help="write plan.json here")


def run(args: argparse.Namespace) -> int:
    if args.target == "calibrate":
        from commd.planner import calibrate

        if args.out is None:
            print("commd plan calibrate: -o FILE names the costs file to write", file=sys.stderr)
            return 2
        args.nproc_per_node = args.nproc_per_node or 2
        return calibrate.run(args)
    try:
        if args.show:
            print(planner.show(planner.load(args.show)))
            return 0
        if args.measure:
            return _measure(args)
        graph = _graph(args)
        if args.write_layers:
            args.write_layers.write_text(json.dumps(graph.to_json(), indent=1) + "\n")
        if not args.mesh:
            raise planner.PlanError("--mesh is needed (e.g. 4 or 2x2)")
        mesh = planner.Mesh.parse(args.mesh, 1, args.gpu)
        mesh = planner.Mesh(mesh.shape, args.nproc_per_node or mesh.world, args.gpu)
        costs, table_id = _costs(args)
        if args.mem_gb is not None and args.mem_gb <= 0:
            raise planner.PlanError("--mem-gb must be positive")
        if not 0 <= args.min_gain < 1:
            raise planner.PlanError(f"--min-gain must be a fraction in [0, 1), not {args.min_gain}")
        if args.optimizer_states < 0:
            raise planner.PlanError("--optimizer-states must not be negative")
        opts = planner.Options(search=args.search, optimizer_states=args.optimizer_states, min_gain=args.min_gain,
                               mem_bytes=args.mem_gb * 2**30 if args.mem_gb else None)
        compute = args.compute or ("flops" if not args.target else "job" if args.hosts or args.compute_from
                                   else "measured")
        job = None
        if compute != "flops" and not args.target:
            raise planner.PlanError(f"--compute {compute} needs the model as MODULE:FACTORY (it runs the model)")
        if compute == "measured":
            from commd.planner import trace

            threads = max(1, (os.cpu_count() or 1) // mesh.nproc_per_node)
            opts.compute, opts.compute_source = "measured", "measured here"
            opts.layer_seconds, _ = trace.measure_in_step(trace.load_factory(args.target), _shape(args.input),
                                                          args.input_dtype, threads=threads)
        elif compute == "job":
            job = _job_compute(args, mesh, graph.batch_dim)
            _use_job(opts, job, costs)
        made = planner.plan(graph, mesh, costs, opts, table_id)
        if job is not None:
            made["compute"]["job"] = job
        if args.target:  # how to build the model again (commd plan --measure, apply in a job)
            made["model_factory"] = {"factory": args.target, "input": list(_shape(args.input)),
                                     "input_dtype": args.input_dtype}
    except (planner.PlanError, CostError, GraphError) as exc:
        print(f"commd plan: {exc}", file=sys.stderr)
        return 2
    print(planner.show(made))
    if args.out:
        planner.save(made, args.out)
        print(f"wrote {args.out}")
    return 0


def _job_compute(args: argparse.Namespace, mesh: planner.Mesh, batch_dim: int = 0) -> dict:
    """The job measurement: read from --compute-from, or measured in a job on simulated hosts (a rank's
    share of the batch cut from the traced graph's ``batch_dim``)."""
    from commd.planner import measure

    factory = {"factory": args.target, "input": list(_shape(args.input)), "input_dtype": args.input_dtype,
               "batch_dim": batch_dim}
    if args.compute_from:
        try:
            raw = json.loads(Path(args.compute_from).read_text())
        except (OSError, ValueError) as exc:
            raise planner.PlanError(f"--compute-from {args.compute_from}: {exc}") from None
        job = raw.get("compute", {}).get("job") if isinstance(raw, dict) and "layers" in raw and "mesh" in raw else raw
        if not isinstance(job, dict) or not {"layers", "collectives", "world", "hosts"} <= set(job):
            raise planner.PlanError(f"--compute-from {args.compute_from}: no job measurement in it (written by "
                                    "--compute job: a plan.json or --compute-out)")
        if job["world"] != mesh.world:
            raise planner.PlanError(f"--compute-from {args.compute_from}: measured on {job['world']} ranks, the "
                                    f"mesh has {mesh.world}")
        if list(job.get("input", [])) != factory["input"]:
            raise planner.PlanError(f"--compute-from {args.compute_from}: measured with input {job.get('input')}, "
                                    f"not {factory['input']}")
    else:
        hosts = args.hosts or 2
        nproc = args.nproc_per_node or max(1, mesh.world // hosts)
        if hosts * nproc != mesh.world:
            raise planner.PlanError(f"--compute job: --hosts {hosts} x {nproc} ranks per node is not the mesh's "
                                    f"{mesh.world} ranks")
        job = measure.job_compute(factory, hosts, nproc, rate=args.rate, delay_ms=args.delay_ms)
    if args.compute_out:
        args.compute_out.write_text(json.dumps(job, indent=1) + "\n")
    return job


def _use_job(opts: planner.Options, job: dict, costs: CollectiveCosts) -> None:
    """Price compute and the torch path's overheads with a job measurement."""
    from commd.planner import measure

    opts.compute = "measured"
    link = [f"{job['rate']}" if job.get("rate") else "", f"{job['delay_ms']} ms" if job.get("delay_ms") else ""]
    opts.compute_source = (f"job on {job['hosts']} simulated hosts x {job['nproc_per_node']} ranks"
                           + "".join(f", {x}" for x in link if x))
    opts.layer_seconds = {name: float(v[1]) for name, v in job["layers"].items()}
    opts.layer_fixed_seconds = {name: float(v[0]) for name, v in job["layers"].items()}
    opts.convert_overhead_s, opts.sync_overhead_s = measure.torch_path_overheads(job, costs)
    opts.wrapper_overhead_s = {name: float(v) for name, v in job.get("wrappers", {}).items()}
    opts.wrapper_curves_s = measure.replicate_curves(job, costs, opts.sync_overhead_s)


def _measure(args: argparse.Namespace) -> int:
    from commd.planner import measure

    plan = planner.load(args.measure)
    nproc = args.nproc_per_node or plan["mesh"]["nproc_per_node"]
    args.hosts = args.hosts or 2
    measure.check(plan, args.hosts, nproc)  # before the simulated hosts come up
    result = measure.measure(plan, args.hosts, nproc, rate=args.rate, delay_ms=args.delay_ms, steps=args.steps,
                             warmup=args.warmup, repeats=args.repeats)
    print(measure.table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _graph(args: argparse.Namespace) -> LayerGraph:
    if args.target:
        if args.layers or args.example:
            raise planner.PlanError("give the model once: MODULE:FACTORY, --layers or --example")
        if not args.input:
            raise planner.PlanError(f"{args.target}: --input SHAPE (the batch the model is traced with) is needed")
        shape = _shape(args.input)
        if args.input_dtype not in ("float32", "float16", "bfloat16", "float64", "int64", "int32"):
            raise planner.PlanError(f"--input-dtype {args.input_dtype!r}: float32, float16, bfloat16, float64, "
                                    "int64 or int32")
        from commd.planner import trace

        return trace.trace(trace.load_factory(args.target), shape, args.input_dtype, args.target)
    if args.layers:
        return LayerGraph.load(args.layers)
    if args.example:
        return EXAMPLES[args.example]()
    raise planner.PlanError("give the model: MODULE:FACTORY with --input SHAPE, --layers FILE (a JSON layer list) "
                            "or --example NAME")


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise planner.PlanError(f"--input {text!r}: sizes such as 8x128") from None
    if any(d <= 0 for d in shape):
        raise planner.PlanError(f"--input {text!r}: sizes must be positive")
    return shape


def _costs(args: argparse.Namespace) -> tuple[CollectiveCosts, str]:
    costs = CollectiveCosts({}, None, "")
    table_id = ""
    if args.table:
        from commd.scheduler.tuning import TuningTable

        try:
            table = TuningTable.load(args.table)
        except (OSError, ValueError) as exc:
            raise CostError(f"cannot use the tuning table {args.table}: {exc}") from None
        costs, table_id = costs.merged(CollectiveCosts.from_table(table)), table.table_id
    if args.costs:
        costs = costs.merged(CollectiveCosts.load(args.costs))
    if args.flops_per_s is not None:
        if args.flops_per_s <= 0:
            raise CostError("--flops-per-s must be positive")
        costs.flops_per_s = args.flops_per_s
    if not costs.curves:
        raise CostError("no measured costs: give --table (from `commd tune`) and/or --costs")
    return costs, table_id
