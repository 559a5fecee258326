"""The op channel's messages: attach, segments, ops, unregister, ring ops, membership reports — each validated first.

A client's op channel (``opchannel.py``, Unix SEQPACKET) first attaches to the client its
hello registered; short extra connections each register one segment (an arena segment or
a registered tensor storage, ``registered.py``), its memfd passed beside the message.  An op is decoded, checked field by field (``parse_submission``),
bounds-checked against the client's segments, admitted against its limits, and handed
to ``OpRouter.route``.  A bad message gets an ERROR naming what is wrong; nothing else changes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from commd.core.ops import Submission
from commd.core.placement import GroupPlacement
from commd.daemon.clients import BufferResolver, ClientRecord, ClientRegistry
from commd.daemon.completion import Completions
from commd.daemon.config import DaemonConfig
from commd.daemon.fastring import RingRegions
from commd.daemon.limits import LimitGuard
from commd.daemon.loglimit import RateLimitedLog
from commd.daemon.opchannel import OpConnection
from commd.daemon.registered import RegisteredSegments
from commd.daemon.router import OpRouter
from commd.daemon.state import NodeState
from commd.memory.arena import ARENA, Segment
from commd.observe.stats import Stats
from commd.observe.trace import check_ring_records
from commd.protocol import schema as s
from commd.runtime import secrets_equal
from commd.scheduler.agreement import parse_submission
from commd.scheduler.local import LocalScheduler

#: What a ring op's failure (``RINGOP`` with ``failed``) may be: the ranks' own doing, never the daemon's.
RING_FAILURES = (s.E_TIMEOUT, s.E_MISMATCH)

log = logging.getLogger("commd.daemon")


def check_secret(msg: dict[str, Any], secret: str) -> None:
    """The message carries the job's secret (compared in constant time), else an ``auth`` error."""
    given = msg.get("secret")
    if not isinstance(given, str) or not secrets_equal(given, secret):
        raise s.ProtocolError("authentication failed: wrong or missing job secret", s.E_AUTH)


