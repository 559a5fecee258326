"""Proves a program right before it runs, with the runtime's semantics, for every schedule.

Stages, in order; each names the file, rank, threadblock and step of every problem it finds:

1. well-formed — ids, peers, channels, chunk ranges inside the buffers, dependencies that
   exist, and chunk counts consistent with the collective and the rank count;
2. matching — per (sender, receiver, channel) the k-th send meets the k-th receive, with
   the same count, none left over;
3. no deadlock — the happens-before graph (threadblock order, dependencies, a receive
   after its matched send; sends never block in commd's runtime) is acyclic;
4. no data race — two accesses to one chunk, at least one a write, are always ordered by
   happens-before;
5. the postcondition, by one symbolic run;
6. determinism — not a refusal but the program's class (:class:`Determinism`): ``bitwise``
   when every rank holding the reduction of the same sources holds the same reduction tree
   (every node ends bit-identical, commd's lane contract, for any dtype and op), else
   ``order-dependent``, with the results whose ranks reduce in different orders.  Program
   selection keeps an order-dependent program off the ops whose result depends on the order
   (``core.ops.order_sensitive``: float sums, products and averages).

A step's accesses happen while it runs: a send has read its source once its step is done
(the runtime copies the data out, so a later step may overwrite the chunk), a receive writes
its destination when its step runs.  Chunks suffice: the runtime runs the same program on
every tile, and tiles touch disjoint elements.

A stage runs only when the stages before it found nothing: each relies on what the earlier
ones proved (a race makes the symbolic run's result depend on the schedule, a cycle leaves
no order to run it in).  :class:`Analysis` keeps what the stages computed for the
simulator and the interpreter: the matched transfers, a topological order of the steps,
the tree of every output chunk and the determinism class; :func:`report` returns it with
the problems, for callers that show both.
"""

from __future__ import annotations

import graphlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import (
    BITWISE,
    BUFFERS,
    ORDER_DEPENDENT,
    Algorithm,
    Rank,
    Step,
    StepType,
    Threadblock,
)
from commd.algorithms.postcondition import ChunkRef, Postcondition, for_algorithm, shape_problems
from commd.algorithms.symbolic import Expr, StepRef, SymbolicState, run

#: The largest program checked: the race stage keeps a bitset of ancestors per step (steps²/16
#: bytes on average: 64 MiB here), and every stage walks each chunk a step touches.
MAX_STEPS = 1 << 15
MAX_CHUNKS = 1 << 22  # chunks touched by all steps, and chunks in all buffers, each


@dataclass(frozen=True)
class Transfer:
    """A matched pair: ``send`` on ``sender`` meets ``recv`` on ``receiver`` (the k-th on ``channel``)."""

    send: StepRef
    recv: StepRef
    channel: int
    cnt: int


@dataclass(frozen=True)
class OrderDifference:
    """One result (the reduction of ``sources``) that ranks build in different orders: each
    distinct tree with the slots holding it (sorted), so a message can say who differs."""

    sources: frozenset[ChunkRef]
    trees: tuple[tuple[str, tuple[ChunkRef, ...]], ...]  # (the tree rendered, the slots holding it)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks holding this result."""
        return tuple(sorted({slot.rank for _, slots in self.trees for slot in slots}))

    def describe(self, limit: int = 4) -> str:
        """``ranks 0, 1, 2 hold it in 3 orders: r0.i0 = (…); r1.i0 = (…); …``: the first ``limit``
        orders, each with the slots that hold it."""
        shown = "; ".join(f"{', '.join(s.short() for s in slots)} = {tree}" for tree, slots in self.trees[:limit])
        more = f"; and {len(self.trees) - limit} more order(s)" if len(self.trees) > limit else ""
        return f"ranks {', '.join(map(str, self.ranks))} hold it in {len(self.trees)} orders: {shown}{more}"


