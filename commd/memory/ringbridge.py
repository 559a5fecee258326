"""One node's bridge line of a bridged exchange ring: the node's part of each ring all-reduce of a
group that spans nodes (up to one entry, or a large slot when a rank plays the bridge).

The node's ranks publish their inputs in the ring (``protocol/fastring.py``); the last of them
to publish tells the bridge, which reduces the node's inputs with the eager kernels, sends that
contribution to the group's other nodes, combines the nodes' contributions in node order once
all are in — the same bits on every node, and the bits the fabric's own tiny all-reduce
computes — and publishes the result as its own entry, which the ranks copy out.

Two processes can play the line, with the same code: the node's daemon (``fabric/bridge.py``,
parts over the fabric's control links) or the node's first rank of the group
(``client/ringbridge.py``, parts over direct connections between the nodes' first ranks).
Nothing here waits or does I/O: ``send`` carries a part away, and the caller feeds in what
arrives.  A failure — the nodes or the local ranks disagree, some node's ranks sent that
collective to their daemon instead, a rank or node died, a rank left the ring — is published
in the bridge's control line (``abandoned`` = 1 + the code's index in ``BRIDGE_ERRORS``, the
reason at the end of its first large slot) and sent to the other nodes, so every rank of the group fails
the op and the group leaves the ring.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
import os
from collections.abc import Callable

import numpy as np

from commd.core.placement import GroupPlacement
from commd.kernels import eager, small
from commd.kernels.dtypes import UnsupportedReduction, check_supported
from commd.memory import futex
from commd.memory.arena import Segment
from commd.protocol import fabric as wire
from commd.protocol import fastring as fr
from commd.protocol import schema as s

log = logging.getLogger("commd.ring")

#: The longest reason published to the ranks (``protocol/fastring.reason_offset``).
MAX_REASON_BYTES = 4096
#: A bridge's failure codes as the daemon's scheduler and log name them.
_DAEMON_CODES = {"mismatch": "mismatch", "diverged": "mismatch", "timeout": "timeout", "peer_died": "peer_died",
                 "internal": "internal"}


class RingBridge:
    """The daemon's line in one group's bridged ring on this node."""

    def __init__(self, group: str, region: Segment, placement: GroupPlacement, node: int,
                 send: Callable[[wire.RingPart], None],
                 on_failed: Callable[[str, int, str, str], None] | None = None) -> None:
        self.group = group
        #: (group, collective number, code, message): an op of a known number failed; the daemon logs
        #: it, and a timed-out one fails a local rank's late op of that number on arrival
        #: (``NodeServices.fail_seq``)
        self.on_failed = on_failed
        self.region = region
        self.placement = placement
        self.node = node
        self.send = send
        header = region.array[8:32].view("u4")
        n, depth, slot = int(header[1]), int(header[2]), int(header[3])
        self.nlines, self.depth, self.slot_bytes = n, depth, slot
        self.large_depth, self.large_bytes = int(header[4]), int(header[5])
        #: the largest op bridged here: one entry, or a large slot less the reason's room
        self.max_bytes = fr.bridged_max_bytes(slot, self.large_bytes)
        self.me = n - 1
        self.local_ranks = placement.local  # group ranks, in line order
        self.others = [x for x in placement.nodes if x != node]
        self.group_size = len(placement.ranks)
        mm = region.mm
        self.words = memoryview(mm).cast("q")
        self.u32 = memoryview(mm).cast("I")
        line = [(fr.CONTROL_OFFSET + r * fr.CONTROL_BYTES) // 8 for r in range(n)]
        self.posted_at = [w + fr.POSTED for w in line]
        self.consumed_at = [w + fr.CONSUMED for w in line]
        self.sleeping_at = [w + fr.SLEEPING for w in line]
        self.submitted_at = [w + fr.SUBMITTED for w in line]
        self.abandoned_at = [w + fr.ABANDONED for w in line]
        self.failed_at = line[self.me] + fr.FAILED
        self.bell_at = (fr.CONTROL_OFFSET + self.me * fr.CONTROL_BYTES + fr.BELL_OFFSET) // 4
        self.bell = ctypes.c_void_p(region.base + self.bell_at * 4)
        # per entry (op number mod depth): where each line's entry starts (byte offsets)
        self.entry_at = [[fr.entry_offset(n, depth, slot, d, r) for r in range(n)] for d in range(depth)]
        self.large_at = [[fr.large_slot_offset(n, depth, slot, self.large_bytes, j, r) for r in range(n)]
                         for j in range(self.large_depth)]
        self.fence = futex.Fence()
        self.words[line[self.me] + fr.PID] = os.getpid()
        self.next_local = 1  # the next op whose local inputs this node reduces
        self.next_result = 1  # the next op whose result this node publishes
        self.mine: dict[int, wire.RingPart] = {}
        self.where: dict[int, int] = {}  # per op of ours in flight: its entry's ``where`` (large slot + 1)
        self.parts: dict[int, dict[int, wire.RingPart]] = {}
        self.failed: str | None = None
        self.ops = 0

    # ---- this node's ranks ------------------------------------------------------------
    def local_ready(self) -> None:
        """Some rank says every local rank has published an op: reduce each such op in order."""
        words, posted = self.words, self.posted_at
        while self.failed is None and all(words[posted[r]] >= self.next_local for r in range(self.me)):
            k = self.next_local
            part = self._contribution(k)
            if part is None:
                return  # failed
            self.next_local = k + 1
            words[self.consumed_at[self.me]] = k  # the inputs are read: the ranks may reuse the entries
            self._ring_bell()
            self.mine[k] = part
            self.where[k] = self.words[self.entry_at[k % self.depth][0] // 8 + fr.WHERE]
            self.send(part)
            self._complete()

    def _contribution(self, k: int) -> wire.RingPart | None:
        words = self.words
        heads = [offset // 8 for offset in self.entry_at[k % self.depth][: self.me]]
        rows = [[words[h + f] for f in (fr.SEQ, fr.DTYPE, fr.OP, fr.COUNT, fr.WHERE, fr.INDEX)] for h in heads]
        first = rows[0]
        if any(row[0] != k for row in rows):
            self.fail("internal", f"the exchange ring of group '{self.group}' is corrupted "
                                  f"(entries {[row[0] for row in rows]} for op {k})")
            return None
        problems = fr.differences(rows, [[r] for r in self.local_ranks])
        if problems:
            self.fail("mismatch", f"mismatched collective #{first[5] - 1} on group '{self.group}': "
                      + "; ".join(problems), index=first[5])
            return None
        _, dcode, ocode, count, where, index = first
        problem = self._check_shape(dcode, ocode, count, [row[4] for row in rows])
        if problem is not None:
            self.fail("internal", f"all-reduce #{index - 1} on group '{self.group}': {problem}", index=index)
            return None
        dtype = small.NUMPY_DTYPES[fr.DTYPES[dcode]]
        mm = self.region.mm
        at = ([h * 8 + fr.ENTRY_HEADER_BYTES for h in heads] if where == 0
              else self.large_at[where - 1][: self.me])
        inputs = [np.ndarray((count,), dtype, mm, offset) for offset in at]
        data = eager.contribution_view(inputs, fr.REDUCE_OPS[ocode])
        return wire.RingPart(self.group, k, index, self.node, self.others, dcode, ocode, count, data)

    def _check_shape(self, dcode: int, ocode: int, count: int, wheres: list[int]) -> str | None:
        """Why the ranks' header cannot be reduced here (they wrote it: never trusted), else None.
        ``wheres``: each local rank's ``where`` (0: in its entry; j + 1: in its large slot j)."""
        if not 0 <= dcode < len(fr.DTYPES) or fr.DTYPES[dcode] not in small.NUMPY_DTYPES:
            return f"unknown dtype code {dcode}"
        if not 0 <= ocode < len(fr.REDUCE_OPS):
            return f"unknown reduce op code {ocode}"
        dtype, op = fr.DTYPES[dcode], fr.REDUCE_OPS[ocode]
        nbytes = count * small.NUMPY_DTYPES[dtype].itemsize
        where = wheres[0]
        fits = (0 <= nbytes <= self.slot_bytes if where == 0
                else 1 <= where <= self.large_depth and self.slot_bytes < nbytes <= self.max_bytes)
        if not fits or any(w != where for w in wheres):
            return (f"{count} {dtype} in slots {wheres} do not fit a bridged ring's entries ({self.slot_bytes} "
                    f"bytes) or large slots ({self.max_bytes} bytes)")
        try:
            check_supported(op, dtype)
        except UnsupportedReduction as exc:
            return str(exc)
        if not eager.on_numpy(dtype, op):
            return f"reduce op {op!r} of {dtype} is not bridged"
        return None

    # ---- the other nodes --------------------------------------------------------------
    def on_part(self, part: wire.RingPart) -> None:
        """Another node's contribution to op ``part.seq``, or why the op failed there."""
        if self.failed is not None:
            return
        if part.error is not None:
            self.fail(part.error, part.message or f"a bridged all-reduce failed on node {part.node}",
                      tell=False, index=max(part.index, 0))
            return
        if part.seq < self.next_result or part.node not in self.others:
            log.warning("group %s: dropped a ring part for op %d from node %d", self.group, part.seq, part.node)
            return
        self.parts.setdefault(part.seq, {})[part.node] = part
        self.check_diverged()
        self._complete()

    def check_diverged(self) -> None:
        """Fail the op if a peer node's ranks published it in their ring while ours sent the same
        place of the group's collectives to the daemon (their ``submitted`` passed it unposted)."""
        if self.failed is not None:
            return
        words = self.words
        for k, parts in self.parts.items():
            if k < self.next_local:
                continue
            index = next(iter(parts.values())).index
            daemon = [g for r, g in enumerate(self.local_ranks)
                      if words[self.submitted_at[r]] >= index and words[self.posted_at[r]] < k]
            if daemon:
                node = next(iter(parts))
                self.fail("diverged", (
                    f"mismatched collective #{index - 1} on group '{self.group}': the ranks on node {node} submitted an "
                    f"all-reduce that goes through the exchange ring, group ranks {daemon} a collective that goes "
                    "through the daemon (another kind, size, dtype, reduce op or device)"), index=index)
                return

    def _complete(self) -> None:
        """Publish every op, in order, whose contributions from all nodes are in."""
        while self.failed is None and self.next_result in self.mine:
            k = self.next_result
            parts = self.parts.get(k, {})
            if len(parts) < len(self.others):
                return
            mine = self.mine[k]
            ordered = [mine if n == self.node else parts[n] for n in self.placement.nodes]
            if len({(p.index, p.dtype, p.op, p.count) for p in ordered}) > 1:
                # every node sees the same parts and fails alike: no need to tell the others
                self.fail("mismatch", self._mismatch(ordered), tell=False, index=mine.index)
                return
            dtype, op = fr.DTYPES[mine.dtype], fr.REDUCE_OPS[mine.op]
            nbytes = len(mine.contribution or b"")
            short = [p.node for p in ordered if len(p.contribution or b"") != nbytes]
            if short:
                self.fail("internal", f"all-reduce #{mine.index - 1} on group '{self.group}': the parts of nodes {short} "
                                      f"are not {nbytes} bytes long", index=mine.index)
                return
            offset = self.entry_at[k % self.depth][self.me]
            where = self.where.pop(k)
            # (large slot j's last result was copied out by every rank: each consumed that op before
            # posting this one, which reuses the slot)
            data = offset + fr.ENTRY_HEADER_BYTES if where == 0 else self.large_at[where - 1][self.me]
            out = np.ndarray((mine.count,), small.NUMPY_DTYPES[dtype], self.region.mm, data)
            eager.combine_into([p.contribution or b"" for p in ordered], dtype, op, self.group_size, out)
            h, words = offset // 8, self.words
            words[h], words[h + fr.DTYPE], words[h + fr.OP], words[h + fr.COUNT] = k, mine.dtype, mine.op, mine.count
            words[h + fr.WHERE], words[h + fr.INDEX] = where, mine.index
            words[self.posted_at[self.me]] = k  # publishes the result (stores stay in order on x86)
            del self.mine[k]
            self.parts.pop(k, None)
            self.next_result = k + 1
            self.ops += 1
            self._ring_bell()

    def _mismatch(self, parts: list[wire.RingPart]) -> str:
        """The nodes' parts differ: worded as the scheduler words a mismatch (scheduler/agreement.py)."""
        rows = [_header(p.seq, p.dtype, p.op, p.count, p.index - 1) for p in parts]  # numbered as the daemon's
        problems = fr.differences(rows, [self.placement.members(p.node) for p in parts],
                                  (("collective number", fr.INDEX, None), *fr.AGREED))
        return (f"mismatched all-reduce #{parts[0].index - 1} on group '{self.group}' across nodes "
                f"{[p.node for p in parts]} (exchange ring op {parts[0].seq}): " + "; ".join(problems))

    # ---- failures ---------------------------------------------------------------------
    def fail(self, code: str, message: str, tell: bool = True, index: int = 0) -> None:
        """The ring is left, on every node (the others told through a ``RingPart`` when ``tell``).
        ``index``: the collective index (an entry's ``INDEX``) of the op that failed: it fails with
        ``message`` on every rank of the group, and the ranks hand the ops around it to their
        daemons; 0: every op from ``next_result`` on fails.  The failed op's number is told to the
        daemon (``on_failed``): its log has the op's line, and its scheduler fails a late rank's op
        of that number on arrival, as on the daemon path.  ``code`` names one of ``BRIDGE_ERRORS`` (anything else, as another node or a
        rank may send: "internal")."""
        if self.failed is not None:
            return
        code = code if code in fr.BRIDGE_ERRORS else "internal"
        if index > 0 and self.on_failed is not None:
            self.on_failed(self.group, index - 1, _DAEMON_CODES[code], message)
        self.failed = message
        reason = message.encode()[:MAX_REASON_BYTES]
        at = fr.reason_offset(self.nlines, self.depth, self.slot_bytes, self.large_bytes)
        self.region.mm[at + 4: at + 4 + len(reason)] = reason
        self.u32[at // 4] = len(reason)
        self.words[self.failed_at] = index
        self.words[self.abandoned_at[self.me]] = 1 + fr.BRIDGE_ERRORS.index(code)  # after the reason and index
        self._ring_bell()
        log.info("group %s: bridged ring left: %s", self.group, message)
        if tell and self.others:
            self.send(wire.RingPart(self.group, self.next_result, index or -1, self.node, self.others, 0, 0, 0, None,
                                    code, message))
        self.mine.clear()
        self.where.clear()
        self.parts.clear()

    def _ring_bell(self) -> None:
        u32, at = self.u32, self.bell_at
        u32[at] = (u32[at] + 1) & 0x7FFFFFFF
        self.fence()
        words = self.words
        if any(words[i] for i in self.sleeping_at):
            futex.futex_wake(self.bell)


def _header(seq: int, dtype: int, op: int, count: int, index: int) -> list[int]:
    """An entry header's i64 words (protocol/fastring.py) for an op with these fields."""
    row = [0] * (fr.INDEX + 1)
    row[fr.SEQ], row[fr.DTYPE], row[fr.OP], row[fr.COUNT], row[fr.INDEX] = seq, dtype, op, count, index
    return row


def bridge_state(region: Segment) -> tuple[int, str | None]:
    """What a bridge line published, read from its ring: the ops it completed and why it failed
    (None: it did not).  How the daemon reports a bridge a rank plays."""
    meta = region.array[8:36].view("u4")  # version, lines, depth, slot bytes, large depth, large bytes, bridged
    n, depth, slot, large = int(meta[1]), int(meta[2]), int(meta[3]), int(meta[5])
    words = region.array.view("i8")
    line = (fr.CONTROL_OFFSET + (n - 1) * fr.CONTROL_BYTES) // 8
    if not words[line + fr.ABANDONED]:
        return int(words[line + fr.POSTED]), None
    at = fr.reason_offset(n, depth, slot, large)
    length = min(int(region.array[at: at + 4].view("u4")[0]), MAX_REASON_BYTES)
    return int(words[line + fr.POSTED]), bytes(region.array[at + 4: at + 4 + length]).decode(errors="replace")


def left_message(group: str, rank: object, code: str, why: str) -> str:
    """A local rank left the ring: its reason as every rank reads it (a timeout's message is the
    rank's own: the daemon path's words)."""
    return why if code == "timeout" else f"rank {rank} left the exchange ring of group '{group}': {why}"


def spanning_placement(group: str, ranks: list[int], node_of: list[int], node: int) -> GroupPlacement:
    """The placement a bridge needs, from plain lists (the ranks' side has no daemon state)."""
    return GroupPlacement(group, tuple(ranks), tuple(node_of), node)


# ---- notices to a bridge a rank plays ---------------------------------------------------
#: A notice is one datagram, a msgpack map: ``k`` (an op every local rank published), ``left``
#: (+ ``code``, ``n``: a local rank left the ring) or ``fail`` (the daemon: the fabric saw a death).
MAX_NOTICE_BYTES = 2048


def group_token(secret: str, group: str) -> str:
    """The token the first ranks of ``group`` prove to each other (every node's daemon derives it
    from the fabric's secret; the ranks never see the secret)."""
    return hmac.new(secret.encode(), f"ringbridge/{group}".encode(), hashlib.sha256).hexdigest()


def notice_address(daemon_pid: int, group: str) -> bytes:
    """Where the rank that plays ``group``'s bridge line on this node hears its notices: an
    abstract Unix socket, named after the daemon and the group (a group name can be too long)."""
    digest = hashlib.sha256(group.encode()).hexdigest()[:24]
    return f"\0commd-bridge-{daemon_pid}-{digest}".encode()


def host_notice(**fields: object) -> bytes:
    return s.encode({"t": "bridge", **fields})


def read_notice(frame: bytes) -> dict[str, object]:
    """A notice, checked: raises ``ProtocolError`` naming what is wrong."""
    if len(frame) > MAX_NOTICE_BYTES:
        raise s.ProtocolError(f"a bridge notice of {len(frame)} bytes (at most {MAX_NOTICE_BYTES})")
    msg = s.decode(frame)
    if "k" in msg:
        s.int_field(msg, "k", 1)
    elif "left" in msg:
        s.field(msg, "left", str)
        s.field(msg, "code", str)
        if "n" in msg:
            s.int_field(msg, "n", 0)
    elif "fail" in msg:
        s.field(msg, "fail", str)
    else:
        raise s.ProtocolError(f"a bridge notice with none of k, left, fail: keys {sorted(msg)}")
    return msg
