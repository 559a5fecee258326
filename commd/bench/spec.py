"""What a benchmark run measures: ops, sizes, lanes, iteration counts, and the bandwidth formulas.

The orchestrator (`commd bench`) and the worker (`python -m commd.bench.worker`
under `commd launch`) take the same measurement options, defined and
validated here once, so a user's own launch of the worker behaves exactly
like the orchestrated one.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from commd.protocol.schema import LANE_NAMES
from commd.scheduler.tuning import format_bytes

#: Every op the benchmark knows, in the order tables list them.
OPS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "alltoallv", "alltonext", "reduce",
       "sendrecv", "barrier")
#: Accepted spellings of op names (torch / nccl-tests style).
OP_ALIASES = {
    "all_reduce": "allreduce", "all_gather": "allgather", "reducescatter": "reduce_scatter",
    "all_to_all": "alltoall", "all_to_all_v": "alltoallv", "send_recv": "sendrecv", "p2p": "sendrecv",
    "all_to_next": "alltonext",
}
#: ``auto``: no lane hint (the daemons' own choice, tuning table included); ``all``: every lane of the fabric.
LANE_WORDS = ("auto", "all")
#: Label of the only commd path on a single node (no inter-node lane exists there).
LOCAL = "local"
COMPARE = ("gloo", "mpi")
DTYPES = ("float32", "float64", "float16", "int32", "int64")
#: Ops that a program can run (on the tcp lane); ``--algorithms`` adds paths for these only (not
#: alltoallv: programs run all-to-alls whose nodes send each other equal bytes).
ALGORITHM_OPS = ("allreduce", "allgather", "alltoall", "alltonext")
#: Ops ``--compression`` adds codec paths for.
COMPRESSED_OPS = ("broadcast", "allgather", "allreduce")
#: The tcp lane's own algorithm (no ``algo=`` hint); ``all``: native and every library program of the op.
NATIVE = "native"
ALGORITHM_WORDS = (NATIVE, "all")
_ALGO_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")
#: The root of rooted ops (broadcast, reduce) and the first side of sendrecv.
ROOT = 0

DEFAULT_OPS = ("allreduce",)
DEFAULT_MIN_BYTES = 1 << 10
DEFAULT_MAX_BYTES = 16 << 20
DEFAULT_STEP = 4
DEFAULT_WARMUP = 3
DEFAULT_ITERS = 20
DEFAULT_OP_TIMEOUT = 60.0
#: Largest message: the arena of each rank holds an op's input and output.
MAX_BYTES_LIMIT = 1 << 30


class SpecError(ValueError):
    """Invalid benchmark options; the message says which and why."""


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor: what each rank's link must carry relative to S.

    alltoallv (S: the largest rank's buffer) takes all-to-all's, so that at one S an alltoallv
    row and an alltoall row compare directly: the same busbw is the same time."""
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("allgather", "reduce_scatter", "alltoall", "alltoallv"):
        return (n - 1) / n
    if op == "barrier":
        return 0.0
    return 1.0  # broadcast, reduce, sendrecv, alltonext (each rank's link carries its buffer once)


_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}


def parse_size(text: str) -> int:
    """'4096', '1K', '4M', '1GiB' -> bytes (binary units)."""
    m = _SIZE.match(str(text))
    if not m:
        raise SpecError(f"size {text!r} is not a byte count such as 4096, 1K, 4M or 1G")
    return int(m.group(1)) << _UNITS[m.group(2).lower()]


def human(nbytes: int) -> str:
    """'4K', '16M': how size options are written."""
    return format_bytes(nbytes, compact=True)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def message_sizes(low: int, high: int, step: int) -> list[int]:
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= step
    return sizes


def split_list(text: str) -> list[str]:
    return [part.strip().lower() for part in str(text).split(",") if part.strip()]


