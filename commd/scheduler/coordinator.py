"""The fabric's coordinator: agree on multi-node ops and release one global order.

Runs in node 0's daemon and does no I/O; it takes and emits only the typed
messages of ``protocol/fabric.py``.  Daemons *report* ops whose local
ranks are all ready; when every node of the op's group has reported, the
coordinator checks that they agree (kind, dtype, count, reduce op, root,
membership...), gives the op the next number of the global order, chooses
its lane and *releases* it to those nodes.  Each daemon hands released ops
to its lanes in the order they arrive — one coordinator, one FIFO channel per
daemon — so every lane sees its ops in the same global order on every node.

Fast path (Horovod's response cache): the first time a pattern is agreed it
gets a cache id that travels in the release; a daemon that sees the same
pattern again reports only ``(group, seq, cache id)``.  When every node sends
the same id the coordinator skips the comparison and the lane choice.

Compression: with the lane and the program the coordinator decides the op's codec
(``selection.choose_codec``: the one the op names, or for an op that lets the daemons
choose, a ``[[compression]]`` rule's, then the tuning table's) and releases it in
``Go.codec``; every node runs the released codec, and a compressed op is never fused.

Uneven all-to-alls: an all-to-all whose nodes send each other different byte counts
(``_UNFIT["alltoall"]``, the test that also keeps programs off it) is decided as its
variant ``alltoallv``: by the tuning table's alltoallv cells (its alltoall cells where the
table has none) and by lane rules naming either kind.  The test reads every node's report,
so the decision is one per op, made here, the same for every rank.

Fusion (Horovod's tensor fusion): small all-reduces of one group, dtype,
reduce op and lane released one after the other in the same dispatch are
marked as one fused set (``Go.fused_with``: the order number of the set's first op),
up to the fusion threshold in bytes.  The nodes run a set as one lane call
on one buffer, at the place of its first op in the global order.  Any other
item in between (another group's release, a failure) closes the set, so a
set is a run of consecutive numbers of the global order and every node
receives it whole, in one message.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from commd.kernels import eager
from commd.observe.stats import FabricStats
from commd.protocol import schema as s
from commd.protocol.fabric import (
    Early,
    Fail,
    Go,
    NodeDead,
    OpPattern,
    P2pFail,
    P2pGo,
    P2pMatch,
    P2pSend,
    RankDied,
    Ready,
    ReadySet,
    RemoteSend,
    Schedule,
    ScheduleEnded,
    ScheduleSlot,
    SendFailed,
    StopSchedule,
    ToMember,
)
from commd.runtime import env_int
from commd.scheduler.agreement import frozen
from commd.scheduler.config import SchedulerConfig
from commd.scheduler.cycles import CycleDetector
from commd.scheduler.selection import (
    LaneCapability,
    SelectionError,
    choose_algorithm,
    choose_codec,
    choose_lane,
    lossy_codec,
)
from commd.scheduler.tree import Ranges, members, ranges_of, size, union
from commd.scheduler.tuning import UNEVEN_VARIANT

log = logging.getLogger("commd.coordinator")

#: Cache ids handed out at most (a job has a few hundred distinct op patterns).
MAX_CACHE_ENTRIES = 1 << 16
#: Ops in one fused set at most (bounds the per-op bookkeeping a node does before the lane call).
MAX_FUSED_OPS = 1024
#: The node whose daemon hosts the coordinator: its reports cost no network trip.
HOME_NODE = 0
#: How many timed-out ops the coordinator remembers (a late report of one fails on arrival).
EXPIRED_KEPT = 1024


@dataclass
class Pending:
    group: str
    seq: int
    nodes: tuple[int, ...]
    members: frozenset[int] = frozenset()  # the nodes, for membership tests (a tuple scan per report is O(N))
    entries: dict[int, OpPattern] = field(default_factory=dict)  # node -> its full report
    #: Relays' merged reports (control tree): (cache id, the nodes as ranges), and all their nodes together.
    sets: list[tuple[int, Ranges]] = field(default_factory=list)
    set_nodes: Ranges = ()
    cids: dict[int, int] = field(default_factory=dict)  # node -> cache id it sent
    data: dict[int, bytes] = field(default_factory=dict)  # node -> its contribution (tiny all-reduces)
    first_at: float = field(default_factory=time.monotonic)
    timeout: float = 30.0
    no_fusion: bool = False  # a node said its buffers overlap an earlier op's


@dataclass
class Outbox:
    """What the coordinator wants sent, in order: each message with the nodes it is for.

    The same message object added for consecutive nodes is kept once with a range of them, so
    a release to a group of N nodes is one entry, whatever N (a control tree routes it as such).
    """

    entries: list[tuple[Ranges, ToMember]] = field(default_factory=list)
    #: The open fused set: (fusion key, order of its first op, bytes, ops), or None.
    fusion: tuple[tuple, int, int, int] | None = None

    def add(self, node: int, message: ToMember) -> None:
        if type(message) is not Go:
            self.fusion = None  # anything between two releases ends a fused set
        entries = self.entries
        if entries and entries[-1][1] is message and entries[-1][0][-1][1] == node:
            ranges = entries[-1][0]
            entries[-1] = (ranges[:-1] + ((ranges[-1][0], node + 1),), message)
        else:
            entries.append((((node, node + 1),), message))

    def add_set(self, ranges: Ranges, message: ToMember) -> None:
        """One message for every node in ``ranges``."""
        if type(message) is not Go:
            self.fusion = None
        if ranges:
            self.entries.append((ranges, message))

    @property
    def messages(self) -> dict[int, list[ToMember]]:
        """Per node, its messages in order (what a star sends)."""
        per_node: dict[int, list[ToMember]] = {}
        for ranges, message in self.entries:
            for node in members(ranges):
                per_node.setdefault(node, []).append(message)
        return per_node

    def fuse(self, key: tuple | None, order: int, nbytes: int, threshold: int) -> int | None:
        """Join the open fused set (returns its first op's order) or open a new one (returns None)."""
        open_set = self.fusion
        if key is None:
            self.fusion = None
            return None
        if (open_set is not None and open_set[0] == key and open_set[2] + nbytes <= threshold
                and open_set[3] < MAX_FUSED_OPS):
            self.fusion = (key, open_set[1], open_set[2] + nbytes, open_set[3] + 1)
            return open_set[1]
        self.fusion = (key, order, nbytes, 1)
        return None


def _unequal_blocks(pending: Pending) -> str | None:
    """Why an all-to-all cannot run as a program (whose blocks all have one size): the bytes each
    node sends each node (its ranks' splits together) differ; None if they are all equal."""
    first = pending.entries[pending.nodes[0]]
    itemsize = s.ITEMSIZE.get(first.signature.get("dtype", "uint8"), 1)
    sent = dict.fromkeys(((a, b) for a in pending.nodes for b in pending.nodes), 0)
    for entry in pending.entries.values():
        for grank, splits_in, _ in entry.alltoall_splits or ():
            for dst, count in enumerate(splits_in):
                key = (first.placement[grank], first.placement[dst])
                sent[key] = sent.get(key, 0) + count * itemsize
    sizes = set(sent.values())
    if len(sizes) == 1:
        return None
    return (f"programs run all-to-alls in which every node sends every node the same number of bytes; "
            f"here node to node blocks range from {min(sizes)} to {max(sizes)} bytes")


def _unequal_gather(pending: Pending) -> str | None:
    """Why an all-gather cannot run as a program (whose blocks all have one size): the nodes'
    blocks (their ranks' counts together) differ; None if they are all equal."""
    first = pending.entries[pending.nodes[0]]
    counts = first.signature.get("counts") or []
    itemsize = s.ITEMSIZE.get(first.signature.get("dtype", "uint8"), 1)
    per_node = dict.fromkeys(pending.nodes, 0)
    for grank, count in enumerate(counts):
        node = first.placement[grank]
        per_node[node] = per_node.get(node, 0) + count * itemsize
    sizes = set(per_node.values())
    if len(sizes) <= 1:
        return None
    return (f"programs run all-gathers in which every node gives the same number of bytes; here the "
            f"nodes give {[per_node[n] for n in pending.nodes]} bytes")


def _not_node_major(pending: Pending) -> str | None:
    """Why an AllToNext cannot run as a program (node i's boundary to node i + 1): the group's
    ranks are not contiguous per node in node order; None if they are."""
    placement = list(pending.entries[pending.nodes[0]].placement)
    if placement == sorted(placement):
        return None
    return (f"AllToNext programs need each node to hold a contiguous range of group ranks, in node order; "
            f"here the ranks' nodes are {placement}")


#: Per op kind: why no program can run a given op of it (None: any program of its kind may).
_UNFIT = {"alltoall": _unequal_blocks, "allgather": _unequal_gather, "alltonext": _not_node_major}


def _pattern_key(pending: Pending) -> tuple:
    """Every node's full report of an op, hashable (what a cache id stands for)."""
    return (pending.group, tuple(
        (node, e.kind, frozen(e.signature), tuple(e.ranks), tuple(e.placement), tuple(e.nodes), tuple(e.mine),
         e.nbytes, e.timeout, frozen(e.alltoall_splits)) for node, e in sorted(pending.entries.items())))


def _op(pending: Pending) -> str:
    """'allreduce #3 on group 'g'' (the kind as the first report gave it; '#3' alone before any)."""
    first = next(iter(pending.entries.values()), None)
    kind = f"{first.kind} " if first is not None else ""
    return f"{kind}#{pending.seq} on group '{pending.group}'"


class Coordinator:
    def __init__(self, nnodes: int, config: SchedulerConfig, lanes: dict[str, LaneCapability],
                 node_names: Sequence[str] | None = None, stats: FabricStats | None = None,
                 catalog: Any = None) -> None:
        self.nnodes = nnodes
        #: Counters live with the rest of the fabric's (observe/stats.py); the member passes its own.
        self.stats = stats if stats is not None else FabricStats()
        #: Node names for error messages ("node 1 (gpu-b)"): what an operator finds in their host list.
        self.node_names = list(node_names) if node_names is not None else None
        self.config = config
        self.lanes = lanes
        #: Node 0's programs (``commd.algorithms.catalog.Catalog``), from which it chooses; None: none.
        self.catalog = catalog
        #: cache id -> the (name, sha256) of the program its ops run (absent: the lane's own algorithm)
        self.cache_algo: dict[int, tuple[str, str]] = {}
        #: cache id -> the codec its ops run with (absent: uncompressed); decided per pattern (kind, size...)
        self.cache_codec: dict[int, str] = {}
        self.order = 0
        self.pending: dict[tuple[str, int], Pending] = {}
        # cache id -> (each node's pattern, lane, (fusion key, bytes) or None)
        self.cache: dict[int, tuple[dict[int, OpPattern], str, tuple[tuple, int] | None]] = {}
        #: cache id -> its group's nodes (tuple, set, ranges): what a merged report needs, built once
        self.cache_nodes: dict[int, tuple[tuple[int, ...], frozenset[int], Ranges]] = {}
        #: every node's report, frozen -> its cache id: the same pattern keeps one id however often it
        #: is reported in full, so a burst of repeats still shows its cycle (scheduler/cycles.py)
        self.cache_ids: dict[tuple, int] = {}
        self.dead: dict[int, str] = {}  # node -> why
        self.live: Ranges = ((0, nnodes),)  # the nodes not dead
        self.p2p: dict[tuple[int, int], tuple[int, int, P2pSend]] = {}  # key -> (src node, dst node, send)
        self.partial: dict[int, dict[tuple[str, int], list[int]]] = {}  # node -> (g, s) -> missing global ranks
        #: (group, seq) -> (code, message) of ops that timed out: a late node's report fails on arrival,
        #: as a late rank's op does on one node (bounded, oldest dropped first)
        self.expired: collections.OrderedDict[tuple[str, int], tuple[str, str]] = collections.OrderedDict()
        # The schedule path (fabric/scheduled.py): the cycle finder, the latest schedule published,
        # whether it still runs, the nodes that said where it ended for them, and what waits for it
        # to end (reports of other groups, transfers to order).
        self.cycles = CycleDetector()
        self.schedules_on = env_int("COMMD_SCHEDULE", 1, 0, 1) == 1
        self.schedule: Schedule | None = None
        self.schedule_active = False
        self.schedule_stopping = False
        self.schedule_ended: set[int] = set()
        self.deferred: list[tuple[int, Ready | P2pMatch]] = []

    def node(self, node: int) -> str:
        """'node 1 (its name)' for messages."""
        names = self.node_names
        return f"node {node} ({names[node]})" if names is not None and 0 <= node < len(names) else f"node {node}"

    def nodes(self, nodes: Sequence[int]) -> str:
        """'nodes [1, 2] (b, c)' for messages."""
        names = self.node_names
        if names is None or not all(0 <= n < len(names) for n in nodes):
            return f"nodes {list(nodes)}"
        return f"nodes {list(nodes)} ({', '.join(names[n] for n in nodes)})"

    # ---- collectives --------------------------------------------------------
    def report(self, node: int, items: list[Ready], out: Outbox) -> None:
        """Take one node's ready ops; may complete and release some."""
        for item in items:
            key = (item.group, item.seq)
            sched = self.schedule
            if (sched is not None and item.group == sched.group and item.seq >= sched.start_seq
                    and node not in self.schedule_ended):
                self.stats.coord_stale_reports += 1  # sent before the node had the schedule: it runs the op so
                continue
            if self.schedule_active:  # ordered once the schedule has ended on every node
                self.deferred.append((node, item))
                self._stop_schedule(out)
                continue
            cid = item.cache_id
            if cid is not None:
                cached = self.cache.get(cid)
                if cached is None or node not in cached[0]:
                    out.add(node, Fail(key[0], key[1], s.E_PROTOCOL,
                                       f"#{key[1]} on group '{key[0]}' from {self.node(node)}: unknown "
                                       f"negotiation cache id {cid}"))
                    continue
                entry = cached[0][node]
            else:
                assert item.pattern is not None  # (a report without a cache id carries its pattern)
                entry = item.pattern
            pending = self.pending.get(key)
            if pending is None and key in self.expired:
                out.add(node, Fail(key[0], key[1], *self.expired[key]))
                continue
            if pending is None:
                nodes = tuple(entry.nodes)
                pending = self.pending[key] = Pending(key[0], key[1], nodes, frozenset(nodes), timeout=entry.timeout,
                                                      first_at=time.monotonic() - item.waited)
                dead = [n for n in nodes if n in self.dead]
                if dead:
                    self._fail(pending, out, s.E_PEER_DIED,
                               f"{entry.kind} #{key[1]} on group '{key[0]}' cannot run: {self.node(dead[0])} "
                               f"{self.dead[dead[0]]}", extra=[node])
                    continue
            if pending.sets:
                self._expand(pending)
            if node in pending.entries:
                out.add(node, Fail(key[0], key[1], s.E_PROTOCOL,
                                   f"{self.node(node)} reported {entry.kind} #{key[1]} of group '{key[0]}' twice"))
                continue
            pending.entries[node] = entry
            if cid is not None:
                pending.cids[node] = cid
            if item.contribution is not None:
                pending.data[node] = item.contribution
            if item.no_fusion:
                pending.no_fusion = True
            pending.timeout = min(pending.timeout, entry.timeout)
            if node not in pending.members:
                self._complete_mismatch(pending, out, extra=[node])
                continue
            if node == HOME_NODE and len(pending.entries) == 1:
                self._send_early(pending, item, out)
            if len(pending.entries) == len(pending.nodes):
                self._complete_guarded(pending, out)

    def report_set(self, item: ReadySet, out: Outbox) -> None:
        """A relay's merged reports: every node in ``item.ranges`` reported the op by one cache id.

        The common case costs O(runs), not O(nodes): the op's nodes and pattern come from the cache,
        and when the sets cover every node with one id the op is released to them as one entry.
        Anything else (an unknown id, a running schedule, a node's own report of the same op, a
        dead node, a node twice) takes the per-node path, which says what is wrong as it always has.
        """
        key = (item.group, item.seq)
        cid = item.cache_id
        known = self.cache_nodes.get(cid)
        pending = self.pending.get(key)
        sched = self.schedule
        if (known is None or self.schedule_active or (sched is not None and item.group == sched.group)
                or key in self.expired or (pending is not None and pending.entries)
                or size(union(known[2], item.ranges)) != size(known[2])):
            self._report_each(item, out)
            return
        nodes, node_set, _ = known
        if pending is None:
            if any(n in node_set for n in self.dead):
                self._report_each(item, out)
                return
            first = self.cache[cid][0][nodes[0]]
            pending = self.pending[key] = Pending(key[0], key[1], nodes, node_set, timeout=first.timeout)
        joined = union(pending.set_nodes, item.ranges)
        if size(joined) != size(pending.set_nodes) + size(item.ranges):  # a node twice: say so per node
            self._expand(pending)
            self._report_each(item, out)
            return
        pending.sets.append((cid, item.ranges))
        pending.set_nodes = joined
        if size(joined) < len(nodes):
            return
        if all(c == cid for c, _ in pending.sets):
            self._release_cached(pending, cid, out)
        else:
            self._expand(pending)
            self._complete_guarded(pending, out)

    def _report_each(self, item: ReadySet, out: Outbox) -> None:
        """A merged set taken node by node, as the nodes' own reports by cache id would be."""
        for node in members(item.ranges):
            self.report(node, [Ready(item.group, item.seq, None, item.cache_id)], out)

    def _place(self, pending: Pending, fuse_key: tuple[tuple, int] | None, result: bytes | None,
               out: Outbox) -> int | None:
        """Give a released op the next number of the global order; the fused set it joins (its first
        op's order) or None.  An op the coordinator reduced itself, or one a node keeps apart, ends
        any open set."""
        self.order += 1
        self.stats.coord_released += 1
        fusible = fuse_key is not None and result is None and not pending.no_fusion
        key, nbytes = fuse_key if fusible else (None, 0)
        return out.fuse(key, self.order, nbytes, self.config.fusion_threshold_bytes)

    def _release_cached(self, pending: Pending, cid: int, out: Outbox) -> None:
        """Every node reported ``cid`` (in merged sets): release without a comparison, as one entry."""
        del self.pending[(pending.group, pending.seq)]
        _, lane, fuse_key = self.cache[cid]
        algo = self.cache_algo.get(cid)
        codec = self.cache_codec.get(cid)
        self.stats.coord_fast_path += 1
        head = self._place(pending, fuse_key, None, out)
        out.add_set(self.cache_nodes[cid][2], Go(pending.group, pending.seq, self.order, lane, None, None, head,
                                                 *(algo or (None, None)), codec))
        self._find_cycle(pending, cid, lane, algo, codec, head is not None, out)

    def _expand(self, pending: Pending) -> None:
        """Turn merged sets into per-node reports (what the comparison, failures and stalls read)."""
        for cid, ranges in pending.sets:
            patterns = self.cache[cid][0]
            for node in members(ranges):
                pending.entries[node] = patterns[node]
                pending.cids[node] = cid
        pending.sets = []
        pending.set_nodes = ()

    def _complete_guarded(self, pending: Pending, out: Outbox) -> None:
        key = (pending.group, pending.seq)
        try:
            self._complete(pending, out)
        except Exception as exc:  # a bug here must fail the op, never leave it waiting
            log.exception("coordinator: completing %s failed", _op(pending))
            self.pending.pop(key, None)
            failure = Fail(key[0], key[1], s.E_INTERNAL,
                           f"the coordinator ({self.node(0)}) could not release {_op(pending)}: {exc}")
            for target in pending.nodes:
                out.add(target, failure)

    def _complete(self, pending: Pending, out: Outbox) -> None:
        del self.pending[(pending.group, pending.seq)]
        cids = set(pending.cids.values())
        lane: str | None = None
        cid: int | None = None
        algo: tuple[str, str] | None = None
        codec: str | None = None
        if len(pending.cids) == len(pending.nodes) and len(cids) == 1:
            cid = cids.pop()
            _, lane, fuse_key = self.cache[cid]
            algo = self.cache_algo.get(cid)
            codec = self.cache_codec.get(cid)
            self.stats.coord_fast_path += 1
        else:
            problem = self._mismatch(pending)
            if problem is not None:
                self.cycles.reset()
                failure = Fail(pending.group, pending.seq, s.E_MISMATCH, self._mismatch_message(pending, problem))
                for node in pending.nodes:
                    out.add(node, failure)
                return
            first = pending.entries[pending.nodes[0]]
            sig = first.signature
            nbytes = max(e.nbytes for e in pending.entries.values())  # buffers differ per rank (gather...)
            algo_hint = sig.get("algo") or None
            asked = sig.get("codec") or ""
            named = asked if asked not in ("", s.CODEC_AUTO, s.NO_CODEC) else None  # (a codec, not a choice)
            unfit = _UNFIT[first.kind](pending) if first.kind in _UNFIT else None
            # an all-to-all whose blocks differ (the test that keeps programs off it) has table cells of its own
            variant = UNEVEN_VARIANT.get(first.kind) if unfit is not None else None
            try:
                lane = choose_lane(  # (programs and named codecs run on the tcp lane: either hint implies it)
                    first.kind, sig.get("dtype", "uint8"), sig.get("reduce_op"), nbytes, pending.nodes,
                    len(first.placement), sig.get("lane") or ("tcp" if algo_hint or named else None), self.config,
                    self.lanes, variant=variant,
                )
                if named is not None and algo_hint is not None and lossy_codec(named):
                    raise SelectionError(f"codec {named!r} is lossy; algorithm {algo_hint!r} runs compressed with "
                                         "lossless codecs only (its partial results would be rounded at every hop)")
                if named is not None and lane != "tcp":
                    raise SelectionError(f"codec {named!r} compresses on the tcp lane only; the op asks for lane "
                                         f"{lane!r}")
                program = choose_algorithm(
                    first.kind, sig.get("dtype", "uint8"), sig.get("reduce_op"), nbytes, pending.nodes,
                    len(first.placement), algo_hint, lane, self.config, self.catalog, unfit, variant=variant,
                )
                if program is not None and algo_hint is None and named is not None and lossy_codec(named):
                    program = None  # a rule's or the table's program would round partial results at every hop
                codec = choose_codec(first.kind, sig.get("dtype", "uint8"), nbytes, pending.nodes,
                                     len(first.placement), asked, lane, program, self.config)
            except SelectionError as exc:
                self.cycles.reset()
                failure = Fail(pending.group, pending.seq, s.E_PROTOCOL, f"{_op(pending)} on "
                               f"{self.nodes(pending.nodes)}: {exc}")
                for node in pending.nodes:
                    out.add(node, failure)
                return
            algo = (program.name, program.digest) if program is not None else None
            # a program or a codec runs one op per lane call: never fused, never reduced here
            fuse_key = self._fusion_key(pending.group, first, nbytes, lane) if algo is None and codec is None else None
            same = _pattern_key(pending)
            known = self.cache_ids.get(same)
            if known is not None:  # reported in full again (a burst sent before the id came back): one id
                cid = known
            elif len(self.cache) < MAX_CACHE_ENTRIES:
                cid = len(self.cache) + 1
                self.cache[cid] = (dict(pending.entries), lane, fuse_key)
                self.cache_nodes[cid] = (pending.nodes, pending.members, ranges_of(pending.nodes))
                self.cache_ids[same] = cid
                if algo is not None:
                    self.cache_algo[cid] = algo
                if codec is not None:
                    self.cache_codec[cid] = codec
        result = self._eager_result(pending, lane) if algo is None else None
        head = self._place(pending, fuse_key, result, out)
        # One release for the nodes that knew the cache id, one (naming it) for those that did not;
        # positional: this runs for every op.  Fields: cache id, result, fused with, program, its hash, codec.
        knew = Go(pending.group, pending.seq, self.order, lane, None, result, head, *(algo or (None, None)), codec)
        told = (Go(pending.group, pending.seq, self.order, lane, cid, result, head, *(algo or (None, None)), codec)
                if cid is not None else knew)
        cids = pending.cids
        for node in pending.nodes:
            out.add(node, knew if cids.get(node) == cid else told)
        self._find_cycle(pending, cid, lane, algo, codec, head is not None, out)

    # ---- the schedule path ------------------------------------------------------
    def _find_cycle(self, pending: Pending, cid: int | None, lane: str, algo: tuple[str, str] | None,
                    codec: str | None, fused: bool, out: Outbox) -> None:
        """Feed a release to the cycle finder; publish the cycle it finds as a schedule when
        nothing else is being ordered (no negotiation, no transfer, no schedule)."""
        nlive = size(self.live)  # (the op's nodes are all alive: one spanning as many spans them all)
        schedulable = (cid is not None and lane == "tcp" and not fused and len(pending.nodes) == nlive
                       and not self.schedule_active)
        slot = (ScheduleSlot(cid, lane, *(algo or (None, None)), codec, self._gathers(cid, algo, nlive))
                if schedulable else None)
        cycle = self.cycles.released(pending.group, pending.seq, slot)
        if cycle is None or self.p2p or not self.schedules_on:
            return
        # Ops of the group some nodes reported already (a burst) join the schedule: their reports are
        # dropped and the nodes run them on it.  Not one that carries a contribution (node 0's may have
        # gone to the other node early, which may have completed it); nor anything of another group.
        if any(p.group != cycle.group or p.data for p in self.pending.values()):
            return
        for key in [k for k in self.pending if k[0] == cycle.group]:
            del self.pending[key]
        epoch = self.schedule.epoch + 1 if self.schedule is not None else 1
        live = list(members(self.live))
        self.schedule = Schedule(epoch, cycle.group, live, self.order + 1, cycle.start_seq, list(cycle.slots))
        self.schedule_active, self.schedule_stopping = True, False
        self.schedule_ended = set()
        self.stats.coord_schedules += 1
        self.cycles.reset()
        log.info("coordinator: group '%s' repeats a cycle of %d ops: its ops from #%d on follow schedule %d",
                 cycle.group, len(cycle.slots), cycle.start_seq, epoch)
        out.add_set(self.live, self.schedule)

    def _gathers(self, cid: int | None, algo: tuple[str, str] | None, nnodes: int) -> bool:
        """Whether a slot's agreement gathers the nodes' contributions: a tiny all-reduce with no
        program, on more than 2 nodes (2 nodes always carry them), all of them together small."""
        cached = self.cache.get(cid) if cid is not None else None
        if cached is None or algo is not None or nnodes <= 2:
            return False
        pattern = next(iter(cached[0].values()))
        return (pattern.kind == "allreduce" and 0 < pattern.nbytes <= eager.MAX_BYTES
                and nnodes * pattern.nbytes <= eager.MAX_GATHERED_BYTES)

    def _stop_schedule(self, out: Outbox) -> None:
        """Something must be ordered outside the running schedule: every node ends it at its next slot."""
        if not self.schedule_active or self.schedule_stopping or self.schedule is None:
            return
        self.schedule_stopping = True
        out.add_set(self.live, StopSchedule(self.schedule.epoch))

    def stop_requested(self, node: int, stop: StopSchedule, out: Outbox) -> None:
        """A node's op waited its timeout on the schedule (a rank is late): end it everywhere, so that
        the op is negotiated, and times out or meets its late peers, as on negotiation."""
        if self.schedule is not None and stop.epoch == self.schedule.epoch:
            log.info("coordinator: %s asks to end schedule %d", self.node(node), stop.epoch)
            self._stop_schedule(out)

    def schedule_end(self, node: int, ended: ScheduleEnded, out: Outbox) -> None:
        """A node ran the schedule up to ``ended.order``: the first such message ends it here, and
        what waited for it is ordered now (numbered after every slot a node may have run)."""
        sched = self.schedule
        if sched is None or ended.epoch != sched.epoch:
            log.warning("coordinator: %s ended schedule %d, which is not the latest", self.node(node), ended.epoch)
            return
        self.schedule_ended.add(node)
        if not self.schedule_active:
            return
        self.schedule_active = False
        self.order = max(self.order, ended.order - 1)
        ran = ended.order - sched.order  # slots run: a schedule that held for two cycles was worth it
        self.cycles.restart() if ran >= 2 * len(sched.slots) else self.cycles.backoff()
        log.info("coordinator: schedule %d of group '%s' ended at order %d (%s)", sched.epoch, sched.group,
                 ended.order, self.node(node))
        waiting, self.deferred = self.deferred, []
        for origin, item in waiting:
            if type(item) is Ready:
                self.report(origin, [item], out)
            else:
                self.p2p_match(origin, item, out)

    def _send_early(self, pending: Pending, item: Ready, out: Outbox) -> None:
        """This node (the coordinator's own) reported a tiny all-reduce of a 2-node group first,
        by cache id, with its contribution: send that to the other node now.  If the other
        node reports the same cache id it may combine both itself (in node order, as
        ``_eager_result`` will) instead of waiting one more trip for the release.  Same
        cache id on both nodes is what lets ``_complete`` skip the comparison, so the
        other node takes no risk the coordinator does not take."""
        cid, data = item.cache_id, item.contribution
        if len(pending.nodes) != 2 or cid is None or not data:
            return
        cached = self.cache.get(cid)
        if (cached is None or cached[1] != "tcp" or cached[0][HOME_NODE].kind != "allreduce"
                or cid in self.cache_algo):
            return  # only what _eager_result would reduce (the tcp lane's tiny all-reduces)
        other = pending.nodes[1] if pending.nodes[0] == HOME_NODE else pending.nodes[0]
        if other not in self.dead:
            out.add(other, Early(pending.group, pending.seq, cid, data))

    def _fusion_key(self, group: str, first: OpPattern, nbytes: int, lane: str) -> tuple[tuple, int] | None:
        """What fused all-reduces share (group, dtype, reduce op, scale, lane) and the op's bytes; None: never fused."""
        threshold = self.config.fusion_threshold_bytes
        if first.kind != "allreduce" or not 0 < nbytes <= threshold:
            return None
        sig = first.signature
        return (group, sig.get("dtype"), sig.get("reduce_op"), sig.get("scale"), lane), nbytes

    def _eager_result(self, pending: Pending, lane: str) -> bytes | None:
        """A tiny all-reduce whose every node sent its contribution with the report is reduced
        here (in node order: the same bits for everyone) and the result rides the release; the
        tcp lane is then never called for it (one round trip instead of a round trip plus a lane
        exchange)."""
        if lane != "tcp" or len(pending.data) != len(pending.nodes) or not all(pending.data.values()):
            return None  # (empty buffers: nothing to reduce, and torch cannot view zero bytes)
        first = pending.entries[pending.nodes[0]]
        if first.kind != "allreduce":
            return None
        dtype = first.signature["dtype"]
        sizes = {len(d) for d in pending.data.values()}
        if len(sizes) != 1 or sizes.pop() % s.ITEMSIZE[dtype]:
            return None  # disagreeing contributions: the lane path runs (and reports) it
        return eager.combine([pending.data[n] for n in pending.nodes], dtype, first.signature["reduce_op"])

    def _complete_mismatch(self, pending: Pending, out: Outbox, extra: list[int]) -> None:
        problem = self._mismatch(pending) or "nodes disagree on the group's members"
        self._fail(pending, out, s.E_MISMATCH, self._mismatch_message(pending, problem), extra)

    def _mismatch_message(self, pending: Pending, problem: str) -> str:
        return (f"mismatched collective {_op(pending)} across {self.nodes(sorted(pending.entries))}: "
                f"{problem}")

    def _fail(self, pending: Pending, out: Outbox, code: str, message: str, extra: list[int] | None = None) -> None:
        self.cycles.reset()
        self._expand(pending)
        self.pending.pop((pending.group, pending.seq), None)
        targets = set(pending.entries) | set(extra or [])
        failure = Fail(pending.group, pending.seq, code, message)
        for node in sorted(targets):
            if node not in self.dead:
                out.add(node, failure)

    def _mismatch(self, pending: Pending) -> str | None:
        """Describe how the nodes' reports disagree (fields and group ranks), or None."""
        entries = pending.entries
        problems: list[str] = []

        def compare(label: str, get: Any) -> None:
            values: dict[str, list[int]] = {}
            for _, entry in sorted(entries.items()):  # node order: the same text whoever reported first
                values.setdefault(repr(get(entry)), []).extend(entry.mine)
            if len(values) > 1:
                parts = ", ".join(f"ranks {sorted(r)} {v}" for v, r in values.items())
                problems.append(f"'{label}' differs: {parts}")

        compare("kind", lambda e: e.kind)
        if problems:
            return "; ".join(problems)
        compare("group members", lambda e: e.ranks)
        compare("placement", lambda e: e.placement)
        names = sorted({name for e in entries.values() for name in e.signature})
        for name in names:
            compare(name, lambda e, name=name: e.signature.get(name))
        if not problems and entries and next(iter(entries.values())).kind == "alltoall":
            splits: dict[int, tuple[list[int], list[int]]] = {}
            for entry in entries.values():
                for grank, sin, sout in entry.alltoall_splits or ():
                    splits[grank] = (sin, sout)
            for a, (sin, _) in sorted(splits.items()):
                for b, (_, sout) in sorted(splits.items()):
                    if sin[b] != sout[a]:
                        problems.append(f"rank {a} sends {sin[b]} elements to rank {b}, which expects {sout[a]}")
        return "; ".join(problems) if problems else None

    # ---- point to point ------------------------------------------------------
    def p2p_send(self, node: int, send: P2pSend, out: Outbox) -> None:
        """A send whose receiver lives on another node: forward it there."""
        dst = send.dst_node
        key = (node, send.key)
        if dst in self.dead or not 0 <= dst < self.nnodes:
            out.add(node, P2pFail(send.key, None, s.E_PEER_DIED,
                                  f"send to group rank {send.dst}: its {self.node(dst)} "
                                  f"{self.dead.get(dst, 'is unknown')}"))
            return
        self.p2p[key] = (node, dst, send)
        out.add(dst, RemoteSend(send, node))

    def p2p_match(self, node: int, match: P2pMatch, out: Outbox) -> None:
        """The receiver matched a forwarded send: order the transfer on both nodes."""
        if self.schedule_active:
            self.deferred.append((node, match))
            self._stop_schedule(out)
            return
        self.cycles.reset()
        key = (match.sender_node, match.key)
        route = self.p2p.pop(key, None)
        if route is None:
            return
        src, dst, send = route
        try:
            lane = choose_lane("sendrecv", "uint8", None, send.nbytes, tuple(sorted((src, dst))), 2,
                               send.lane_hint, self.config, self.lanes)
        except SelectionError as exc:
            message = f"send/recv from {self.node(src)} to {self.node(dst)}: {exc}"
            for target in (src, dst):
                out.add(target, P2pFail(match.key, src, s.E_PROTOCOL, message))
            return
        self.order += 1
        self.stats.coord_released += 1
        out.add(src, P2pGo(match.key, sender_node=None, order=self.order, lane=lane, role="send", peer=dst))
        out.add(dst, P2pGo(match.key, sender_node=src, order=self.order, lane=lane, role="recv", peer=src))

    def p2p_fail(self, node: int, failed: SendFailed, out: Outbox) -> None:
        """The receiver failed a forwarded send (mismatch, timeout): tell the sender."""
        key = (failed.sender_node, failed.key)
        route = self.p2p.pop(key, None)
        if route is not None:
            out.add(route[0], P2pFail(failed.key, None, failed.code, failed.message))

    # ---- failures ------------------------------------------------------------
    def node_dead(self, node: int, why: str, out: Outbox) -> None:
        if node in self.dead:
            return
        self._stop_schedule(out)
        self.cycles.reset()
        self.dead[node] = why
        self.live = ranges_of(n for n in range(self.nnodes) if n not in self.dead)
        for pending in list(self.pending.values()):
            if node in pending.nodes:
                self._fail(pending, out, s.E_PEER_DIED, f"{_op(pending)} cannot run: {self.node(node)} {why}")
        for key, (src, dst, _item) in list(self.p2p.items()):
            if node in (src, dst):
                del self.p2p[key]
                if src != node:
                    out.add(src, P2pFail(key[1], None, s.E_PEER_DIED, f"send to {self.node(dst)}: that node {why}"))
        # every node, and the node itself, if it can still hear: a daemon that was only stopped reads
        # this the moment it runs again, instead of waiting out a peer timeout of the coordinator's silence
        out.add_set(union(self.live, ((node, node + 1),)), NodeDead(node, why))

    def rank_died(self, node: int, rank: int, why: str, out: Outbox) -> None:
        self._stop_schedule(out)
        self.cycles.reset()
        for pending in list(self.pending.values()):
            self._expand(pending)
            first = next(iter(pending.entries.values()), None)
            if first is not None and rank in first.ranks:
                self._fail(pending, out, s.E_PEER_DIED,
                           f"{_op(pending)} cannot run: rank {rank} (on {self.node(node)}) {why}")
        died = RankDied(rank, why)
        for other in members(self.live):
            if other != node:
                out.add(other, died)

    def expire(self, now: float, out: Outbox) -> None:
        """Fail negotiations some node never joined within the op timeout."""
        for pending in list(self.pending.values()):
            if now - pending.first_at < pending.timeout:
                continue
            self._expand(pending)
            missing = [n for n in pending.nodes if n not in pending.entries]
            ranks = self._missing_ranks(pending, missing)
            first = next(iter(pending.entries.values()))
            message = s.not_submitted(f"{first.kind} #{pending.seq} on group '{pending.group}'", self.nodes(missing),
                                      ranks, pending.timeout)
            self.expired[(pending.group, pending.seq)] = (s.E_TIMEOUT, message)
            while len(self.expired) > EXPIRED_KEPT:
                self.expired.popitem(last=False)
            # the missing nodes too: they drop what they hold of it (node 0's early contribution)
            self._fail(pending, out, s.E_TIMEOUT, message, extra=missing)

    # ---- stalls --------------------------------------------------------------
    def _missing_ranks(self, pending: Pending, missing_nodes: list[int]) -> list[int]:
        first = next(iter(pending.entries.values()))
        ranks: list[int] = []
        for node in missing_nodes:
            partial = self.partial.get(node, {}).get((pending.group, pending.seq))
            if partial is not None:
                ranks.extend(partial)
            else:
                ranks.extend(r for r, n in zip(first.ranks, first.placement, strict=True) if n == node)
        return sorted(ranks)

    def stalls(self, now: float, threshold: float) -> list[dict[str, Any]]:
        """Negotiations waiting longer than ``threshold``, with the nodes and ranks holding them up."""
        rows = []
        for pending in self.pending.values():
            waited = now - pending.first_at
            if waited < threshold:
                continue
            self._expand(pending)
            missing = [n for n in pending.nodes if n not in pending.entries]
            first = next(iter(pending.entries.values()))
            rows.append({
                "group": pending.group, "seq": pending.seq, "kind": first.kind, "waiting_s": round(waited, 3),
                "missing_nodes": missing, "missing_ranks": self._missing_ranks(pending, missing),
            })
        rows.sort(key=lambda r: -r["waiting_s"])
        return rows
