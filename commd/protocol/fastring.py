"""The layout of a local group's exchange ring: shared memory the daemon creates and the ranks share.

Why it exists: a tiny all-reduce through the daemon costs three process wake-ups
(rank → daemon, daemon → each rank) and the daemon's per-op Python work; on a node
whose cores the ranks share with the daemon that is 100+ µs, while two ranks that
meet in shared memory need a few.  For a group whose ranks are all on this node the
daemon hands every member the same sealed memfd (``FASTRING`` on the op socket, the
descriptor beside the reply); the ranks then exchange small all-reduces there without
the daemon on the path (``commd/client/fastring.py``).

Layout (native byte order, every field naturally aligned):

- bytes 0..63: the region header: ``magic`` u64, ``version`` u32, ``nranks`` u32,
  ``depth`` u32, ``slot_bytes`` u32, ``large_depth`` u32, ``large_bytes`` u32,
  ``bridged`` u32 (1: the group spans nodes and the last of the ``nranks`` lines is the
  *bridge*, see below), ``tracing`` u32 at byte 36 (1 while the daemon writes a
  trace: the first rank's line then sends each op's times to the daemon, which traces it
  as it traces its own ops);
- a 64-byte control line per group rank ``r`` at ``CONTROL_OFFSET + 64 r``: ``pid``
  i64 (written when the rank maps the region), ``posted`` i64 (the last op number it
  published), ``consumed`` i64 (the last op whose inputs it has read), ``bell`` u32
  (bumped on every change of ``posted``/``consumed``: the futex word peers sleep on),
  ``sleeping`` i64 at byte 32 (how many of the rank's threads sleep on a peer's bell: a
  rank that bumps its bell makes the futex call only when some peer sleeps),
  ``submitted`` i64 at byte 40 (how many collectives of the group the rank has
  submitted, through the ring or the daemon; written after ``posted``), ``abandoned``
  i64 at byte 48 (1 once the rank has left the ring: every rank then follows it to the
  daemon path), and in the bridge's line ``failed`` i64 at byte 56 (see ``FAILED``);
- ``depth × nranks`` entries at ``entries_offset``: entry (k mod depth, r) is a 64-byte
  header — ``seq`` i64 (the op number k), ``dtype`` i64 (index into ``DTYPES``),
  ``op`` i64 (index into ``REDUCE_OPS``), ``count`` i64, ``where`` i64 (0: the data
  follows in the entry's ``slot_bytes``; j + 1: it is in the rank's large slot j),
  ``index`` i64 (the op's place among the group's collectives, ``submitted`` after it: the
  group's one collective number plus one, the same on the ring and on the daemon path),
  ``state`` i64 (0; ``WITHDRAWING`` while the poster decides that its op timed out;
  ``WITHDRAWN`` once it did) and ``verdict`` i64 (a withdrawn op's missing lines as a bit
  mask, and its timeout in milliseconds from bit 16) — and ``slot_bytes`` of data;
- ``large_depth × nranks`` large slots of ``large_bytes`` at ``large_offset``: an op
  larger than a slot (up to ``large_bytes``) keeps its header in its entry and its data
  in the poster's next large slot, which the poster reuses only once every rank has
  consumed the op that last used it.

A rank may publish op k only once every rank has consumed op k - depth.

A timeout is one decision, taken by the rank that times out and seen by every rank
(``commd/client/fastring.py``): the rank marks its entry ``WITHDRAWING``, then reads the
others' ``posted``; if all posted the op, it clears the mark and the op completes as usual;
else it marks the entry ``WITHDRAWN`` and fails its op.  A rank that finds every input
posted reads the marks after its own ``posted``: ``WITHDRAWN`` anywhere fails its op too (a
late op fails on arrival, as on the daemon path), ``WITHDRAWING`` waits for the verdict.
x86's store order makes the two sides see at least one of each other's stores (the
classic store-buffer pattern, with a fence between each side's store and load), so no
rank can complete an op that another rank has failed.  Later ops are unaffected.  A rank whose
op k (the group's collective number i) is missing while its ``submitted`` has reached i
sent that collective to the daemon: the ranks disagree on the op, and those in the ring
tell the daemon (see ``commd/client/fastring.py``).

A group that spans nodes gets a *bridged* ring on each of its nodes: the lines are the
node's members of the group, then the bridge line (``memory/ringbridge.py``), played by the
daemon or by the node's first rank of the group.  Ranks
publish as above; the rank that sees every local rank published tells the bridge
(``RINGOP`` on its op channel, or a notice datagram); the bridge reduces the local inputs,
exchanges that contribution with the group's other nodes and publishes the result as
the bridge's entry (its header as the ranks' headers; ``where`` = -(1 + i) instead when
the op failed with ``BRIDGE_ERRORS[i]``, the data then the UTF-8 reason, ``count`` its
length).  When the bridge fails one op (it names it in ``failed``), the ranks fail that op
and hand the ops around it, whose results it will never publish, to their daemon under
their own numbers: they run as they would have on the daemon path.  The ranks copy the
bridge's entry out instead of reducing.  An op larger than a slot (up to ``bridged_max_bytes``,
when the ring's ``large_bytes`` leaves room: a rank's bridge) keeps its inputs in
the ranks' large slots as above, and the bridge publishes its result in its own large slot
of the same index (``where`` as theirs).  The bridge's failure reason (a u32 length, then
the UTF-8 bytes) lives in the last ``REASON_RESERVE`` bytes of its first large slot
(``reason_offset``), where no result reaches: a rank may still be copying one out.
"""