@dataclass
class BenchSpec:
    """Validated measurement options (JSON-able: the report records them)."""

    ops: list[str]
    sizes: list[int]
    lanes: list[str] | None  # None: "auto" plus every lane of the fabric
    warmup: int
    iters: int
    time_per_size: float | None
    dtype: str
    compare: list[str]
    op_timeout: float
    extra: dict[str, Any] = field(default_factory=dict)
    blocks: bool = False  # time each path's iterations in one block instead of in alternation
    algorithms: list[str] | None = None  # tcp-lane programs to measure (NATIVE: no hint); None: none
    compression: list[str] | None = None  # codecs of the compressed ops' tcp paths (one path each); None: none
    #: node counts of the groups measured, each the first g nodes with all their ranks, ascending (the job's
    #: own count: the whole job); None: not given, the whole job only (``commd tune``: ``sweep_group_nodes``)
    group_nodes: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def add_measure_arguments(parser: argparse.ArgumentParser, *, ops_default: str = ",".join(DEFAULT_OPS),
                          lanes_default: str = "auto,all", step_default: int = DEFAULT_STEP,
                          max_default: int = DEFAULT_MAX_BYTES, algorithms_default: str = "") -> None:
    """The options both the orchestrator and the worker accept."""
    parser.add_argument("--ops", default=ops_default,
                        help=f"comma-separated ops: {','.join(OPS)} (default {ops_default})")
    parser.add_argument("--min-bytes", default=human(DEFAULT_MIN_BYTES),
                        help="smallest message S, a power of two such as 1K (default 1K)")
    parser.add_argument("--max-bytes", default=human(max_default),
                        help=f"largest message S, a power of two (default {human(max_default)})")
    parser.add_argument("--step-factor", type=int, default=step_default,
                        help=f"each size is the previous times this power of two (default {step_default})")
    parser.add_argument("--lanes", default=lanes_default,
                        help="comma-separated commd lanes: auto (no hint: the daemons' choice incl. the tuning "
                             "table), tcp, gloo, mpi, nccl, or all (every lane the fabric has); "
                             f"default {lanes_default}. A single node has no lanes: its rows say 'local'")
    parser.add_argument("--algorithms", default=algorithms_default,
                        help="comma-separated programs to run all-reduce and all-to-all with on the tcp lane, one "
                             "path each (commd-tcp/NAME): native (the lane's own algorithm, no hint), a library "
                             "program (oneshot, twoshot, halving_doubling, ring, alltoall, ...) or a file of the "
                             "daemons' algorithms directory; all: native and every library program of the op"
                             + (f" (default {algorithms_default})" if algorithms_default else " (default: none)"))
    parser.add_argument("--compression", default="",
                        help="comma-separated codecs (bf16, bf16-cast, lossless, lossless-zstd, fp16) to broadcast, "
                             "all-gather and all-reduce with on the tcp lane, one path each (commd-tcp+CODEC); every "
                             "commd path of those ops then moves model-like float32 data (broadcasts and all-gathers "
                             "checked against the data or its rounding, all-reduces within the codec's bound per hop); "
                             "CODEC/per-hop: the broadcast baseline that decodes and codes again at every hop "
                             "(default: none)")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                        help="untimed iterations per size and path after the checked one (default %(default)s)")
    parser.add_argument("--iters", type=int, default=DEFAULT_ITERS,
                        help="timed iterations per size and path; with --time-per-size the most (default "
                             "%(default)s)")
    parser.add_argument("--time-per-size", type=float, default=None, metavar="SECONDS",
                        help="adaptive: as many timed iterations as fit in SECONDS (at least 3, at most --iters)")
    parser.add_argument("--dtype", default="float32", help=f"element type: {','.join(DTYPES)} (default float32)")
    parser.add_argument("--compare", default="",
                        help="also run the ops through gloo (torch.distributed) and/or mpi (mpi4py) directly, "
                             "e.g. --compare gloo,mpi")
    parser.add_argument("--op-timeout", type=float, default=DEFAULT_OP_TIMEOUT,
                        help=f"seconds one op may wait for its peers (default {DEFAULT_OP_TIMEOUT:g})")
    parser.add_argument("--group-nodes", default="",
                        help="comma-separated node counts g of the groups to measure the ops on, e.g. 2,4: each "
                             "group is the first g nodes with all their ranks (the job's node count: the whole "
                             "job); each g a power of two or the job's node count, 2 <= g <= nodes. Default: the "
                             "whole job only (commd tune: the whole job and every power of two below it)")
    parser.add_argument("--blocks", action="store_true",
                        help="time each path's iterations in one block (default: the paths of a size in "
                             "alternation, iteration by iteration, so they see the same machine load)")


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    """Validate the shared options; SpecError names the option and the problem."""
    ops: list[str] = []
    for name in split_list(args.ops):
        op = OP_ALIASES.get(name, name)
        if op not in OPS:
            raise SpecError(f"--ops: unknown op {name!r}; choose from {','.join(OPS)}")
        if op not in ops:
            ops.append(op)
    if not ops:
        raise SpecError("--ops: give at least one op")
    low, high = parse_size(args.min_bytes), parse_size(args.max_bytes)
    for what, value in (("--min-bytes", low), ("--max-bytes", high)):
        if not _is_pow2(value):
            raise SpecError(f"{what} {value} is not a power of two")
    if low > high:
        raise SpecError(f"--min-bytes {human(low)} is larger than --max-bytes {human(high)}")
    if high > MAX_BYTES_LIMIT:
        raise SpecError(f"--max-bytes {human(high)} is above the limit {human(MAX_BYTES_LIMIT)}")
    if args.step_factor < 2 or not _is_pow2(args.step_factor):
        raise SpecError(f"--step-factor {args.step_factor} must be a power of two >= 2")
    lanes_raw = split_list(args.lanes)
    if not lanes_raw:
        raise SpecError("--lanes: give at least one lane (or auto)")
    for lane in lanes_raw:
        if lane not in LANE_NAMES + LANE_WORDS + (LOCAL,):
            raise SpecError(f"--lanes: unknown lane {lane!r}; choose from {','.join(LANE_WORDS + LANE_NAMES)}")
    lanes = None if lanes_raw == ["auto", "all"] else list(dict.fromkeys(lanes_raw))
    if args.warmup < 0:
        raise SpecError("--warmup must be >= 0")
    if args.iters < 1:
        raise SpecError("--iters must be >= 1")
    if args.time_per_size is not None and not args.time_per_size > 0:
        raise SpecError("--time-per-size must be > 0 seconds")
    dtype = args.dtype.strip().lower()
    if dtype not in DTYPES:
        raise SpecError(f"--dtype {args.dtype!r}: choose from {','.join(DTYPES)}")
    compare = split_list(args.compare)
    for name in compare:
        if name not in COMPARE:
            raise SpecError(f"--compare: unknown peer {name!r}; choose from {','.join(COMPARE)}")
    if not 0.1 <= args.op_timeout <= 86400:
        raise SpecError("--op-timeout must lie in [0.1, 86400] seconds")
    algorithms = parse_algorithms(getattr(args, "algorithms", "") or "")
    if algorithms and not any(op in ALGORITHM_OPS for op in ops):
        raise SpecError(f"--algorithms: programs run {','.join(ALGORITHM_OPS)} only; --ops has none of them")
    compression = parse_compression(getattr(args, "compression", "") or "")
    if compression and not set(ops) & set(COMPRESSED_OPS):
        raise SpecError(f"--compression: {', '.join(COMPRESSED_OPS)} compress; --ops has none of them")
    if compression and dtype != "float32":
        raise SpecError(f"--compression measures model-like float32 data; --dtype is {dtype}")
    return BenchSpec(ops=ops, sizes=message_sizes(low, high, args.step_factor), lanes=lanes,
                     warmup=args.warmup, iters=args.iters, time_per_size=args.time_per_size, dtype=dtype,
                     compare=list(dict.fromkeys(compare)), op_timeout=args.op_timeout, blocks=args.blocks,
                     algorithms=algorithms, compression=compression,
                     group_nodes=parse_group_nodes(getattr(args, "group_nodes", "") or ""))


