"""Which lane runs an op (hint, config rules, tuning table, default), which program runs it on the tcp
lane, and which codec compresses it there.

``choose_lane`` is a pure function of the op's description, the rules and
the lanes' own ``can_run`` answers, so any daemon computing it for the same
op gets the same lane; in a fabric the coordinator computes it once and the
decision travels in the release message.  The same module maps each op kind
to the lane primitive it needs.  (Which thread runs an op, and the exclusion
rule for lanes that must not run at once on one device, are execution's:
``commd.execution.workers.worker_key``.)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from commd.algorithms.catalog import COLL_FOR_KIND
from commd.algorithms.ir import ORDER_DEPENDENT
from commd.core.ops import COMPRESS_MIN_BYTES, COMPRESSED_KINDS, order_sensitive
from commd.kernels.split import split_reduce
from commd.protocol.schema import CODEC_AUTO, LANE_NAMES, NO_CODEC
from commd.scheduler.config import SchedulerConfig
from commd.scheduler.tuning import NATIVE

if TYPE_CHECKING:
    from commd.algorithms.catalog import Catalog, Program

log = logging.getLogger("commd.coordinator")

#: The lane primitive each op kind's inter-node phase uses.
PRIMITIVE_FOR_KIND = {
    "allreduce": "allreduce",
    "reduce": "allreduce",
    "reduce_scatter": "allreduce",
    "broadcast": "broadcast",
    "allgather": "allgatherv",
    "gather": "alltoallv",
    "scatter": "alltoallv",
    "alltoall": "alltoallv",
    "alltonext": "alltoallv",  # (a lane without an AllToNext of its own: blocks to the next node only)
    "barrier": "barrier",
    "send": "send",
    "recv": "send",
    "sendrecv": "send",
}


class LaneCapability(Protocol):
    def can_run(self, primitive: str, dtype: str, reduce_op: str | None, nodes: tuple[int, ...]) -> str | None: ...


class SelectionError(ValueError):
    """No lane can run the op as asked (names the lane and the reason)."""


def choose_lane(
    kind: str,
    dtype: str,
    reduce_op: str | None,
    nbytes: int,
    nodes: tuple[int, ...],
    group_size: int,
    hint: str | None,
    config: SchedulerConfig,
    lanes: dict[str, LaneCapability],
    *,
    variant: str | None = None,
) -> str:
    """The lane for one op: hint, config rules, tuning table, default; SelectionError if a hint cannot be honoured.

    ``variant``: the op's uneven variant (``tuning.UNEVEN_VARIANT``: ``alltoallv`` for an
    all-to-all whose node-to-node blocks differ), which has table cells of its own and which a
    rule may name instead of the kind; None for any other op."""
    primitive = PRIMITIVE_FOR_KIND[kind]
    op = split_reduce(reduce_op).lane_op if primitive == "allreduce" and reduce_op else None
    prim_dtype = dtype if primitive in ("allreduce",) else "uint8"

    def why_not(name: str) -> str | None:
        lane = lanes.get(name)
        if lane is None:
            return f"lane '{name}' is not available in this fabric (available: {sorted(lanes)})"
        return lane.can_run(primitive, prim_dtype, op, nodes)

    if hint:
        reason = why_not(hint)
        if reason is not None:
            raise SelectionError(f"{kind} asked for lane '{hint}', which cannot run it: {reason}")
        return hint
    for rule in config.rules:
        if rule.matches(kind, nbytes, group_size, variant) and why_not(rule.lane) is None:
            return rule.lane
    if config.table is not None:
        tuned = config.table.lookup(variant or kind, nbytes, len(nodes))
        if tuned is not None and why_not(tuned) is None:
            return tuned
    for name in (config.default_lane, *LANE_NAMES):
        if why_not(name) is None:
            return name
    raise SelectionError(f"no lane can run {kind} of {dtype}" + (f" with {reduce_op}" if reduce_op else ""))


def lossy_codec(choice: str) -> bool:
    """Whether the codec an op names (``NAME`` or ``NAME/per-hop``) loses precision."""
    from commd.codecs import parse_choice

    return parse_choice(choice)[0].lossy


def choose_codec(kind: str, dtype: str, nbytes: int, nodes: tuple[int, ...], group_size: int, asked: str,
                 lane: str, program: object, config: SchedulerConfig) -> str | None:
    """The codec an op is released with (None: it runs uncompressed).

    ``asked`` is the op's agreed codec field: a codec named there is released as it is (agreement
    checked that it takes the dtype; the caller refused it with another lane, or lossy with a
    program: a lossless one codes the program's transfers); "none"
    never compresses; "" lets the ``[[compression]]`` rules, then the tuning table, choose a
    lossless codec, "auto" any codec.  Only ops of a compressed kind, on the tcp lane without a
    program, of at least ``COMPRESS_MIN_BYTES`` (an all-gather: its whole output) compress, and a
    chosen codec must take the op's dtype: an automatic choice never makes an op fail."""
    if asked == NO_CODEC or kind not in COMPRESSED_KINDS or lane != "tcp" or nbytes < COMPRESS_MIN_BYTES:
        return None
    if asked not in ("", CODEC_AUTO):
        return asked  # (with a program: a lossless codec, the caller refused a lossy one)
    if program is not None:  # the daemons never add a codec to a program on their own
        return None
    from commd.codecs import get

    lossy = asked == CODEC_AUTO

    def fits(name: str) -> bool:
        codec = get(name)
        return (lossy or not codec.lossy) and dtype in codec.dtypes

    for rule in config.codec_rules:
        if rule.matches(kind, nbytes, group_size):
            if rule.codec == NO_CODEC:
                return None
            if fits(rule.codec):
                return rule.codec
    if config.table is not None:
        for name in config.table.lookup_codecs(kind, nbytes, len(nodes), lossy):
            if fits(name):
                return name
    return None