from __future__ import annotations

from collections.abc import Sequence

MAGIC = 0x676E6972646D6D63  # "cmmdring"
VERSION = 5
HEADER_BYTES = 64
CONTROL_OFFSET = 64
CONTROL_BYTES = 64
ENTRY_HEADER_BYTES = 64
#: Ops up to this many bytes are carried in the entry itself.
SLOT_BYTES = 64 << 10
DEPTH = 8
#: Larger ops, up to ``large_bytes(nranks)``, in large slots: this many per rank.
LARGE_DEPTH = 2
#: A rank reduces every rank's input itself, so the largest ring op shrinks as the group grows:
#: what one rank reads per op stays at this (measured: ``benchmarks/allreduce.py``).
LARGE_READ_BYTES = 8 << 20
#: The end of a bridged ring's first large slot of the bridge line: its failure reason (see above).
REASON_RESERVE = 8 << 10
#: The largest op a bridged ring takes.  Past it the daemons' path was faster (2 simulated hosts x
#: 2 ranks on 2 cores, 2026-11-30: the rank's bridge 2,543 against 2,858 µs at 512 KiB, 3,843
#: against 3,388 at 1 MiB; ``docs/performance.md``).
BRIDGED_MAX_BYTES = 512 << 10
#: Groups with more local ranks than this keep the daemon path (region size grows with n).
MAX_RANKS = 8

#: Why a bridged op failed (the bridge's ``where`` = -(1 + index)); the names are the daemon's error codes.
BRIDGE_ERRORS = ("mismatch", "peer_died", "timeout", "internal", "diverged")

# Control line fields: i64 indices inside a rank's line, and the bell's byte offset.
PID, POSTED, CONSUMED, SLEEPING, SUBMITTED, ABANDONED = 0, 1, 2, 4, 5, 6
#: A rank line's ``ABANDONED``: 0 while in the ring; ``LEFT`` once it left; ``DEAD_LINE + r`` when it
#: left because line r's process died (so the ranks that follow it out name the dead rank too).
LEFT, DEAD_LINE = 1, 2
#: The bridge's line only: the collective index (an entry's ``INDEX``) of the op it failed, written
#: before ``abandoned``; 0: the failure names no op (every op from its next result fails).
FAILED = 7
BELL_OFFSET = 24
# Entry header fields (i64 indices inside an entry's header).
SEQ, DTYPE, OP, COUNT, WHERE, INDEX, STATE, VERDICT = 0, 1, 2, 3, 4, 5, 6, 7
#: ``STATE`` values: the poster is deciding that its op timed out; it did (the op failed on every rank).
WITHDRAWING, WITHDRAWN = 1, 2
#: ``VERDICT``: the missing lines' bit mask below this bit, the op's timeout in milliseconds above it.
VERDICT_TIMEOUT_SHIFT = 16

#: The header's ``tracing`` word (a u32 index into the region).
TRACING_U32 = 36 // 4
#: A rank sends its traced ring ops to the daemon in batches of at most this many, or this old.
TRACE_BATCH, TRACE_BATCH_S = 16, 0.05

