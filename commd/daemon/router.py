"""Where an accepted op goes: the one place that sends it local, to negotiation, matched, or forwarded.

A single-node op runs on the node's local worker (inline on the loop when the worker is
idle and the op small); a multi-node collective is negotiated by the fabric member; a
send to a rank on another node is forwarded; a forwarded send that met its local recv
is handed back to the member to be ordered.
"""

from __future__ import annotations

import logging

from commd.core.ops import MatchError, ReadyOp, Submission
from commd.core.placement import GroupPlacement
from commd.daemon.clients import BufferResolver
from commd.daemon.completion import Completions
from commd.daemon.cuda import CudaImporter
from commd.daemon.state import NodeState
from commd.execution import torch_loader
from commd.execution.small import execute_small, runs_on_numpy
from commd.execution.workers import LOCAL_KEY, WorkerPool
from commd.observe.stats import Stats
from commd.scheduler.local import LocalScheduler

log = logging.getLogger("commd.daemon")


class OpRouter:
    def __init__(self, state: NodeState, scheduler: LocalScheduler, completions: Completions,
                 buffers: BufferResolver, cuda: CudaImporter, stats: Stats, workers: WorkerPool) -> None:
        self.state = state
        self.scheduler = scheduler
        self.completions = completions
        self.buffers = buffers
        self.cuda = cuda
        self.stats = stats
        self.workers = workers

    def route(self, sub: Submission, placement: GroupPlacement | None) -> None:
        """Send an accepted submission on its way (its group's ``placement``; None: not yet known)."""
        member = self.state.member
        multi_node = placement is not None and placement.multi_node and member is not None
        if multi_node and sub.kind == "send" and placement.node_of[sub.peer] != placement.me:
            member.forward_send(sub, placement)
            return
        ready = self.match(sub)
        if ready is None:
            return
        if not multi_node:
            self.run_local(ready)
        elif ready.kind != "sendrecv":
            member.negotiate(ready, placement)
        elif ready.subs[0].origin >= 0:
            member.matched(ready)
        else:
            self.run_local(ready)

    def match(self, sub: Submission) -> ReadyOp | None:
        """Local matching; a mismatch fails the op to every rank it names (the one place that does)."""
        try:
            return self.scheduler.submit(sub)
        except MatchError as exc:
            self.completions.fail_op(exc.subs, exc.code, str(exc))
            return None

    def run_local(self, op: ReadyOp) -> None:
        """Run a matched single-node op on the local worker, in the order ops became ready."""
        # An op that needs torch before it is loaded goes to the thread: the loop never waits for the import.
        run_now = self.workers.submit(
            LOCAL_KEY, None, op.nbytes, lambda inline: self._job(op, inline),
            lambda error: self.completions.complete(op, error),
            may_inline=torch_loader.loaded() or runs_on_numpy(op),
        )
        if run_now is not None:
            run_now()
        else:
            self.stats.queued(op.group)

    def _job(self, op: ReadyOp, inline: bool) -> str | None:
        if inline:
            self.stats.started(op.group, queued=False)
        elif self.state.closing:
            return "daemon shutting down before the op could run"
        else:
            self.workers.loop.call_soon_threadsafe(self.stats.started, op.group)
        tracer = self.state.tracer
        if tracer.on:
            return tracer.timed_run(op, self._execute)
        return self._execute(op)

    def _execute(self, op: ReadyOp) -> str | None:
        try:
            if op.on_gpu:
                device = next(b.cuda.device for x in op.subs for b in x.buffers.values() if b.cuda is not None)
                with torch_loader.torch_module().cuda.stream(self.cuda.stream(device)):
                    torch_loader.executor().execute(op, self.buffers.resolve)
                self.cuda.synchronize()  # results are visible to the clients when we answer
            elif not execute_small(op, self.buffers.resolve_array):
                torch_loader.executor().execute(op, self.buffers.resolve)
            return None
        except Exception as exc:
            log.exception("executing %s failed", op.describe())
            return f"{op.describe()} failed in the daemon: {exc}"