def choose_algorithm(
    kind: str,
    dtype: str,
    reduce_op: str | None,
    nbytes: int,
    nodes: tuple[int, ...],
    group_size: int,
    hint: str | None,
    lane: str,
    config: SchedulerConfig,
    catalog: Catalog | None,
    unfit: str | None = None,
    *,
    library_ranges: bool = False,
    variant: str | None = None,
) -> Program | None:
    """The program that runs an op on the tcp lane: the hint, then ``[[algorithms]]`` rules, then the
    tuning table's algorithm, then a program whose own size range holds the op, then None (the
    lane's own algorithm).

    SelectionError if a hint cannot be honoured; a rule, table entry or ranged program that
    cannot run the op is skipped with its reason in the log, never silently.  An order-dependent
    program (``Program.determinism``) cannot run an op whose result depends on the order
    (:func:`order_refusal`) unless the rule that names it allows it.  ``unfit``: why no
    program can run this op whatever its name (e.g. an all-to-all of unequal blocks); ``variant``:
    the kind the table is consulted for, as in :func:`choose_lane` (its ``alltoallv`` cells name
    no program, so an uneven all-to-all is not offered the even cells' one).  The size
    range step considers user files that state ``minBytes``/``maxBytes``; the library's programs
    (ranges from ``library.describe``) join it only with ``library_ranges``, because a library
    program in the small range would take tiny all-reduces off the native path, which fuses them
    and lets the coordinator reduce them itself.
    """
    primitive = PRIMITIVE_FOR_KIND[kind]
    op = split_reduce(reduce_op).lane_op if primitive == "allreduce" and reduce_op else None
    if hint:
        if lane != "tcp":
            raise SelectionError(f"{kind} asked for algorithm {hint!r}, but programs run on the tcp lane and "
                                 f"the op's lane is {lane!r}")
        if catalog is None:
            raise SelectionError(f"{kind} asked for algorithm {hint!r}, but the coordinator has no programs")
        found = unfit or catalog.runnable(hint, kind, len(nodes), dtype, op)
        if not isinstance(found, str):
            found = order_refusal(found, dtype, reduce_op if op else None) or found
        if isinstance(found, str):
            raise SelectionError(f"{kind} asked for algorithm {hint!r}, which cannot run it: {found}")
        return found
    if lane != "tcp" or catalog is None:
        return None

    def usable(name: str, step: str, allow_order_dependent: bool = False) -> Program | None:
        found = unfit or catalog.runnable(name, kind, len(nodes), dtype, op)
        if not isinstance(found, str) and not allow_order_dependent:
            found = order_refusal(found, dtype, reduce_op if op else None) or found
        if isinstance(found, str):
            log.warning("algorithm %s for %r skipped for %s of %d bytes on %d nodes: %s", step, name, kind,
                        nbytes, len(nodes), found)
            return None
        return found

    for rule in config.algorithm_rules:
        if rule.matches(kind, nbytes, group_size):
            found = usable(rule.name, "rule", rule.allow_order_dependent)
            if found is not None:
                return found
    if config.table is not None:
        tuned = config.table.lookup_algorithm(variant or kind, nbytes, len(nodes))
        if tuned == NATIVE:
            return None  # measured: the lane's own algorithm is the fastest here
        if tuned is not None:
            found = usable(tuned, "from the tuning table")
            if found is not None:
                return found
    coll = COLL_FOR_KIND.get(kind)
    for name in ranged_candidates(catalog, library_ranges):
        program = catalog.get(name, len(nodes))
        if isinstance(program, str) or program.algo.coll != coll:
            continue  # (refused at load, logged then; or another collective's program: not a candidate)
        if in_size_range(program.algo.min_bytes, program.algo.max_bytes, nbytes):
            found = usable(name, "by its size range")
            if found is not None:
                return found
    return None


def order_refusal(program: Program, dtype: str, reduce_op: str | None) -> str | None:
    """Why ``program`` may not run a ``dtype`` op reduced with ``reduce_op`` (None: it may): an
    order-dependent program's nodes reduce in different orders, which an op whose result depends
    on the order (``core.ops.order_sensitive``: float sum, avg, product) cannot afford, since
    every node must end with the same bits."""
    if program.determinism != ORDER_DEPENDENT or not order_sensitive(dtype, reduce_op):
        return None
    return (f"algorithm {program.name!r} is {ORDER_DEPENDENT} (its nodes reduce in different orders) and a "
            f"{dtype} {reduce_op} must be bit-identical on every node; integer dtypes and min, max, band, bor, "
            "bxor may use it (an [[algorithms]] rule with allow_order_dependent = true may choose it anyway)")


def ranged_candidates(catalog: Catalog, library_ranges: bool) -> list[str]:
    """Names the size-range step tries, in order: the user's files (sorted), then the library's."""
    files = sorted(catalog.files)
    return files + [name for name in catalog.names() if name not in catalog.files] if library_ranges else files


def in_size_range(min_bytes: int | None, max_bytes: int | None, nbytes: int) -> bool:
    """Whether a program's own range holds ``nbytes`` (``max_bytes`` 0 is unbounded, as on MSCCL's
    newer runtimes).  A program that states no range, or the whole line (0..0, as many MSCCL files
    do), says nothing about where it pays off: the range step never chooses it (a hint or a rule
    still can), else one such file would take every op off the native path."""
    if not min_bytes and not max_bytes:
        return False
    if min_bytes is not None and nbytes < min_bytes:
        return False
    return not max_bytes or nbytes <= max_bytes