@dataclass(frozen=True)
class Determinism:
    """A checked program's determinism class (``ir.BITWISE`` or ``ir.ORDER_DEPENDENT``) and why.

    Why a class rather than a refusal: a program whose ranks reduce in different orders is
    exact for integers and min/max/bitwise ops and within rounding for floats, so it may run
    every op but those that must be bit-identical on every node (float sums, products, averages)."""

    kind: str
    differences: tuple[OrderDifference, ...] = ()  # the results reduced in more than one order

    @property
    def bitwise(self) -> bool:
        return self.kind == BITWISE

    def explain(self, limit: int = 3) -> list[str]:
        """The class and why, as lines: the first ``limit`` results reduced in different orders."""
        if self.bitwise:
            return [f"{BITWISE} (every rank reduces each result's sources in the same order: bit-identical results "
                    "on every rank for any dtype and reduce op)"]
        lines = [f"{ORDER_DEPENDENT} (ranks reduce the same sources in different orders)",
                 "integer dtypes, min, max, band, bor, bxor: exact on every rank; float sum, product, avg: ranks "
                 "may differ in the last bits, so commd does not choose it for those ops (unless an [[algorithms]] "
                 "rule says allow_order_dependent = true)"]
        for diff in self.differences[:limit]:
            lines.append(f"result {'+'.join(s.short() for s in sorted(diff.sources))}: {diff.describe()}")
        if len(self.differences) > limit:
            lines.append(f"… and {len(self.differences) - limit} more result(s) reduced in different orders")
        return lines


@dataclass(frozen=True)
class Analysis:
    """What the checker proved about an accepted program, for the stages that run it."""

    algo: Algorithm
    post: Postcondition
    order: tuple[StepRef, ...]  # every step, in a topological order of happens-before
    transfers: tuple[Transfer, ...]
    received_from: Mapping[StepRef, StepRef]  # receiving step → its matched send
    sent_to: Mapping[StepRef, StepRef]  # sending step → its matched receive
    outputs: Mapping[ChunkRef, Expr]  # per postcondition slot, the value it ends with
    state: SymbolicState
    determinism: Determinism


@dataclass(frozen=True)
class Report:
    """A check's outcome: the problems of the first stage that found any, or (accepted) the analysis."""

    problems: tuple[ProgramError, ...]
    analysis: Analysis | None

    @property
    def determinism(self) -> Determinism | None:
        """An accepted program's class (None when refused)."""
        return self.analysis.determinism if self.analysis is not None else None


def check(algo: Algorithm, post: Postcondition | str | Path | None = None,
          source: str | Path = "<program>") -> Determinism:
    """Raise the first :class:`ProgramError` of ``algo``, or return its determinism class when it is proved right."""
    return analyze(algo, post, source).determinism


def problems(algo: Algorithm, post: Postcondition | str | Path | None = None,
             source: str | Path = "<program>") -> list[ProgramError]:
    """Every problem of the first stage that finds any (empty: accepted)."""
    return list(report(algo, post, source).problems)


def report(algo: Algorithm, post: Postcondition | str | Path | None = None,
           source: str | Path = "<program>") -> Report:
    """Every problem of the first stage that finds any, or the analysis of an accepted program."""
    found, analysis = _Checker(algo, post, str(source)).run()
    return Report(tuple(found), None if found else analysis)


def analyze(algo: Algorithm, post: Postcondition | str | Path | None = None,
            source: str | Path = "<program>") -> Analysis:
    """Check ``algo`` and return what the check computed; raise the first problem if refused."""
    found, analysis = _Checker(algo, post, str(source)).run()
    if found:
        raise found[0]
    assert analysis is not None
    return analysis


