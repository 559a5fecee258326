"""The node daemon: control socket, client registry, op dispatch, watchdog.

One event loop (uvloop) owns the ZeroMQ ROUTER socket; nothing else touches
it.  Matched ops run on one *lane* thread in the order they became ready
(small ops run inline on the loop when that lane is idle, which keeps the
order and saves two thread hops).  Completions come back to the loop with
``call_soon_threadsafe`` and are answered on each client's reply socket.

Every message is validated before it changes any state; a bad message is
answered with an error and logged, and the daemon carries on serving others.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from commd.core.ops import MatchError, ReadyOp, Submission
from commd.core.placement import GroupPlacement
from commd.daemon import notify
from commd.daemon.cuda import CudaImporter
from commd.daemon.failure_log import OpFailureLog
from commd.daemon.limits import REPLY_BACKLOG, ClientLimits, LimitGuard, PendingLedger
from commd.daemon.loglimit import RateLimitedLog
from commd.daemon.opchannel import OpConnection, OpListener
from commd.execution import torch_loader
from commd.execution.small import execute_small, runs_on_numpy
from commd.kernels.small import NUMPY_DTYPES
from commd.memory.arena import Segment
from commd.observe.hooks import DaemonObservers
from commd.observe.settings import MetricsSettings
from commd.observe.stats import Stats
from commd.observe.trace import TraceError
from commd.protocol import schema as s
from commd.runtime import JobPaths, pid_alive, secrets_equal
from commd.scheduler.agreement import parse_submission
from commd.scheduler.local import LocalScheduler
from commd.scheduler.selection import SchedulerConfig

if TYPE_CHECKING:
    import torch

    from commd.fabric.member import FabricMember
    from commd.fabric.rendezvous import Fabric

log = logging.getLogger("commd.daemon")

#: Ops at most this large run inline on the event loop when the lane is idle.
INLINE_EXEC_BYTES = 64 * 1024
WATCHDOG_PERIOD_S = 0.1
#: After a client's op channel closes, how long to wait for its pid to vanish
#: before reporting it as disconnected rather than dead.
DISCONNECT_VERDICT_S = 1.0
#: zmq drops (and disconnects) frames above this; below it we answer with an error.
ZMQ_MAX_FRAME = 16 * s.MAX_MESSAGE_BYTES


@dataclass
class DaemonConfig:
    paths: JobPaths
    secret: str
    op_timeout: float = 30.0
    exit_when_idle: bool = False
    idle_grace: float = 3.0
    #: With exit_when_idle: an auto-started daemon that no client reaches within this long after it
    #: starts serving exits (the process that started it died before connecting).
    first_client_grace: float = 60.0
    owner_pid: int | None = None
    max_arena_bytes: int = 1 << 40
    #: Segments one client may register: each costs the daemon a mapping (the process's
    #: count is finite) and a registration; without a cap one client could exhaust them for all.
    max_segments: int = 1024
    node_name: str = "localhost"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fabric: Fabric | None = None
    peer_timeout: float = 10.0
    limits: ClientLimits = field(default_factory=ClientLimits)
    metrics: MetricsSettings | None = None  # None: no metrics endpoint or textfile
    trace: str | None = None  # trace every op into this file from the start


@dataclass
class ClientRecord:
    client_id: int
    identity: bytes
    reply_identity: bytes | None
    rank: int
    local_rank: int
    world_size: int
    pid: int
    connected_at: float = field(default_factory=time.time)
    segments: dict[int, Segment] = field(default_factory=dict)
    views: dict[int, torch.Tensor] = field(default_factory=dict)  # made on first use (torch loads lazily)
    groups: dict[str, int] = field(default_factory=dict)  # group name -> group rank
    op_channel: OpConnection | None = None
    pending: PendingLedger = field(default_factory=PendingLedger)

    @property
    def arena_bytes(self) -> int:
        return sum(seg.size for seg in self.segments.values())


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.stats = Stats()
        self.limits = LimitGuard(config.limits, self.stats.limit_hit)
        self.scheduler = LocalScheduler(self.stats)
        #: Every line a client can cause goes through this limiter (a bad client cannot flood the log).
        self.log_limit = RateLimitedLog(log)
        self.failures = OpFailureLog(self.log_limit, self._group_members)
        self.cuda = CudaImporter()
        self.clients: dict[bytes, ClientRecord] = {}
        self.by_id: dict[int, ClientRecord] = {}
        self._next_client = 1
        self._lane: queue.SimpleQueue[ReadyOp | None] = queue.SimpleQueue()
        self._lane_busy = 0  # ops handed to the lane and not yet completed (loop thread only)
        self._executing: ReadyOp | None = None
        self._closing = False
        self._shutdown_reason = "shut down"
        self._had_clients = False
        self._idle_since = time.monotonic()
        self._stopped: asyncio.Event | None = None  # created in run(), on the loop
        #: Node rank of every global rank of the job (from the clients' hello); None until known.
        self.placement: list[int] | None = None
        self.plans: dict[str, GroupPlacement] = {}
        self.fabric_member: FabricMember | None = None
        self._stall_warned: set[tuple[str, int]] = set()
        self._last_stall_scan = 0.0
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_FRAME)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.observers = DaemonObservers(self, config.metrics, config.trace)  # sets self.tracer

    # ---- lifecycle ----------------------------------------------------
    def bind(self) -> None:
        paths = self.config.paths.ensure()
        if paths.socket.exists():
            paths.socket.unlink()
        old_umask = os.umask(0o177)
        try:
            self.sock.bind(paths.endpoint)
        finally:
            os.umask(old_umask)
        os.chmod(paths.socket, 0o600)
        paths.write_secret(self.config.secret)
        paths.pid_file.write_text(str(os.getpid()))

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT or, if configured, until the job's last client left."""
        self.loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self.loop.add_reader(self.sock.getsockopt(zmq.FD), self._on_readable)
        self.ops = OpListener(
            self.config.paths.ops_socket, self.loop, self._on_channel_message, self._on_channel_closed,
            self.config.limits.max_reply_backlog, self._on_channel_overflow,
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.shutdown, f"signal {signal.Signals(sig).name}")
        self._lane_thread = threading.Thread(target=self._lane_main, name="commd-lane-local", daemon=True)
        self._lane_thread.start()
        self.loop.call_soon(self._on_readable)
        if self.config.fabric is not None:
            from commd.fabric.member import FabricMember

            self.fabric_member = FabricMember(self, self.config.fabric, self.config.peer_timeout)
            self.fabric_member.start(self.loop)
        self.observers.start(self.loop)
        watchdog = asyncio.ensure_future(self._watchdog())
        log.info("daemon for job %s listening on %s", self.config.paths.job, self.config.paths.endpoint)
        self._idle_since = time.monotonic()  # serving from now: the first client's grace starts here
        await self._stopped.wait()
        watchdog.cancel()
        self._lane.put(None)
        self._lane_thread.join(timeout=10)
        if self.fabric_member is not None:
            self.fabric_member.close(self._shutdown_reason)
        self.observers.close()
        self._cleanup()

    def shutdown(self, reason: str = "shutdown requested") -> None:
        """Stop accepting, fail everything in flight, then stop the loop."""
        if self._closing:
            return
        self._closing = True
        self._shutdown_reason = reason
        log.info("shutting down: %s", reason)
        notify.stopping(reason)
        message = f"daemon shutting down ({reason})"
        self.fail_each([(sub, message) for sub in self.scheduler.drain_all()], s.E_SHUTDOWN)
        # Queued ops are failed by the lane as it drains; wait for the running one.
        self.loop.create_task(self._finish_shutdown())

    async def _finish_shutdown(self) -> None:
        deadline = time.monotonic() + 10
        while self._lane_busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.flush()
        self._stopped.set()

    def _cleanup(self) -> None:
        notice = s.encode({"t": s.ERROR, "code": s.E_SHUTDOWN, "message": "daemon shutting down", "id": -1})
        for client in self.clients.values():
            if client.op_channel is not None:
                client.op_channel.send(notice)  # tells the client the close that follows is orderly
        self.ops.close()
        self.loop.remove_reader(self.sock.getsockopt(zmq.FD))
        self.sock.close(linger=1000)
        paths = self.config.paths
        for path in (paths.socket, paths.pid_file, paths.secret_file):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        for client in list(self.clients.values()):
            self._release(client)
        log.info("daemon stopped")

    # ---- socket I/O (loop thread only) --------------------------------
    def _on_readable(self) -> None:
        sock = self.sock
        # Drain while zmq says a message is there (cheaper than ending on zmq.Again).
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            if len(frames) != 2:
                self.log_limit.log(logging.WARNING, ("frames", frames[0]), f"bad messages from {frames[0]!r}",
                                   "dropping a message of %d frames from %r", len(frames), frames[0])
                continue
            self._dispatch(frames[0], frames[1])

    def flush(self) -> None:
        # zmq's FD is edge-triggered: sends may have consumed a read edge.
        if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.loop.call_soon(self._on_readable)

    def _send(self, identity: bytes, message: dict[str, Any]) -> None:
        try:
            self.sock.send_multipart([identity, s.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("cannot reach client %r: %s", identity, exc)

    def _reply_error(self, identity: bytes, code: str, message: str, op_id: int = -1) -> None:
        self.log_limit.log(logging.WARNING, ("control", identity, code), f"{code} errors for {identity!r}",
                           "error for %r: %s", identity, message)
        self.stats.error(message)
        self.stats.error_reply(code)
        self._send(identity, {"t": s.ERROR, "code": code, "message": message, "id": op_id})

    def _reply(self, client: ClientRecord, message: dict[str, Any]) -> None:
        """Answer an op on the client's op channel (or its ZeroMQ reply socket)."""
        if client.op_channel is not None:
            client.op_channel.reply(message)
        elif client.reply_identity is not None:
            self._send(client.reply_identity, message)

    def fail_op(self, subs: Sequence[Submission], code: str, message: str) -> None:
        """Fail one op: a line in the log, an entry in 'last errors', the error to each submission's rank."""
        self.stats.error(message)
        self.failures.record(code, message, subs)
        for sub in subs:
            self._send_error(sub, code, message)

    def fail_each(self, failed: Sequence[tuple[Submission, str]], code: str) -> None:
        """Fail (submission, message) pairs, grouped into ops (same group, sequence and message)."""
        ops: dict[tuple[str, int, str, bool], list[Submission]] = {}
        for sub, message in failed:
            ops.setdefault((sub.group, sub.seq, message, sub.kind in ("send", "recv")), []).append(sub)
        for (_group, _seq, message, _p2p), subs in ops.items():
            self.fail_op(subs, code, message)

    def _group_members(self, name: str) -> list[int] | None:
        group = self.scheduler.groups.get(name)
        return group.ranks if group is not None else None

    def _send_error(self, sub: Submission, code: str, message: str) -> None:
        if sub.origin >= 0:  # a send forwarded from another node: the error goes back there
            if self.fabric_member is not None:
                self.fabric_member.fail_remote(sub, code, message)
            return
        client = self.by_id.get(sub.client_id)
        if client is not None:
            client.pending.release(sub.op_id)
            self.stats.error_reply(code)
            self._reply(client, {"t": s.ERROR, "code": code, "message": message, "id": sub.op_id})

    # ---- op channel -----------------------------------------------------
    def _on_channel_message(self, channel: OpConnection, frame: bytes, fds: list[int]) -> None:
        op_id = -1
        try:
            msg = s.decode(frame)
            op_id = msg["id"] if type(msg.get("id")) is int else -1
            if channel.client is None and msg["t"] == s.SEGMENT:
                self._on_segment_fd(channel, msg, fds)
            elif channel.client is None:
                self._attach_channel(channel, msg)
            elif msg["t"] == s.OP:
                self._on_client_op(channel.client, msg)
            else:
                raise s.ProtocolError(f"only ops travel on the op channel, not {msg['t']!r}")
        except s.ProtocolError as exc:
            self.stats.error(str(exc))
            who = f"client {channel.client.client_id}" if channel.client is not None else f"channel {id(channel):x}"
            self.log_limit.log(logging.WARNING, ("ops", id(channel), exc.code), f"{exc.code} errors from {who}",
                               "op channel error from %s: %s", who, exc)
            self.stats.error_reply(exc.code)
            channel.send(s.encode({"t": s.ERROR, "code": exc.code, "message": str(exc), "id": op_id}))
        except Exception as exc:  # never let one bad message stop the daemon
            self.log_limit.log(logging.ERROR, ("internal", id(channel)), "internal errors on an op channel",
                               "internal error handling an op", exc_info=True)
            channel.send(s.encode({"t": s.ERROR, "code": s.E_INTERNAL, "message": f"internal error: {exc}", "id": op_id}))

    def _attach_channel(self, channel: OpConnection, msg: dict[str, Any]) -> None:
        if msg["t"] != "attach":
            raise s.ProtocolError("op channel: send 'attach' first", s.E_AUTH)
        self._check_secret(msg)
        client = self.by_id.get(s.int_field(msg, "client_id", 0))
        if client is None:
            raise s.ProtocolError("attach names an unknown client id", s.E_AUTH)
        if client.op_channel is not None:
            raise s.ProtocolError(f"client {client.client_id} already has an op channel")
        channel.client = client
        client.op_channel = channel
        channel.send(s.encode({"t": s.ACK}))

    def _on_segment_fd(self, channel: OpConnection, msg: dict[str, Any], fds: list[int]) -> None:
        """A segment registration: its own short connection to the op socket, the memfd beside it."""
        self._check_secret(msg)
        client = self.by_id.get(s.int_field(msg, "client_id", 0))
        if client is None:
            raise s.ProtocolError("segment registration names an unknown client id", s.E_AUTH)
        if len(fds) != 1:
            raise s.ProtocolError(f"a segment registration must carry exactly one file descriptor, not {len(fds)}")
        self._attach_segment(client, msg, fds[0])
        channel.send(s.encode({"t": s.ACK}))

    def _on_channel_closed(self, channel: OpConnection) -> None:
        client = channel.client
        if client is None or self.by_id.get(client.client_id) is not client:
            return
        client.op_channel = None
        self._judge_disconnect(client, time.monotonic() + DISCONNECT_VERDICT_S)

    def _on_channel_overflow(self, channel: OpConnection) -> None:
        """The client left more replies unread than the limit allows: drop it as if it had died."""
        client = channel.client
        if client is None or self.by_id.get(client.client_id) is not client:
            return
        client.op_channel = None
        why = (f"(pid {client.pid}) stopped reading replies ({channel.overflowed_at} bytes unread on its op "
               f"channel, limit {channel.max_backlog}: --max-reply-backlog)")
        self.limits.hit(REPLY_BACKLOG, client.rank, f"rank {client.rank} {why}")
        self._drop_client(client, why, notify_peers=True)
        self.flush()

    def _judge_disconnect(self, client: ClientRecord, deadline: float) -> None:
        """A closed op channel usually means the process is dying: give it a moment to be gone."""
        if self.by_id.get(client.client_id) is not client:
            return
        if not pid_alive(client.pid):
            self._drop_client(client, f"(pid {client.pid}) died", notify_peers=True)
        elif time.monotonic() >= deadline:
            self._drop_client(client, f"(pid {client.pid}) closed its op channel", notify_peers=True)
        else:
            self.loop.call_later(0.01, self._judge_disconnect, client, deadline)
            return
        self.flush()

    # ---- dispatch -----------------------------------------------------
    def _dispatch(self, identity: bytes, frame: bytes) -> None:
        op_id = -1
        try:
            msg = s.decode(frame)
            op_id = msg.get("id", -1) if isinstance(msg.get("id"), int) else -1
            kind = msg["t"]
            if kind == s.OP:
                self._on_op(identity, msg)
            elif kind == s.HELLO:
                self._on_hello(identity, msg)
            elif kind == "attach":
                self._on_attach(identity, msg)
            elif kind == s.GROUP:
                self._on_group(identity, msg)
            elif kind == s.SEGMENT:
                self._on_segment(identity, msg)
            elif kind == s.STATUS:
                self._on_status(identity, msg)
            elif kind == s.TRACE:
                self._on_trace(identity, msg)
            elif kind == s.BYE:
                self._on_bye(identity)
            elif kind == s.PING:
                self._send(identity, {"t": s.ACK, "pid": os.getpid()})
            else:
                raise s.ProtocolError(f"unknown message type {kind!r}")
        except s.ProtocolError as exc:
            client = self.clients.get(identity)
            target = client.reply_identity if client and op_id >= 0 and client.reply_identity else identity
            self._reply_error(target, exc.code, str(exc), op_id)
        except Exception as exc:  # never let one bad message stop the daemon
            self.log_limit.log(logging.ERROR, ("internal", identity), f"internal errors for {identity!r}",
                               "internal error handling a message", exc_info=True)
            self._reply_error(identity, s.E_INTERNAL, f"internal error: {exc}", op_id)

    def _client(self, identity: bytes) -> ClientRecord:
        client = self.clients.get(identity)
        if client is None:
            raise s.ProtocolError("not registered: send 'hello' first", s.E_AUTH)
        return client

    def _check_secret(self, msg: dict[str, Any]) -> None:
        secret = msg.get("secret")
        if not isinstance(secret, str) or not secrets_equal(secret, self.config.secret):
            raise s.ProtocolError("authentication failed: wrong or missing job secret", s.E_AUTH)

    def _on_hello(self, identity: bytes, msg: dict[str, Any]) -> None:
        if self._closing:
            raise s.ProtocolError("daemon shutting down", s.E_SHUTDOWN)
        self._check_secret(msg)
        job = s.field(msg, "job", str)
        if job != self.config.paths.job:
            raise s.ProtocolError(f"this daemon serves job {self.config.paths.job!r}, not {job!r}", s.E_AUTH)
        if identity in self.clients:
            raise s.ProtocolError("already registered on this connection")
        world_size = s.int_field(msg, "world_size", 1, s.MAX_GROUP_SIZE)
        rank = s.int_field(msg, "rank", 0, world_size - 1)
        local_rank = s.int_field(msg, "local_rank", 0, s.MAX_GROUP_SIZE)
        pid = s.int_field(msg, "pid", 1, 1 << 31)
        for other in self.clients.values():
            if other.rank == rank:
                raise s.ProtocolError(f"rank {rank} is already connected (pid {other.pid})")
            if other.world_size != world_size:
                raise s.ProtocolError(
                    f"world size {world_size} disagrees with rank {other.rank}'s {other.world_size}"
                )
        placement = self._check_placement(msg, rank, world_size)
        if s.field(msg, "segments", list):
            raise s.ProtocolError(
                "field 'segments' must be empty: segments are registered on the op socket, each with its "
                "sealed memfd attached"
            )
        client = ClientRecord(self._next_client, identity, None, rank, local_rank, world_size, pid)
        self._next_client += 1
        self.placement = placement
        self.clients[identity] = client
        self.by_id[client.client_id] = client
        self._had_clients = True
        log.info("client rank %d (pid %d) connected", rank, pid)
        self._send(
            identity,
            {"t": s.WELCOME, "client_id": client.client_id, "daemon_pid": os.getpid(),
             "op_timeout": self.config.op_timeout, "cuda": self.cuda.available()},
        )
        me = self.config.fabric.node_rank if self.config.fabric is not None else 0
        if len(self.clients) >= placement.count(me):  # every local rank is here: load torch now, off the loop
            torch_loader.warm_up()

    def _check_placement(self, msg: dict[str, Any], rank: int, world_size: int) -> list[int]:
        """The node of every rank, from the hello's 'nodes' (node names); all clients must agree."""
        fabric = self.config.fabric
        names = msg.get("nodes")
        me = fabric.node_rank if fabric is not None else 0
        if names is None:
            if fabric is not None:
                raise s.ProtocolError(
                    f"this daemon is node {me} ('{self.config.node_name}') of a {fabric.nnodes}-node fabric: "
                    "the hello must say where every rank runs (field 'nodes': one node name per rank)"
                )
            placement = [0] * world_size
        else:
            if not isinstance(names, list) or len(names) != world_size or not all(isinstance(n, str) for n in names):
                raise s.ProtocolError(f"field 'nodes' must list {world_size} node names (one per rank)")
            known = fabric.node_of_name() if fabric is not None else {self.config.node_name: 0}
            unknown = sorted(set(names) - set(known))
            if unknown:
                raise s.ProtocolError(f"field 'nodes' names nodes {unknown} that are not in the fabric {sorted(known)}")
            placement = [known[n] for n in names]
            if placement[rank] != me:
                raise s.ProtocolError(
                    f"rank {rank} is placed on node '{names[rank]}' but connected to the daemon of "
                    f"'{self.config.node_name}'"
                )
        if self.placement is not None and self.clients and placement != self.placement:
            raise s.ProtocolError("field 'nodes' disagrees with the placement the job's other ranks sent")
        return placement

    def _attach_segment(self, client: ClientRecord, raw: dict[str, Any], fd: int) -> None:
        seg_id = s.int_field(raw, "seg", 0, 1 << 20)
        name = s.check_segment_name(s.field(raw, "name", str))
        size = s.int_field(raw, "size", 1)  # the per-client cap below names itself
        if seg_id in client.segments:
            raise s.ProtocolError(f"segment {seg_id} is already registered")
        if len(client.segments) >= self.config.max_segments:
            raise s.ProtocolError(
                f"rank {client.rank} already has {len(client.segments)} segments registered, the limit "
                f"(COMMD_MAX_SEGMENTS={self.config.max_segments}); allocate fewer, larger arena tensors",
                s.E_BOUNDS,
            )
        if client.arena_bytes + size > self.config.max_arena_bytes:
            self.stats.limit_hit("max_arena_bytes")
            raise s.ProtocolError(
                f"rank {client.rank}'s arena would reach {client.arena_bytes + size} bytes, over the limit "
                f"of {self.config.max_arena_bytes} bytes per client (COMMD_MAX_ARENA_BYTES)",
                s.E_BOUNDS,
            )
        try:
            segment = Segment.from_fd(seg_id, name, size, fd, os.getuid())
        except (OSError, ValueError) as exc:
            raise s.ProtocolError(f"cannot map segment {name!r}: {exc}") from None
        client.segments[seg_id] = segment
        log.debug("rank %d registered segment %d (%d bytes)", client.rank, seg_id, size)

    def _on_attach(self, identity: bytes, msg: dict[str, Any]) -> None:
        self._check_secret(msg)
        client = self.by_id.get(s.int_field(msg, "client_id", 0))
        if client is None:
            raise s.ProtocolError("attach names an unknown client id", s.E_AUTH)
        client.reply_identity = identity
        self._send(identity, {"t": s.ACK})

    def _on_segment(self, identity: bytes, msg: dict[str, Any]) -> None:
        self._client(identity)
        raise s.ProtocolError(
            "segments are registered on the op socket with their sealed memfd attached, not by name"
        )

    def _on_group(self, identity: bytes, msg: dict[str, Any]) -> None:
        client = self._client(identity)
        name = s.check_group_name(s.field(msg, "name", str))
        ranks = s.field(msg, "ranks", list)
        if not ranks or len(ranks) > client.world_size:
            raise s.ProtocolError(f"group '{name}' must have 1 to {client.world_size} ranks")
        if any(not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < client.world_size for r in ranks):
            raise s.ProtocolError(f"group '{name}' ranks must be integers in [0, {client.world_size})")
        if len(set(ranks)) != len(ranks):
            raise s.ProtocolError(f"group '{name}' lists a rank twice")
        if client.rank not in ranks:
            raise s.ProtocolError(f"rank {client.rank} is not a member of group '{name}'")
        me = self.config.fabric.node_rank if self.config.fabric is not None else 0
        plan = GroupPlacement(name, tuple(ranks), tuple(self.placement[r] for r in ranks), me)
        try:
            self.scheduler.register_group(name, ranks, plan.local)
        except ValueError as exc:
            raise s.ProtocolError(str(exc)) from None
        self.plans[name] = plan
        client.groups[name] = ranks.index(client.rank)
        self._send(identity, {"t": s.ACK})
        if self.fabric_member is not None:
            self.fabric_member.group_registered(name)

    def _on_bye(self, identity: bytes) -> None:
        client = self.clients.get(identity)
        if client is not None:
            self._drop_client(client, "left the job", notify_peers=True, clean=True)
        self._send(identity, {"t": s.ACK})

    def _on_status(self, identity: bytes, msg: dict[str, Any]) -> None:
        self._check_secret(msg)
        self._send(identity, {"t": s.STATUS, "status": self.status()})

    def _on_trace(self, identity: bytes, msg: dict[str, Any]) -> None:
        self._check_secret(msg)
        try:
            self._send(identity, {"t": s.ACK, **self.observers.on_control(msg)})
        except TraceError as exc:
            raise s.ProtocolError(str(exc)) from None

    # ---- ops ------------------------------------------------------------
    def _on_op(self, identity: bytes, msg: dict[str, Any]) -> None:
        self._on_client_op(self._client(identity), msg)

    def _on_client_op(self, client: ClientRecord, msg: dict[str, Any]) -> None:
        try:
            self._accept_op(client, msg)
        except s.LimitError as exc:  # counted, logged once per client and limit; the op alone is refused
            self.limits.hit(exc.limit, client.rank, str(exc))
            self.stats.error(str(exc))
            op_id = msg["id"] if type(msg.get("id")) is int else -1
            error = {"t": s.ERROR, "code": exc.code, "message": str(exc), "id": op_id}
            if client.op_channel is not None:
                client.op_channel.reply(error)
            elif client.reply_identity is not None:
                self._send(client.reply_identity, error)

    def _accept_op(self, client: ClientRecord, msg: dict[str, Any]) -> None:
        if client.reply_identity is None and client.op_channel is None:
            raise s.ProtocolError("reply channel not attached")
        if self._closing:
            raise s.ProtocolError("daemon shutting down", s.E_SHUTDOWN)
        group_name = s.field(msg, "group", str)
        group_rank = client.groups.get(group_name)
        if group_rank is None:
            raise s.ProtocolError(f"rank {client.rank} has not registered group {group_name!r}")
        group = self.scheduler.groups[group_name]
        sub = parse_submission(msg, client.client_id, group_rank, len(group.ranks), self.config.op_timeout)
        self._check_bounds(client, sub)
        sub.timeout = self.limits.cap_timeout(client.rank, sub.timeout)
        self.limits.admit(client.rank, client.pending, sub.op_id, sub.buffers)
        self.stats.submitted(sub.group, sub.seq)
        plan = self.plans.get(group_name)
        multi_node = plan is not None and plan.multi_node and self.fabric_member is not None
        if multi_node and sub.kind == "send" and plan.node_of[sub.peer] != plan.me:
            self.fabric_member.forward_send(sub, plan)
            return
        try:
            ready = self.scheduler.submit(sub)
        except MatchError as exc:
            self.fail_op(exc.subs, exc.code, str(exc))
            return
        if ready is None:
            return
        if not multi_node:
            self._start(ready)
        elif ready.kind != "sendrecv":
            self.fabric_member.negotiate(ready, plan)
        elif ready.subs[0].origin >= 0:
            self.fabric_member.matched(ready)
        else:
            self._start(ready)

    def _check_bounds(self, client: ClientRecord, sub: Submission) -> None:
        itemsize = s.ITEMSIZE[sub.dtype]
        for name, ref in sub.buffers.items():
            if ref.inline is not None:
                continue
            if ref.cuda is not None:
                self.cuda.check(ref.cuda, ref.offset, ref.nbytes)
                continue
            segment = client.segments.get(ref.segment)
            if segment is None:
                raise s.ProtocolError(f"buffer '{name}' names unknown segment {ref.segment}", s.E_BOUNDS)
            if ref.offset + ref.nbytes > segment.size:
                raise s.ProtocolError(
                    f"buffer '{name}' [{ref.offset}, {ref.offset + ref.nbytes}) lies outside "
                    f"segment {ref.segment} of {segment.size} bytes",
                    s.E_BOUNDS,
                )
            if ref.offset % itemsize:
                raise s.ProtocolError(
                    f"buffer '{name}' offset {ref.offset} is not aligned to {sub.dtype}", s.E_BOUNDS
                )

    def resolve(self, sub: Submission, name: str) -> torch.Tensor:
        ref = sub.buffers[name]
        torch = torch_loader.torch_module()
        dtype = torch_loader.executor().torch_dtype(sub.dtype)
        if ref.nbytes == 0:
            return torch.empty(0, dtype=dtype)
        if ref.inline is not None:
            return torch.frombuffer(ref.inline, dtype=dtype)
        if ref.cuda is not None:
            return self.cuda.tensor(sub.client_id, ref.cuda, ref.offset, ref.nbytes, dtype)
        client = self.by_id[sub.client_id]
        view = client.views.get(ref.segment)
        if view is None:
            segment = client.segments[ref.segment]
            view = client.views[ref.segment] = torch.frombuffer(segment.mm, dtype=torch.uint8, count=segment.size)
        return view[ref.offset : ref.offset + ref.nbytes].view(dtype)

    def resolve_array(self, sub: Submission, name: str) -> np.ndarray:
        ref = sub.buffers[name]
        dtype = NUMPY_DTYPES[sub.dtype]
        if ref.inline is not None:
            return np.frombuffer(ref.inline, dtype=dtype)
        segment = self.by_id[sub.client_id].segments[ref.segment]
        return segment.array[ref.offset : ref.offset + ref.nbytes].view(dtype)

    def _start(self, op: ReadyOp) -> None:
        # An op that needs torch before it is loaded goes to the lane: the loop never waits for the import.
        if self._lane_busy == 0 and op.nbytes <= INLINE_EXEC_BYTES and (torch_loader.loaded() or runs_on_numpy(op)):
            self.stats.started(op.group, queued=False)
            error = self._run(op)
            self.complete(op, error)
            return
        self.stats.queued(op.group)
        self._lane_busy += 1
        self._lane.put(op)

    def _run(self, op: ReadyOp) -> str | None:
        if self.tracer.on:
            return self.tracer.timed_run(op, self._execute)
        return self._execute(op)

    def _execute(self, op: ReadyOp) -> str | None:
        try:
            if op.on_gpu:
                device = next(b.cuda.device for x in op.subs for b in x.buffers.values() if b.cuda is not None)
                with torch_loader.torch_module().cuda.stream(self.cuda.stream(device)):
                    torch_loader.executor().execute(op, self.resolve)
                self.cuda.synchronize()  # results are visible to the clients when we answer
            elif not execute_small(op, self.resolve_array):
                torch_loader.executor().execute(op, self.resolve)
            return None
        except Exception as exc:
            log.exception("executing %s failed", op.describe())
            return f"{op.describe()} failed in the daemon: {exc}"

    def _lane_main(self) -> None:
        while True:
            op = self._lane.get()
            if op is None:
                return
            if self._closing:
                error = "daemon shutting down before the op could run"
            else:
                self.loop.call_soon_threadsafe(self.stats.started, op.group)
                self._executing = op
                error = self._run(op)
                self._executing = None
            try:
                self.loop.call_soon_threadsafe(self._lane_done, op, error)
            except RuntimeError:  # loop already closed
                return

    def _lane_done(self, op: ReadyOp, error: str | None) -> None:
        self._lane_busy -= 1
        self.complete(op, error)
        self.flush()

    def complete(self, op: ReadyOp, error: str | None, code: str | None = None) -> None:
        if self.tracer.on:
            self.tracer.op_done(op, error)
        self.stats.finished(op.group, op.kind, op.nbytes, time.monotonic() - op.first_at, error is None, op.lane)
        if error is not None:
            code = s.E_SHUTDOWN if self._closing else (code or s.E_INTERNAL)
            self.fail_op(op.subs, code, error)
            return
        for sub in op.subs:
            client = self.by_id.get(sub.client_id)
            if client is None:
                continue
            client.pending.release(sub.op_id)
            reply: dict[str, Any] = {"t": s.DONE, "id": sub.op_id}
            for name in ("buf", "out"):
                ref = sub.buffers.get(name)
                if ref is not None and ref.inline is not None:
                    reply["data"] = bytes(ref.inline)
            if op.kind == "sendrecv" and sub.kind == "recv":
                reply["src"] = op.subs[0].group_rank
            self._reply(client, reply)

    # ---- liveness -------------------------------------------------------
    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            try:
                self._check_clients()
                now = time.monotonic()
                self.fail_each(self.scheduler.expire(now), s.E_TIMEOUT)
                if self.fabric_member is not None:
                    self.fabric_member.tick(now)
                self._inspect_stalls(now)
                self._check_idle()
                self.log_limit.flush()
                self.flush()
            except Exception:
                log.exception("watchdog failed")

    def _check_clients(self) -> None:
        for client in list(self.clients.values()):
            if not pid_alive(client.pid):
                self._drop_client(client, f"(pid {client.pid}) died", notify_peers=True)

    def _drop_client(self, client: ClientRecord, why: str, notify_peers: bool, clean: bool = False) -> None:
        """``clean``: the rank said goodbye (a departure, not an error; ops it leaves behind still fail)."""
        log.info("client rank %d %s", client.rank, why)
        if clean:
            self.stats.departed(f"rank {client.rank} {why}")
        else:
            self.stats.error(f"rank {client.rank} {why}")
        self.clients.pop(client.identity, None)
        self.by_id.pop(client.client_id, None)
        if client.op_channel is not None:
            client.op_channel.close()
            client.op_channel = None
        if notify_peers:
            self.fail_ops_waiting_on(client.rank, why)
            if self.fabric_member is not None:
                self.fabric_member.rank_died(client.rank, why)
        self._release(client)
        self.limits.forget(client.rank)
        self.scheduler.forget_client_groups({c.rank for c in self.clients.values()})
        if not self.clients:
            self._idle_since = time.monotonic()

    def fail_ops_waiting_on(self, rank: int, why: str) -> None:
        """Rank ``rank`` (of this node or another) is gone: fail what waits for it here."""
        self.fail_each(self.scheduler.rank_died(rank, why), s.E_PEER_DIED)

    def _inspect_stalls(self, now: float) -> None:
        """Log ops waiting longer than the stall threshold (once each); optionally shut down."""
        if now - self._last_stall_scan < 1.0:
            return
        self._last_stall_scan = now
        config = self.config.scheduler
        for row in self.scheduler.waiting_summary():
            if row["waiting_s"] < config.stall_warning_s or row["seq"] is None:
                continue
            key = (row["group"], row["seq"])
            if key not in self._stall_warned:
                self._stall_warned.add(key)
                log.warning("stalled: %s #%s on group '%s' has waited %.0fs for ranks %s to submit it",
                            row["kind"], row["seq"], row["group"], row["waiting_s"], row["missing_ranks"])
            if config.stall_shutdown_s and row["waiting_s"] >= config.stall_shutdown_s and self.fabric_member is None:
                self.shutdown(f"{row['kind']} #{row['seq']} on group '{row['group']}' stalled for "
                              f"{row['waiting_s']:.0f}s waiting for ranks {row['missing_ranks']}")
                return

    def _release(self, client: ClientRecord) -> None:
        # Views still used by a running op keep their mapping alive; dropping
        # the references unmaps each segment once the last view is gone.
        client.views.clear()
        self.cuda.forget_client(client.client_id)
        client.segments.clear()

    def _check_idle(self) -> None:
        if self.config.owner_pid is not None and not pid_alive(self.config.owner_pid):
            self.shutdown(f"its owner (pid {self.config.owner_pid}) is gone")
            return
        if not self.config.exit_when_idle or self.clients:
            return
        idle = time.monotonic() - self._idle_since
        if self._had_clients and idle >= self.config.idle_grace:
            self.shutdown("the job's last client left")
        elif not self._had_clients and idle >= self.config.first_client_grace:
            self.shutdown(f"no client connected within {self.config.first_client_grace:g}s of the start")

    # ---- what the fabric member may use (fabric.services.NodeServices) ----------
    @property
    def closing(self) -> bool:
        return self._closing

    def group_size(self, name: str) -> int | None:
        group = self.scheduler.groups.get(name)
        return len(group.ranks) if group is not None else None

    def match(self, sub: Submission) -> ReadyOp | None:
        return self.scheduler.submit(sub)

    def waiting_summary(self) -> list[dict[str, Any]]:
        return self.scheduler.waiting_summary()

    def apply_trace(self, item: dict[str, Any]) -> None:
        self.observers.apply_forwarded(item)

    # ---- status -----------------------------------------------------------
    def status(self) -> dict[str, Any]:
        stats = self.stats
        waiting = self.scheduler.waiting_summary()
        waiting_by_group: dict[str, int] = {}
        for row in waiting:
            waiting_by_group[row["group"]] = waiting_by_group.get(row["group"], 0) + 1
        return {
            "job": self.config.paths.job,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - stats.started_at, 3),
            "closing": self._closing,
            "torch_loaded": torch_loader.loaded(),
            "clients": [
                {"rank": c.rank, "local_rank": c.local_rank, "pid": c.pid, "arena_bytes": c.arena_bytes,
                 "pending_ops": len(c.pending.ops), "pending_bytes": c.pending.bytes}
                for c in sorted(self.clients.values(), key=lambda c: c.rank)
            ],
            "groups": {
                name: {
                    "size": g.size,
                    "next_seq": g.next_seq,
                    "waiting": waiting_by_group.get(name, 0),
                    "queued": g.queued,
                    "executing": g.executing,
                    "done": g.done,
                    "failed": g.failed,
                    "bytes": g.bytes,
                }
                for name, g in stats.groups.items()
            },
            "ops_done": stats.ops_done,
            "bytes_moved": stats.bytes_moved,
            "latency_us": stats.latency_table(),
            "ops_by_lane": stats.per_kind(),
            "oldest_waiting": waiting[0] if waiting else None,
            "stalls": self._stalls(waiting),
            "node": self.config.node_name,
            "fabric": self.fabric_member.status() if self.fabric_member is not None else None,
            "last_errors": list(stats.errors),
            "departures": list(stats.departures),
            "limits": self.config.limits.to_status(),
            "limits_hit": dict(self.stats.limits_hit),
            "observe": self.observers.status(),
        }

    def _stalls(self, waiting: list[dict[str, Any]]) -> list[dict[str, Any]]:
        threshold = self.config.scheduler.stall_warning_s
        rows = [dict(r, missing_nodes=[]) for r in waiting if r["waiting_s"] >= threshold]
        if self.fabric_member is not None:
            rows += [r for r in self.fabric_member.fabric_stalls]
        return rows
