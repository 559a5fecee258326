"""All-reduces of a local group exchanged in shared memory, without the daemon on the path.

Measured on a 2-core node (2 ranks + daemon): the cheapest possible daemon round trip in
Python (SEQPACKET, no validation) is ~95 µs, the same through shared memory with futex
doorbells ~47 µs; two ranks meeting in shared memory need ~6 µs (spinning briefly) to
~26 µs (sleeping at once).  So an all-reduce of a group whose ranks all live on this
node goes through the group's exchange ring (``protocol/fastring.py``) when it is at
most the ring's largest op (4 MiB with 2 ranks: there a rank's copy in, its reduction
and the result are cheaper than the daemon's round trip): each rank publishes its input
and the op's description in its own entry (a larger input in its own large slot), and
every rank, once all have published, checks that the descriptions agree (else a
``MismatchError`` on every rank, naming the fields and ranks) and reduces the entries
itself, in group-rank order with the daemon's NumPy kernels, so every rank computes the
same bits the daemon would.

Waiting spins for ``SPIN_S`` (when every rank can have a core) and then sleeps on the
peer's futex word, in slices of at most ``SLICE_S`` after which it checks the op's
deadline, the missing ranks' processes and the daemon's.  A timeout fails that op alone,
on every rank, as on the daemon path: the rank whose deadline passed withdraws its entry
(one decision, see ``protocol/fastring.py``), a rank that waits with it fails the op when
it sees the withdrawal, a late rank fails it on arrival, and later ops are unaffected.  A
dead rank or a dead daemon fails the op and every later op of the group's ring (the ring
is then out of step) instead of hanging.  A rank announces its sleep in its control line,
so a poster makes the futex call only when someone sleeps.

Every ring op takes the group's one collective number (``take_number``: the client's,
shared with the daemon path), its messages name it as the daemon names its ops, and the
ranks' entries must carry the same number, or the op fails and the group leaves the ring:
op k of one rank is only ever combined with op k of the others.

Ordering relies on x86's store order (data and header are written before ``posted``,
read after it; ``futex.Fence`` where a store must be seen before a later load);
``available()`` keeps the ring off other architectures.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from commd.client.errors import (
    CommdError,
    CommTimeoutError,
    ConnectError,
    DaemonDiedError,
    MismatchError,
    PeerDiedError,
    from_reply,
)
from commd.client.handle import Handle
from commd.client.trust import connect_to_daemon
from commd.kernels import small
from commd.memory import futex
from commd.memory.arena import Segment
from commd.protocol import fastring as fr
from commd.protocol import schema as s
from commd.protocol.fdpass import close_all, recv_with_fds
from commd.runtime import ClosedAtExit, env_int, pid_alive

log = logging.getLogger("commd.client")

#: Busy-wait this long for the peers before sleeping (a core is never burnt while idle).
SPIN_S = 1e-3
#: Longest sleep between checks of the deadline and of the peers' and daemon's processes.
SLICE_S = 0.1
_DTYPE_CODE = {name: i for i, name in enumerate(fr.DTYPES)}
_OP_CODE = {name: i for i, name in enumerate(fr.REDUCE_OPS)}
#: What a bridged ring tells its daemon when this rank leaves it, by the error's type.
_ERROR_CODES = {MismatchError: "mismatch", CommTimeoutError: "timeout", PeerDiedError: "peer_died",
                DaemonDiedError: "peer_died"}
#: What a local ring tells its daemon of a failed op, by the error's type (``on_failed``).
_FAILURE_CODES = {MismatchError: s.E_MISMATCH, CommTimeoutError: s.E_TIMEOUT}
#: How long ``close`` waits for the progress thread to leave (it wakes at once, at most ``SLICE_S``).
CLOSE_JOIN_S = 2.0
#: Rings not closed yet: closed at interpreter exit, before daemon threads are stopped (``close``).
_OPEN_RINGS = ClosedAtExit()


def available() -> bool:
    """The ring needs a total-store-order CPU and the futex syscall (both: x86-64 Linux);
    ``COMMD_LOCAL_RING=0`` keeps every op on the daemon path (a bad value raises ConfigError)."""
    return futex.available() and env_int("COMMD_LOCAL_RING", 1, 0, 1) == 1


def request_ring(ops_socket: Any, client_id: int, secret: str, group: str, timeout: float,
                 daemon_pid: int, bridge: str = "daemon") -> tuple[Segment, dict[str, Any]]:
    """Ask the daemon (``daemon_pid`` only, checked by its kernel credentials) for ``group``'s ring.
    ``bridge``: who should play a bridged ring's bridge line, ``daemon`` or ``rank`` (the node's
    first rank of the group, ``client/ringbridge.py``); the reply says who does (the first request
    of the node decided it), and with ``rank`` gives the node, its address and the group's token."""
    request = {"t": s.FASTRING, "client_id": client_id, "secret": secret, "group": group, "bridge": bridge}
    fds: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout)
        try:
            connect_to_daemon(sock, ops_socket, daemon_pid, f"the exchange ring of group {group!r}")
            sock.send(s.encode(request))
            frame, fds, _ = recv_with_fds(sock, 64 << 10)
            reply = s.decode(frame)
        except (OSError, s.ProtocolError) as exc:
            close_all(fds)
            raise ConnectError(f"cannot get the exchange ring of group {group!r}: {exc}") from None
    try:
        if reply.get("t") != s.ACK:
            raise from_reply(reply.get("code", ""), reply.get("message", "ring refused"))
        bridged = reply.get("bridged") is True
        nranks = s.int_field(reply, "nranks", 2, fr.MAX_RANKS + bridged)
        members = reply.get("members") if bridged else None
        if bridged and (type(members) is not list or len(members) != nranks - 1
                        or not all(type(m) is int and m >= 0 for m in members)):
            raise s.ProtocolError("a bridged ring's reply must list its members' group ranks")
        depth = s.int_field(reply, "depth", 1, 1 << 16)
        slot_bytes = s.int_field(reply, "slot_bytes", 8, 1 << 24)
        large_depth = s.int_field(reply, "large_depth", 1, 64)
        large_bytes = s.int_field(reply, "large_bytes", slot_bytes, 1 << 30)
        rank = s.int_field(reply, "rank", 0, nranks - 1 - bridged)  # never the bridge's line
        host = reply.get("bridge", "daemon") if bridged else None
        if host not in (None, "daemon", "rank"):
            raise s.ProtocolError(f"unknown bridge host {host!r}")
        hosting = {"node": s.int_field(reply, "node", 0), "ip": s.field(reply, "ip", str),
                   "token": s.field(reply, "token", str)} if host == "rank" else {}
        size = fr.region_bytes(nranks, depth, slot_bytes, large_depth, large_bytes)
        if len(fds) != 1 or s.int_field(reply, "size", 1) != size or slot_bytes % 8 or large_bytes % 8:
            raise ConnectError(f"the daemon's exchange ring for group {group!r} is malformed")
        try:
            region = Segment.from_fd(0, f"ring {group}", size, fds[0], os.getuid())
        except (OSError, ValueError) as exc:
            raise ConnectError(f"cannot map the exchange ring of group {group!r}: {exc}") from None
    except s.ProtocolError as exc:
        raise ConnectError(f"the daemon's exchange ring reply for group {group!r} is malformed: {exc}") from None
    finally:
        close_all(fds)
    header = region.array[: fr.HEADER_BYTES]
    if int(header[:8].view("u8")[0]) != fr.MAGIC or tuple(int(x) for x in header[8:36].view("u4")) != (
            fr.VERSION, nranks, depth, slot_bytes, large_depth, large_bytes, int(bridged)):
        raise ConnectError(f"the exchange ring of group {group!r} has an unknown header")
    return region, {"nranks": nranks, "depth": depth, "slot_bytes": slot_bytes, "large_depth": large_depth,
                    "large_bytes": large_bytes, "rank": rank, "bridged": bridged, "members": members,
                    "bridge": host, **hosting}


