"""One rank of a program in one node's daemon, over a lane's ``Transport``.

:meth:`Plan.build` compiles once (cached per program, rank, count, dtype and tile size)
what this rank does; :func:`run` runs it as a dataflow engine inside one
``transport.wait()``: a step runs when its threadblock predecessor and its dependency are
done and, if it receives, when its data has landed — per tile, so tiles pipeline across
nodes (tile t+1 of a chunk leaves while tile t is reduced further down the line).

The transport has one FIFO stream per peer and no channels, so the program's channels are
multiplexed onto it by a *static* order that both ends compute from the program alone:
every transfer (tile, matched send/receive pair) between a sender and a receiver is ranked
by (depth of its send step in the happens-before graph, tile, channel, k).  The sender
posts its sends to a peer in that order (a send whose data is ready but whose predecessor
on that stream is not yet posted waits in a queue); the receiver posts, before anything
else, all its receives in that order — into a landing area sized to the op's known receive
volume, or, for a plain receive whose destination nothing else can touch until it runs
(:func:`_lands_in_place`), straight into that destination — and applies each receiving step
once its data has landed and its dependencies are done.  Nothing is ever left in a socket
waiting for a receive.  A send of one chunk or
of whole chunks goes straight from working memory (no copy); until the transport reports it
complete, a step that would overwrite that memory waits.

Why this cannot deadlock: the happens-before graph (threadblock order, dependencies,
matched transfers; per tile, tiles independent) is acyclic — :class:`~commd.algorithms.
execute.Wiring` refuses it otherwise — and sorting its vertices by depth is a topological
order every node computes identically.  By induction on depth, over steps and transfers
together: a step's predecessors all have smaller depth, so they ran and the receives among
them were delivered; so the step runs.  A transfer's send step ran, and so did every send
before it on its stream (their depth is not larger), so it was posted; the receive it meets
was posted at the start: it is delivered.  A step held back by a send still reading its
destination waits for a step before it in happens-before (the checker refuses the data
race it would otherwise be), whose transfer the same induction delivers.  Sends and
receives wait on nothing but each other and the data, so the transport's deadline is the
only bound a failure needs: a peer that dies or never sends is a ``TransportError`` naming
it, which :func:`run` lets through, never a hang.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from commd.algorithms.errors import ProgramError
from commd.algorithms.execute import REDUCE_OPS, StepId, Transfer, Wiring, run_step, tile_view, tiles
from commd.algorithms.ir import Algorithm, Step, StepType
from commd.algorithms.layout import (
    BufferLayout,
    RankLayout,
    address,
    allocate,
    finish,
    layouts_for,
    working_bound,
    writes_input,
)
from commd.lanes.base import Done, Transport, TransportError

#: Default tile: small enough that a 4-node pipeline fills, large enough that a step's
#: Python overhead (tens of µs) is a small part of its transfer time.
DEFAULT_TILE_BYTES = 256 << 10


@dataclass(frozen=True)
class Slot:
    """One transfer of this rank on the wire: its place in a peer's stream and in the landing area."""

    tile: int
    transfer: Transfer
    elements: int  # cnt × tile width
    landing: int = -1  # element offset in the landing area (receives landing there only)
    direct: bool = False  # a plain receive (r, rcs) posted straight into its destination (see _lands_in_place)


@dataclass(frozen=True, slots=True)
class StepRun:
    """What the engine asks of one step on every tile, read off its type once per plan (the
    enum's properties and frozenset lookups cost more than the step's bookkeeping otherwise)."""

    step: Step
    dependency: tuple[int, int] | None
    receives: bool
    sends: bool
    writes_dst: bool
    zero_copy: bool  # ``s``/``rrcs``: what it sends can be the working buffer's own memory
    dependents: tuple[int, ...]  # threadblocks whose step waits on this one


