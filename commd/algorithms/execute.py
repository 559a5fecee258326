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
from commd.kernels.small import reduce_into

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
             received: np.ndarray | None = None, *, copy: bool = True) -> np.ndarray | None:
    """Apply ``step`` to tile ``[lo, hi)`` of its chunks; return the data it sends (a contiguous
    ``(cnt, hi - lo)`` array), or None.

    ``received`` is the matched send's data for a receiving step (``(cnt, hi - lo)`` or flat).
    What is sent is never written afterwards: a copy, the received data itself, or — with
    ``copy=False``, for ``s`` and ``rrcs`` only — the working buffer's own view, which the
    caller must then keep unwritten until the send is complete (and must ask for only where
    that view is contiguous: one chunk, or whole chunks)."""
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
        reduce_into(dst, [dst, src], op)
        return None
    # rrc, rrs, rrcs: local(src) ⊕ received
    if kind is StepType.RECV_REDUCE_SEND:
        result = np.empty(shape, received.dtype)
        reduce_into(result, [src, received], op)
        return result
    reduce_into(dst, [src, received], op)
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
        sends: dict[Channel, list[StepId]] = collections.defaultdict(list)
        recvs: dict[Channel, list[StepId]] = collections.defaultdict(list)
        nranks = len(algo.ranks)
        for rank in algo.ranks:
            r = rank.id
            tb_ids = {tb.id for tb in rank.threadblocks}
            for tb in rank.threadblocks:
                self.threadblock_peers[(r, tb.id)] = (tb.send, tb.recv, tb.chan)
                self.lengths[(r, tb.id)] = len(tb.steps)
                for index, step in enumerate(tb.steps):
                    sid = (r, tb.id, index)
                    self.steps[sid] = step
                    if step.cnt < 0 or (step.type is not StepType.NOP and step.cnt == 0):
                        raise _where(source, sid, f"count {step.cnt} is not a positive number of chunks")
                    for peer, used, what in ((tb.send, step.type.sends, "sends"),
                                             (tb.recv, step.type.receives, "receives")):
                        if used and not (0 <= peer < nranks and peer != r):
                            raise _where(source, sid, f"{step.type.value} {what} but the threadblock's peer is "
                                                      f"{peer} (ranks 0..{nranks - 1}, not itself)")
                    if step.type.sends:
                        sends[(r, tb.send, tb.chan)].append(sid)
                    if step.type.receives:
                        recvs[(tb.recv, r, tb.chan)].append(sid)
                    dep = step.dependency
                    if dep is not None:
                        if dep[0] not in tb_ids or not 0 <= dep[1] < len(
                                next(t for t in rank.threadblocks if t.id == dep[0]).steps):
                            raise _where(source, sid, f"depends on threadblock {dep[0]} step {dep[1]}, "
                                                      f"which rank {r} does not have")
                    if layouts is not None and r in layouts:
                        self._check_offsets(layouts[r], sid, step)
        self.transfers: list[Transfer] = []
        self.transfer_of_send: dict[StepId, Transfer] = {}
        self.transfer_of_recv: dict[StepId, Transfer] = {}
        for channel in sorted(set(sends) | set(recvs)):
            out, inn = sends.get(channel, []), recvs.get(channel, [])
            for k in range(max(len(out), len(inn))):
                if k >= len(inn):
                    raise _where(source, out[k], f"send #{k} from rank {channel[0]} to rank {channel[1]} on "
                                                 f"channel {channel[2]} is never received")
                if k >= len(out):
                    raise _where(source, inn[k], f"receive #{k} at rank {channel[1]} from rank {channel[0]} on "
                                                 f"channel {channel[2]} is never sent")
                cnt_s, cnt_r = self.steps[out[k]].cnt, self.steps[inn[k]].cnt
                if cnt_s != cnt_r:
                    raise _where(source, inn[k], f"receives {cnt_r} chunks but the matched send (rank "
                                                 f"{out[k][0]}, threadblock {out[k][1]}, step {out[k][2]}) "
                                                 f"sends {cnt_s}")
                transfer = Transfer(channel, k, out[k], inn[k], cnt_s)
                self.transfers.append(transfer)
                self.transfer_of_send[out[k]] = transfer
                self.transfer_of_recv[inn[k]] = transfer
        self.depth, self.cyclic = self._depths()
        self.order = sorted(self.depth, key=lambda sid: (self.depth[sid], sid))

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