class RingLeft(CommdError):
    """An op reached a ring that a failure had left since its caller checked ``usable()``.  It has
    no number yet: the caller sends it down the daemon path, where every other rank's op went (an
    error here would leave this rank a collective behind the others from then on)."""


class RingHandle(Handle):
    """A Handle whose completion comes from the ring (``client`` is the ring: it waits and pumps), or,
    once its op was handed over to the daemon (``delegate_to``), from the daemon op's handle."""

    __slots__ = ("delegate", "after")  # (set by ``ExchangeRing.post``: no __init__ of its own on the op's path)

    def is_completed(self) -> bool:
        if not self._done:
            if self.delegate is not None:
                if self.delegate.is_completed():
                    self.settle_delegated()
            else:
                self.client.poll()
        return self._done

    def delegate_to(self, handle: Handle, after: Callable[[], None] | None) -> None:
        """The op now runs on the daemon as ``handle``: this handle completes or fails as it does
        (``after``, the ring's copy-out, once it succeeded), even when nobody waits (a future)."""
        self.after = after
        self.delegate = handle
        handle.get_future().add_done_callback(lambda _future: self.settle_delegated())

    def settle_delegated(self) -> None:
        """Complete or fail as the delegate did (it is done); idempotent."""
        if self._done or self.delegate is None:
            return
        error = self.delegate.exception()
        if error is not None:
            self.fail(error)
            return
        after, self.after = self.after, None
        try:
            if after is not None:
                after()
        except Exception as exc:  # a failed copy-out is the op's failure
            self.fail(CommdError(f"{self.description}: copying the result out failed: {exc}"))
            return
        self.complete({})


class _Op:
    __slots__ = ("seq", "index", "dtype", "op", "count", "nbytes", "address", "handle", "after", "timeout",
                 "hand_over", "posted_at")

    def __init__(self, seq: int, index: int, dtype: int, op: int, count: int, nbytes: int, address: int,
                 handle: RingHandle, after: Callable[[], None] | None, timeout: float,
                 hand_over: Callable[[int], Handle] | None = None) -> None:
        self.seq, self.index, self.dtype, self.op, self.count, self.nbytes = seq, index, dtype, op, count, nbytes
        self.address, self.handle, self.after, self.timeout = address, handle, after, timeout
        #: submits this op to the daemon under the number given (its own): a bridged ring that is left
        #: hands over the ops whose results it never published, so they run as on the daemon path
        self.hand_over = hand_over
        self.posted_at = 0.0  # when it was posted, if it is traced (``ExchangeRing._trace``)


