"""The client side of the control protocol: connect, register, submit, complete.

A client has two connections to its node daemon: a ZeroMQ DEALER socket for
control requests (handshake, registrations, status, bye; synchronous, under a
lock) and the op channel (a Unix SEQPACKET socket) for op submissions and
their replies.  Whoever waits reads the op channel; a dead daemon is noticed
at once (the channel closes) or by its pid, and fails every pending op.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import torch
import zmq

from commd.client.batch import HeldOps
from commd.client.errors import (
    CommdError,
    CommTimeoutError,
    ConnectError,
    DaemonDiedError,
    DaemonShutdownError,
    RequestError,
    UntrustedDaemonError,
    from_reply,
)
from commd.client.handle import Handle
from commd.client.registry import StorageRegistry, default_budget, first_sighting_bytes, registration_enabled
from commd.client.segments import register_fd, register_segment
from commd.client.spawn import wait_for_secret
from commd.client.trust import connect_op_channel, read_job_secret, verify_job_files
from commd.client.writebacks import PendingWrites, Span, span
from commd.kernels.reduce import DTYPE_NAMES, TORCH_DTYPES
from commd.memory.arena import REGISTERED, Arena, Segment
from commd.memory.budget import arena_bytes_setting, default_arena_bytes
from commd.protocol import schema as s
from commd.protocol.seqpacket import peer_closed
from commd.runtime import JobPaths, env_float, env_int, pid_alive

log = logging.getLogger("commd.client")

#: Extra time a client grants the daemon beyond an op's own timeout before
#: it gives up on an answer (the daemon normally reports the timeout itself).
ANSWER_GRACE_S = 10.0
RECEIVER_POLL_MS = 100
OPS_BUFFER_BYTES = 4 << 20
OPS_RECV_BYTES = s.MAX_MESSAGE_BYTES + (64 << 10)
#: How long the daemon may take to map a new arena segment.
REGISTER_TIMEOUT_S = 30.0
#: How long ``report_membership`` waits for room on the op channel before it gives the report up.
REPORT_SEND_S = 1.0


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise RequestError(f"dtype {dtype} is not supported by commd") from None


class Client:
    """One process's connection to its node daemon."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        local_rank: int = 0,
        job: str | None = None,
        secret: str | None = None,
        arena_bytes: int | None = None,
        op_timeout: float | None = None,
        connect_timeout: float = 30.0,
        nodes: list[str] | None = None,
    ) -> None:
        """``nodes``: the node name of every rank (needed when the job spans several nodes)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        if nodes is not None and (len(nodes) != world_size or not all(isinstance(n, str) and n for n in nodes)):
            raise ValueError(f"nodes must give a node name for each of the {world_size} ranks")
        self.nodes = list(nodes) if nodes is not None else None
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.paths = JobPaths.for_job(job)
        # None: read from the job directory (checked to be ours first), waiting while a
        # cluster prologue is still starting the daemon.
        self.secret = secret if secret is not None else wait_for_secret(self.paths, connect_timeout)
        size = arena_bytes if arena_bytes is not None else (arena_bytes_setting() or default_arena_bytes())
        token = uuid.uuid4().hex[:12]
        self.arena = Arena(f"commd-{self.paths.job}-r{rank}-{os.getpid()}-{token}", size)
        self.arena.on_new_segment = self._register_segment
        # An op's timeout: the op's own, else this client's (the argument, else COMMD_OP_TIMEOUT
        # in this process's environment), else the daemon's (its WELCOME says which).
        if op_timeout is None and os.environ.get("COMMD_OP_TIMEOUT"):
            op_timeout = env_float("COMMD_OP_TIMEOUT", 30.0, 0.001, s.MAX_OP_TIMEOUT_S)
        if op_timeout is not None and not 0.001 <= op_timeout <= s.MAX_OP_TIMEOUT_S:
            raise ValueError(f"op_timeout {op_timeout} must lie in [0.001, {s.MAX_OP_TIMEOUT_S:.0f}] seconds")
        self.op_timeout = op_timeout
        # COMMD_REGISTER, COMMD_MAX_REGISTERED_BYTES, COMMD_REGISTER_FIRST_BYTES are checked before anything connects
        self._register_budget = default_budget() if registration_enabled() else None
        self._register_first_bytes = first_sighting_bytes() if self._register_budget is not None else None
        self._ids = itertools.count(1)
        #: per group, the number of its next collective: one numbering for every path an op takes (the
        #: daemon's, a group's exchange ring), so op k of one rank only ever meets op k of the others
        self._seq: dict[str, itertools.count[int]] = {}  # (``next`` is atomic: no lock on the ring's path)
        #: per group, told the count of the group's collectives each time one goes to the daemon
        self._numbered: dict[str, Callable[[int], None]] = {}
        self._groups: dict[str, list[int]] = {}
        self._pending: dict[int, Handle] = {}
        #: groups whose ops are held to leave together (``hold``/``release``): a coalesced batch each
        self._held: dict[str, HeldOps] = {}
        #: messages carrying ops sent on the op channel: one per op, or one per held batch
        self.op_messages = 0
        # the bytes pending ops copy their results back into: an op that copies those bytes in
        # waits for them (program order, as in any backend)
        self._copy_back = PendingWrites()
        self._pending_lock = threading.Lock()
        self._rx_lock = threading.Lock()
        self._in_flight = threading.Event()
        self._send_lock = threading.RLock()
        self._broken: CommdError | None = None
        self._shutdown_seen = False
        self._closed = False
        self._ctx = zmq.Context.instance()
        self._req = self._ctx.socket(zmq.DEALER)
        self._req.setsockopt(zmq.LINGER, 0)
        self._ops = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            self._ops.setsockopt(socket.SOL_SOCKET, option, OPS_BUFFER_BYTES)
        try:
            self._connect(connect_timeout)
        except BaseException:
            for segment in self.arena.segments:
                segment.close_fd()
            self._closed = True
            self._req.close()
            self._ops.close()
            raise

    # ---- connection ---------------------------------------------------
    def _connect(self, timeout: float) -> None:
        # Nothing is sent before the job's files and the daemon process prove to be our own
        # (commd/client/trust.py says why this order).
        deadline = time.monotonic() + timeout
        verify_job_files(self.paths)
        if self.secret is None:
            self.secret = read_job_secret(self.paths)
        self._ops.settimeout(timeout)
        peer_pid = connect_op_channel(self._ops, self.paths, deadline)
        self.arena.new_segment(self.arena.segment_bytes)
        self._req.connect(self.paths.endpoint)
        first = self.arena.segments[0]
        welcome = self._request(
            {
                "t": s.HELLO, "job": self.paths.job, "secret": self.secret, "rank": self.rank,
                "local_rank": self.local_rank, "world_size": self.world_size, "pid": os.getpid(),
                "segments": [],
                **({"nodes": self.nodes} if self.nodes is not None else {}),
            },
            timeout,
        )
        self.client_id = welcome["client_id"]
        self.daemon_pid = welcome["daemon_pid"]
        if peer_pid and self.daemon_pid != peer_pid:
            raise UntrustedDaemonError(
                f"refusing job {self.paths.job!r}: the daemon on {self.paths.socket} says it is pid "
                f"{self.daemon_pid}, but pid {peer_pid} listens on {self.paths.ops_socket}"
            )
        if self.op_timeout is None:
            self.op_timeout = float(welcome["op_timeout"])
        # CUDA tensors go by IPC handle when the daemon can open them, else via host memory.
        self._cuda = None
        if welcome.get("cuda") and torch.cuda.is_available() and env_int("COMMD_CUDA_IPC", 1, 0, 1):
            from commd.client.cuda_ipc import CudaExporter

            self._cuda = CudaExporter()
        # Ops and their replies travel on the op channel (see commd/daemon/opchannel.py).
        try:
            self._ops.send(s.encode({"t": "attach", "client_id": self.client_id, "secret": self.secret}))
            ack = s.decode(self._ops.recv(OPS_RECV_BYTES))
            self._ops.settimeout(0.0)
            self._ops_poll = select.poll()
            self._ops_poll.register(self._ops.fileno(), select.POLLIN)
        except (OSError, s.ProtocolError) as exc:
            raise ConnectError(f"cannot open the op channel {self.paths.ops_socket}: {exc}") from None
        if ack.get("t") != s.ACK:
            raise from_reply(ack.get("code", ""), ack.get("message", "attach refused"))
        self._receiver: threading.Thread | None = None
        register_segment(self.paths.ops_socket, self.client_id, self.secret, first, timeout, self.daemon_pid)
        # Ordinary tensors seen again (or viewed by others) are moved into shared memory once and named in place after.
        self._registry = (StorageRegistry(self.arena.prefix, self._register_storage, self._register_budget,
                                          first_bytes=self._register_first_bytes)
                          if self._register_budget is not None else None)

    def _request(self, message: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        """Synchronous request/reply on the request socket."""
        with self._send_lock:
            self._check_usable()
            self._req.send(s.encode(message))
            deadline = time.monotonic() + timeout
            while not self._req.poll(RECEIVER_POLL_MS):
                if not self._daemon_alive():
                    raise DaemonDiedError(f"commd daemon (job {self.paths.job!r}) died")
                if time.monotonic() > deadline:
                    raise ConnectError(f"commd daemon did not answer a '{message['t']}' request in {timeout:.0f}s")
            reply = s.decode(self._req.recv())
        if reply.get("t") == s.ERROR:
            raise from_reply(reply.get("code", ""), reply.get("message", "request refused"))
        return reply

    def _daemon_alive(self) -> bool:
        pid = getattr(self, "daemon_pid", None)
        return True if pid is None else pid_alive(pid)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise type(self._broken)(str(self._broken))
        if self._closed:
            raise CommdError("commd client is closed")

    def _register_segment(self, segment: Segment) -> None:
        self._check_usable()
        register_segment(
            self.paths.ops_socket, self.client_id, self.secret, segment, REGISTER_TIMEOUT_S, self.daemon_pid
        )

    def _register_storage(self, seg_id: int, name: str, nbytes: int, fd: int) -> None:
        self._check_usable()
        register_fd(self.paths.ops_socket, self.client_id, self.secret, self.daemon_pid, REGISTER_TIMEOUT_S,
                    seg_id, name, nbytes, fd, REGISTERED)

    def register_group(self, name: str, ranks: list[int]) -> None:
        """Tell the daemon about a group (all members must register the same ranks)."""
        self._request({"t": s.GROUP, "name": name, "ranks": list(ranks)})
        self._groups[name] = list(ranks)
        self._seq.setdefault(name, itertools.count())

    def numbering(self, group: str) -> Callable[[], int]:
        """Takes the number of ``group``'s next collective, for an op that does not go to the daemon (an
        exchange ring's): the daemon path's numbering skips it, so the paths never disagree on op k."""
        if group not in self._seq:
            raise RequestError(f"group {group!r} is not registered")
        return self._seq[group].__next__

    def on_numbered(self, group: str, listener: Callable[[int], None] | None) -> None:
        """``listener(count)`` is called, without locks of its own to take, each time a collective of
        ``group`` is numbered for the daemon (``count``: the group's collectives numbered so far)."""
        if listener is None:
            self._numbered.pop(group, None)
        else:
            self._numbered[group] = listener

    def notify_ring(self, group: str, **fields: Any) -> None:
        """Tell the daemon about ``group``'s bridged exchange ring (``RINGOP``: an op every local rank
        published, ``k=``, or this rank leaving it, ``left=``/``code=``); in order with this rank's ops."""
        frame = s.encode({"t": s.RINGOP, "g": group, **fields})
        with self._send_lock:
            self._check_usable()
            self._send_op(frame, time.monotonic() + self.op_timeout)

    def report_membership(self, event: str, *, epoch: int, gone: list[int] | tuple[int, ...],
                          members: list[int] | tuple[int, ...], seconds: float, step: int,
                          group: str | None = None, why: str | None = None) -> bool:
        """Tell the node daemon what ``commd.ft`` did about a lost rank, which only the guard knows, for
        ``commd status``, the metrics and the trace: ``event`` one of ``recovered`` (going on with
        ``members`` without ``gone``), ``joined`` (a replacement taken back in: ``gone`` empty, ``members``
        the whole group) or ``gave_up`` (UnrecoverableError; ``why``: its message).

        Fire-and-forget (no reply; a refusal is logged by the daemon and when replies are next read here):
        it waits at most ``REPORT_SEND_S`` for room on the op channel, and a report that cannot be sent is
        logged and returns False, so a training step never fails over it.  Arguments the daemon would
        refuse raise ValueError (``schema.check_membership_report``)."""
        message: dict[str, Any] = {
            "t": s.MEMBERSHIP, "event": event, "epoch": epoch, "step": step, "gone": list(gone),
            "members": list(members), "seconds": float(seconds) if type(seconds) is int else seconds,
        }
        if group is not None:
            message["group"] = group
        if why:
            message["why"] = why[:s.MAX_WHY_CHARS]
        s.check_membership_report(message, self.rank, self.world_size)
        try:
            with self._send_lock:
                self._check_usable()
                self._send_op(s.encode(message), time.monotonic() + REPORT_SEND_S)
        except CommdError as exc:
            log.warning("commd.ft: rank %d could not report '%s' (epoch %d) to its daemon: %s",
                        self.rank, event, epoch, exc)
            return False
        return True

    # ---- coalesced batches ------------------------------------------------
    def hold(self, group: str) -> None:
        """Hold ``group``'s ops from now on: each is checked, numbered and pending as usual, but leaves
        with the others at ``release``, one op-channel message for them all (a coalesced batch).  Ops
        still held from an earlier ``hold`` of the group are sent first."""
        with self._send_lock:
            self._check_usable()
            if group not in self._seq:
                raise RequestError(f"group {group!r} is not registered")
            earlier = self._held.get(group)
            if earlier is not None:
                self._send_held(earlier)
            self._held[group] = HeldOps()

    def release(self, group: str) -> list[Handle]:
        """Send ``group``'s held ops and stop holding them; the handles of every op held since ``hold``."""
        with self._send_lock:
            held = self._held.pop(group, None)
            if held is None:
                return []
            self._send_held(held)
            return held.handles

    def holding(self, group: str) -> bool:
        """Whether ``group``'s ops are being held for a batch."""
        return group in self._held

    def send_held(self) -> None:
        """Send every held op now; the groups stay held.  Nothing this client waits on may stay
        unsent, so whoever blocks on a reply calls this first."""
        with self._send_lock:
            for held in list(self._held.values()):
                self._send_held(held)

    def _send_held(self, held: HeldOps) -> None:
        """One message with ``held``'s unsent ops (caller holds the send lock); ops that cannot be sent fail."""
        taken = held.take()
        if taken is None:
            return
        message, unsent = taken
        try:
            self._send_op(message, min(h.deadline for h in unsent))
        except BaseException as exc:
            error = exc if isinstance(exc, CommdError) else CommdError(f"not sent to the daemon: {exc!r}")
            with self._pending_lock:
                for handle in unsent:
                    self._pending.pop(handle.op_id, None)
            for handle in unsent:
                handle.fail(type(error)(f"{handle.description}: {error}"))
            raise
        self.op_messages += 1

    def group_rank(self, group: str) -> int:
        return self._groups[group].index(self.rank)

    def group_size(self, group: str) -> int:
        """How many ranks the registered group ``group`` has."""
        return len(self._groups[group])

    def close(self) -> None:
        """Leave the job: fail nothing, tell the daemon, release the arena."""
        if self._closed:
            return
        if self._broken is None:
            try:
                self._request({"t": s.BYE}, timeout=5.0)
            except CommdError:
                pass
        self._closed = True
        self._broken = self._broken or CommdError("commd client is closed")
        self._held.clear()
        self._fail_all(CommdError("client closed while the op was pending"))
        if self._receiver is not None:
            self._receiver.join(timeout=2)
        with self._rx_lock:
            self._req.close()
            self._ops.close()

    # ---- receiving ------------------------------------------------------
    # Replies are received by whoever needs them: a thread blocked in
    # Handle.wait() reads the op channel itself (no thread hop on the
    # latency-critical path); a background thread, started the first time a
    # Future is requested, reads it when nobody waits.  Only one thread at a
    # time receives, under ``_rx_lock``; sends go under ``_send_lock``.

    def pump(self, timeout_s: float) -> None:
        """Receive and dispatch replies for up to ``timeout_s`` (caller holds no lock)."""
        with self._rx_lock:
            self._pump_locked(timeout_s)

    def _pump_locked(self, timeout_s: float) -> None:
        # The op socket is non-blocking: wait with poll(), then drain.
        sock = self._ops
        try:
            if not self._ops_poll.poll(max(0, int(timeout_s * 1000))):
                self._check_deadlines()
                return
            while True:
                try:
                    frame = sock.recv(OPS_RECV_BYTES)
                except (BlockingIOError, InterruptedError):
                    return
                if not frame:
                    if peer_closed(sock):
                        self._daemon_gone("closed the op channel")
                        return
                    log.error("commd daemon sent an empty message on the op channel; ignored")
                    continue
                self._on_reply(frame)
        except (OSError, ValueError) as exc:
            if not self._closed:
                self._daemon_gone(f"op channel failed: {exc}")

    def _daemon_gone(self, why: str) -> None:
        if self._broken is not None:
            return
        if self._shutdown_seen:
            self._broken = DaemonShutdownError(f"commd daemon (job {self.paths.job!r}) shut down")
        else:
            self._broken = DaemonDiedError(f"commd daemon (pid {self.daemon_pid}, job {self.paths.job!r}) died: {why}")
        self._fail_all(self._broken)

    def _send_op(self, frame: bytes, deadline: float) -> None:
        """Send one op message (caller holds the send lock); never blocks past ``deadline``."""
        while True:
            try:
                self._ops.send(frame)
                return
            except (BlockingIOError, InterruptedError):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommTimeoutError("the commd daemon is not reading ops (op channel full)") from None
                select.select([], [self._ops], [], min(remaining, 0.1))
            except OSError as exc:
                self._daemon_gone(f"op channel failed: {exc}")
                raise self._broken from None

    def wait_for(self, handle: Handle, timeout: float | None) -> None:
        """Block until ``handle`` completes or ``timeout`` passes, receiving replies meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._held and not handle.is_completed():
            self.send_held()  # what we wait on may need an op still held here, ours or a peer's
        while not handle.is_completed():
            slice_s = RECEIVER_POLL_MS / 1000
            if deadline is not None:
                slice_s = min(slice_s, deadline - time.monotonic())
                if slice_s <= 0:
                    return
            if self._closed:
                handle.block(slice_s)
            elif self._rx_lock.acquire(blocking=False):
                try:
                    if not handle.is_completed():
                        self._pump_locked(slice_s)
                finally:
                    self._rx_lock.release()
            else:
                # Another thread is receiving; it completes us, or we take over shortly.
                handle.block(min(slice_s, 0.001))

    def start_receiver(self) -> None:
        """Run a background receiver so futures complete without anyone waiting (and send the ops held
        so far: a future may be waited on where this client cannot see it)."""
        if self._held:
            self.send_held()
        with self._send_lock:
            if self._receiver is None and not self._closed:
                self._receiver = threading.Thread(target=self._receive_loop, name="commd-client-rx", daemon=True)
                self._receiver.start()

    def _receive_loop(self) -> None:
        while not self._closed:
            if self._pending:
                self.pump(RECEIVER_POLL_MS / 1000)
                continue
            # Nothing in flight: sleep until submit() signals (re-check after
            # clearing so a submission between the check and the clear is seen).
            self._in_flight.clear()
            if not self._pending:
                self._in_flight.wait(RECEIVER_POLL_MS / 1000)

    def _on_reply(self, frame: bytes) -> None:
        try:
            reply = s.decode(frame)
        except s.ProtocolError as exc:
            log.error("bad reply from the daemon: %s", exc)
            return
        if reply.get("t") == s.BATCH:
            items = reply.get("items")
            if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
                log.error("bad reply from the daemon: a batch without a list of replies")
                return
            for item in items:
                self._on_one_reply(item)
            return
        self._on_one_reply(reply)

    def _on_one_reply(self, reply: dict[str, Any]) -> None:
        op_id = reply.get("id", -1)
        with self._pending_lock:
            handle = self._pending.pop(op_id, None)
        if handle is None:
            if reply.get("t") == s.ERROR:
                if reply.get("code") == s.E_SHUTDOWN:
                    self._shutdown_seen = True
                else:
                    log.error("commd daemon: %s", reply.get("message"))
            return
        if reply.get("t") == s.DONE:
            handle.complete(reply)
        else:
            handle.fail(from_reply(reply.get("code", ""), reply.get("message", "op failed")))

    def _check_deadlines(self) -> None:
        if not self._pending:
            return
        if not self._daemon_alive():
            self._broken = DaemonDiedError(
                f"commd daemon (pid {self.daemon_pid}, job {self.paths.job!r}) died"
            )
            self._fail_all(self._broken)
            return
        now = time.monotonic()
        with self._pending_lock:
            late = [h for h in self._pending.values() if h.deadline < now]
            for h in late:
                del self._pending[h.op_id]
        for h in late:
            h.fail(CommTimeoutError(f"{h.description}: no answer from the commd daemon in time"))

    def _fail_all(self, error: CommdError) -> None:
        with self._pending_lock:
            handles = list(self._pending.values())
            self._pending.clear()
        for h in handles:
            h.fail(type(error)(f"{h.description}: {error}"))

    # ---- buffers ------------------------------------------------------
    def empty(self, shape: tuple[int, ...] | list[int] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor in this client's shared arena: collectives on it are zero-copy."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        block = self.arena.allocate(nbytes)
        flat = torch.frombuffer(block.array, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]
        return flat.view(dtype).view(shape)

    def in_arena(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and self.arena.locate(tensor.data_ptr(), tensor.numel() * tensor.element_size()) is not None
        )

    def _wait_copy_back(self, tensor: torch.Tensor, role: str, copied: list[Span],
                        whole_storage: bool = False) -> None:
        """Before copying ``tensor`` in: let pending ops that will write into its bytes (``whole_storage``:
        anywhere in its storage) finish first; an output (``role`` not "in") is noted in ``copied``."""
        if self._copy_back:
            for earlier in self._copy_back.writers(tensor, whole_storage):
                try:
                    earlier.wait(max(0.0, earlier.deadline - time.monotonic()))
                except CommdError:
                    pass  # the earlier op reports its own failure; this one goes ahead
        if role != "in":
            copied.append(span(tensor))

    def wait_group_idle(self, group: str) -> None:
        """Let every pending op of ``group`` finish first (their own failures report themselves).

        An op completed outside the op channel (a local group's exchange ring) on a tensor
        that a pending op reads or writes in place (arena, registered storage) must not
        overtake it: ops of one group keep program order, as on any backend.
        """
        with self._pending_lock:
            handles = [h for h in self._pending.values() if h.group == group]
        for handle in handles:
            try:
                handle.wait(max(0.0, handle.deadline - time.monotonic()))
            except CommdError:
                pass

    def wait_writes_to(self, tensor: torch.Tensor) -> None:
        """Before reading ``tensor`` outside ``submit``: let a pending op that writes it back finish."""
        if self._copy_back:
            self._wait_copy_back(tensor, "in", [])

    def note_write_back(self, tensor: torch.Tensor, handle: Handle) -> None:
        """``handle`` (an op completed outside the op channel) writes ``tensor`` when it completes:
        a later op that copies those bytes in waits for it (as for staged outputs)."""
        self._copy_back.note(span(tensor), handle)

    def _plan(
        self, tensor: torch.Tensor, role: str, finishers: list, keep: list, copied: list[Span],
        registered: list[int] | None = None, may_register: bool = False,
    ) -> dict[str, Any]:
        """Reference for one buffer; queue its copy-out in ``finishers`` if staged.

        ``registered``: where the segment id goes when the buffer lies in a registered storage;
        ``may_register``: its storage may be registered now (the client registry decides).
        """
        if tensor.device.type == "cuda" and self._cuda is not None and tensor.is_contiguous():
            keep.append(tensor)  # its storage (and so its export) lives while the op is pending
            return self._cuda.export(tensor)
        if tensor.device.type != "cpu":
            self._wait_copy_back(tensor, role, copied)
            staged = tensor.detach().to("cpu")
            ref = self._plan(staged, role, finishers, keep, [])
            if role != "in":
                finishers.append(lambda _reply: tensor.copy_(staged))
            return ref
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.is_contiguous():
            found = self.arena.locate(tensor.data_ptr(), nbytes) if nbytes else None
            if found is not None:
                segment, offset = found
                keep.append(tensor)  # its block must not be reused while the op is pending
                return {"seg": segment.seg_id, "off": offset, "n": nbytes}
            if registered is not None and nbytes > s.INLINE_MAX_BYTES and self._registry is not None:
                # earlier staged ops' copy-outs land first: into these bytes, or anywhere in the
                # storage if the lookup may register it (that moves the whole storage)
                self._wait_copy_back(tensor, "in", copied, whole_storage=may_register)
                found = self._registry.lookup(tensor, may_register)
                if found is not None:
                    keep.append(tensor)  # keeps the storage (and its registration) alive while pending
                    registered.append(found[0])
                    return {"seg": found[0], "off": found[1], "n": nbytes}
        if nbytes:
            self._wait_copy_back(tensor, role, copied)
        if nbytes <= s.INLINE_MAX_BYTES:
            if role != "in":
                finishers.append(_copy_from_reply(tensor))
            if role == "out":
                return {"inline": nbytes}
            return {"data": _tensor_bytes(tensor)}
        block = self.arena.allocate(nbytes)
        staging = torch.frombuffer(block.array, dtype=torch.uint8, count=nbytes).view(tensor.dtype).view(tensor.shape)
        keep.append(block)
        if role != "out":
            copy_tensor(staging, tensor)
        if role != "in":
            finishers.append(lambda _reply: copy_tensor(tensor, staging))
        return {"seg": block.segment.seg_id, "off": block.offset, "n": nbytes, "st": 1}

    # ---- submission ---------------------------------------------------
    def submit(
        self,
        kind: str,
        group: str,
        buffers: dict[str, tuple[torch.Tensor, str]] | None = None,
        dtype: torch.dtype | None = None,
        result: Any = None,
        after: Callable[[], None] | None = None,
        seq: int | None = None,
        **fields: Any,
    ) -> Handle:
        """Submit one op; ``buffers`` maps 'buf'/'in'/'out' to (tensor, role).  ``seq``: a collective's
        number taken already (``numbering``), for an op handed over from another path."""
        if self._broken is not None or self._closed:
            self._check_usable()
        if group not in self._seq:
            raise RequestError(f"group {group!r} is not registered")
        op_id = next(self._ids)
        timeout = fields.pop("timeout", None) or self.op_timeout
        message: dict[str, Any] = {
            "v": s.PROTOCOL_VERSION, "t": s.OP, "id": op_id, "kind": kind, "group": group,
            "timeout_ms": max(1, int(timeout * 1000)),
        }
        if dtype is not None:
            message["dtype"] = dtype_name(dtype)
        for key, value in fields.items():
            if value is not None:
                message[key] = value
        finishers: list = []
        keep: list = []
        copied: list[Span] = []
        registered: list[int] = []
        if buffers:
            for name, (tensor, role) in buffers.items():
                # only in-place buffers get registered (see commd/client/registry.py for why)
                message[name] = self._plan(tensor, role, finishers, keep, copied, registered, name == "buf")
        if after is not None:
            finishers.append(lambda _reply: after())
        finish = None
        if finishers:
            finish = finishers[0] if len(finishers) == 1 else _chain(finishers)
        handle = Handle(
            self, op_id, kind, group, time.monotonic() + timeout + ANSWER_GRACE_S,
            finish=finish, result=result, keep=keep or None,
        )
        for where in copied:
            self._copy_back.note(where, handle)
        with self._send_lock:
            if self._broken is not None or self._closed:
                self._check_usable()
            if kind in s.COLLECTIVES and seq is not None:
                message["seq"] = seq
            elif kind in s.COLLECTIVES:
                message["seq"] = number = next(self._seq[group])
                listener = self._numbered.get(group)
                if listener is not None:
                    listener(number + 1)
            frame = msgpack.packb(message, use_bin_type=True)
            if len(frame) > s.MAX_MESSAGE_BYTES:
                raise RequestError(f"{handle.description}: control message of {len(frame)} bytes is too large")
            if self._registry is not None:
                for seg_id in self._registry.due_unregisters(self._pending.__contains__):  # after the ops that used them
                    self._send_op(s.encode({"t": s.UNREGISTER, "seg": seg_id}), handle.deadline)
            held = self._held.get(group) if self._held else None
            with self._pending_lock:
                self._pending[op_id] = handle
            try:
                if held is None:
                    self._send_op(frame, handle.deadline)
                    self.op_messages += 1
                else:
                    if held.full_with(frame):
                        self._send_held(held)
                    held.add(frame, handle)
            except BaseException:
                with self._pending_lock:
                    self._pending.pop(op_id, None)
                raise
            finally:
                for seg_id in registered:  # the op's id once it is pending (0: it never was)
                    self._registry.mark_used(seg_id, op_id if op_id in self._pending else 0)  # type: ignore[union-attr]
        if self._receiver is not None:
            self._in_flight.set()
        return handle


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return b""
    contiguous = tensor if tensor.is_contiguous() else tensor.contiguous()  # keep it alive while read
    return ctypes.string_at(contiguous.data_ptr(), nbytes)


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src for same-shape CPU tensors.

    Contiguous pairs are copied with one plain memcpy on the calling thread (the GIL released):
    torch's copy_ may fan out to its thread pool, which stalls when the node's cores are shared
    by several ranks and the daemon.  Not through NumPy: ``Tensor.numpy()`` marks the user's
    storage as not resizable for good (FSDP resizes its buffers), and keeps it from registration.
    """
    if dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype and dst.numel():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
    else:
        dst.copy_(src)


def _copy_from_reply(tensor: torch.Tensor) -> Callable[[dict[str, Any]], None]:
    nbytes = tensor.numel() * tensor.element_size()

    def finish(reply: dict[str, Any]) -> None:
        data = reply.get("data")
        if data is None or len(data) != nbytes:
            raise CommdError(f"daemon reply carries {0 if data is None else len(data)} bytes, expected {nbytes}")
        if not nbytes:
            return
        if tensor.is_contiguous():
            ctypes.memmove(tensor.data_ptr(), data, nbytes)
        else:
            tensor.copy_(torch.frombuffer(bytearray(data), dtype=tensor.dtype).view(tensor.shape))

    return finish


def _chain(finishers: list) -> Callable[[dict[str, Any]], None]:
    def run(reply: dict[str, Any]) -> None:
        for finish in finishers:
            finish(reply)

    return run


__all__ = ["Client", "dtype_name", "TORCH_DTYPES"]
