"""`commd algo`: compile, check, simulate and list collective programs (MSCCL XML files and the library).

``compile PROGRAM.py [ARGS…] -o FILE.xml`` runs a DSL program file (msccl-tools programs run
unmodified) and writes its IR as MSCCL XML, checked first (a custom collective's postcondition
beside it as ``FILE.post.json``); ``check FILE.xml`` proves a file right before it runs anywhere (exit 0 accepted, 1 refused,
every reason as "file, rank r, threadblock t, step s: reason"; an accepted file's determinism
class, and for an order-dependent one which ranks reduce which result in which order);
``simulate FILE.xml`` runs all its ranks in this process on random data and compares with
NumPy (exit 0 on a match, then how far each rank's floats lie from NumPy's and from each
other; 1 with the first differing element, or with the blocked steps of a deadlock); ``list`` shows
the built-in programs and the files of an algorithms directory.  Exit 2: a usage error (a
file that cannot be read, a reduce op the dtype has not).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from commd.algorithms import checker, mscclxml, postcondition
from commd.algorithms.errors import ProgramError
from commd.algorithms.execute import REDUCE_OPS
from commd.algorithms.ir import ORDER_DEPENDENT, Algorithm
from commd.algorithms.layout import layouts_for
from commd.algorithms.simulator import (
    SAME_OUTPUT_EVERYWHERE,
    Spread,
    TraceRecord,
    format_trace,
    reference,
    simulate,
    spread,
)
from commd.core.ops import order_sensitive

#: Dtypes ``simulate`` can draw random data for (NumPy's; bfloat16 has no NumPy type).
DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")
BITWISE_OPS = frozenset({"band", "bor", "bxor"})
#: Where ``list`` looks for user programs when --dir is not given.
DIR_ENV = "COMMD_ALGORITHMS_DIR"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    comp = sub.add_parser("compile", help="compile a DSL program file to MSCCL XML (checked before it is written)")
    comp.add_argument("-o", "--output", required=True,
                      help="the XML file to write (a file that builds several programs: FILE-<name>.xml each)")
    comp.add_argument("program", help="DSL program file (Python; msccl-tools' imports work unchanged)")
    comp.add_argument("argv", nargs=argparse.REMAINDER, help="arguments the program reads from sys.argv")
    check = sub.add_parser("check", help="prove an MSCCL XML file right (exit 0 accepted, 1 refused)")
    check.add_argument("file", help="MSCCL XML file")
    check.add_argument("--post", help="postcondition sidecar (default for coll=\"custom\": FILE.post.json)")
    sim = sub.add_parser("simulate", help="run every rank of a file in-process on random data, compare with NumPy")
    sim.add_argument("file", help="MSCCL XML file")
    sim.add_argument("--count", type=int, required=True,
                     help="elements per rank as torch counts them (all_gather: the input, reduce_scatter: the "
                          "output, all_to_all: the whole input)")
    sim.add_argument("--dtype", choices=DTYPES, default="float32", help="the inputs' element type (default float32)")
    sim.add_argument("--op", choices=sorted(REDUCE_OPS), default="sum",
                     help="the reduce op of a reducing collective (default sum)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    sim.add_argument("--tile-elements", type=int, default=None,
                     help="cut each chunk into tiles of at most this many elements (as the interpreter does)")
    sim.add_argument("--trace", action="store_true", help="print a per-step timeline (logical time = dataflow depth)")
    sim.add_argument("--post", help="postcondition sidecar of a custom collective (default: FILE.post.json)")
    listing = sub.add_parser("list", help="the built-in programs and the files of an algorithms directory")
    listing.add_argument("--dir", help=f"directory of MSCCL XML files (default: ${DIR_ENV})")
    listing.add_argument("--job", help="also say, for this running job's fabric, which programs can run and why "
                                       "not ($COMMD_JOB names it too; the daemon of this node is asked)")


def run(args: argparse.Namespace) -> int:
    return {"compile": _compile, "check": _check, "simulate": _simulate, "list": _list}[args.action](args)


def _compile(args: argparse.Namespace) -> int:
    """Compile every program the file builds, check each, and write the accepted ones (exit 1 if any is refused)."""
    from commd.algorithms import dslfile

    try:
        programs = dslfile.run_file(args.program, args.argv)
    except ProgramError as exc:
        print(f"refused: {exc}")
        return 1
    out = Path(args.output)
    status = 0
    for prog in programs:
        target = out if len(programs) == 1 else out.with_name(f"{out.stem}-{_file_safe(prog.name)}{out.suffix}")
        try:
            algo = prog.compile()
            # a built-in collective's postcondition follows from its header; a custom one travels beside it
            side = prog.sidecar(target.name) if algo.coll == "custom" else None
            post = postcondition.parse_sidecar(side, str(target)) if side is not None else None
            problems = checker.problems(algo, post, source=target if side is not None else prog.source)
        except ProgramError as exc:
            problems = [exc]
        if problems:
            status = 1
            print(f"refused: {prog.source} (nothing written to {target})")
            for problem in problems:
                print(f"  {_located(problem)}")
            continue
        try:
            mscclxml.dump(algo, target)
            if side is not None:
                sidecar_path(target).write_text(json.dumps(side, indent=1) + "\n")
        except OSError as exc:
            print(f"{target}: cannot write: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {target}: {algo.name}, {algo.coll}, {algo.ngpus} ranks, "
              f"{sum(len(tb.steps) for r in algo.ranks for tb in r.threadblocks)} steps (checked)")
    return status


def sidecar_path(xml: Path) -> Path:
    """Where a custom collective's postcondition goes: ``X.post.json`` beside ``X.xml``."""
    return xml.with_suffix(".post.json") if xml.suffix == ".xml" else xml.with_name(xml.name + ".post.json")


