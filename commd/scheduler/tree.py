"""The control tree: reports merged upward and releases routed downward, log N deep.

With a star, node 0 receives a report from and sends a release to every node for every
negotiated op: its work and its messages per op grow as N.  With a tree of fan-out *k*,
each daemon talks only to its parent and at most *k* children:

* **up**: a *relay* (a node with children) merges its subtree's cached reports of one op
  (same group, sequence number and cache id) into one ``ReadySet`` naming the nodes as
  ranges, and passes anything else on unchanged, tagged with the node it came from;
* **down**: the coordinator addresses each message to a set of nodes (``Ranges``); a relay
  hands it to itself if it is one of them and to each child whose subtree holds some.

Subtrees are contiguous intervals of node numbers (node *a*'s subtree is ``[a, end(a))``),
so the nodes of a group that spans the job are one range whatever N is, and the
coordinator's work for a cached op is O(k): one set per child in, one routed release per
child out.  This module is pure: no I/O, no clock but the one it is given.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from commd.protocol import fabric as wire

log = logging.getLogger("commd.fabric")

#: Half-open ranges of node numbers, sorted and disjoint: ((0, 4), (6, 7)) is nodes 0-3 and 6.
Ranges = tuple[tuple[int, int], ...]

#: A relay forwards its subtree's partial merge after holding it this long: the coordinator must
#: see who reported to time out an op some node never joins, and to say who is missing.
HOLD_S = 0.5
#: Ops whose group a relay remembers while waiting for their release (full reports seen, no go yet).
GROUPS_KEPT = 4096


def ranges_of(nodes: Iterable[int]) -> Ranges:
    """The sorted, distinct ``nodes`` as runs."""
    runs: list[tuple[int, int]] = []
    for node in sorted(set(nodes)):
        if runs and runs[-1][1] == node:
            runs[-1] = (runs[-1][0], node + 1)
        else:
            runs.append((node, node + 1))
    return tuple(runs)


def size(ranges: Ranges) -> int:
    """How many nodes."""
    return sum(hi - lo for lo, hi in ranges)


def contains(ranges: Ranges, node: int) -> bool:
    return any(lo <= node < hi for lo, hi in ranges)


def members(ranges: Ranges) -> Iterator[int]:
    for lo, hi in ranges:
        yield from range(lo, hi)


def clip(ranges: Ranges, lo: int, hi: int) -> Ranges:
    """The part of ``ranges`` inside [lo, hi)."""
    return tuple((max(a, lo), min(b, hi)) for a, b in ranges if a < hi and b > lo)


def union(a: Ranges, b: Ranges) -> Ranges:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(a + b):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def valid(ranges: Any, nnodes: int) -> bool:
    """Sorted, disjoint, non-empty runs inside [0, nnodes): what a received range list must be."""
    if type(ranges) not in (list, tuple):
        return False
    last = 0
    for run in ranges:
        if type(run) not in (list, tuple) or len(run) != 2 or type(run[0]) is not int or type(run[1]) is not int:
            return False
        lo, hi = run
        if not last <= lo < hi <= nnodes:
            return False
        last = hi
    return True


class ControlTree:
    """A fan-out-``k`` tree over nodes 0..N-1 rooted at the coordinator, each subtree an interval.

    Node ``a`` heads ``[a, end(a))``; the rest of that interval is cut into at most ``k``
    consecutive chunks as even as can be, and each chunk's first node is a child.  With
    ``k >= N - 1`` it is the star the fabric has always had (every node a child of node 0).
    """

    def __init__(self, nnodes: int, fanout: int) -> None:
        if nnodes < 1 or fanout < 2:
            raise ValueError(f"a control tree needs at least one node and a fan-out of 2 or more "
                             f"(got {nnodes} nodes, fan-out {fanout})")
        self.nnodes = nnodes
        self.fanout = fanout
        self.parent: list[int | None] = [None] * nnodes
        self.end = [nnodes] * nnodes
        self.children: list[tuple[int, ...]] = [()] * nnodes
        todo = [(0, nnodes)]
        while todo:
            head, end = todo.pop()
            self.end[head] = end
            rest = end - head - 1
            chunks = min(fanout, rest)
            kids: list[int] = []
            start = head + 1
            for i in range(chunks):
                size = rest // chunks + (1 if i < rest % chunks else 0)
                kids.append(start)
                self.parent[start] = head
                todo.append((start, start + size))
                start += size
            self.children[head] = tuple(kids)

    @property
    def is_star(self) -> bool:
        return all(p in (None, 0) for p in self.parent)

    def depth(self) -> int:
        """Links between node 0 and the deepest node."""
        deepest = 0
        for node in range(self.nnodes):
            hops, at = 0, node
            while (up := self.parent[at]) is not None:
                hops, at = hops + 1, up
            deepest = max(deepest, hops)
        return deepest

    def subtree(self, node: int) -> tuple[int, int]:
        return node, self.end[node]

    def relay_of(self, node: int) -> list[int]:
        """The relays between node 0 and ``node`` (excluding both), nearest first."""
        path = []
        at = self.parent[node]
        while at is not None and at != 0:
            path.append(at)
            at = self.parent[at]
        return path

    def route(self, me: int, ranges: Ranges) -> tuple[bool, list[tuple[int, Ranges]]]:
        """Whether ``me`` is addressed, and the part of ``ranges`` each child's subtree holds."""
        mine = contains(ranges, me)
        parts = []
        for child in self.children[me]:
            part = clip(ranges, child, self.end[child])
            if part:
                parts.append((child, part))
        return mine, parts