def parse_group_nodes(text: str) -> list[int] | None:
    """``--group-nodes``: node counts, ascending, duplicates dropped (None: not given).

    One node is refused: a group on one node never takes a lane (its ops stay in the node's shared
    memory), so it has no cell in a tuning table; ``commd bench`` on this host measures that."""
    counts: list[int] = []
    for part in split_list(text):
        if not part.isdigit():
            raise SpecError(f"--group-nodes: {part!r} is not a node count (give numbers such as 2,4)")
        g = int(part)
        if g < 2:
            raise SpecError(f"--group-nodes {g}: a group measures the lanes between nodes, so it spans at least "
                            "2 nodes (a group on one node takes no lane; `commd bench` on one host measures it)")
        counts.append(g)
    return sorted(set(counts)) or None


def check_group_nodes(counts: list[int], nnodes: int) -> None:
    """Every count fits a job of ``nnodes`` nodes: 2 <= g <= nnodes, a power of two or nnodes itself
    (the group sizes whose table classes a job's groups look up: 2, 3-4, 5-8, ...)."""
    for g in counts:
        if g > nnodes:
            where = "this host is one node (use --hosts H)" if nnodes == 1 else f"the job has {nnodes} nodes"
            raise SpecError(f"--group-nodes {g}: a group cannot span more nodes than the job; {where}")
        if not _is_pow2(g) and g != nnodes:
            raise SpecError(f"--group-nodes {g}: give a power of two or the job's node count ({nnodes})")