@dataclass(frozen=True, eq=False)
class Plan:
    """What one rank does for one op shape, computed once and reused for every op of that shape."""

    algo: Algorithm
    rank: int
    count: int
    dtype: np.dtype
    layout: RankLayout
    tiles: tuple[tuple[int, int], ...]
    threadblocks: dict[int, tuple[Step, ...]]  # threadblock id -> its steps
    peers_of: dict[int, tuple[int, int]]  # threadblock id -> (send peer, recv peer)
    sends: dict[int, tuple[Slot, ...]]  # peer -> this rank's sends to it, in wire order
    recvs: dict[int, tuple[Slot, ...]]  # peer -> this rank's receives from it, in wire order
    send_position: dict[tuple[int, StepId], tuple[int, int]]  # (tile, send step) -> (peer, index)
    recv_slot: dict[tuple[int, StepId], Slot]  # (tile, receive step) -> its slot
    dependents: dict[tuple[int, int], tuple[int, ...]]  # (tb, step) -> threadblocks whose step waits on it
    landing_elements: int
    writes_input: bool
    #: (tile, rrs step) -> element offset of its result in the outgoing area (what an rrs sends is a
    #: fresh value: it gets a place of its own for the run, kept between runs like the landing area)
    outgoing: dict[tuple[int, StepId], int] = field(default_factory=dict)
    outgoing_elements: int = 0
    #: elements kept after the landing and outgoing areas for the run's scratch and working copies
    working_elements: int = 0
    runs: dict[int, tuple[StepRun, ...]] = field(default_factory=dict)  # threadblock id -> its steps' records
    source: str = field(default="<program>", compare=False)
    _spare: list[np.ndarray] = field(default_factory=list, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def take_landing(self) -> np.ndarray:
        """The landing and outgoing areas of one run, then room for its scratch and working
        copies, in one array: the plan keeps one between runs, so that an op of a cached shape
        does not fault in fresh pages each time (two runs at once get two)."""
        with self._lock:
            if self._spare:
                return self._spare.pop()
        return np.empty(self.landing_elements + self.outgoing_elements + self.working_elements, self.dtype)

    def give_back(self, landing: np.ndarray) -> None:
        with self._lock:
            if not self._spare:
                self._spare.append(landing)

    @staticmethod
    def build(algo: Algorithm, rank: int, count: int, dtype: np.dtype | str, tile_bytes: int = DEFAULT_TILE_BYTES,
              source: str = "<program>") -> Plan:
        """The plan of ``rank`` for ``count`` elements of ``dtype`` (cached); ProgramError if the
        program cannot run (a dangling peer, an unmatched transfer, a cycle, bad chunk counts)."""
        key = (id(algo), int(rank), int(count), np.dtype(dtype).str, int(tile_bytes), source)
        hit = _BY_IDENTITY.get(key)
        if hit is not None and hit[0] is algo:  # the hot path: no hash over the whole program
            return hit[1]
        plan = _build(algo, *key[1:])
        if len(_BY_IDENTITY) >= 64:
            _BY_IDENTITY.clear()
        _BY_IDENTITY[key] = (algo, plan)
        return plan


#: Plans by the identity of their program object (checked with ``is``), in front of the cache
#: by content: hashing a frozen program costs about a microsecond per step, on every op.
_BY_IDENTITY: dict[tuple[int, int, int, str, int, str], tuple[Algorithm, Plan]] = {}


@functools.lru_cache(maxsize=32)
def _build(algo: Algorithm, rank: int, count: int, dtype_str: str, tile_bytes: int, source: str) -> Plan:
    dtype = np.dtype(dtype_str)
    if tile_bytes <= 0:
        raise ValueError(f"tile_bytes must be positive, got {tile_bytes}")
    layouts = layouts_for(algo, count, source)
    if not 0 <= rank < len(layouts):
        raise ProgramError(f"no rank {rank} in a program of {len(layouts)} ranks", source=source)
    wiring = Wiring(algo, layouts, source)
    wiring.require_acyclic()
    layout = layouts[rank]
    tile_list = tuple(tiles(layout.q, max(1, tile_bytes // dtype.itemsize)))

    def rank_key(tile: int, t: Transfer) -> tuple[int, int, int, int]:
        return (wiring.depth[t.send], tile, t.channel[2], t.index)

    sends: dict[int, list[Slot]] = collections.defaultdict(list)
    recvs: dict[int, list[Slot]] = collections.defaultdict(list)
    for t in wiring.transfers:
        for ti, (lo, hi) in enumerate(tile_list):
            if t.channel[0] == rank:
                sends[t.channel[1]].append(Slot(ti, t, t.cnt * (hi - lo)))
            if t.channel[1] == rank:
                recvs[t.channel[0]].append(Slot(ti, t, t.cnt * (hi - lo)))
    send_position: dict[tuple[int, StepId], tuple[int, int]] = {}
    for peer, slots in sends.items():
        slots.sort(key=lambda s: rank_key(s.tile, s.transfer))
        for index, slot in enumerate(slots):
            send_position[(slot.tile, slot.transfer.send)] = (peer, index)
    recv_slot: dict[tuple[int, StepId], Slot] = {}
    landing = 0
    in_place = _lands_in_place(algo, rank, wiring, layout)
    for peer in sorted(recvs):
        ordered = sorted(recvs[peer], key=lambda s: rank_key(s.tile, s.transfer))
        placed = []
        for slot in ordered:
            lo, hi = tile_list[slot.tile]
            if slot.transfer.recv in in_place and (slot.transfer.cnt == 1 or hi - lo == layout.q):
                slot = Slot(slot.tile, slot.transfer, slot.elements, -1, True)  # contiguous in its destination
            else:
                slot = Slot(slot.tile, slot.transfer, slot.elements, landing)
                landing += slot.elements
            placed.append(slot)
            recv_slot[(slot.tile, slot.transfer.recv)] = slot
        recvs[peer] = placed
    mine = algo.ranks[rank]
    outgoing: dict[tuple[int, StepId], int] = {}
    outgoing_elements = 0
    for tb in mine.threadblocks:
        for index, step in enumerate(tb.steps):
            if step.type is StepType.RECV_REDUCE_SEND:
                for ti, (lo, hi) in enumerate(tile_list):
                    outgoing[(ti, (rank, tb.id, index))] = landing + outgoing_elements
                    outgoing_elements += step.cnt * (hi - lo)
    dependents: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for tb in mine.threadblocks:
        for step in tb.steps:
            if step.dependency is not None:
                dependents[step.dependency].append(tb.id)
    runs = {tb.id: tuple(StepRun(step, step.dependency, step.type.receives, step.type.sends, step.type.writes_dst,
                                 step.type in _ZERO_COPY, tuple(dependents.get((tb.id, s), ())))
                         for s, step in enumerate(tb.steps))
            for tb in mine.threadblocks}
    return Plan(algo, rank, count, dtype, layout, tile_list,
                {tb.id: tb.steps for tb in mine.threadblocks}, {tb.id: (tb.send, tb.recv) for tb in mine.threadblocks},
                {p: tuple(v) for p, v in sends.items()}, {p: tuple(v) for p, v in recvs.items()}, send_position,
                recv_slot, {k: tuple(v) for k, v in dependents.items()}, landing, writes_input(algo, rank), outgoing,
                outgoing_elements, working_bound(layout), runs, source)


def _lands_in_place(algo: Algorithm, rank: int, wiring: Wiring, layout: RankLayout) -> frozenset[StepId]:
    """The plain receives (``r``, ``rcs``: dst ← received) of ``rank`` whose data may be received
    straight into their destination instead of the landing area (one copy fewer per chunk).

    Data lands when it arrives: after its send step S ran on the peer, possibly long before the
    receive step R runs here.  That is safe when every other step A of this rank that touches
    the destination's chunks either runs after R (R precedes A in happens-before: R waits for
    the data) or is over before S starts: A precedes S and, if A sends, the receive matched with
    A's send precedes S too (the peer has all of A's bytes, so nothing still reads A's memory).
    Happens-before is the checked program's (threadblock order, dependencies, matched transfers),
    per tile; buffers that alias (in-place programs) are compared in the buffer they live in."""
    order = wiring.order
    bit = {sid: 1 << n for n, sid in enumerate(order)}
    before: dict[StepId, int] = {}  # every step that precedes, as a bitmask over ``order``
    for sid in order:
        mask = 0
        for p in wiring.predecessors(sid):
            mask |= before[p] | bit[p]
        before[sid] = mask

    def chunks(buf: str, off: int, cnt: int) -> set[tuple[str, int]]:
        if layout.alias is not None and buf == layout.alias[0]:
            buf, off = layout.alias[1], off + layout.alias[2]
        return {(buf, c) for c in range(off, off + cnt)}

    touches: dict[StepId, set[tuple[str, int]]] = {}
    for sid, step in wiring.steps.items():
        if sid[0] != rank or step.type is StepType.NOP:
            continue
        reached: set[tuple[str, int]] = set()
        if step.type.reads_src:
            reached |= chunks(step.srcbuf, step.srcoff, step.cnt)
        if step.type.writes_dst or step.type.reads_dst:
            reached |= chunks(step.dstbuf, step.dstoff, step.cnt)
        touches[sid] = reached
    safe = set()
    for sid, step in wiring.steps.items():
        if sid[0] != rank or step.type not in (StepType.RECV, StepType.RECV_COPY_SEND):
            continue
        send = wiring.transfer_of_recv[sid].send
        dst = chunks(step.dstbuf, step.dstoff, step.cnt)
        for other, reached in touches.items():
            if other == sid or not reached & dst or before[other] & bit[sid]:
                continue  # untouched, or after this receive
            sent = wiring.transfer_of_send.get(other)
            if not before[send] & bit[other] or (sent is not None and sent.recv != send
                                                  and not before[send] & bit[sent.recv]):
                break
        else:
            safe.add(sid)
    return frozenset(safe)


#: Steps whose sent data can be the working buffer's own memory (``rcs`` forwards the landing
#: area's, ``rrs`` a fresh result: neither needs a copy either).
_ZERO_COPY = frozenset({StepType.SEND, StepType.RECV_REDUCE_COPY_SEND})


def _bytes(a: np.ndarray) -> memoryview:
    """A flat byte view of a contiguous array (what the transport moves)."""
    return memoryview(a).cast("B")


class _Engine:
    """The per-run state of one plan: which step each (tile, threadblock) is at, what has landed."""

    def __init__(self, plan: Plan, transport: Transport, peers: list[int], work: dict[str, np.ndarray],
                 op: str, area: np.ndarray) -> None:
        self.plan = plan
        self.transport = transport
        self.peers = peers
        self.work = work
        self.op = op
        self.next = {(ti, tb): 0 for ti in range(len(plan.tiles)) for tb in plan.threadblocks}
        self.landing = area[:plan.landing_elements + plan.outgoing_elements]
        self.landed: set[tuple[int, StepId]] = set()
        self.outbox: dict[int, dict[int, tuple[np.ndarray, int, list[tuple[int, int]] | None]]] = {
            p: {} for p in plan.sends}
        self.posted = {p: 0 for p in plan.sends}
        self.runnable: collections.deque[tuple[int, int]] = collections.deque()
        self.draining = False
        # zero-copy sends not yet complete, per tile: the working memory (address ranges) they read
        self.inflight: dict[int, list[list[tuple[int, int]]]] = collections.defaultdict(list)
        self.held: list[tuple[int, int]] = []  # (tile, threadblock) waiting for such a send to complete
        self.address = {name: address(a) for name, a in work.items()}
        self.itemsize = plan.dtype.itemsize

    def start(self) -> None:
        landing = _bytes(self.landing) if self.landing.size else memoryview(b"")
        size = self.plan.dtype.itemsize
        q = self.plan.layout.q
        for peer, slots in self.plan.recvs.items():
            for slot in slots:
                if slot.direct:
                    _, tb, s = slot.transfer.recv
                    step = self.plan.threadblocks[tb][s]
                    lo, hi = self.plan.tiles[slot.tile]
                    target = tile_view(self.work[step.dstbuf], q, step.dstoff, step.cnt, lo, hi)
                    assert target.flags.c_contiguous  # (one chunk, or whole chunks: _build's condition)
                    view = _bytes(target)
                else:
                    view = landing[slot.landing * size:(slot.landing + slot.elements) * size]
                self.transport.post_recv(self.peers[peer], view, self._landed(slot))
        self.runnable.extend(sorted(self.next))
        self._drain()

    def _landed(self, slot: Slot) -> Done:
        def done() -> None:
            self.landed.add((slot.tile, slot.transfer.recv))
            self.runnable.append((slot.tile, slot.transfer.recv[1]))
            self._drain()
        return done

    def _drain(self) -> None:
        if self.draining:  # a completion inside a post: the running drain picks its work up
            return
        self.draining = True
        try:
            while self.runnable:
                self._advance(*self.runnable.popleft())
        finally:
            self.draining = False

    def _advance(self, ti: int, tb: int) -> None:
        plan, me, nxt = self.plan, self.plan.rank, self.next
        runs = plan.runs[tb]
        lo, hi = plan.tiles[ti]
        whole = hi - lo == plan.layout.q
        key = (ti, tb)
        while nxt[key] < len(runs):
            s = nxt[key]
            run = runs[s]
            step = run.step
            dep = run.dependency
            if dep is not None and nxt[(ti, dep[0])] <= dep[1]:
                return
            sid = (me, tb, s)
            received = None
            if run.receives:
                if (ti, sid) not in self.landed:
                    return
                slot = plan.recv_slot[(ti, sid)]
                if slot.direct:  # the data is in its destination already
                    if run.sends:  # rcs forwards it from there, as a zero-copy send
                        reads = self._ranges(step.dstbuf, step.dstoff, step.cnt, lo, hi)
                        self.inflight[ti].append(reads)
                        self._send(ti, sid, tile_view(self.work[step.dstbuf], plan.layout.q, step.dstoff,
                                                      step.cnt, lo, hi), reads)
                    nxt[key] = s + 1
                    if run.dependents:
                        self.runnable.extend((ti, waiter) for waiter in run.dependents)
                    continue
                received = self.landing[slot.landing:slot.landing + slot.elements]
            if run.writes_dst and self.inflight[ti] and self._overwrites(ti, step, lo, hi):
                self.held.append(key)
                return
            zero_copy = run.zero_copy and (step.cnt == 1 or whole)
            at = plan.outgoing.get((ti, sid)) if run.sends else None
            result = None if at is None else self.landing[at:at + step.cnt * (hi - lo)]
            data = run_step(step, self.work, plan.layout.q, lo, hi, self.op, received, copy=not zero_copy,
                            result=result)
            if run.sends:
                reads = None
                if zero_copy:
                    buf, off = (step.srcbuf, step.srcoff) if step.type is StepType.SEND else (step.dstbuf, step.dstoff)
                    reads = self._ranges(buf, off, step.cnt, lo, hi)
                    self.inflight[ti].append(reads)
                self._send(ti, sid, data, reads)
            nxt[key] = s + 1
            if run.dependents:
                self.runnable.extend((ti, waiter) for waiter in run.dependents)

    def _ranges(self, buf: str, off: int, cnt: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """Address ranges of tile [lo, hi) of chunks [off, off + cnt) of working buffer ``buf``
        (addresses, so that aliased buffers — in-place programs — compare right)."""
        q, size, base = self.plan.layout.q, self.itemsize, self.address[buf]
        return [(base + ((off + c) * q + lo) * size, base + ((off + c) * q + hi) * size) for c in range(cnt)]

    def _overwrites(self, ti: int, step: Step, lo: int, hi: int) -> bool:
        """Whether ``step`` would write memory that a zero-copy send of tile ``ti`` still reads."""
        writes = self._ranges(step.dstbuf, step.dstoff, step.cnt, lo, hi)
        return any(a < d and c < b for reads in self.inflight[ti] for c, d in reads for a, b in writes)

    def _send(self, ti: int, sid: StepId, data: np.ndarray, reads: list[tuple[int, int]] | None) -> None:
        peer, index = self.plan.send_position[(ti, sid)]
        box = self.outbox[peer]
        box[index] = (data, ti, reads)
        slots = self.plan.sends[peer]
        while self.posted[peer] < len(slots) and self.posted[peer] in box:
            ready, tile, held = box.pop(self.posted[peer])
            done = self._sent(tile, held) if held is not None else None
            self.transport.post_send(self.peers[peer], _bytes(ready), done)
            self.posted[peer] += 1

    def _sent(self, ti: int, reads: list[tuple[int, int]]) -> Done:
        def done() -> None:
            self.inflight[ti].remove(reads)
            self.runnable.extend(self.held)
            self.held.clear()
            self._drain()
        return done

    def unfinished(self) -> list[tuple[int, int, int]]:
        """(tile, threadblock, step) of every threadblock that did not run to its end."""
        return [(ti, tb, s) for (ti, tb), s in sorted(self.next.items()) if s < len(self.plan.threadblocks[tb])]


def run(plan: Plan, transport: Transport, peers: list[int] | tuple[int, ...], inp: np.ndarray, out: np.ndarray,
        op: str, deadline: float | None = None) -> None:
    """Run this rank's part of ``plan``: ``out`` gets the rank's result of the collective on ``inp``.

    ``peers[r]`` is the node the transport knows program rank ``r`` by; ``inp`` and ``out`` are
    flat arrays of the plan's dtype (``out`` may be ``inp`` for an in-place op whose input and
    output have one size).  ``deadline`` (``time.monotonic()``) is the lane call's; the
    transport enforces it during the run.  A TransportError propagates as raised."""
    running = start(plan, transport, peers, inp, out, op, deadline)
    transport.wait()
    running.finish()


class Running:
    """A started run of one rank (:func:`start`): its engine, working buffers and kept area."""

    def __init__(self, plan: Plan, engine: _Engine, area: np.ndarray,
                 stores: list[tuple[BufferLayout, np.ndarray, np.ndarray]]) -> None:
        self.plan, self._engine, self._area, self._stores = plan, engine, area, stores

    def finish(self) -> None:
        """Once the transport has completed everything posted: the results into the user's memory."""
        stuck = self._engine.unfinished()
        if stuck:  # only a transport that returned before its receives landed can get here
            raise TransportError(None, "internal", f"rank {self.plan.rank} of {self.plan.algo.name}: the "
                                                   f"transport's wait returned with steps not run, e.g. (tile, "
                                                   f"threadblock, step) {stuck[:4]}")
        finish(self._stores)
        self.plan.give_back(self._area)


def start(plan: Plan, transport: Transport, peers: list[int] | tuple[int, ...], inp: np.ndarray, out: np.ndarray,
          op: str, deadline: float | None = None) -> Running:
    """:func:`run` without the wait: post this rank's receives and run every step that needs no
    data yet.  The caller drives the transport until all that is posted (and whatever the
    completions post) is done, then calls ``finish()``.  :func:`run` is this, one
    ``transport.wait()`` and ``finish()``; a driver that runs every rank in one thread (the
    interpreter's CPU benchmark) starts them all first."""
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not one of {sorted(REDUCE_OPS)}")
    if len(peers) != plan.algo.ngpus:
        raise ValueError(f"{len(peers)} peers for a program of {plan.algo.ngpus} ranks")
    for what, a in (("input", inp), ("output", out)):
        if a.dtype != plan.dtype or a.ndim != 1 or not a.flags.c_contiguous:
            raise ValueError(f"{what} must be a flat contiguous {plan.dtype} array, got {a.dtype} of shape {a.shape}")
    if not out.flags.writeable:
        raise ValueError("output must be writable")
    if deadline is not None and time.monotonic() >= deadline:
        raise TransportError(None, "timeout", f"rank {plan.rank} of {plan.algo.name}: the deadline passed before "
                                              "the program started")
    area = plan.take_landing()
    free = [plan.landing_elements + plan.outgoing_elements]

    def zeros(n: int) -> np.ndarray:  # the run's scratch and working copies, from the kept area
        piece = area[free[0]:free[0] + n]
        free[0] += n
        piece.fill(0)
        return piece

    work, stores = allocate(plan.layout, plan.dtype, inp, out, plan.writes_input, zeros)
    engine = _Engine(plan, transport, list(peers), work, op, area)
    engine.start()
    return Running(plan, engine, area, stores)
