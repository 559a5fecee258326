"""Answering ops: DONE or ERROR to every rank of an op, each failure logged and counted once.

Every way an op ends goes through here (``complete``, ``fail_op``, ``fail_each``), so an
error always reaches every rank of the op, lands in ``commd status``'s last errors and
leaves one line in the log.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Any

from commd.core.ops import ReadyOp, Submission
from commd.daemon.clients import ClientRecord, ClientRegistry
from commd.daemon.failure_log import OpFailureLog
from commd.daemon.state import NodeState
from commd.observe.stats import Stats
from commd.protocol import schema as s
from commd.scheduler.local import LocalScheduler

#: How many told ring failures ``Completions`` remembers (each is logged once).
TOLD_KEPT = 1024


class Completions:
    def __init__(self, state: NodeState, stats: Stats, failures: OpFailureLog, clients: ClientRegistry) -> None:
        self.state = state
        self.stats = stats
        self.failures = failures
        self.clients = clients
        #: (group, seq) of ring ops whose failure a rank told (``fail_numbered``), the latest first
        self._told: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()

    def reply(self, client: ClientRecord, message: dict[str, Any]) -> None:
        """Answer an op on the client's op channel (a client without one has no op in flight)."""
        if client.op_channel is not None:
            client.op_channel.reply(message)

    def complete(self, op: ReadyOp, error: str | None, code: str | None = None) -> None:
        """The op ran (``error`` None) or failed: answer each of its local ranks."""
        tracer = self.state.tracer
        if tracer.on:
            tracer.op_done(op, error)
        self.stats.finished(op.group, op.kind, op.nbytes, time.monotonic() - op.first_at, error is None, op.lane,
                            op.algo, op.codec)
        if error is not None:
            code = s.E_SHUTDOWN if self.state.closing else (code or s.E_INTERNAL)
            self.fail_op(op.subs, code, error)
            return
        by_id = self.clients.by_id
        for sub in op.subs:
            client = by_id.get(sub.client_id)
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
            self.reply(client, reply)

    def fail_op(self, subs: Sequence[Submission], code: str, message: str) -> None:
        """Fail one op: a line in the log, an entry in 'last errors', the error to each submission's rank."""
        self.stats.error(message)
        self.failures.record(code, message, subs)
        for sub in subs:
            self._send_error(sub, code, message)

    def fail_numbered(self, scheduler: LocalScheduler, group: str, seq: int, code: str, message: str) -> None:
        """All-reduce ``seq`` of ``group`` failed off the daemon's path (an exchange ring): the log has
        its line, once, as for an op the daemon ran; a timeout is remembered by the scheduler (a late
        rank's op of that number fails on arrival, one already waiting fails now).  A disagreement is
        not: the ranks that sent the op to the daemon meet the ring ranks' op there, and the daemons
        name the fields."""
        key = (group, seq)
        if key in self._told or group not in scheduler.groups:
            return  # another rank told first
        self._told[key] = None
        while len(self._told) > TOLD_KEPT:
            self._told.popitem(last=False)
        subs = scheduler.fail_seq(group, seq, message, code) if code == s.E_TIMEOUT else []
        if subs is None:
            return  # the daemon failed it itself (and wrote its line)
        self.stats.error(message)
        self.failures.record_op(code, message, group, f"allreduce #{seq} on group '{group}'",
                                scheduler.groups[group].local)
        for sub in subs:
            self._send_error(sub, code, message)

    def fail_each(self, failed: Sequence[tuple[Submission, str]], code: str) -> None:
        """Fail (submission, message) pairs, grouped into ops (same group, sequence and message)."""
        ops: dict[tuple[str, int, str, bool], list[Submission]] = {}
        for sub, message in failed:
            ops.setdefault((sub.group, sub.seq, message, sub.kind in ("send", "recv")), []).append(sub)
        for (_group, _seq, message, _p2p), subs in ops.items():
            self.fail_op(subs, code, message)

    def _send_error(self, sub: Submission, code: str, message: str) -> None:
        if sub.origin >= 0:  # a send forwarded from another node: the error goes back there
            if self.state.member is not None:
                self.state.member.fail_remote(sub, code, message)
            return
        client = self.clients.by_id.get(sub.client_id)
        if client is not None:
            client.pending.release(sub.op_id)
            self.stats.error_reply(code)
            self.reply(client, {"t": s.ERROR, "code": code, "message": message, "id": sub.op_id})