#: Wire codes of the entry header: the position in these tuples.
DTYPES = (
    "float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
    "complex64", "complex128",
)
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")


#: The entry header fields every rank of an op must agree on, as the scheduler names them
#: (scheduler/agreement.py): (name, i64 index in the header, the names of its codes or None).
AGREED = (("dtype", DTYPE, DTYPES), ("count", COUNT, None), ("reduce_op", OP, REDUCE_OPS))


def differences(rows: Sequence[Sequence[int]], ranks: Sequence[Sequence[int]],
                fields: Sequence[tuple[str, int, tuple[str, ...] | None]] = AGREED) -> list[str]:
    """The ``fields`` on which entry headers ``rows`` (i64 words from ``SEQ`` on) differ, worded as the
    scheduler words a mismatch: "'count' differs: ranks [0] 4, ranks [1] 5"; ``ranks[i]``: the group
    ranks behind row i."""
    problems = []
    for name, index, names in fields:
        shown: dict[str, list[int]] = {}
        for row, who in zip(rows, ranks, strict=True):
            value = row[index]
            label = names[value] if names is not None and 0 <= value < len(names) else value
            shown.setdefault(repr(label), []).extend(who)
        if len(shown) > 1:
            problems.append(f"'{name}' differs: " + ", ".join(f"ranks {rs} {v}" for v, rs in shown.items()))
    return problems


def entries_offset(nranks: int) -> int:
    """Where the entries start: after the control lines, page aligned."""
    end = CONTROL_OFFSET + CONTROL_BYTES * nranks
    return (end + 4095) // 4096 * 4096


def entry_bytes(slot_bytes: int) -> int:
    return ENTRY_HEADER_BYTES + slot_bytes


def large_bytes(nranks: int) -> int:
    """The largest op a ring of ``nranks`` takes (page multiple, never below a slot)."""
    return max(SLOT_BYTES, LARGE_READ_BYTES // nranks // 4096 * 4096)


def bridged_large_bytes(local_ranks: int, nodes: int) -> int:
    """The large slot of a bridged ring across ``nodes`` nodes, at most ``local_ranks`` on one (the
    same on every node: each must bridge the same ops).  Its bridge reads every local input and
    every other node's part of an op, so that read stays within ``LARGE_READ_BYTES``; the op within
    ``BRIDGED_MAX_BYTES`` and never below a slot; the reason's room is added."""
    share = LARGE_READ_BYTES // (local_ranks + nodes - 1) // 4096 * 4096
    return max(SLOT_BYTES, min(share, BRIDGED_MAX_BYTES)) + REASON_RESERVE


def bridged_max_bytes(slot_bytes: int, large: int) -> int:
    """The largest op a bridged ring with large slots of ``large`` bytes takes."""
    return max(slot_bytes, large - REASON_RESERVE)


def reason_offset(nranks: int, depth: int, slot_bytes: int, large: int) -> int:
    """Where a bridged ring's bridge (the last line) writes why it failed."""
    return large_slot_offset(nranks, depth, slot_bytes, large, 0, nranks - 1) + large - REASON_RESERVE


def large_offset(nranks: int, depth: int, slot_bytes: int) -> int:
    """Where the large slots start: after the entries, page aligned."""
    end = entries_offset(nranks) + depth * nranks * entry_bytes(slot_bytes)
    return (end + 4095) // 4096 * 4096


def region_bytes(nranks: int, depth: int = DEPTH, slot_bytes: int = SLOT_BYTES, large_depth: int = LARGE_DEPTH,
                 large: int | None = None) -> int:
    """The whole region's size (what the daemon creates and the client checks)."""
    large = large_bytes(nranks) if large is None else large
    return large_offset(nranks, depth, slot_bytes) + large_depth * nranks * large


def large_slot_offset(nranks: int, depth: int, slot_bytes: int, large: int, index: int, rank: int) -> int:
    return large_offset(nranks, depth, slot_bytes) + (index * nranks + rank) * large


def entry_offset(nranks: int, depth: int, slot_bytes: int, seq: int, rank: int) -> int:
    return entries_offset(nranks) + ((seq % depth) * nranks + rank) * entry_bytes(slot_bytes)