def _file_safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "program"


def _load(path: str) -> Algorithm | int:
    """The file's program, or an exit status after saying why not."""
    if not Path(path).is_file():
        print(f"{path}: no such file", file=sys.stderr)
        return 2
    try:
        return mscclxml.load(path)
    except ProgramError as exc:
        print(f"refused: {exc}")
        return 1
    except OSError as exc:
        print(f"{path}: cannot read: {exc}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> int:
    algo = _load(args.file)
    if isinstance(algo, int):
        return algo
    try:
        post = postcondition.load_sidecar(args.post) if args.post else None
    except (ProgramError, OSError) as exc:
        print(f"refused: {exc}")
        return 1
    checked = checker.report(algo, post, source=args.file)
    if checked.determinism is None:
        found = checked.problems
        print(f"refused: {args.file} ({len(found)} problem{'s' if len(found) != 1 else ''})")
        for problem in found:
            print(f"  {problem}")
        return 1
    print(f"accepted: {args.file} ({algo.name}: {algo.coll}, {algo.ngpus} ranks, {algo.nchunksperloop} chunks "
          f"per loop, {'in place' if algo.inplace else 'out of place'})")
    first, *why = checked.determinism.explain()
    print(f"determinism: {first}")
    for line in why:
        print(f"  {line}")
    return 0


def random_inputs(algo: Algorithm, count: int, dtype: np.dtype, op: str, seed: int,
                  source: str = "<program>") -> list[np.ndarray]:
    """One random input per rank, sized as the collective wants for ``count``; values kept small
    enough that an integer product or a float sum stays meaningful."""
    rng = np.random.default_rng(seed)
    layouts = layouts_for(algo, count, source)
    out = []
    for r in range(algo.ngpus):
        n = layouts[r].input_elements
        if dtype == np.bool_:
            out.append(rng.integers(0, 2, n).astype(bool))
        elif dtype.kind in "iu":
            low, high = (1, 4) if op == "product" else (0 if dtype.kind == "u" else -50, 50)
            out.append(rng.integers(low, high, n).astype(dtype))
        else:
            out.append(rng.uniform(0.5, 1.5, n).astype(dtype) if op == "product" else
                       rng.uniform(-1.0, 1.0, n).astype(dtype))
    return out


def tolerance(dtype: np.dtype, nranks: int) -> float:
    """Relative and absolute tolerance of a float result: reduction order moves each of the
    ``nranks`` roundings by one unit in the last place."""
    return 0.0 if dtype.kind not in "fc" else 4.0 * nranks * float(np.finfo(dtype).eps)


def _simulate(args: argparse.Namespace) -> int:
    algo = _load(args.file)
    if isinstance(algo, int):
        return algo
    dtype = np.dtype(args.dtype)
    if args.op in BITWISE_OPS and dtype.kind not in "iub":
        print(f"{args.op} needs an integer or bool dtype, got {args.dtype}", file=sys.stderr)
        return 2
    if args.count < 0 or (args.tile_elements is not None and args.tile_elements < 1):
        print("--count must be >= 0 and --tile-elements >= 1", file=sys.stderr)
        return 2
    trace: list[TraceRecord] | None = [] if args.trace else None
    try:
        post = postcondition.for_algorithm(algo, args.post, source=args.file) if algo.coll == "custom" else None
        inputs = random_inputs(algo, args.count, dtype, args.op, args.seed, args.file)
        outputs = simulate(algo, inputs, args.op, tile_elements=args.tile_elements, trace=trace, count=args.count,
                           source=args.file)
        expected = reference(algo, inputs, args.op, count=args.count, post=post, source=args.file)
    except ProgramError as exc:
        if trace:
            print(format_trace(trace))
        print(f"failed: {exc}")
        return 1
    if trace is not None:
        print(format_trace(trace))
    tol = tolerance(dtype, algo.ngpus)
    for r, (got, (want, specified)) in enumerate(zip(outputs, expected, strict=True)):
        if dtype.kind in "fc":
            bad = ~np.isclose(got, want, rtol=tol, atol=tol) & specified
        else:
            bad = (got != want) & specified
        if bad.any():
            e = int(np.flatnonzero(bad)[0])
            print(f"mismatch: {args.file}, rank {r}, output element {e}: got {got[e]!r}, NumPy says {want[e]!r} "
                  f"({int(bad.sum())} of {got.size} elements differ)")
            return 1
    checked = sum(int(s.sum()) for _, s in expected)
    print(f"match: {args.file} ({algo.coll}, {algo.ngpus} ranks, count {args.count}, {args.dtype}, {args.op}): "
          f"{checked} output elements equal NumPy" + (f" within {tol:.1e}" if tol else " exactly"))
    for line in _agreement(algo, outputs, expected, post, args.file, args.dtype, args.op):
        print(f"  {line}")
    return 0


def _agreement(algo: Algorithm, outputs: list[np.ndarray], expected: list[tuple[np.ndarray, np.ndarray]],
               post: postcondition.Postcondition | None, source: str, dtype: str, op: str) -> list[str]:
    """How the ranks' results compare with NumPy's and with each other, and the program's
    determinism class, so an order-dependent program shows what it costs in ulps."""
    lines = []
    if outputs and outputs[0].dtype.kind in "fc":
        against = [spread(got, want, specified) for got, (want, specified) in zip(outputs, expected, strict=True)]
        lines.append("against NumPy: " + ", ".join(f"rank {r} {_gap(s)}" for r, s in enumerate(against)))
    if algo.coll in SAME_OUTPUT_EVERYWHERE and len(outputs) > 1:
        specified = expected[0][1]
        between = {r: spread(got, outputs[0], specified) for r, got in enumerate(outputs) if r}
        differ = [r for r, s in between.items() if s.differing]
        if differ:
            worst = max((between[r] for r in differ), key=lambda s: (s.max_ulp, s.max_abs))
            lines.append(f"between ranks: rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} "
                         f"differ from rank 0 in up to {max(between[r].differing for r in differ)} of "
                         f"{worst.compared} elements, {_gap(worst)}")
        else:
            lines.append("between ranks: every rank's result is bit-identical to rank 0's")
    checked = checker.report(algo, post, source=source)
    if checked.determinism is not None:
        exact = "" if checked.determinism.bitwise or order_sensitive(dtype, op) else \
            f"; {dtype} {op} is exact in any order"
        lines.append(f"determinism: {checked.determinism.explain()[0]}{exact}")
    return lines


def _gap(s: Spread) -> str:
    """A spread as the summary shows it: ``at most 2 ulp (max abs 1.2e-07)``."""
    if not s.differing:
        return "bit-identical"
    return f"at most {s.max_ulp:g} ulp (max abs {s.max_abs:.2g})"


def _list(args: argparse.Namespace) -> int:
    status = _listed(args)
    job = args.job or os.environ.get("COMMD_JOB")
    if job:
        return _list_fabric(job) or status
    return status


def _list_fabric(job: str) -> int:
    """Which programs the job's fabric can run, as its daemons' catalogue sees them."""
    from commd.client.status import StatusError, query_status, resolve_job

    try:
        fabric = query_status(resolve_job(job, None)).get("fabric")
    except StatusError as exc:
        print(f"job {job!r}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(fabric, dict) or not isinstance(fabric.get("algorithms"), dict):
        print(f"job {job!r}: a single node (no fabric) runs no programs: they are the inter-node phase of an op")
        return 0
    catalog, nnodes = fabric["algorithms"], len(fabric.get("nodes") or [])
    print(f"on the fabric of job {job!r} ({nnodes} nodes; programs run ops of groups spanning nodes, on the tcp lane):")
    for name in catalog.get("library") or []:
        print(f"  {name}: {_library_verdict(name, nnodes)}")
    for name, row in sorted((catalog.get("files") or {}).items()):
        fits = row.get("nodes") == nnodes
        verdict = "can run" if fits else f"cannot run: written for {row.get('nodes')} nodes"
        order = f", {ORDER_DEPENDENT}" if row.get("determinism") == ORDER_DEPENDENT else ""
        print(f"  {name} ({row.get('coll')}{order}, from {row.get('path')}, sha256 {str(row.get('sha256'))[:16]}): "
              f"{verdict}" + ("" if fits else f", the fabric has {nnodes} (a group spanning that many nodes)"))
    for row in catalog.get("refused") or []:
        print(f"  {row.get('name')}: refused: {row.get('reason')}")
    return 0


def _library_verdict(name: str, nnodes: int) -> str:
    """Whether the library's program compiles and passes the checker for a group spanning every node."""
    from commd.algorithms import library

    if nnodes < 2:
        return "cannot run: the fabric has one node"
    try:
        algo = library.get(name, nnodes)
        post = postcondition.parse_sidecar(library.sidecar(name, nnodes)) if algo.coll == "custom" else None
        determinism = checker.check(algo, post, source=f"library program {name!r}")
    except (ProgramError, ValueError) as exc:
        return f"cannot run on {nnodes} nodes: {exc}"
    order = "" if determinism.bitwise else f", {ORDER_DEPENDENT}"
    return f"can run ({algo.coll}, checked for {nnodes} nodes{order})"


def _listed(args: argparse.Namespace) -> int:
    try:
        library = importlib.import_module("commd.algorithms.library")
    except ModuleNotFoundError:
        library = None
    if library is not None:
        print("built-in programs:")
        describe = getattr(library, "describe", None)
        for name in library.names():
            entry = describe(name) if describe is not None else None
            if entry is None:
                print(f"  {name}")
                continue
            high = f"{entry.max_bytes} B" if entry.max_bytes else "unbounded"
            print(f"  {name} ({entry.coll}, {entry.min_nodes}+ nodes, sizes {entry.min_bytes} B to {high}): "
                  f"{entry.description}")
    folder = args.dir or os.environ.get(DIR_ENV)
    if not folder:
        if library is None:
            print(f"no built-in programs in this build; name a directory of MSCCL files with --dir or ${DIR_ENV}")
        return 0
    if not Path(folder).is_dir():
        print(f"{folder}: not a directory", file=sys.stderr)
        return 2
    print(f"files in {folder}:")
    for path in sorted(Path(folder).glob("*.xml")):
        try:
            algo = mscclxml.load(path)
            checked = checker.report(algo, source=str(path))
        except ProgramError as exc:
            print(f"  {path.name}: refused: {_located(exc)}")
            continue
        sizes = _size_range(algo)
        if checked.determinism is None:
            status = f"refused: {_located(checked.problems[0])}"
        else:
            status = "accepted" + ("" if checked.determinism.bitwise else f", {ORDER_DEPENDENT}")
        print(f"  {path.name}: {algo.name} ({algo.coll}, {algo.ngpus} ranks{sizes}) {status}")
    return 0


def _located(error: ProgramError) -> str:
    """A refusal without its file name (the listing names the file already)."""
    where = [f"{label} {value}" for label, value in (("rank", error.rank), ("threadblock", error.threadblock),
                                                     ("step", error.step)) if value is not None]
    return ", ".join([*where, error.reason]) if where else error.reason


def _size_range(algo: Algorithm) -> str:
    if algo.min_bytes is None and algo.max_bytes is None:
        return ""
    low = algo.min_bytes or 0
    high = "unbounded" if not algo.max_bytes else f"{algo.max_bytes} B"
    return f", sizes {low} B to {high}"