class ExchangeRing:
    """This rank's side of one local group's ring (thread-safe; one per group and process).

    The per-op path is a few dozen word reads and writes through ``memoryview``s of the
    region (NumPy indexing and ``ctypes`` attribute lookups cost microseconds each in
    Python, and a tiny all-reduce is nothing but such steps), one ``memmove`` in, one
    cached NumPy reduction and one ``memmove`` out; the futex is touched only when a
    peer sleeps.
    """

    def __init__(self, region: Segment, meta: dict[str, Any], group: str, rank: int, daemon_pid: int,
                 op_timeout: float) -> None:
        self.region = region
        self.group = group
        self.rank = rank  # the process's global rank (for messages)
        self.me = meta["rank"]
        self.nranks, self.depth, self.slot_bytes = meta["nranks"], meta["depth"], meta["slot_bytes"]
        self.large_depth, self.large_bytes = meta["large_depth"], meta["large_bytes"]
        #: a group that spans nodes: the last line is the daemon's bridge, which publishes each op's
        #: result (the ranks copy it out instead of reducing)
        self.bridged: bool = meta.get("bridged", False)
        self.bridge = self.nranks - 1 if self.bridged else -1
        #: the bridge line is played by the node's first rank of the group (client/ringbridge.py)
        self.rank_bridged: bool = meta.get("bridge") == "rank"
        #: the group rank of each line, for messages (the bridge's line: the group's other nodes)
        self.members: list[int] = list(meta["members"]) if self.bridged else list(range(self.nranks))
        #: the largest all-reduce (bytes) this ring takes
        self.max_bytes = (fr.bridged_max_bytes(self.slot_bytes, self.large_bytes) if self.bridged
                          else max(self.slot_bytes, self.large_bytes))
        self.daemon_pid = daemon_pid
        self.op_timeout = op_timeout
        mm = region.mm
        n, depth, slot = self.nranks, self.depth, self.slot_bytes
        self.control = np.ndarray((n, fr.CONTROL_BYTES // 8), np.int64, mm, fr.CONTROL_OFFSET)
        self.bells = [ctypes.c_void_p(region.base + fr.CONTROL_OFFSET + r * fr.CONTROL_BYTES + fr.BELL_OFFSET)
                      for r in range(n)]
        # word indices into the region, for the memoryviews below
        self._words = memoryview(mm).cast("q")
        self._u32 = memoryview(mm).cast("I")
        line = [(fr.CONTROL_OFFSET + r * fr.CONTROL_BYTES) // 8 for r in range(n)]
        self._posted_at = [w + fr.POSTED for w in line]
        self._local_posted_at = self._posted_at[:-1] if self.bridged else self._posted_at  # the ranks' lines
        self._consumed_at = [w + fr.CONSUMED for w in line]
        self._sleeping_at = [w + fr.SLEEPING for w in line]
        self._submitted_at = [w + fr.SUBMITTED for w in line]
        self._abandoned_at = [w + fr.ABANDONED for w in line]
        self._failed_at = line[-1] + fr.FAILED  # (the bridge's line, in a bridged ring)
        self._bell_at = [(fr.CONTROL_OFFSET + r * fr.CONTROL_BYTES + fr.BELL_OFFSET) // 4 for r in range(n)]
        offsets = [[fr.entry_offset(n, depth, slot, d, r) for r in range(n)] for d in range(depth)]
        self._header_at = [[o // 8 for o in row] for row in offsets]
        self._state_at = [[h + fr.STATE for h in row] for row in self._header_at]  # (read on every op)
        self._data_offset = [[o + fr.ENTRY_HEADER_BYTES for o in row] for row in offsets]
        self._data_address = [[region.base + o for o in row] for row in self._data_offset]
        large = [[fr.large_slot_offset(n, depth, slot, self.large_bytes, j, r) for r in range(n)]
                 for j in range(self.large_depth)]
        self._large_offset = large
        self._large_address = [[region.base + o for o in row] for row in large]
        self._large_next = 0  # the large slot our next large op takes
        self._large_last = [0] * self.large_depth  # per large slot: the last op of ours that used it
        self._scratch = np.empty(slot, np.uint8)
        self._scratch_address = self._scratch.ctypes.data
        self._reductions: dict[tuple[int, int, int, int], Callable[[], None]] = {}
        self._fence = futex.Fence()
        # spinning only helps when every rank can run at once, and not for a bridged op's result,
        # which comes from other nodes (the cores are better left to the daemon); else sleep at once
        self._spin_s = SPIN_S if n <= len(os.sched_getaffinity(0)) and not self.bridged else 0.0
        self.next_seq = self._words[self._posted_at[self.me]] + 1
        #: the group's collectives this rank has submitted, through the ring or the daemon
        self.group_ops = self._words[self._submitted_at[self.me]]
        #: called (dtype, reduce op, count, the op's number) when this rank's ring op meets peers that
        #: sent the same collective to the daemon: it submits a daemon all-reduce of that shape and
        #: number, so the daemon reports the disagreement to those peers too (they wait for it there)
        self.on_diverged: Callable[[str, str, int, int], Any] | None = None
        #: bridged rings: called (op number) when this rank saw every local rank publish an op (the
        #: daemon then reduces them), and (error code, reason, the group's number of the op it left at
        #: or None) when this rank leaves the ring on its own
        self.on_all_posted: Callable[[int], Any] | None = None
        self.on_left: Callable[[str, str, int | None], Any] | None = None
        #: called with a batch of traced ops (the ring's first line, while the daemon traces):
        #: [number, bytes, posted, all inputs in, done, error or None] each, times on the monotonic clock
        self.on_trace: Callable[[list[list[Any]]], Any] | None = None
        self._traced: list[list[Any]] = []
        #: (the op's number, error code, message) when a ring op fails on a local ring (a timeout, a
        #: mismatch): the daemon logs the op's line and fails a late rank's op of that number at once
        self.on_failed: Callable[[int, str, str], Any] | None = None
        #: the group's collective numbering (``Client.numbering``): returns the next op's number and
        #: takes it; None: this ring counts the group's collectives itself (``group_ops``)
        self.take_number: Callable[[], int] | None = None
        #: each group rank's global rank, for messages (None: the group ranks are the global ranks)
        self.global_ranks: list[int] | None = None
        self.control[self.me, fr.PID] = os.getpid()
        self.pending: collections.deque[_Op] = collections.deque()
        self.broken: CommdError | None = None
        self._lock = threading.RLock()
        self._ids = 0
        self._progress_thread: threading.Thread | None = None
        self._wanted = threading.Event()
        self._next_check = 0.0  # when the missing ranks' and the daemon's processes are checked next
        self.closed = False
        #: called once the ring is closed (a bridge this rank plays, its notice socket)
        self.on_close: list[Callable[[], Any]] = []
        #: a bridge line a rank plays: its node, listener address and the group's token (request_ring)
        self.hosting: dict[str, Any] = {k: meta[k] for k in ("node", "ip", "token") if k in meta}
        _OPEN_RINGS.add(self)

    # ---- publishing -----------------------------------------------------
    def _ring_bell(self) -> None:
        """Tell the peers our posted/consumed moved: bump our bell; wake only a peer asleep on it."""
        words, at = self._u32, self._bell_at[self.me]
        words[at] = (words[at] + 1) & 0x7FFFFFFF
        self._fence()
        words64 = self._words
        for index in self._sleeping_at:
            if words64[index]:  # some thread of that rank sleeps (on our bell, or another's)
                futex.futex_wake(self.bells[self.me])
                return

    def all_reduce(self, array: np.ndarray, dtype: str, op: str, timeout: float | None,
                   result: Any = None, after: Callable[[], None] | None = None) -> RingHandle:
        """Publish ``array`` (a contiguous NumPy array, reduced in place) as the next op."""
        return self.post(array.ctypes.data, array.nbytes, dtype, op, timeout, result, after, keep=array)

    def post(self, address: int, nbytes: int, dtype: str, op: str, timeout: float | None,
             result: Any = None, after: Callable[[], None] | None = None, keep: Any = None,
             hand_over: Callable[[int], Handle] | None = None) -> RingHandle:
        """Publish the ``nbytes`` at ``address`` (the caller keeps them alive: ``result``/``keep``)
        as the next op; the result is written back there when it completes.  ``hand_over``: see ``_Op``.
        Raises ``RingLeft`` (before the op takes a number) when the ring has been left: the op then
        belongs on the daemon path, as on every rank that saw the ring left before its ``usable()``."""
        timeout = timeout or self.op_timeout
        dcode, ocode = _DTYPE_CODE[dtype], _OP_CODE[op]
        count = nbytes // small.NUMPY_DTYPES[dtype].itemsize
        words, me = self._words, self.me
        with self._lock:
            seq = self.next_seq
            self._ids += 1
            handle = RingHandle(self, self._ids, "allreduce", self.group, time.monotonic() + timeout,
                                result=result, keep=keep)
            handle.delegate = handle.after = None
            # entry (seq mod depth) is free once every rank has consumed seq - depth
            self._wait_consumed(seq - self.depth, handle.deadline, "the exchange ring is full")
            d = seq % self.depth
            if nbytes <= self.slot_bytes:
                where, target = 0, self._data_address[d][me]
            else:
                j = self._large_next
                self._wait_consumed(self._large_last[j], handle.deadline, "the large slots are full")
                where, target = j + 1, self._large_address[j][me]
                self._large_next = (j + 1) % self.large_depth
                self._large_last[j] = seq
            if self.broken is not None:  # a failure seen since the caller's ``usable()``, or while waiting for room
                raise RingLeft(f"group {self.group!r}: the exchange ring was left ({self.broken})")
            # the op's number is taken once it is sure to be posted: a number never skipped on this path
            index = (self.take_number() if self.take_number is not None else self.group_ops) + 1
            ctypes.memmove(target, address, nbytes)
            h = self._header_at[d][me]
            words[h + fr.STATE] = 0  # first: the entry's last op may have been withdrawn (stores stay in order)
            words[h], words[h + fr.DTYPE], words[h + fr.OP], words[h + fr.COUNT] = seq, dcode, ocode, count
            words[h + fr.WHERE], words[h + fr.INDEX] = where, index
            words[self._posted_at[me]] = seq  # publishes the entry (stores stay in order on x86)
            words[self._submitted_at[me]] = self.group_ops = index  # after posted: see _diverged
            self.next_seq = seq + 1
            self._ring_bell()  # (its fence orders our posted before the reads below)
            self.pending.append(_Op(seq, index, dcode, ocode, count, nbytes, address, handle, after, timeout,
                                    hand_over))
            if me == 0 and self._u32[fr.TRACING_U32]:  # one word read per op while nobody traces
                self.pending[-1].posted_at = time.monotonic()
            if self.bridged and self.on_all_posted is not None and not self._behind(seq, self._local_posted_at):
                self._tell_daemon(self.on_all_posted, seq)  # every rank that sees this may tell: no one misses it
            self._progress()
        if not Handle.is_completed(handle) and self._progress_thread is not None:
            self._wanted.set()
        return handle

    def usable(self) -> bool:
        """False once this rank or a peer has left the ring: the group's ops then take the daemon path."""
        if self.broken is None:
            words = self._words
            for r, index in enumerate(self._abandoned_at):
                if words[index]:
                    with self._lock:
                        if r == self.bridge:
                            self._progress()  # a pending op the bridge failed fails as the bridge says
                            self._bridge_failed(None)
                        elif words[index] >= fr.DEAD_LINE:  # it left because a rank died: name that rank
                            dead = words[index] - fr.DEAD_LINE
                            self._break(self._died(dead), dead=dead)
                        else:
                            self._break(CommdError(f"group {self.group!r}: group rank {self.members[r]} left the "
                                                   "exchange ring"))
                    break
        return self.broken is None

    def note_daemon_op(self) -> None:
        """A collective of the group goes to the daemon (rings that count the group's collectives
        themselves, ``take_number`` None): count it, as ``note_submitted`` does."""
        with self._lock:
            self.note_submitted(self.group_ops + 1)

    def note_submitted(self, count: int) -> None:
        """``count`` collectives of the group are numbered, the last for the daemon: a peer whose ring op
        waits at that place learns the ranks disagree at once (instead of when the op times out).
        Takes no lock (``Client.on_numbered`` calls it under the client's): only this rank writes its
        ``submitted`` word, and it only grows."""
        if count > self.group_ops:
            self.group_ops = count
            self._words[self._submitted_at[self.me]] = count
            self._ring_bell()

    def drain(self) -> None:
        """Wait until every op posted here has completed (ops complete in order: the last one).

        A daemon op of the same group may read or write the same tensors in place, so it
        must not start before the ring ops submitted ahead of it are done.
        """
        with self._lock:
            last = self.pending[-1].handle if self.pending else None
        if last is not None:
            try:
                last.wait(max(0.0, last.deadline - time.monotonic()))
            except CommdError:
                pass  # the op reports its own failure

    def _wait_consumed(self, seq: int, deadline: float, full: str) -> None:
        """Before reusing memory op ``seq`` used: wait until every rank has consumed it."""
        if seq > 0 and self._behind(seq, self._consumed_at):
            self._wait(lambda: self._progressed_behind(seq), deadline,
                       f"allreduce on group '{self.group}' (rank {self.rank}): {full}")

    def _progressed_behind(self, seq: int) -> list[int]:
        """Ranks that have not consumed ``seq`` yet, after completing what we can ourselves
        (two ranks that both filled the ring with async ops must not wait on each other); none
        once the ring is left (``post`` then says so)."""
        self._progress()
        if self.broken is not None:
            return []
        return self._behind(seq, self._consumed_at)

    def _behind(self, seq: int, where: list[int]) -> list[int]:
        """The group ranks whose word at ``where`` (posted / consumed) has not reached ``seq``."""
        words = self._words
        return [r for r, index in enumerate(where) if words[index] < seq]

    # ---- completing -----------------------------------------------------
    def _progress(self) -> None:
        """Complete every pending op whose inputs are all published (caller holds the lock)."""
        words, pending = self._words, self.pending
        while pending:
            head = pending[0]
            seq = head.seq
            for index in self._posted_at:
                if words[index] < seq:
                    # A bridge that failed comes first: peers that saw it left for the daemon, and
                    # its reason (a dead node's rank, say), not a mismatch, is why they are not here.
                    if self.bridged and words[self._abandoned_at[self.bridge]]:
                        self._bridge_failed(head)
                    else:
                        daemon = self._sent_to_daemon(head)
                        if daemon:
                            self._diverged(head, daemon)  # fails it, and leaves the ring
                    return
            pending.popleft()
            in_at = time.monotonic() if head.posted_at else 0.0
            d = seq % self.depth
            error = self._withdrawal(head, d) or self._disagreement(head, d)
            if error is None and self.bridged:
                # the bridge published the result in its entry (same header as ours), or for a large
                # op in its large slot of the same index as ours
                error = self._copy_bridged(head, d)
            elif error is None:
                if head.nbytes <= self.slot_bytes:
                    key = (d, head.dtype, head.op, head.count)
                    reduction = self._reductions.get(key)
                    if reduction is None:
                        reduction = self._reductions[key] = self._reduction(*key)
                    reduction()  # into the scratch buffer: the caller's memory is written below
                else:
                    error = self._reduce_large(head, d)  # straight into the caller's memory
            words[self._consumed_at[self.me]] = seq
            self._ring_bell()
            if error is not None:
                head.handle.fail(error)
                self._tell_failed(head, error)
            else:
                if head.nbytes <= self.slot_bytes and not self.bridged:
                    ctypes.memmove(head.address, self._scratch_address, head.nbytes)
                if head.after is not None:
                    try:
                        head.after()
                    except Exception as exc:  # a failed copy-out is the op's failure
                        error = CommdError(f"{head.handle.description}: copying the result out failed: {exc}")
                if error is None:
                    head.handle.complete({})
                else:
                    head.handle.fail(error)
            if head.posted_at:
                self._trace(head, in_at, error)

    def _trace(self, op: _Op, in_at: float, error: CommdError | None) -> None:
        """Keep a traced op's times for the daemon's trace; send them in batches (``on_trace``)."""
        done = time.monotonic()
        self._traced.append([op.index - 1, op.nbytes, op.posted_at, in_at or done, done,
                             None if error is None else str(error)])
        if len(self._traced) >= fr.TRACE_BATCH or done - self._traced[0][4] >= fr.TRACE_BATCH_S:
            self.flush_trace()

    def flush_trace(self) -> None:
        """Send the traced ops kept so far to the daemon (before a daemon op of the group: the
        trace then has them before it, as they ran)."""
        if self._traced:
            with self._lock:
                records, self._traced = self._traced, []
                if records and self.on_trace is not None:
                    self._tell_daemon(self.on_trace, records)

    def _reduction(self, d: int, dtype_code: int, op_code: int, count: int) -> Callable[[], None]:
        """The reduction of entry ``d``'s inputs into the scratch buffer, built once per shape."""
        if len(self._reductions) >= 4 * self.depth:
            self._reductions.clear()  # a bound: shapes that come and go do not pile up
        dtype = small.NUMPY_DTYPES[fr.DTYPES[dtype_code]]
        op = fr.REDUCE_OPS[op_code]
        mm = self.region.mm
        inputs = [np.ndarray((count,), dtype, mm, offset) for offset in self._data_offset[d]]
        out = self._scratch[: count * dtype.itemsize].view(dtype)
        return lambda: small.reduce_into_unchecked(out, inputs, op)

    def _copy_bridged(self, head: _Op, d: int) -> CommdError | None:
        """A bridged op's result, copied out of the bridge's entry or large slot."""
        if head.nbytes <= self.slot_bytes:
            ctypes.memmove(head.address, self._data_address[d][self.bridge], head.nbytes)
            return None
        where = self._words[self._header_at[d][self.bridge] + fr.WHERE]
        if not 1 <= where <= self.large_depth or where != self._words[self._header_at[d][self.me] + fr.WHERE]:
            return self._break(CommdError(f"{head.handle.description}: the exchange ring is corrupted "
                                          f"(the bridge names large slot {where - 1})"))
        ctypes.memmove(head.address, self._large_address[where - 1][self.bridge], head.nbytes)
        return None

    def _reduce_large(self, head: _Op, d: int) -> CommdError | None:
        """A large op: every rank's input is in the large slot its header names."""
        dtype = small.NUMPY_DTYPES[fr.DTYPES[head.dtype]]
        mm, words = self.region.mm, self._words
        inputs = []
        for r, h in enumerate(self._header_at[d]):
            where = words[h + fr.WHERE]
            if not 1 <= where <= self.large_depth:
                return self._break(CommdError(f"{head.handle.description}: the exchange ring is corrupted "
                                              f"(rank {r} names large slot {where - 1})"))
            inputs.append(np.ndarray((head.count,), dtype, mm, self._large_offset[where - 1][r]))
        out = np.frombuffer((ctypes.c_char * head.nbytes).from_address(head.address), dtype)
        small.reduce_into_unchecked(out, inputs, fr.REDUCE_OPS[head.op])
        return None

    def _withdrawal(self, head: _Op, d: int) -> CommdError | None:
        """Every input of ``head`` is posted: its error if a rank withdrew it (it timed out there).

        Read after this rank's own ``posted`` (and a fence): a rank still deciding (``WITHDRAWING``)
        is waited for, so this rank never completes an op another rank fails (``protocol/fastring.py``).
        """
        words = self._words
        for at in self._state_at[d]:
            if words[at]:
                break
        else:
            return None
        for r, h in enumerate(self._header_at[d]):
            state = words[h + fr.STATE]
            if state == fr.WITHDRAWING:
                state = self._verdict_of(r, h)
            if state == fr.WITHDRAWN and words[h + fr.INDEX] == head.index:  # else: _disagreement's to name
                return CommTimeoutError(self._withdrawn_message(head, words[h + fr.VERDICT]))
        return None

    def _verdict_of(self, r: int, h: int) -> int:
        """Wait for rank line ``r`` to decide whether its entry at ``h`` is withdrawn (a few stores away,
        unless its process was preempted or died): its final state."""
        words, pid = self._words, int(self.control[r, fr.PID])
        while (state := words[h + fr.STATE]) == fr.WITHDRAWING:
            if pid and not pid_alive(pid):
                raise self._break(PeerDiedError(f"group {self.group!r}: group rank {self.members[r]} (pid {pid}) "
                                                "died while it withdrew an op"), dead=r)
            time.sleep(20e-6)
        return state

    def _time_out(self, head: _Op) -> None:
        """``head``'s deadline passed: withdraw it, unless every input arrived meanwhile (then it
        completes as usual).  Local rings go on (later ops are unaffected); a bridged ring, whose
        result may be on its way from other nodes, is left, and the daemons fail the op everywhere."""
        words = self._words
        if self.bridged:
            error = CommTimeoutError(self._timeout_message(head, self._behind(head.seq, self._posted_at), head.timeout))
            self.pending.popleft()
            head.handle.fail(error)  # in the daemon's words; the ops behind it are handed to the daemon
            if head.posted_at:
                self._trace(head, 0.0, error)
            self._break(error, number=head.index - 1, only=head.index)
            return
        h = self._header_at[head.seq % self.depth][self.me]
        words[h + fr.STATE] = fr.WITHDRAWING
        self._fence()  # our mark before we read their posted (the other side: post, then _withdrawal)
        missing = self._behind(head.seq, self._posted_at)
        if not missing:
            words[h + fr.STATE] = 0  # they all came in time: the op completes (the caller's _progress)
            return
        words[h + fr.VERDICT] = (sum(1 << r for r in missing)
                                 | round(head.timeout * 1000) << fr.VERDICT_TIMEOUT_SHIFT)
        words[h + fr.STATE] = fr.WITHDRAWN
        error = CommTimeoutError(self._timeout_message(head, missing, head.timeout))
        self._fail_head(head, error)
        self._tell_failed(head, error)

    def _tell_failed(self, head: _Op, error: CommdError) -> None:
        """A local ring's op failed on every rank (a timeout, a mismatch): tell the daemon (``on_failed``;
        each rank may, the daemon keeps the first)."""
        code = _FAILURE_CODES.get(type(error))
        if code is not None and not self.bridged and self.on_failed is not None:
            self._tell_daemon(self.on_failed, head.index - 1, code, str(error))

    def _fail_head(self, head: _Op, error: CommdError) -> None:
        """``head`` (the first pending op) failed before its inputs were read: consumed, failed."""
        self.pending.popleft()
        self._words[self._consumed_at[self.me]] = head.seq
        self._ring_bell()
        head.handle.fail(error)
        if head.posted_at:
            self._trace(head, 0.0, error)

    def _withdrawn_by_peer(self, head: _Op) -> bool:
        """Fail ``head`` if a rank that posted it has withdrawn it (the op timed out there): a rank
        that waits with it fails at once, as the daemon fails every waiting rank of a timed-out op.

        A rank's ``posted`` is read before its entry: an entry being rewritten for this op still
        shows the withdrawal of the op that used it ``depth`` ops ago (a stale mark)."""
        words, d = self._words, head.seq % self.depth
        for r, h in enumerate(self._header_at[d]):
            if r == self.me or words[self._posted_at[r]] < head.seq:
                continue
            if (words[h + fr.STATE] == fr.WITHDRAWN and words[h] == head.seq
                    and words[h + fr.INDEX] == head.index):
                self._fail_head(head, CommTimeoutError(self._withdrawn_message(head, words[h + fr.VERDICT])))
                return True
        return False

    def _timeout_message(self, head: _Op, lines: list[int], timeout: float) -> str:
        """A timed-out op's message, in the daemon's words (``schema.not_submitted``), global ranks named."""
        ranks = [self.members[r] for r in lines if r != self.bridge]
        if self.bridge in lines and self.global_ranks is not None:  # the ranks on the other nodes, all named
            ranks += [g for g in range(len(self.global_ranks)) if g not in self.members]
        named = sorted(self.global_ranks[r] for r in ranks) if self.global_ranks is not None else ranks
        return s.not_submitted(f"allreduce #{head.index - 1} on group '{self.group}'", self._describe(lines),
                               named, timeout)

    def _withdrawn_message(self, head: _Op, verdict: int) -> str:
        mask = verdict & ((1 << fr.VERDICT_TIMEOUT_SHIFT) - 1)
        lines = [r for r in range(self.nranks) if mask >> r & 1]
        return self._timeout_message(head, lines, (verdict >> fr.VERDICT_TIMEOUT_SHIFT) / 1000)

    def _disagreement(self, head: _Op, d: int) -> CommdError | None:
        words, seq = self._words, head.seq
        for h in self._header_at[d]:
            if (words[h] != seq or words[h + fr.DTYPE] != head.dtype or words[h + fr.OP] != head.op
                    or words[h + fr.COUNT] != head.count or words[h + fr.INDEX] != head.index):
                break
        else:
            return None
        rows = [[words[h + k] for k in range(fr.INDEX + 1)] for h in self._header_at[d]]
        if any(row[fr.SEQ] != seq for row in rows):
            return self._break(CommdError(f"{head.handle.description}: the exchange ring is corrupted "
                                          f"(entries {[row[fr.SEQ] for row in rows]} for op {seq})"))
        who = [[self.members[r] if r != self.bridge else -1] for r in range(self.nranks)]
        if any(row[fr.INDEX] != head.index for row in rows):
            # the ranks took different collectives to this ring op (one sent a place to the daemon late,
            # after the op there timed out): out of step, so the ring is left; numbers as the daemon's
            numbers = [[*row[:fr.INDEX], row[fr.INDEX] - 1] for row in rows]
            problems = fr.differences(numbers, who, (("collective number", fr.INDEX, None),))
            return self._break(MismatchError(f"mismatched collective #{head.index - 1} on group '{self.group}': "
                                             "the ranks' exchange ring op is not the same collective: "
                                             + "; ".join(problems)))
        problems = fr.differences(rows, who)
        return MismatchError(f"mismatched collective #{head.index - 1} on group '{self.group}': "
                             + "; ".join(problems))

    def _sent_to_daemon(self, head: _Op) -> list[int]:
        """The ranks that submitted ``head``'s place without posting it: it went to their daemon.

        ``submitted`` is written after ``posted``, so it is read first and ``posted`` after it.
        """
        words = self._words
        return [r for r, (submitted, posted) in enumerate(zip(self._submitted_at, self._posted_at, strict=True))
                if words[submitted] >= head.index and words[posted] < head.seq]

    def _diverged(self, head: _Op, daemon: list[int]) -> None:
        """Peers sent the head's collective to the daemon: fail it here with a MismatchError,
        leave the ring (every rank follows to the daemon path), and tell the daemon
        (``on_diverged``): the peers wait for this rank's op there and get the daemon's
        MismatchError, naming the fields that differ.  A rank that died explains it instead (the
        peers left the ring on seeing it, before this op): PeerDiedError naming it, as on the daemon."""
        dead = self._dead_line()
        if dead is not None:
            self._break(self._died(dead), dead=dead)
            return
        ring = [self.members[r] for r in range(self.nranks) if r not in daemon and r != self.bridge]
        dtype, op = fr.DTYPES[head.dtype], fr.REDUCE_OPS[head.op]
        self._break(MismatchError(
            f"mismatched collective #{head.index - 1} on group '{self.group}': group ranks {ring} submitted an "
            f"all-reduce of {head.count} {dtype} ({op}) that goes through the exchange ring, group ranks "
            f"{[self.members[r] for r in daemon]} a collective that goes through the daemon (another kind, size, "
            "dtype, reduce op or device)"))
        self._tell_daemon_diverged(head)

    def _tell_daemon_diverged(self, head: _Op) -> None:
        dtype, op = fr.DTYPES[head.dtype], fr.REDUCE_OPS[head.op]
        if self.on_diverged is not None:
            try:
                self.on_diverged(dtype, op, head.count, head.index - 1)
            except Exception as exc:  # noqa: BLE001 - this rank's op has failed already; the peers time out
                log.warning("group %s: could not tell the daemon about mismatched collective #%d: %s",
                            self.group, head.index, exc)

    def _bridge_failed(self, head: _Op | None) -> None:
        """The daemon's bridge failed the ring's ops from ``head`` on (bridged rings): fail them with
        its reason and leave the ring; when the group's ranks on another node sent ``head``'s place
        to their daemon, also submit it there, as for a local disagreement (``_diverged``)."""
        words = self._words
        code_index = words[self._abandoned_at[self.bridge]] - 1
        code = fr.BRIDGE_ERRORS[code_index] if 0 <= code_index < len(fr.BRIDGE_ERRORS) else "internal"
        at = fr.reason_offset(self.nranks, self.depth, self.slot_bytes, self.large_bytes)
        length = min(self._u32[at // 4], fr.REASON_RESERVE - 4)
        reason = bytes(self.region.mm[at + 4: at + 4 + length]).decode(errors="replace")
        error = MismatchError(reason) if code == "diverged" else from_reply(code, reason)
        failed = words[self._failed_at]  # the failed op's collective index; 0: the failure names none
        head = next((op for op in self.pending if op.index == failed), None) if failed else head
        if failed and code != "peer_died":  # the ops around it run as on the daemon path: handed over
            self._break(error, tell=False, only=failed)
        else:
            self._break(error, tell=False)
        if code == "diverged" and head is not None:
            self._tell_daemon_diverged(head)

    def _tell_daemon(self, call: Callable[..., Any], *args: Any) -> None:
        try:
            call(*args)
        except CommdError as exc:  # the daemon is gone or stuck: this rank's waits see it and fail
            log.warning("group %s: could not reach the daemon for the exchange ring: %s", self.group, exc)

    def _dead_line(self) -> int | None:
        """A ring line whose process died, as a line that left says or as its pid shows; None if none."""
        words = self._words
        for r in range(self.nranks):
            if r != self.bridge and words[self._abandoned_at[r]] >= fr.DEAD_LINE:
                return int(words[self._abandoned_at[r]] - fr.DEAD_LINE)
        for r in range(self.nranks):
            pid = int(self.control[r, fr.PID])
            if r != self.bridge and pid and not pid_alive(pid):
                return r
        return None

    def _died(self, line: int) -> PeerDiedError:
        pid = int(self.control[line, fr.PID])
        if line == self.bridge:  # a bridge a rank played: that rank, the node's first of the group
            return PeerDiedError(f"group {self.group!r}: group rank {self.members[0]} (pid {pid}), which "
                                 "bridged this node's ranks to the group's other nodes, died")
        return PeerDiedError(f"group {self.group!r}: group rank {self.members[line]} (pid {pid}) died")

    def _break(self, error: CommdError, tell: bool = True, number: int | None = None,
               only: int | None = None, dead: int | None = None) -> CommdError:
        """The ring is out of step: fail everything pending and leave the ring (``usable()``: the
        group's later ops take the daemon path, on every rank once it sees the flag).  A bridged
        ring also tells the daemon (``tell``), whose bridge fails the op on the other nodes, and
        with the op's ``number`` the daemons fail a late rank's op of that number on arrival.
        ``only``: the collective index of the one op that failed (a bridged ring's bridge decided it:
        no rank completes the others on the ring); the others are handed over to the daemon.
        ``dead``: the ring line whose process died, if that is why (the others then name it too)."""
        if self.broken is None:
            self.broken = error
            self._words[self._abandoned_at[self.me]] = fr.LEFT if dead is None else fr.DEAD_LINE + dead
            self._ring_bell()
            if tell and self.bridged and self.on_left is not None:
                self._tell_daemon(self.on_left, _ERROR_CODES.get(type(error), "internal"), str(error), number)
        failed = list(self.pending)
        self.pending.clear()
        for op in failed:
            if only is not None and op.index != only and op.hand_over is not None:
                self._hand_over(op)
            else:
                op.handle.fail(type(error)(f"{op.handle.description}: {error}"))
                if op.posted_at:
                    self._trace(op, 0.0, error)
        return error

    def _hand_over(self, op: _Op) -> None:
        """Run ``op`` on the daemon under its own number; its handle follows the daemon op's."""
        assert op.hand_over is not None
        try:
            delegate = op.hand_over(op.index - 1)
        except CommdError as exc:
            op.handle.fail(type(exc)(f"{op.handle.description}: handing the op to the daemon failed: {exc}"))
            return
        op.handle.delegate_to(delegate, op.after)

    # ---- waiting --------------------------------------------------------
    def poll(self) -> None:
        """Complete what can be completed now, without waiting."""
        if self._lock.acquire(blocking=False):
            try:
                self._progress()
            finally:
                self._lock.release()

    def wait_for(self, handle: RingHandle, timeout: float | None) -> None:
        """Block until ``handle`` completes or ``timeout`` passes (``Handle.wait`` calls this)."""
        limit = handle.deadline if timeout is None else min(handle.deadline, time.monotonic() + timeout)
        self._wait_on_ring(handle, limit)
        delegate = handle.delegate
        if delegate is not None and not handle.is_completed():  # handed over: the daemon op decides
            try:
                delegate.wait(None if timeout is None else max(0.0, limit - time.monotonic()))
            except CommTimeoutError as exc:
                if timeout is None and not delegate.is_completed():
                    handle.fail(exc)  # the daemon never answered in the op's time
            except CommdError:
                pass  # the delegate failed: the handle takes its error below
            if delegate.is_completed():
                handle.settle_delegated()

    def _wait_on_ring(self, handle: RingHandle, limit: float) -> None:
        with self._lock:
            while not Handle.is_completed(handle) and handle.delegate is None:
                self._progress()
                if Handle.is_completed(handle) or not self.pending:
                    return
                head = self.pending[0]
                try:
                    arrived = self._wait(lambda head=head: self._head_missing(head),
                                         min(limit, head.handle.deadline), None)
                except CommdError:
                    return  # a dead peer or daemon: _check_alive failed every pending handle
                if not arrived:
                    if time.monotonic() < head.handle.deadline:
                        return  # the caller's own timeout: the op stays pending
                    if self.pending and self.pending[0] is head:
                        self._time_out(head)  # then the next pending op, if it is the one waited for

    def _describe(self, lines: list[int]) -> str:
        """Ring lines as the user knows them: group ranks, and the bridge as the other nodes."""
        ranks = [self.members[r] for r in lines if r != self.bridge]
        words = [f"group ranks {ranks}"] if ranks else []
        if self.bridge in lines:
            words.append("the group's ranks on its other nodes")
        return " and ".join(words)

    def _head_missing(self, head: _Op) -> list[int]:
        """The ranks ``head`` still waits for; none once it completed or failed (a disagreement)."""
        missing = self._behind(head.seq, self._posted_at)
        if missing:
            self._progress()
            if not self.pending or self.pending[0] is not head or self._withdrawn_by_peer(head):
                return []
        return missing

    def _wait(self, missing: Callable[[], list[int]], deadline: float, full: str | None) -> bool:
        """Wait until ``missing()`` is empty: spin briefly, then sleep on a missing rank's bell.

        False once ``deadline`` passes (raises instead when ``full`` names the wait); a dead
        missing rank or daemon breaks the ring (raises its error).
        """
        if not missing():
            return True
        if self._spin_s:
            clock = time.perf_counter
            spin_end = clock() + self._spin_s
            while clock() < spin_end:  # no sched_yield: it can hand the core away for a whole time slice
                if not missing():
                    return True
        words, sleeping = self._words, self._sleeping_at[self.me]
        while True:
            waiting = missing()
            if not waiting:
                return True
            now = time.monotonic()
            if now >= self._next_check or now >= deadline:  # per ring: short waits check too
                self._next_check = now + SLICE_S
                self._check_alive(waiting, missing)
            if now >= deadline:
                if full is not None:
                    raise CommTimeoutError(f"{full}: {self._describe(waiting)} are {self.depth} ops behind")
                return False
            peer = self._sleep_on(waiting, full is None)
            words[sleeping] += 1  # announce the sleep, then read the bell (see futex.Fence); under our lock
            try:
                self._fence()
                seen = self._u32[self._bell_at[peer]]
                if not missing():
                    return True
                self._lock.release()
                try:
                    futex.futex_wait(self.bells[peer], seen, min(SLICE_S, max(deadline - now, 1e-4)))
                finally:
                    self._lock.acquire()
            finally:
                words[sleeping] -= 1

    def _sleep_on(self, waiting: list[int], for_result: bool) -> int:
        """Whose bell to sleep on while ``waiting`` (lines) have not moved.

        Never our own when a peer's move is what we need: when we ourselves are behind (a full
        ring waits for our own consumption too), what we need is the head op's missing inputs.
        A bridged ring's result comes after every input, so waiting for results (not for a
        peer's consumption, which rings only that peer's bell) we sleep on the bridge's alone:
        a wake-up per local peer saved.
        """
        if self.me in waiting and self.pending:
            behind = [r for r in self._behind(self.pending[0].seq, self._posted_at) if r != self.me]
            if behind:
                waiting, for_result = behind, True
        others = [r for r in waiting if r != self.me]
        if not others:
            return self.me  # nothing a peer must do: a slice, then look again
        if self.bridged and for_result and self.bridge in others:
            return self.bridge
        return others[0]

    def _check_alive(self, waiting: list[int], missing: Callable[[], list[int]]) -> None:
        """Break the ring if a line we wait for belongs to a dead process.  ``waiting`` may be stale: a
        peer can post what we wait for and then exit (its job done) before we look, so a dead line
        counts only if ``missing()``, read after its death was seen, still lists it."""
        for r in waiting:
            if r == self.bridge and not self.rank_bridged:
                continue  # the daemon's line: checked below
            pid = int(self.control[r, fr.PID])
            if pid and not pid_alive(pid) and r in missing():
                raise self._break(self._died(r), dead=r)
        if not pid_alive(self.daemon_pid):
            raise self._break(DaemonDiedError(f"commd daemon (pid {self.daemon_pid}) died"))

    # ---- futures ----------------------------------------------------------
    def start_receiver(self) -> None:
        """Futures complete without anyone waiting: a thread finishes pending ops (idle: asleep)."""
        with self._lock:
            if self._progress_thread is not None:
                return
            self._progress_thread = threading.Thread(target=self._run_progress, name="commd-ring", daemon=True)
            self._progress_thread.start()
        self._wanted.set()

    def _run_progress(self) -> None:
        while not self.closed:
            self._wanted.wait(SLICE_S)
            self._wanted.clear()
            while self.pending and not self.closed:
                head = self.pending[0].handle
                try:
                    self.wait_for(head, SLICE_S)
                except CommdError:
                    pass  # the failed handles carry the error
                except Exception as exc:  # noqa: BLE001 - never let futures wait on a dead thread
                    with self._lock:
                        self._break(CommdError(f"group {self.group!r}: the exchange ring failed: {exc!r}"))

    def close(self) -> None:
        """Fail what is pending and stop the progress thread (joined, bounded by ``CLOSE_JOIN_S``).

        A daemon thread still running at interpreter exit is stopped by Python where it next takes
        the GIL; inside one of torch's C++ calls that aborts the process ("terminate called without
        an active exception") after the training finished."""
        with self._lock:
            self.closed = True
            self._break(CommdError("commd client is closed"), tell=False)
            self.flush_trace()
        self._wanted.set()
        thread = self._progress_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_JOIN_S)
        closers, self.on_close = self.on_close, []
        for closer in closers:
            closer()
        _OPEN_RINGS.discard(self)
