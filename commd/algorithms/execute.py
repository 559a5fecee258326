"""The runtime semantics of a program, written once for the simulator and the interpreter.

Two things live here, both read off ``ir``'s docstring:

- :func:`run_step`: one step's data effect on NumPy working buffers, on a tile ``[lo, hi)``
  of each chunk it touches (``⊕`` is ``commd.kernels.small.reduce_into``);
- :class:`Wiring`: how the steps of all ranks connect — the k-th send of (sender,
  receiver, channel) matched with the k-th receive, each step's dependency, and each
  step's *depth* in the happens-before graph (threadblock order, dependencies, matched
  transfers).  The simulator prints depths as its logical time; the interpreter orders
  transfers by them.  Anything that would make a run fail midway (a dangling peer or
  dependency, an offset outside a buffer, an unmatched or mis-sized transfer, a cycle) is
  a ProgramError here, before any data moves.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import Algorithm, Step, StepType
from commd.algorithms.layout import RankLayout
from commd.kernels.small import reduce_into_unchecked

#: Reduce operators a program may run with (the lanes' element-wise ops).
REDUCE_OPS = frozenset({"sum", "product", "min", "max", "band", "bor", "bxor"})

#: A step anywhere in a program: (rank, threadblock, step).
StepId = tuple[int, int, int]
#: One transfer stream of the runtime: (sender, receiver, channel).
Channel = tuple[int, int, int]


def tile_view(buf: np.ndarray, q: int, off: int, cnt: int, lo: int, hi: int) -> np.ndarray:
    """Elements ``[lo, hi)`` of chunks ``[off, off + cnt)``: a ``(cnt, hi - lo)`` view of ``buf``."""
    return buf[off * q:(off + cnt) * q].reshape(cnt, q)[:, lo:hi]


def run_step(step: Step, bufs: Mapping[str, np.ndarray], q: int, lo: int, hi: int, op: str,
             received: np.ndarray | None = None, *, copy: bool = True,
             result: np.ndarray | None = None) -> np.ndarray | None:
    """Apply ``step`` to tile ``[lo, hi)`` of its chunks; return the data it sends (a contiguous
    ``(cnt, hi - lo)`` array), or None.

    ``received`` is the matched send's data for a receiving step (``(cnt, hi - lo)`` or flat).
    What is sent is never written afterwards: a copy, the received data itself, or — with
    ``copy=False``, for ``s`` and ``rrcs`` only — the working buffer's own view, which the
    caller must then keep unwritten until the send is complete (and must ask for only where
    that view is contiguous: one chunk, or whole chunks).  ``result``: where an ``rrs`` puts what
    it sends (``cnt × (hi - lo)`` elements the caller keeps unwritten until the send is complete;
    by default a fresh array)."""
    kind = step.type
    if kind is StepType.NOP:
        return None
    shape = (step.cnt, hi - lo)
    if kind.receives:
        if received is None:
            raise ValueError(f"step {step.s} ({kind.value}) receives but no data was given")
        received = received.reshape(shape)
    dst = tile_view(bufs[step.dstbuf], q, step.dstoff, step.cnt, lo, hi) if kind.writes_dst else None
    src = tile_view(bufs[step.srcbuf], q, step.srcoff, step.cnt, lo, hi) if kind.reads_src else None
    if kind is StepType.SEND:
        return np.array(src) if copy else src
    if kind in (StepType.RECV, StepType.RECV_COPY_SEND):
        dst[...] = received
        return received if kind.sends else None  # received data is never written: no copy to forward it
    if kind is StepType.COPY:
        dst[...] = src
        return None
    if kind is StepType.REDUCE:
        reduce_into_unchecked(dst, [dst, src], op)
        return None
    # rrc, rrs, rrcs: local(src) ⊕ received
    if kind is StepType.RECV_REDUCE_SEND:
        result = np.empty(shape, received.dtype) if result is None else result.reshape(shape)
        reduce_into_unchecked(result, [src, received], op)
        return result
    reduce_into_unchecked(dst, [src, received], op)
    if not kind.sends:
        return None
    return np.array(dst) if copy else dst


@dataclass(frozen=True)
class Transfer:
    """One matched send/receive pair of a program (per tile: the same for every tile)."""

    channel: Channel
    index: int  # k: the k-th transfer of ``channel``
    send: StepId
    recv: StepId
    cnt: int


def _where(source: str, sid: StepId, reason: str) -> ProgramError:
    return ProgramError(reason, source=source, rank=sid[0], threadblock=sid[1], step=sid[2])


class Wiring:
    """The static structure of a program run: matched transfers, dependencies, depths.

    ``steps`` maps every StepId to its Step; ``threadblock_peers`` a (rank, tb) to its
    (send peer, recv peer, channel); ``transfer_of_send`` / ``transfer_of_recv`` a step to
    its Transfer; ``depth`` a step to the length of the longest happens-before path ending
    at it (1 for a step nothing precedes); ``order`` every step sorted by (depth, rank,
    threadblock, step) — a topological order, the same wherever it is computed.
    """

    def __init__(self, algo: Algorithm, layouts: Mapping[int, RankLayout] | None = None,
                 source: str = "<program>") -> None:
        self.algo = algo
        self.source = source
        self.steps: dict[StepId, Step] = {}
        self.threadblock_peers: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.lengths: dict[tuple[int, int], int] = {}
        for rank in algo.ranks:
            for tb in rank.threadblocks:
                if (rank.id, tb.id) in self.lengths:
                    raise ProgramError(f"two threadblocks with id {tb.id}", source=source, rank=rank.id,
                                       threadblock=tb.id)
                self.threadblock_peers[(rank.id, tb.id)] = (tb.send, tb.recv, tb.chan)
                self.lengths[(rank.id, tb.id)] = len(tb.steps)
                for index, step in enumerate(tb.steps):
                    self.steps[(rank.id, tb.id, index)] = step
        for sid, step in self.steps.items():
            self._check_step(sid, step, layouts.get(sid[0]) if layouts is not None else None)
        self.transfers: list[Transfer] = []
        self.transfer_of_send: dict[StepId, Transfer] = {}
        self.transfer_of_recv: dict[StepId, Transfer] = {}
        self._match()
        self.depth, self.cyclic = self._depths()
        self.order = sorted(self.depth, key=lambda sid: (self.depth[sid], sid))

    def _check_step(self, sid: StepId, step: Step, layout: RankLayout | None) -> None:
        """What would make this step fail at run time: its count, peers, dependency, offsets."""
        r, tb, _ = sid
        if step.cnt < 0 or (step.type is not StepType.NOP and step.cnt == 0):
            raise _where(self.source, sid, f"count {step.cnt} is not a positive number of chunks")
        send, recv, _ = self.threadblock_peers[(r, tb)]
        nranks = len(self.algo.ranks)
        for peer, used, what in ((send, step.type.sends, "sends"), (recv, step.type.receives, "receives")):
            if used and not (0 <= peer < nranks and peer != r):
                raise _where(self.source, sid, f"{step.type.value} {what} but the threadblock's peer is {peer} "
                                               f"(ranks 0..{nranks - 1}, not itself)")
        dep = step.dependency
        if dep is not None and not 0 <= dep[1] < self.lengths.get((r, dep[0]), 0):
            raise _where(self.source, sid, f"depends on threadblock {dep[0]} step {dep[1]}, which rank {r} "
                                           "does not have")
        if layout is not None:
            self._check_offsets(layout, sid, step)

    def _match(self) -> None:
        """Pair the k-th send of every (sender, receiver, channel) with its k-th receive."""
        sends: dict[Channel, list[StepId]] = collections.defaultdict(list)
        recvs: dict[Channel, list[StepId]] = collections.defaultdict(list)
        for sid, step in self.steps.items():  # in (rank, threadblock, step) order
            send, recv, chan = self.threadblock_peers[sid[:2]]
            if step.type.sends:
                sends[(sid[0], send, chan)].append(sid)
            if step.type.receives:
                recvs[(recv, sid[0], chan)].append(sid)
        for channel in sorted(set(sends) | set(recvs)):
            out, inn = sends.get(channel, []), recvs.get(channel, [])
            for k in range(max(len(out), len(inn))):
                if k >= len(inn):
                    raise _where(self.source, out[k], f"send #{k} from rank {channel[0]} to rank {channel[1]} on "
                                                      f"channel {channel[2]} is never received")
                if k >= len(out):
                    raise _where(self.source, inn[k], f"receive #{k} at rank {channel[1]} from rank {channel[0]} "
                                                      f"on channel {channel[2]} is never sent")
                cnt_s, cnt_r = self.steps[out[k]].cnt, self.steps[inn[k]].cnt
                if cnt_s != cnt_r:
                    raise _where(self.source, inn[k], f"receives {cnt_r} chunks but the matched send (rank "
                                                      f"{out[k][0]}, threadblock {out[k][1]}, step {out[k][2]}) "
                                                      f"sends {cnt_s}")
                transfer = Transfer(channel, k, out[k], inn[k], cnt_s)
                self.transfers.append(transfer)
                self.transfer_of_send[out[k]] = transfer
                self.transfer_of_recv[inn[k]] = transfer

    def require_acyclic(self) -> None:
        """ProgramError unless the happens-before graph is acyclic (else some run would hang)."""
        if self.cyclic:
            stuck = self.cyclic
            raise _where(self.source, stuck[0], f"the steps wait for each other in a cycle (the happens-before "
                                                f"graph is not acyclic): {len(stuck)} steps on or after it, e.g. "
                                                f"{', '.join(map(str, stuck[:6]))} as (rank, threadblock, step)")

    def _check_offsets(self, layout: RankLayout, sid: StepId, step: Step) -> None:
        for used, buf, off in ((step.type.reads_src, step.srcbuf, step.srcoff),
                               (step.type.writes_dst, step.dstbuf, step.dstoff)):
            if not used:
                continue
            if buf not in ("i", "o", "s"):
                raise _where(self.source, sid, f"unknown buffer {buf!r}")
            chunks = layout.buffer(buf).chunks
            if off < 0 or off + step.cnt > chunks:
                raise _where(self.source, sid, f"chunks [{off}, {off + step.cnt}) of buffer {buf!r} are outside "
                                               f"its {chunks} chunks")

    def predecessors(self, sid: StepId) -> list[StepId]:
        """The steps ``sid`` waits for: its threadblock predecessor, its dependency, its matched send."""
        r, tb, s = sid
        found = [(r, tb, s - 1)] if s > 0 else []
        dep = self.steps[sid].dependency
        if dep is not None:
            found.append((r, dep[0], dep[1]))
        transfer = self.transfer_of_recv.get(sid)
        if transfer is not None:
            found.append(transfer.send)
        return found

    def _depths(self) -> tuple[dict[StepId, int], list[StepId]]:
        """Depth of every step reachable in a topological order, and the steps on or after a cycle."""
        successors: dict[StepId, list[StepId]] = collections.defaultdict(list)
        waiting = {}
        for sid in self.steps:
            preds = self.predecessors(sid)
            waiting[sid] = len(preds)
            for p in preds:
                successors[p].append(sid)
        depth: dict[StepId, int] = {}
        level = {sid: 1 for sid in self.steps}
        ready = collections.deque(sorted(sid for sid, n in waiting.items() if n == 0))
        while ready:
            sid = ready.popleft()
            depth[sid] = level[sid]
            for nxt in successors[sid]:
                level[nxt] = max(level[nxt], level[sid] + 1)
                waiting[nxt] -= 1
                if waiting[nxt] == 0:
                    ready.append(nxt)
        return depth, sorted(sid for sid in self.steps if sid not in depth)


def tiles(q: int, tile_elements: int | None) -> list[tuple[int, int]]:
    """The tiles ``[lo, hi)`` each chunk of ``q`` elements is cut into (one if unbounded)."""
    if q <= 0:
        return []
    size = q if not tile_elements or tile_elements >= q else max(1, int(tile_elements))
    return [(lo, min(q, lo + size)) for lo in range(0, q, size)]