class _Checker:
    def __init__(self, algo: Algorithm, post: Postcondition | str | Path | None, source: str) -> None:
        self.algo = algo
        self.given = post
        self.post: Postcondition | None = None
        self.source = source
        self.found: list[ProgramError] = []
        self.tbs: dict[tuple[int, int], Threadblock] = {}

    def problem(self, reason: str, at: StepRef | None = None, *, rank: int | None = None,
                tb: int | None = None) -> None:
        if at is not None:
            rank, tb = at.rank, at.tb
        self.found.append(ProgramError(reason, source=self.source, rank=rank, threadblock=tb,
                                       step=at.step if at is not None else None))

    def step(self, ref: StepRef) -> Step:
        return self.tbs[(ref.rank, ref.tb)].steps[ref.step]

    def run(self) -> tuple[list[ProgramError], Analysis | None]:
        self.well_formed()
        if self.found:
            return self.found, None
        try:
            self.post = for_algorithm(self.algo, self.given, source=self.source)
        except ProgramError as exc:
            return [exc], None
        transfers = self.matching()
        if self.found:
            return self.found, None
        order = self.happens_before(transfers)
        if self.found:
            return self.found, None
        self.races(order)
        if self.found:
            return self.found, None
        received_from = {t.recv: t.send for t in transfers}
        state = run(self.algo, order, received_from)
        outputs = self.postcondition(state)
        if self.found:
            return self.found, None
        determinism = self.determinism(outputs)
        assert self.post is not None
        return [], Analysis(self.algo, self.post, tuple(order), tuple(transfers), received_from,
                            {t.send: t.recv for t in transfers}, outputs, state, determinism)

    # --- 1. well-formed -----------------------------------------------------------------------

    def well_formed(self) -> None:
        algo = self.algo
        if algo.ngpus != len(algo.ranks):
            self.problem(f"ngpus={algo.ngpus} but the program has {len(algo.ranks)} ranks")
        if algo.nchannels < 1:
            self.problem(f"nchannels={algo.nchannels}: needs at least one channel")
        steps = sum(len(tb.steps) for rank in algo.ranks for tb in rank.threadblocks)
        touched = sum(max(step.cnt, 0) for rank in algo.ranks for tb in rank.threadblocks for step in tb.steps)
        held = sum(max(rank.i_chunks, 0) + max(rank.o_chunks, 0) + max(rank.s_chunks, 0) for rank in algo.ranks)
        if steps > MAX_STEPS or touched > MAX_CHUNKS or held > MAX_CHUNKS:
            self.problem(f"too large to check: {steps} steps touching {touched} chunks, buffers of {held} chunks "
                         f"(limits: {MAX_STEPS} steps, {MAX_CHUNKS} chunks)")
            return
        for pos, rank in enumerate(algo.ranks):
            if rank.id != pos:
                self.problem(f"rank at position {pos} has id {rank.id}: ranks must be numbered 0..{len(algo.ranks) - 1}"
                             " in order", rank=pos)
                return
        self.found.extend(shape_problems(algo, self.source))
        for rank in algo.ranks:
            self.rank_well_formed(rank)

    def rank_well_formed(self, rank: Rank) -> None:
        r, nranks = rank.id, len(self.algo.ranks)
        seen_send: dict[tuple[int, int], int] = {}
        seen_recv: dict[tuple[int, int], int] = {}
        for tb in rank.threadblocks:
            if tb.id < 0 or (r, tb.id) in self.tbs:
                self.problem(f"threadblock id {tb.id} is negative or used twice", rank=r, tb=tb.id)
                continue
            self.tbs[(r, tb.id)] = tb
        for tb in rank.threadblocks:
            if not 0 <= tb.chan < self.algo.nchannels:
                self.problem(f"channel {tb.chan} outside 0..{self.algo.nchannels - 1} (nchannels="
                             f"{self.algo.nchannels})", rank=r, tb=tb.id)
            for role, peer, seen in (("send", tb.send, seen_send), ("recv", tb.recv, seen_recv)):
                if peer == -1:
                    continue
                if not 0 <= peer < nranks or peer == r:
                    why = "the rank itself" if peer == r else f"outside 0..{nranks - 1}"
                    self.problem(f"{role} peer {peer} is {why}", rank=r, tb=tb.id)
                    continue
                other = seen.setdefault((peer, tb.chan), tb.id)
                if other != tb.id:
                    verb = "send to" if role == "send" else "receive from"
                    self.problem(f"threadblocks {other} and {tb.id} both {verb} rank {peer} on channel {tb.chan}: "
                                 "the order of their transfers would be ambiguous", rank=r, tb=tb.id)
            for pos, step in enumerate(tb.steps):
                self.step_well_formed(rank, tb, pos, step)

    def step_well_formed(self, rank: Rank, tb: Threadblock, pos: int, step: Step) -> None:
        at = StepRef(rank.id, tb.id, pos)
        t = step.type
        if step.s != pos:
            self.problem(f"step numbered s={step.s} at position {pos}: steps must be numbered in order", at)
        if not isinstance(t, StepType):
            self.problem(f"unknown step type {t!r}", at)
            return
        if t.sends and tb.send < 0:
            self.problem(f"'{t.value}' sends but the threadblock has no send peer (send=-1)", at)
        if t.receives and tb.recv < 0:
            self.problem(f"'{t.value}' receives but the threadblock has no receive peer (recv=-1)", at)
        if t is not StepType.NOP:
            if step.cnt < 1:
                self.problem(f"'{t.value}' with cnt={step.cnt}: a step moves at least one chunk", at)
            else:
                if t.reads_src:
                    self.range_ok(rank, at, "src", step.srcbuf, step.srcoff, step.cnt)
                if t.writes_dst or t.reads_dst:
                    self.range_ok(rank, at, "dst", step.dstbuf, step.dstoff, step.cnt)
        dep = step.dependency
        if dep is None:
            return
        dtb, ds = dep
        target = self.tbs.get((rank.id, dtb))
        if target is None:
            self.problem(f"depends on threadblock {dtb}, which rank {rank.id} does not have", at)
        elif not 0 <= ds < len(target.steps):
            self.problem(f"depends on step {ds} of threadblock {dtb}, which has {len(target.steps)} steps", at)
        elif (dtb, ds) == (tb.id, pos):
            self.problem("depends on itself", at)

    def range_ok(self, rank: Rank, at: StepRef, role: str, buf: str, off: int, cnt: int) -> None:
        if buf not in BUFFERS:
            self.problem(f"{role} buffer {buf!r} is not one of {', '.join(BUFFERS)}", at)
            return
        have = rank.chunks(buf)
        if off < 0 or off + cnt > have:
            self.problem(f"{role} chunks [{off}, {off + cnt}) of buffer {buf!r} outside its {have} chunks on "
                         f"rank {rank.id}", at)

    # --- 2. matching ------------------------------------------------------------------------------

    def matching(self) -> list[Transfer]:
        sends: dict[tuple[int, int, int], list[StepRef]] = {}
        recvs: dict[tuple[int, int, int], list[StepRef]] = {}
        for rank in self.algo.ranks:
            for tb in rank.threadblocks:
                for pos, step in enumerate(tb.steps):
                    if step.type.sends:
                        sends.setdefault((rank.id, tb.send, tb.chan), []).append(StepRef(rank.id, tb.id, pos))
                    if step.type.receives:
                        recvs.setdefault((tb.recv, rank.id, tb.chan), []).append(StepRef(rank.id, tb.id, pos))
        transfers: list[Transfer] = []
        for key in sorted(set(sends) | set(recvs)):
            src, dst, chan = key
            ss, rs = sends.get(key, []), recvs.get(key, [])
            for k, (s, rv) in enumerate(zip(ss, rs, strict=False)):
                sc, rc = self.step(s).cnt, self.step(rv).cnt
                if sc != rc:
                    self.problem(f"receives {rc} chunk(s) from rank {src} on channel {chan}, but the matched send "
                                 f"(#{k + 1} on that channel, {s.short()}) sends {sc}", rv)
                transfers.append(Transfer(s, rv, chan, sc))
            if len(ss) > len(rs):
                self.problem(f"unmatched send: send #{len(rs) + 1} to rank {dst} on channel {chan} has no receive "
                             f"(rank {dst} receives {len(rs)} time(s) from rank {src} on channel {chan}, rank {src} "
                             f"sends {len(ss)})", ss[len(rs)])
            elif len(rs) > len(ss):
                self.problem(f"unmatched receive: receive #{len(ss) + 1} from rank {src} on channel {chan} has no "
                             f"send (rank {src} sends {len(ss)} time(s) to rank {dst} on channel {chan}, rank {dst} "
                             f"receives {len(rs)})", rs[len(ss)])
        return transfers

    # --- 3. happens-before and deadlock -----------------------------------------------------------

    def happens_before(self, transfers: list[Transfer]) -> list[StepRef]:
        """A topological order of happens-before, and its predecessor sets for the race stage."""
        preds: dict[StepRef, list[tuple[StepRef, str]]] = {}
        for rank in self.algo.ranks:
            for tb in rank.threadblocks:
                for pos, step in enumerate(tb.steps):
                    ref = StepRef(rank.id, tb.id, pos)
                    edges = preds.setdefault(ref, [])
                    if pos:
                        edges.append((StepRef(rank.id, tb.id, pos - 1), "the previous step of its threadblock"))
                    if step.dependency is not None:
                        edges.append((StepRef(rank.id, *step.dependency), "its dependency"))
        for t in transfers:
            preds[t.recv].append((t.send, "its matched send"))
        self.preds = preds
        sorter = graphlib.TopologicalSorter({ref: [p for p, _ in edges] for ref, edges in preds.items()})
        try:
            return list(sorter.static_order())
        except graphlib.CycleError as exc:
            cycle: list[StepRef] = exc.args[1]
            self.deadlock(cycle)
            return []

    def deadlock(self, cycle: list[StepRef]) -> None:
        """Name the steps of a cycle; in ``cycle`` each is an immediate predecessor of the next."""
        links = []
        for before, after in zip(cycle, cycle[1:], strict=False):
            why = next(w for p, w in self.preds[after] if p == before)
            links.append(f"{after.short()} ({self.step(after).type.value}) waits for {why}, {before.short()}")
        self.problem("deadlock: these steps wait for each other in a cycle: " + "; ".join(links), cycle[1])

    # --- 4. data races ----------------------------------------------------------------------------

    def races(self, order: list[StepRef]) -> None:
        """Each access must come after the last write of its chunk, each write after the reads since.

        Checked in a topological order, this finds every unordered pair with a write: if every
        access is ordered after the previous write and every write after the previous epoch's
        reads, any two conflicting accesses are linked by a chain of such orderings.
        """
        index = {ref: n for n, ref in enumerate(order)}
        ancestors = [0] * len(order)
        for n, ref in enumerate(order):
            acc = 0
            for p, _ in self.preds[ref]:
                pi = index[p]
                acc |= ancestors[pi] | (1 << pi)
            ancestors[n] = acc
        last_write: dict[ChunkRef, int] = {}
        reads: dict[ChunkRef, list[int]] = {}
        reported: set[tuple[int, int]] = set()

        def ordered(a: int, b: int, slot: ChunkRef, a_writes: bool, b_writes: bool) -> None:
            if (ancestors[b] >> a) & 1 or (a, b) in reported:
                return
            reported.add((a, b))
            other = order[a]
            self.problem(f"data race on {slot.short()}: this step {'writes' if b_writes else 'reads'} it and "
                         f"{other.short()} ({self.step(other).type.value}) {'writes' if a_writes else 'reads'} it, "
                         "with no happens-before order between them (add a dependency or reorder the "
                         "threadblock)", order[b])

        for n, ref in enumerate(order):
            for slot, writes in self.accesses(ref).items():
                lw = last_write.get(slot)
                if lw is not None:
                    ordered(lw, n, slot, True, writes)
                if writes:
                    for rd in reads.pop(slot, []):
                        ordered(rd, n, slot, False, True)
                    last_write[slot] = n
                else:
                    reads.setdefault(slot, []).append(n)

    def accesses(self, ref: StepRef) -> dict[ChunkRef, bool]:
        """The chunks a step touches on its own rank: True where it writes, False where it only reads."""
        step = self.step(ref)
        t = step.type
        out: dict[ChunkRef, bool] = {}
        if t is StepType.NOP:
            return out
        if t.reads_src:
            for c in range(step.srcoff, step.srcoff + step.cnt):
                out[ChunkRef(ref.rank, step.srcbuf, c)] = False
        if t.writes_dst:
            for c in range(step.dstoff, step.dstoff + step.cnt):
                out[ChunkRef(ref.rank, step.dstbuf, c)] = True
        return out

    # --- 5. postcondition -------------------------------------------------------------------------

    def postcondition(self, state: SymbolicState) -> dict[ChunkRef, Expr]:
        assert self.post is not None
        outputs: dict[ChunkRef, Expr] = {}
        masks: dict[frozenset[ChunkRef], int] = {}
        for slot, sources in self.post:
            value = state.value(slot)
            outputs[slot] = value
            if len(sources) == 1:
                (want,) = sources
                if value.source == want:
                    continue
                expected = want.short()
            else:
                mask = masks.get(sources)
                if mask is None:
                    mask = masks[sources] = state.table.mask_of(sources)
                if value.size == len(sources) and value.mask == mask:
                    continue
                expected = "the reduction of " + ", ".join(s.short() for s in sorted(sources)) + ", each once"
            writer = state.last_writer.get(slot)
            holds = value.render() + ("" if writer is not None else " (never written: its initial value)")
            self.problem(f"wrong result: {slot.short()} must hold {expected}, but holds {holds}", writer,
                         rank=slot.rank)
        return outputs

    # --- 6. determinism ---------------------------------------------------------------------------

    def determinism(self, outputs: dict[ChunkRef, Expr]) -> Determinism:
        """The class: per result (a set of sources reduced), the distinct trees the slots holding it have."""
        assert self.post is not None
        trees: dict[frozenset[ChunkRef], dict[int, list[ChunkRef]]] = {}
        for slot, sources in self.post:
            if len(sources) >= 2:
                trees.setdefault(sources, {}).setdefault(outputs[slot].id, []).append(slot)
        differences = []
        for sources, by_tree in trees.items():
            if len(by_tree) > 1:
                shown = sorted((sorted(slots) for slots in by_tree.values()), key=lambda slots: slots[0])
                differences.append(OrderDifference(sources, tuple((outputs[slots[0]].render(), tuple(slots))
                                                                  for slots in shown)))
        differences.sort(key=lambda d: min(d.sources))
        return Determinism(ORDER_DEPENDENT if differences else BITWISE, tuple(differences))