@dataclass(slots=True)
class Held:
    """A relay's merge of one op's cached reports, not yet passed up."""

    cache_id: int
    ranges: Ranges
    since: float


class ReportMerger:
    """A relay's merging of its subtree's reports (``up``) and what it learns from releases (``learn``).

    ``up`` takes what arrived from one node of the subtree (the relay's own items, or a child's
    batch) as ``(origin, item)`` pairs and ``ReadySet``-like tuples, and returns what to send to the
    parent now, in order.  Merged: a report by cache id alone (no contribution, no flag) of an op
    whose subtree size the relay knows.  Anything else first passes up the merges that hold a report
    of its node, so that each node's items reach the coordinator in the order the node sent them.
    """

    def __init__(self, tree: ControlTree, me: int, hold_s: float = HOLD_S) -> None:
        self.lo, self.hi = tree.subtree(me)
        self.hold_s = hold_s
        #: cache id -> how many nodes of this subtree run its ops (learned from its first release)
        self.expected: dict[int, int] = {}
        #: (group, seq) -> the group's nodes in this subtree, from a full report, until its release
        self.group_nodes: collections.OrderedDict[tuple[str, int], int] = collections.OrderedDict()
        self.held: dict[tuple[str, int], Held] = {}
        #: (group, seq) -> reports of it already passed up (unmerged, or in a partial set): a merge
        #: of the rest is complete when it has the others
        self.passed: collections.OrderedDict[tuple[str, int], int] = collections.OrderedDict()
        self.merged = 0  # reports merged into sets (counted for the status)

    def mergeable(self, ready: Any) -> bool:
        return (ready.pattern is None and ready.contribution is None and not ready.no_fusion and not ready.waited
                and ready.cache_id in self.expected)

    def up(self, items: list[Any], now: float) -> list[Any]:
        """``items``: (origin, message) pairs or ``ReadySet``s; returns the same kinds, to pass up."""
        out: list[Any] = []
        for entry in items:
            if type(entry) is wire.ReadySet:
                if entry.cache_id in self.expected:
                    self._merge(entry.group, entry.seq, entry.cache_id, entry.ranges, now, out)
                else:
                    self._pass_on(entry, entry.ranges, (entry.group, entry.seq), out)
                continue
            origin, item = entry
            if item.TYPE == "hb":  # liveness: no order to keep with reports, no reason to end a merge
                out.append(entry)
                continue
            node = ((origin, origin + 1),)
            if type(item) is not wire.Ready:
                self._pass_on(entry, node, None, out)
            elif self.mergeable(item):
                self._merge(item.group, item.seq, item.cache_id, node, now, out)
            else:
                if item.pattern is not None:
                    self.remember(item.group, item.seq, item.pattern.nodes)
                self._pass_on(entry, node, (item.group, item.seq), out)
        return out

    def _pass_on(self, entry: Any, ranges: Ranges, op: tuple[str, int] | None, out: list[Any]) -> None:
        """Pass an item of the nodes in ``ranges`` up as it is, after the merges holding a report of
        theirs; a report counts towards its op (``op``), whose other reports' merge may now be whole."""
        self._flush_from(ranges, out)
        out.append(entry)
        if op is not None:
            self._passed(op, size(ranges))
            self._pass_if_complete(op, out)

    def _merge(self, group: str, seq: int, cid: int, ranges: Ranges, now: float, out: list[Any]) -> None:
        key = (group, seq)
        held = self.held.get(key)
        if held is not None and held.cache_id != cid:  # the nodes disagree: the coordinator will say how
            self._pass_held(key, out)
            held = None
        if held is None:
            held = self.held[key] = Held(cid, ranges, now)
        else:
            held.ranges = union(held.ranges, ranges)
        self.merged += size(ranges)
        self._pass_if_complete(key, out)

    def _pass_if_complete(self, key: tuple[str, int], out: list[Any]) -> None:
        held = self.held.get(key)
        if held is not None and size(held.ranges) + self.passed.get(key, 0) >= self.expected[held.cache_id]:
            out.append(wire.ReadySet(key[0], key[1], held.cache_id, held.ranges))
            del self.held[key]
            self.passed.pop(key, None)

    def _pass_held(self, key: tuple[str, int], out: list[Any]) -> None:
        held = self.held.pop(key)
        out.append(wire.ReadySet(key[0], key[1], held.cache_id, held.ranges))
        self._passed(key, size(held.ranges))

    def _passed(self, key: tuple[str, int], reports: int) -> None:
        self.passed[key] = self.passed.get(key, 0) + reports
        while len(self.passed) > GROUPS_KEPT:
            self.passed.popitem(last=False)

    def _flush_from(self, ranges: Ranges, out: list[Any]) -> None:
        """Pass up the merges holding a report of these nodes: what they send next must follow it."""
        for key in [k for k, h in self.held.items() if any(clip(h.ranges, lo, hi) for lo, hi in ranges)]:
            self._pass_held(key, out)

    def expire(self, now: float) -> list[Any]:
        """Merges held longer than ``hold_s``, as partial sets (more of the op's reports merge anew)."""
        out = []
        for key in [k for k, h in self.held.items() if now - h.since >= self.hold_s]:
            self._pass_held(key, out)
        return out

    def remember(self, group: str, seq: int, nodes: list[int]) -> None:
        """A full report of the op passed: how many of its group's nodes are in this subtree."""
        self.group_nodes[(group, seq)] = sum(1 for n in nodes if self.lo <= n < self.hi)
        while len(self.group_nodes) > GROUPS_KEPT:
            self.group_nodes.popitem(last=False)

    def learn(self, raw: dict[str, Any]) -> None:
        """A release passing down (its wire map): the first one with a cache id tells how many
        nodes of this subtree report that id; a failure forgets the op."""
        t = raw.get("t")
        if t == "go":
            here = self.group_nodes.pop((raw.get("g"), raw.get("s")), None)
            cid = raw.get("c")
            if here is not None and type(cid) is int and here > 0:
                self.expected[cid] = here
        elif t == "fail":
            self.group_nodes.pop((raw.get("g"), raw.get("s")), None)


