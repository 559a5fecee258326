"""Small all-reduces of a local group exchanged in shared memory, without the daemon on the path.

Measured on a 2-core node (2 ranks + daemon): the cheapest possible daemon round trip in
Python (SEQPACKET, no validation) is ~95 µs, the same through shared memory with futex
doorbells ~47 µs; two ranks meeting in shared memory need ~6 µs (spinning briefly) to
~26 µs (sleeping at once).  So a tiny all-reduce of a group whose ranks all live on this
node goes through the group's exchange ring (``protocol/fastring.py``): each rank
publishes its input and the op's description in its own entry, and every rank, once all
have published, checks that the descriptions agree (else a ``MismatchError`` on every
rank, naming the fields and ranks) and reduces the entries itself, in group-rank order
with the daemon's NumPy kernels, so every rank computes the same bits the daemon would.

Waiting spins for ``SPIN_S`` and then sleeps on the peer's futex word, in slices of at
most ``SLICE_S`` after which it checks the op's deadline, the missing ranks' processes
and the daemon's: a timeout, a dead rank or a dead daemon fails the op (and, since the
ring is then out of step, every later op of the group's ring) instead of hanging.

Ordering relies on x86's store order (data and header are written before ``posted``,
read after it); ``available()`` keeps the ring off other architectures.
"""

from __future__ import annotations

import collections
import ctypes
import os
import platform
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
from commd.memory.arena import Segment
from commd.protocol import fastring as fr
from commd.protocol import schema as s
from commd.protocol.fdpass import close_all, recv_with_fds
from commd.runtime import env_int, pid_alive

#: Busy-wait this long for the peers before sleeping (a core is never burnt while idle).
SPIN_S = 50e-6
#: Longest sleep between checks of the deadline and of the peers' and daemon's processes.
SLICE_S = 0.1
_FUTEX_SYSCALL = {"x86_64": 202}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_DTYPE_CODE = {name: i for i, name in enumerate(fr.DTYPES)}
_OP_CODE = {name: i for i, name in enumerate(fr.REDUCE_OPS)}


def available() -> bool:
    """The ring needs a total-store-order CPU and the futex syscall (both: x86-64 Linux);
    ``COMMD_LOCAL_RING=0`` keeps every op on the daemon path (a bad value raises ConfigError)."""
    return platform.machine() in _FUTEX_SYSCALL and env_int("COMMD_LOCAL_RING", 1, 0, 1) == 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall


def _futex_wait(address: ctypes.c_void_p, expected: int, timeout_s: float) -> None:
    """Sleep while the u32 at ``address`` equals ``expected`` (or until woken / ``timeout_s``)."""
    spec = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _syscall(_FUTEX_SYSCALL["x86_64"], address, _FUTEX_WAIT, ctypes.c_uint32(expected),
                  ctypes.byref(spec), None, 0)