class OpIngress:
    def __init__(self, config: DaemonConfig, state: NodeState, clients: ClientRegistry, buffers: BufferResolver,
                 scheduler: LocalScheduler, placements: dict[str, GroupPlacement], router: OpRouter,
                 completions: Completions, limits: LimitGuard, stats: Stats, log_limit: RateLimitedLog) -> None:
        self.config = config
        self.state = state
        self.clients = clients
        self.buffers = buffers
        self.scheduler = scheduler
        self.placements = placements
        self.router = router
        self.completions = completions
        self.limits = limits
        self.stats = stats
        self.log_limit = log_limit
        self.registered = RegisteredSegments(config.max_registered_bytes, stats)
        self.rings = RingRegions(clients, placements, state)

    def on_message(self, channel: OpConnection, frame: bytes, fds: list[int]) -> None:
        """One message on an op channel (the ``OpListener``'s callback)."""
        op_id = -1
        try:
            msg = s.decode(frame)
            op_id = msg["id"] if type(msg.get("id")) is int else -1
            if channel.client is None and msg["t"] == s.SEGMENT:
                self._on_segment_fd(channel, msg, fds)
            elif channel.client is None and msg["t"] == s.FASTRING:
                check_secret(msg, self.config.secret)
                self.rings.grant(channel, msg)
            elif channel.client is None:
                self._attach_channel(channel, msg)
            elif msg["t"] == s.OP:
                self._on_client_op(channel.client, msg)
            elif msg["t"] == s.OPS:
                self._on_client_batch(channel.client, msg)
            elif msg["t"] == s.UNREGISTER:
                self.registered.unregister(channel.client, msg)
            elif msg["t"] == s.RINGOP:
                self._on_ring_op(channel.client, msg)
            elif msg["t"] == s.MEMBERSHIP:
                self._on_membership(channel.client, msg)
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
        check_secret(msg, self.config.secret)
        client = self.clients.find(s.int_field(msg, "client_id", 0))
        if client is None:
            raise s.ProtocolError("attach names an unknown client id", s.E_AUTH)
        if client.op_channel is not None:
            raise s.ProtocolError(f"client {client.client_id} already has an op channel")
        channel.client = client
        client.op_channel = channel
        channel.send(s.encode({"t": s.ACK}))

    def _on_segment_fd(self, channel: OpConnection, msg: dict[str, Any], fds: list[int]) -> None:
        """A segment registration: its own short connection to the op socket, the memfd beside it."""
        check_secret(msg, self.config.secret)
        client = self.clients.find(s.int_field(msg, "client_id", 0))
        if client is None:
            raise s.ProtocolError("segment registration names an unknown client id", s.E_AUTH)
        if len(fds) != 1:
            raise s.ProtocolError(f"a segment registration must carry exactly one file descriptor, not {len(fds)}")
        self._attach_segment(client, msg, fds[0])
        channel.send(s.encode({"t": s.ACK}))

    def _attach_segment(self, client: ClientRecord, raw: dict[str, Any], fd: int) -> None:
        seg_id = s.int_field(raw, "seg", 0, s.MAX_SEGMENT_ID)
        name = s.check_segment_name(s.field(raw, "name", str))
        size = s.int_field(raw, "size", 1)  # the per-client cap below names itself
        kind = s.optional(raw, "kind", str, ARENA)
        if kind not in s.SEGMENT_KINDS:
            raise s.ProtocolError(f"segment kind {kind!r} is not one of {list(s.SEGMENT_KINDS)}")
        if seg_id in client.segments:
            raise s.ProtocolError(f"segment {seg_id} is already registered")
        if kind != ARENA:
            self.registered.check_registration(client, seg_id, size)
        elif seg_id > s.ARENA_SEG_MAX:
            raise s.ProtocolError(f"arena segment id {seg_id} outside [0, {s.ARENA_SEG_MAX}]")
        if len(client.segments) >= self.config.max_segments:
            raise s.ProtocolError(
                f"rank {client.rank} already has {len(client.segments)} segments registered, the limit "
                f"(COMMD_MAX_SEGMENTS={self.config.max_segments}); allocate fewer, larger arena tensors",
                s.E_BOUNDS,
            )
        if kind == ARENA and client.arena_bytes + size > self.config.max_arena_bytes:
            self.stats.limit_hit("max_arena_bytes")
            raise s.ProtocolError(
                f"rank {client.rank}'s arena would reach {client.arena_bytes + size} bytes, over the limit "
                f"of {self.config.max_arena_bytes} bytes per client (COMMD_MAX_ARENA_BYTES)",
                s.E_BOUNDS,
            )
        try:
            segment = Segment.from_fd(seg_id, name, size, fd, os.getuid(), kind)
        except (OSError, ValueError) as exc:
            raise s.ProtocolError(f"cannot map segment {name!r}: {exc}") from None
        client.segments[seg_id] = segment
        log.debug("rank %d registered %s segment %d (%d bytes)", client.rank, kind, seg_id, size)

    def _on_client_op(self, client: ClientRecord, msg: dict[str, Any]) -> None:
        """An op from a registered client; a limit refuses this op alone (counted, logged once)."""
        try:
            self._accept_op(client, msg)
        except s.LimitError as exc:  # counted, logged once per client and limit; the op alone is refused
            self.limits.hit(exc.limit, client.rank, str(exc))
            self.stats.error(str(exc))
            op_id = msg["id"] if type(msg.get("id")) is int else -1
            self.completions.reply(client, {"t": s.ERROR, "code": exc.code, "message": str(exc), "id": op_id})

    def _on_client_batch(self, client: ClientRecord, msg: dict[str, Any]) -> None:
        """Ops submitted together: every item is checked and admitted before any is routed, so a bad
        item refuses the whole batch (each item's rank hears why) and nothing of it runs; the accepted
        batch is routed in order, as ops sent one message each would be."""
        subs: list[Submission] = []
        admitted: list[int] = []
        items: list[dict[str, Any]] = []
        try:
            items = s.op_batch_items(msg)
            for item in items:
                subs.append(self._check_op(client, item))
            for sub in subs:
                self.limits.admit(client.rank, client.pending, sub.op_id, sub.buffers)
                admitted.append(sub.op_id)
        except s.ProtocolError as exc:
            for op_id in admitted:  # admitted before the refusal: not pending after all
                client.pending.release(op_id)
            at_fault = None if not items else len(subs) if len(subs) < len(items) else len(admitted)
            self._refuse_batch(client, msg, exc, at_fault, len(items))
            return
        self.stats.op_batch(len(subs))
        for sub in subs:
            try:
                self._route(client, sub)
            except Exception as exc:  # this op fails alone; the batch's other ops go on
                self.log_limit.log(logging.ERROR, ("internal", client.client_id), "internal errors routing ops",
                                   "internal error routing an op of a batch", exc_info=True)
                self.completions.fail_op([sub], s.E_INTERNAL, f"internal error: {exc}")

    def _refuse_batch(self, client: ClientRecord, msg: dict[str, Any], exc: s.ProtocolError, index: int | None,
                      size: int) -> None:
        """An ERROR for every op of a refused batch, naming the item at fault (counted, logged once)."""
        where = f"item {index} of {size}" if index is not None else "the batch itself"
        message = f"op batch refused, none of its ops was taken: {where}: {exc}"
        if isinstance(exc, s.LimitError):
            self.limits.hit(exc.limit, client.rank, message)
        self.stats.error(message)
        self.log_limit.log(logging.WARNING, ("ops", client.client_id, exc.code),
                           f"{exc.code} errors from rank {client.rank}", "op channel error from rank %d: %s",
                           client.rank, message)
        for op_id in s.op_batch_ids(msg) or [-1]:
            self.stats.error_reply(exc.code)
            self.completions.reply(client, {"t": s.ERROR, "code": exc.code, "message": message, "id": op_id})

    def _accept_op(self, client: ClientRecord, msg: dict[str, Any]) -> None:
        sub = self._check_op(client, msg)
        self.limits.admit(client.rank, client.pending, sub.op_id, sub.buffers)
        self._route(client, sub)

    def _check_op(self, client: ClientRecord, msg: dict[str, Any]) -> Submission:
        """One op message as a submission, every field and buffer checked; changes no state."""
        if client.op_channel is None:
            raise s.ProtocolError("reply channel not attached")
        if self.state.closing:
            raise s.ProtocolError("daemon shutting down", s.E_SHUTDOWN)
        group_name = s.field(msg, "group", str)
        group_rank = client.groups.get(group_name)
        if group_rank is None:
            raise s.ProtocolError(f"rank {client.rank} has not registered group {group_name!r}")
        group = self.scheduler.groups[group_name]
        sub = parse_submission(msg, client.client_id, group_rank, len(group.ranks), self.config.op_timeout)
        self.buffers.check_bounds(client, sub)
        sub.timeout = self.limits.cap_timeout(client.rank, sub.timeout)
        return sub

    def _route(self, client: ClientRecord, sub: Submission) -> None:
        """An admitted op on its way: counted, then to ``OpRouter.route``."""
        self.registered.count(client, sub)
        self.stats.submitted(sub.group, sub.seq)
        placement = self.placements.get(sub.group)
        if placement is not None and placement.multi_node and self.state.member is not None:
            self.state.member.bridges.daemon_op(sub.group)  # a peer node's ring op may sit at its place
        self.router.route(sub, placement)

    def _on_membership(self, client: ClientRecord, msg: dict[str, Any]) -> None:
        """What ``commd.ft`` did about a lost rank (only the guard knows): kept for ``commd status`` and the
        metrics, logged and marked in the trace once per recovery (every survivor reports it)."""
        report = s.check_membership_report(msg, client.rank, client.world_size)
        _entry, new = self.stats.ft_event(client.rank, report)
        if not new:
            return
        event, epoch = report["event"], report["epoch"]
        self.log_limit.log(logging.WARNING if event == "gave_up" else logging.INFO, ("ft", client.client_id),
                           f"commd.ft reports from rank {client.rank}",
                           "commd.ft (rank %d): %s, epoch %d at step %d: ranks %s gone, %d ranks go on, %.2fs%s",
                           client.rank, event, epoch, report["step"], report["gone"], len(report["members"]),
                           report["seconds"], f" ({report['why']})" if "why" in report else "")
        tracer = self.state.tracer
        if tracer.on:
            tracer.instant(f"ft {event} epoch {epoch}", {**report, "reported_by": client.rank})

    def _on_ring_op(self, client: ClientRecord, msg: dict[str, Any]) -> None:
        """A rank of an exchange ring: an op failed there (``failed``: its number); of a bridged ring:
        every local rank published an op, or this rank left the ring."""
        group = s.field(msg, "g", str)
        if group not in client.groups:
            raise s.ProtocolError(f"rank {client.rank} has not registered group {group!r}")
        if "trace" in msg:
            try:
                records = check_ring_records(msg["trace"])
            except ValueError as exc:
                raise s.ProtocolError(f"ringop: {exc}") from None
            tracer, placement = self.state.tracer, self.placements.get(group)
            if tracer.on and placement is not None:  # (records sent as a trace stops are dropped)
                tracer.ring_ops(group, list(placement.local), records)
            return
        if "failed" in msg:
            code = s.field(msg, "code", str)
            if code not in RING_FAILURES:
                raise s.ProtocolError(f"ringop: a ring op's failure code must be one of {list(RING_FAILURES)}")
            self.completions.fail_numbered(self.scheduler, group, s.int_field(msg, "failed", 0), code,
                                           s.field(msg, "why", str)[:1024])
            return
        member = self.state.member
        if member is None:
            raise s.ProtocolError("ringop: this daemon has no fabric")
        if "left" in msg:
            number = s.int_field(msg, "n", 0) if "n" in msg else None
            member.bridges.left(group, client.rank, s.field(msg, "code", str), s.field(msg, "left", str)[:1024],
                                number)
        else:
            member.bridges.local_ready(group)