def sweep_group_nodes(nnodes: int) -> list[int]:
    """``commd tune``'s groups: every power of two from 2 below ``nnodes``, and the whole job."""
    counts, g = [], 2
    while g < nnodes:
        counts.append(g)
        g *= 2
    return [*counts, nnodes]


def parse_compression(text: str) -> list[str] | None:
    """``--compression``: codec names (``commd.codecs``), each optionally with ``/per-hop``."""
    from commd.codecs import CodecError, parse_choice

    out = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            parse_choice(part)
        except CodecError as exc:
            raise SpecError(f"--compression: {exc} (each optionally /per-hop)") from None
        out.append(part)
    return list(dict.fromkeys(out)) or None


def parse_algorithms(text: str) -> list[str] | None:
    """``--algorithms``: names kept as written (file names are case-sensitive), duplicates dropped."""
    names = [part.strip() for part in str(text).split(",") if part.strip()]
    for name in names:
        if name.lower() in ALGORITHM_WORDS:
            continue
        if not _ALGO_NAME.match(name):
            raise SpecError(f"--algorithms: {name!r} is not an algorithm's name (letters, digits, _ . + -)")
    return list(dict.fromkeys(n.lower() if n.lower() in ALGORITHM_WORDS else n for n in names)) or None


def measure_argv(spec: BenchSpec) -> list[str]:
    """The worker's command-line options for ``spec`` (the inverse of spec_from_args)."""
    argv = ["--ops", ",".join(spec.ops), "--min-bytes", str(spec.sizes[0]), "--max-bytes", str(spec.sizes[-1]),
            "--step-factor", str(spec.sizes[1] // spec.sizes[0] if len(spec.sizes) > 1 else 2),
            "--lanes", ",".join(spec.lanes) if spec.lanes is not None else "auto,all",
            "--warmup", str(spec.warmup), "--iters", str(spec.iters), "--dtype", spec.dtype,
            "--op-timeout", repr(spec.op_timeout)]
    if spec.time_per_size is not None:
        argv += ["--time-per-size", repr(spec.time_per_size)]
    if spec.compare:
        argv += ["--compare", ",".join(spec.compare)]
    if spec.blocks:
        argv.append("--blocks")
    argv += ["--algorithms", ",".join(spec.algorithms or [])]
    argv += ["--compression", ",".join(spec.compression or [])]
    if spec.group_nodes:
        argv += ["--group-nodes", ",".join(map(str, spec.group_nodes))]
    return argv