def _futex_wake(address: ctypes.c_void_p) -> None:
    _syscall(_FUTEX_SYSCALL["x86_64"], address, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def request_ring(ops_socket: Any, client_id: int, secret: str, group: str, timeout: float,
                 daemon_pid: int) -> tuple[Segment, dict[str, Any]]:
    """Ask the daemon (``daemon_pid`` only, checked by its kernel credentials) for ``group``'s ring."""
    request = {"t": s.FASTRING, "client_id": client_id, "secret": secret, "group": group}
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
        nranks = s.int_field(reply, "nranks", 2, fr.MAX_RANKS)
        depth = s.int_field(reply, "depth", 1, 1 << 16)
        slot_bytes = s.int_field(reply, "slot_bytes", 8, 1 << 24)
        rank = s.int_field(reply, "rank", 0, nranks - 1)
        size = fr.region_bytes(nranks, depth, slot_bytes)
        if len(fds) != 1 or s.int_field(reply, "size", 1) != size:
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
    if int(header[:8].view("u8")[0]) != fr.MAGIC or tuple(int(x) for x in header[8:24].view("u4")) != (
            fr.VERSION, nranks, depth, slot_bytes):
        raise ConnectError(f"the exchange ring of group {group!r} has an unknown header")
    return region, {"nranks": nranks, "depth": depth, "slot_bytes": slot_bytes, "rank": rank}


class RingHandle(Handle):
    """A Handle whose completion comes from the ring (``client`` is the ring: it waits and pumps)."""

    __slots__ = ()

    def is_completed(self) -> bool:
        if not self._done:
            self.client.poll()
        return self._done


class _Op:
    __slots__ = ("seq", "dtype", "op", "count", "out", "handle", "after", "timeout")

    def __init__(self, seq: int, dtype: int, op: int, count: int, out: np.ndarray, handle: RingHandle,
                 after: Callable[[], None] | None, timeout: float) -> None:
        self.seq, self.dtype, self.op, self.count, self.out, self.handle = seq, dtype, op, count, out, handle
        self.after, self.timeout = after, timeout


class ExchangeRing:
    """This rank's side of one local group's ring (thread-safe; one per group and process)."""

    def __init__(self, region: Segment, meta: dict[str, Any], group: str, rank: int, daemon_pid: int,
                 op_timeout: float) -> None:
        self.region = region
        self.group = group
        self.rank = rank  # the process's global rank (for messages)
        self.me = meta["rank"]
        self.nranks, self.depth, self.slot_bytes = meta["nranks"], meta["depth"], meta["slot_bytes"]
        self.daemon_pid = daemon_pid
        self.op_timeout = op_timeout
        mm = region.mm
        self.control = np.ndarray((self.nranks, fr.CONTROL_BYTES // 8), np.int64, mm, fr.CONTROL_OFFSET)
        self.bells = [ctypes.c_void_p(region.base + fr.CONTROL_OFFSET + r * fr.CONTROL_BYTES + fr.BELL_OFFSET)
                      for r in range(self.nranks)]
        self._bell_words = np.ndarray((self.nranks,), np.uint32, mm, fr.CONTROL_OFFSET + fr.BELL_OFFSET,
                                      (fr.CONTROL_BYTES,))
        self.headers = []  # per entry index: (nranks, 4) i64, one row per rank's entry header
        self.data = []
        for d in range(self.depth):
            offsets = [fr.entry_offset(self.nranks, self.depth, self.slot_bytes, d, r) for r in range(self.nranks)]
            self.headers.append(np.ndarray((self.nranks, 4), np.int64, mm, offsets[0],
                                           (fr.entry_bytes(self.slot_bytes), 8)))
            self.data.append([np.ndarray((self.slot_bytes,), np.uint8, mm, o + fr.ENTRY_HEADER_BYTES)
                              for o in offsets])
        self.next_seq = int(self.control[self.me, fr.POSTED]) + 1
        self.control[self.me, fr.PID] = os.getpid()
        self.pending: collections.deque[_Op] = collections.deque()
        self.broken: CommdError | None = None
        self._lock = threading.RLock()
        self._ids = 0
        self._progress_thread: threading.Thread | None = None
        self._wanted = threading.Event()
        self._next_check = 0.0  # when the missing ranks' and the daemon's processes are checked next
        self.closed = False

    # ---- publishing -----------------------------------------------------
    def _ring_bell(self) -> None:
        self._bell_words[self.me] = (int(self._bell_words[self.me]) + 1) & 0x7FFFFFFF
        _futex_wake(self.bells[self.me])

    def all_reduce(self, array: np.ndarray, dtype: str, op: str, timeout: float | None,
                   result: Any = None, after: Callable[[], None] | None = None) -> RingHandle:
        """Publish ``array`` (a contiguous byte view of the tensor, reduced in place) as the next op."""
        timeout = timeout or self.op_timeout
        with self._lock:
            if self.broken is not None:
                raise type(self.broken)(str(self.broken))
            seq = self.next_seq
            self._ids += 1
            handle = RingHandle(self, self._ids, "allreduce", self.group, time.monotonic() + timeout,
                                result=result)
            # entry (seq mod depth) is free once every rank has consumed seq - depth
            if self._behind(seq - self.depth, fr.CONSUMED):
                self._wait(lambda: self._progressed_behind(seq - self.depth), handle.deadline,
                           f"allreduce on group '{self.group}' (rank {self.rank}): the exchange ring is full")
            d = seq % self.depth
            nbytes = array.nbytes
            count = nbytes // small.NUMPY_DTYPES[dtype].itemsize
            self.data[d][self.me][:nbytes] = array.reshape(-1).view(np.uint8)
            self.headers[d][self.me] = (seq, _DTYPE_CODE[dtype], _OP_CODE[op], count)
            self.control[self.me, fr.POSTED] = seq  # publishes the entry (stores stay in order on x86)
            self.next_seq = seq + 1
            self._ring_bell()
            self.pending.append(_Op(seq, _DTYPE_CODE[dtype], _OP_CODE[op], count, array, handle, after,
                                    timeout))
            self._progress()
        if not handle.is_completed() and self._progress_thread is not None:
            self._wanted.set()
        return handle

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

    def _progressed_behind(self, seq: int) -> list[int]:
        """Ranks that have not consumed ``seq`` yet, after completing what we can ourselves
        (two ranks that both filled the ring with async ops must not wait on each other)."""
        self._progress()
        return self._behind(seq, fr.CONSUMED)

    def _behind(self, seq: int, field: int) -> list[int]:
        """The group ranks whose ``field`` (posted / consumed) has not reached ``seq``."""
        column = self.control[:, field].tolist()
        return [r for r in range(self.nranks) if column[r] < seq]

    # ---- completing -----------------------------------------------------
    def _progress(self) -> None:
        """Complete every pending op whose inputs are all published (caller holds the lock)."""
        while self.pending:
            head = self.pending[0]
            if self._behind(head.seq, fr.POSTED):
                return
            self.pending.popleft()
            d = head.seq % self.depth
            headers = self.headers[d]
            error = self._disagreement(head, headers)
            if error is None:
                nbytes = head.out.nbytes
                dtype = small.NUMPY_DTYPES[fr.DTYPES[head.dtype]]
                inputs = [entry[:nbytes].view(dtype) for entry in self.data[d]]
                small.reduce_into(head.out.reshape(-1).view(dtype), inputs, fr.REDUCE_OPS[head.op])
            self.control[self.me, fr.CONSUMED] = head.seq
            self._ring_bell()
            if error is not None:
                head.handle.fail(error)
                continue
            if head.after is not None:
                try:
                    head.after()
                except Exception as exc:  # a failed copy-out is the op's failure
                    head.handle.fail(CommdError(f"{head.handle.description}: copying the result out failed: {exc}"))
                    continue
            head.handle.complete({})

    def _disagreement(self, head: _Op, headers: np.ndarray) -> CommdError | None:
        rows = headers.tolist()
        first = rows[0]
        if all(row == first for row in rows) and first[0] == head.seq:
            return None
        if any(row[0] != head.seq for row in rows):
            return self._break(CommdError(f"{head.handle.description}: the exchange ring is corrupted "
                                          f"(entries {[row[0] for row in rows]} for op {head.seq})"))
        problems = []  # worded as the daemon's scheduler words them (scheduler/agreement.py)
        for name, index, names in (("dtype", 1, fr.DTYPES), ("count", 3, None), ("reduce_op", 2, fr.REDUCE_OPS)):
            values = [row[index] for row in rows]
            if len(set(values)) > 1:
                shown: dict[str, list[int]] = {}
                for r, v in enumerate(values):
                    label = names[v] if names is not None and 0 <= v < len(names) else v
                    shown.setdefault(repr(label), []).append(r)
                problems.append(f"'{name}' differs: " + ", ".join(f"ranks {rs} {v}" for v, rs in shown.items()))
        if not problems:
            return None
        return MismatchError(f"mismatched collective #{head.seq} on group '{self.group}': " + "; ".join(problems))

    def _break(self, error: CommdError) -> CommdError:
        """The ring is out of step: fail everything pending and refuse later ops of this group's ring."""
        if self.broken is None:
            self.broken = error
        failed = list(self.pending)
        self.pending.clear()
        for op in failed:
            op.handle.fail(type(error)(f"{op.handle.description}: {error}"))
        return error

    # ---- waiting --------------------------------------------------------
    def poll(self) -> None:
        """Complete what can be completed now, without waiting."""
        if self._lock.acquire(blocking=False):
            try:
                self._progress()
            finally:
                self._lock.release()

    def wait_for(self, handle: Handle, timeout: float | None) -> None:
        """Block until ``handle`` completes or ``timeout`` passes (``Handle.wait`` calls this)."""
        limit = handle.deadline if timeout is None else min(handle.deadline, time.monotonic() + timeout)
        with self._lock:
            while not handle.is_completed():
                self._progress()
                if handle.is_completed() or not self.pending:
                    return
                head = self.pending[0]
                seq = head.seq
                try:
                    arrived = self._wait(lambda seq=seq: self._behind(seq, fr.POSTED), limit, None)
                except CommdError:
                    return  # a dead peer or daemon: _check_alive failed every pending handle
                if not arrived:
                    if timeout is not None and limit < handle.deadline:
                        return  # the caller's own timeout: the op stays pending
                    missing = self._behind(seq, fr.POSTED)
                    self._break(CommTimeoutError(
                        f"allreduce #{seq} on group '{self.group}' timed out after {head.timeout:.1f}s "
                        f"waiting for group ranks {missing} to submit it"))

    def _wait(self, missing: Callable[[], list[int]], deadline: float, full: str | None) -> bool:
        """Wait until ``missing()`` is empty: spin, then sleep on a missing rank's bell.

        False once ``deadline`` passes (raises instead when ``full`` names the wait); a dead
        missing rank or daemon breaks the ring (raises its error).
        """
        waiting = missing()
        if not waiting:
            return True
        spin_end = time.perf_counter() + SPIN_S
        while time.perf_counter() < spin_end:
            os.sched_yield()  # a peer waiting for our core runs now (cores shared with the daemon and others)
            if not missing():
                return True
        while True:
            waiting = missing()
            if not waiting:
                return True
            peer = waiting[0]
            seen = int(self._bell_words[peer])
            if not missing():
                return True
            now = time.monotonic()
            if now >= self._next_check or now >= deadline:  # per ring: short waits check too
                self._check_alive(waiting)
                self._next_check = now + SLICE_S
            if now >= deadline:
                if full is not None:
                    raise CommTimeoutError(f"{full}: group ranks {waiting} are {self.depth} ops behind")
                return False
            self._lock.release()
            try:
                _futex_wait(self.bells[peer], seen, min(SLICE_S, max(deadline - now, 1e-4)))
            finally:
                self._lock.acquire()

    def _check_alive(self, waiting: list[int]) -> None:
        for r in waiting:
            pid = int(self.control[r, fr.PID])
            if pid and not pid_alive(pid):
                raise self._break(PeerDiedError(f"group {self.group!r}: group rank {r} (pid {pid}) died"))
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

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._break(CommdError("commd client is closed"))
        self._wanted.set()