class TreeRouter:
    """One node's part in a control tree: what goes up to its parent, what goes down to its children.

    Pure: the fabric member feeds it decoded items and sends what it returns (``fabric/member.py``);
    ``commd.sim.control_plane`` drives N of them with the coordinator, in one process.
    """

    def __init__(self, tree: ControlTree, me: int, hold_s: float = HOLD_S) -> None:
        self.tree = tree
        self.me = me
        self.parent = tree.parent[me]
        self.children = tree.children[me]
        #: Only relays merge (node 0 hands everything to the coordinator).
        self.merger = ReportMerger(tree, me, hold_s) if self.children and self.parent is not None else None

    # ---- up -------------------------------------------------------------------------
    def own_at_root(self, items: list[Any]) -> list[Any]:
        """Node 0's own items for its coordinator: a report by cache id alone as a set of one node,
        so that it joins its children's sets instead of turning the op into per-node reports."""
        me = ((self.me, self.me + 1),)
        return [wire.ReadySet(m.group, m.seq, m.cache_id, me)
                if type(m) is wire.Ready and m.pattern is None and m.contribution is None and not m.no_fusion
                and not m.waited else (self.me, m) for m in items]

    def from_child(self, child: int, items: list[Any]) -> list[Any]:
        """A child's decoded batch as (origin, item) pairs and merged sets, in order."""
        lo, hi = self.tree.subtree(child)
        entries: list[Any] = []
        for item in items:
            kind = type(item)
            if kind is wire.Via:
                if lo <= item.node < hi and item.node != child:
                    entries.extend((item.node, m) for m in item.items)
                else:
                    log.error("control tree: node %d passed up items of node %d, not of its subtree [%d, %d): "
                              "dropped", child, item.node, lo, hi)
            elif kind is wire.ReadySet:
                if clip(item.ranges, lo, hi) == item.ranges:
                    entries.append(item)
                else:
                    log.error("control tree: node %d passed up reports of nodes %s, not all of its subtree "
                              "[%d, %d): dropped", child, list(item.ranges), lo, hi)
            else:
                entries.append((child, item))
        return entries

    def up(self, entries: list[Any], now: float) -> list[Any]:
        """What to send the parent for ``entries`` (this node's own as (me, item)): relays merge."""
        if self.merger is not None:
            entries = self.merger.up(entries, now)
        return self.pack_up(entries)

    def expire(self, now: float) -> list[Any]:
        """Partial merges held too long, ready to send up."""
        return self.merger.expire(now) if self.merger is not None else []

    def pack_up(self, entries: list[Any]) -> list[Any]:
        """(origin, item) pairs as items of one frame: this node's plain, others' in ``Via``."""
        out: list[Any] = []
        for entry in entries:
            if type(entry) is wire.ReadySet:
                out.append(entry)
                continue
            origin, item = entry
            if origin == self.me:
                out.append(item)
            elif out and type(out[-1]) is wire.Via and out[-1].node == origin:
                out[-1].items.append(item)
            else:
                out.append(wire.Via(origin, [item]))
        return out

    # ---- down -----------------------------------------------------------------------
    def route_entries(self, entries: list[tuple[Ranges, dict[str, Any]]]) -> tuple[list[dict[str, Any]],
                                                                                dict[int, list[Any]]]:
        """(ranges, wire map) pairs in order -> this node's maps, and per child what to send it:
        wire maps for a leaf (all its own), ``Routed`` items for a relay."""
        mine: list[dict[str, Any]] = []
        per_child: dict[int, list[Any]] = {}
        route = self.tree.route
        merger = self.merger
        for ranges, raw in entries:
            here, parts = route(self.me, ranges)
            if here:
                mine.append(raw)
            if merger is not None and type(raw) is dict:
                merger.learn(raw)
            for child, part in parts:
                batch = per_child.setdefault(child, [])
                if not self.tree.children[child]:
                    batch.append(raw)
                elif batch and type(batch[-1]) is wire.Routed and batch[-1].ranges == part:
                    batch[-1].items.append(raw)
                else:
                    batch.append(wire.Routed(part, [raw]))
        return mine, per_child

    def from_parent(self, items: list[Any]) -> list[tuple[Ranges, dict[str, Any]]]:
        """A frame from the parent as (ranges, wire map) pairs: ``Routed`` items keep their ranges
        (clipped to this subtree), anything else is for this node alone."""
        lo, hi = self.tree.subtree(self.me)
        entries: list[tuple[Ranges, dict[str, Any]]] = []
        own = ((self.me, self.me + 1),)
        for item in items:
            if type(item) is wire.Routed:
                part = clip(item.ranges, lo, hi)
                if part:
                    entries.extend((part, raw) for raw in item.items)
            else:
                entries.append((own, item))
        return entries
