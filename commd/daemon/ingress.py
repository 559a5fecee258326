"""The control socket: a ZeroMQ ROUTER for hello, group, status, trace, bye and ping.

One event loop owns the socket; nothing else touches it.  Every message is validated
before it changes any state; a bad message is answered with an error and logged, and
the daemon carries on serving everyone else.  Ops (and the attach that opens their
channel) travel only on the op socket (``opingress.py``): segments can only be
registered there (a memfd by SCM_RIGHTS), so every client needs it anyway, and its
reply queue is bounded per client.  An op or attach sent here is refused with an
error that says so.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from commd.core.placement import GroupPlacement
from commd.daemon.clients import ClientRecord, ClientRegistry
from commd.daemon.config import DaemonConfig
from commd.daemon.cuda import CudaImporter
from commd.daemon.loglimit import RateLimitedLog
from commd.daemon.opingress import check_secret
from commd.daemon.state import NodeState
from commd.execution import torch_loader
from commd.observe.hooks import DaemonObservers
from commd.observe.stats import Stats
from commd.observe.trace import TraceError
from commd.protocol import schema as s
from commd.runtime import pid_alive
from commd.scheduler.local import LocalScheduler

log = logging.getLogger("commd.daemon")

#: zmq drops (and disconnects) frames above this; below it we answer with an error.
ZMQ_MAX_FRAME = 16 * s.MAX_MESSAGE_BYTES
#: At most this many control messages, or this long, per turn of the event loop; then its timers
#: (the watchdog) and other callbacks run before the control socket is read on.
DRAIN_TURN_MESSAGES = 32
DRAIN_TURN_S = 0.02

#: ``drop(client, why, notify_peers, clean)``: the watchdog's way to let a client go.
DropClient = Callable[..., None]


class ControlIngress:
    def __init__(self, config: DaemonConfig, state: NodeState, clients: ClientRegistry, scheduler: LocalScheduler,
                 placements: dict[str, GroupPlacement], cuda: CudaImporter, stats: Stats,
                 log_limit: RateLimitedLog, observers: DaemonObservers, status: Callable[[], dict[str, Any]],
                 drop_client: DropClient, read_queued_ops: Callable[[ClientRecord], None]) -> None:
        """``read_queued_ops(client)``: handle what the client's op channel holds unread (``_on_bye``)."""
        self.config = config
        self.state = state
        self.clients = clients
        self.scheduler = scheduler
        self.placements = placements
        self.cuda = cuda
        self.stats = stats
        self.log_limit = log_limit
        self.observers = observers
        self.status = status
        self.drop_client = drop_client
        self.read_queued_ops = read_queued_ops
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_FRAME)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)

    # ---- socket I/O (loop thread only) --------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        loop.add_reader(self.sock.getsockopt(zmq.FD), self._on_readable)
        loop.call_soon(self._on_readable)

    def close(self) -> None:
        self.loop.remove_reader(self.sock.getsockopt(zmq.FD))
        self.sock.close(linger=1000)

    def _on_readable(self) -> None:
        sock = self.sock
        # Drain while zmq says a message is there (cheaper than ending on zmq.Again), a turn's worth
        # at a time: clients that query as fast as they are answered (commd.ft's survivors poll the
        # status) must not keep the loop from its timers (the watchdog that sees dead ranks).
        ends = time.monotonic() + DRAIN_TURN_S
        for _ in range(DRAIN_TURN_MESSAGES):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            if len(frames) != 2:
                self.log_limit.log(logging.WARNING, ("frames", frames[0]), f"bad messages from {frames[0]!r}",
                                   "dropping a message of %d frames from %r", len(frames), frames[0])
                continue
            self._dispatch(frames[0], frames[1])
            if time.monotonic() >= ends:
                break
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # more: read on once the loop's other work had its turn
            self.loop.call_soon(self._on_readable)

    def flush(self) -> None:
        """Look for messages again: zmq's FD is edge-triggered and sends may have consumed a read edge."""
        if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.loop.call_soon(self._on_readable)

    def send(self, identity: bytes, message: dict[str, Any]) -> None:
        try:
            self.sock.send_multipart([identity, s.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("cannot reach client %r: %s", identity, exc)

    def _reply_error(self, identity: bytes, code: str, message: str, op_id: int = -1) -> None:
        self.log_limit.log(logging.WARNING, ("control", identity, code), f"{code} errors for {identity!r}",
                           "error for %r: %s", identity, message)
        self.stats.error(message)
        self.stats.error_reply(code)
        self.send(identity, {"t": s.ERROR, "code": code, "message": message, "id": op_id})

    # ---- dispatch -----------------------------------------------------
    def _dispatch(self, identity: bytes, frame: bytes) -> None:
        op_id = -1
        try:
            msg = s.decode(frame)
            op_id = msg.get("id", -1) if isinstance(msg.get("id"), int) else -1
            kind = msg["t"]
            if kind in (s.OP, s.OPS, "attach"):
                raise s.ProtocolError(
                    f"{kind!r} messages travel on the op socket ({self.config.paths.ops_socket}, SEQPACKET), "
                    "not on the control socket"
                )
            if kind == s.HELLO:
                self._on_hello(identity, msg)
            elif kind == s.GROUP:
                self._on_group(identity, msg)
            elif kind == s.SEGMENT:
                self._client(identity)
                raise s.ProtocolError(
                    "segments are registered on the op socket with their sealed memfd attached, not by name"
                )
            elif kind == s.STATUS:
                check_secret(msg, self.config.secret)
                self.send(identity, {"t": s.STATUS, "status": self.status()})
            elif kind == s.TRACE:
                self._on_trace(identity, msg)
            elif kind == s.BYE:
                self._on_bye(identity)
            elif kind == s.PING:
                self.send(identity, {"t": s.ACK, "pid": os.getpid()})
            else:
                raise s.ProtocolError(f"unknown message type {kind!r}")
        except s.ProtocolError as exc:
            self._reply_error(identity, exc.code, str(exc), op_id)
        except Exception as exc:  # never let one bad message stop the daemon
            self.log_limit.log(logging.ERROR, ("internal", identity), f"internal errors for {identity!r}",
                               "internal error handling a message", exc_info=True)
            self._reply_error(identity, s.E_INTERNAL, f"internal error: {exc}", op_id)

    def _client(self, identity: bytes) -> ClientRecord:
        client = self.clients.get(identity)
        if client is None:
            raise s.ProtocolError("not registered: send 'hello' first", s.E_AUTH)
        return client

    def _on_hello(self, identity: bytes, msg: dict[str, Any]) -> None:
        if self.state.closing:
            raise s.ProtocolError("daemon shutting down", s.E_SHUTDOWN)
        check_secret(msg, self.config.secret)
        job = s.field(msg, "job", str)
        if job != self.config.paths.job:
            raise s.ProtocolError(f"this daemon serves job {self.config.paths.job!r}, not {job!r}", s.E_AUTH)
        if self.clients.get(identity) is not None:
            raise s.ProtocolError("already registered on this connection")
        world_size = s.int_field(msg, "world_size", 1, s.MAX_GROUP_SIZE)
        rank = s.int_field(msg, "rank", 0, world_size - 1)
        local_rank = s.int_field(msg, "local_rank", 0, s.MAX_GROUP_SIZE)
        pid = s.int_field(msg, "pid", 1, 1 << 31)
        for other in list(self.clients):
            if other.rank == rank:
                if pid_alive(other.pid):
                    raise s.ProtocolError(f"rank {rank} is already connected (pid {other.pid})")
                # a replacement (commd launch --max-restarts) may say hello before the watchdog's next
                # look has freed the dead process's seat: free it now, failing what waited for it
                self.drop_client(other, f"(pid {other.pid}) died", notify_peers=True)
                continue
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
        client = self.clients.add(identity, rank, local_rank, world_size, pid, placement)
        self.stats.rank_back(rank)
        log.info("client rank %d (pid %d) connected", rank, pid)
        self.send(
            identity,
            {"t": s.WELCOME, "client_id": client.client_id, "daemon_pid": os.getpid(),
             "op_timeout": self.config.op_timeout, "cuda": self.cuda.available()},
        )
        if len(self.clients) >= placement.count(self.config.node_rank):
            torch_loader.warm_up()  # every local rank is here: load torch now, off the loop

    def _check_placement(self, msg: dict[str, Any], rank: int, world_size: int) -> list[int]:
        """The node of every rank, from the hello's 'nodes' (node names); all clients must agree."""
        fabric = self.config.fabric
        names = msg.get("nodes")
        me = self.config.node_rank
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
        if self.clients.placement is not None and len(self.clients) and placement != self.clients.placement:
            raise s.ProtocolError("field 'nodes' disagrees with the placement the job's other ranks sent")
        return placement

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
        node_of = self.clients.placement
        placement = GroupPlacement(name, tuple(ranks), tuple(node_of[r] for r in ranks), self.config.node_rank)
        try:
            self.scheduler.register_group(name, ranks, placement.local)
        except ValueError as exc:
            raise s.ProtocolError(str(exc)) from None
        self.placements[name] = placement
        client.groups[name] = ranks.index(client.rank)
        self.send(identity, {"t": s.ACK})
        if self.state.member is not None:
            self.state.member.group_registered(name)

    def _on_bye(self, identity: bytes) -> None:
        client = self.clients.get(identity)
        if client is not None:
            # What the rank sent on its op channel before this BYE (its ring's last traced ops, ops) may be
            # unread yet: nothing orders the two sockets.  Handled first, not dropped with the channel.
            self.read_queued_ops(client)
            self.drop_client(client, "left the job", notify_peers=True, clean=True)
        self.send(identity, {"t": s.ACK})

    def _on_trace(self, identity: bytes, msg: dict[str, Any]) -> None:
        check_secret(msg, self.config.secret)
        try:
            self.send(identity, {"t": s.ACK, **self.observers.on_control(msg)})
        except TraceError as exc:
            raise s.ProtocolError(str(exc)) from None
