"""Running a released multi-node op: on its lane's worker thread (or inline), then completing it.

Collectives and cross-node send/recv are released by the coordinator the same way
and run the same way: queued on ``execution.workers.WorkerPool`` under their lane's
worker key (program order per group), their buffers resolved through the node (a
rank that died after release gets a stand-in so the lanes stay in step), errors
turned into one completion for the op's local ranks.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from commd.core.ops import ReadyOp, Submission
from commd.execution.hierarchy import scratch_like
from commd.execution.workers import INLINE_BYTES, WorkerPool, worker_key
from commd.lanes.base import LaneError
from commd.protocol import schema as s
from commd.runtime import env_float, env_int

if TYPE_CHECKING:
    from commd.fabric.services import NodeServices

log = logging.getLogger("commd.fabric")


class LaneRunner:
    """Queues released work on the worker pool and reports its outcome to the node."""

    def __init__(self, node: NodeServices, workers: WorkerPool, peer_timeout: float,
                 unreachable: Callable[[Sequence[int]], str | None] = lambda nodes: None) -> None:
        self.node = node
        self.workers = workers
        self.peer_timeout = peer_timeout
        #: The fabric's verdict on a set of nodes (``Liveness.unreachable``): why an op on them cannot run.
        self.unreachable = unreachable
        #: Testing knob: random delays before lane ops (the deadlock stress test sets it).
        self.chaos_delay_s = env_float("COMMD_CHAOS_DELAY_MS", 0.0, 0.0, 10_000.0) / 1000
        self.chaos_seed = env_int("COMMD_CHAOS_SEED", 0)
        self._chaos = threading.local()

    def enqueue(self, lane_name: str, on_gpu: bool, group: str, work: Callable[[float], None],
                done: Callable[[str | None, str], None], nbytes: int,
                inline_bytes: int = INLINE_BYTES) -> Callable[[], None] | None:
        """Queue the op on its lane's worker, or return it to be run right now on the loop
        (when its worker is idle, its group's previous op done, and it is at most ``inline_bytes``)."""

        def job(inline: bool) -> tuple[str | None, str]:
            # On the loop, a peer that stopped answering may hold it for at most the peer
            # timeout (after which that peer counts as dead anyway), not the op timeout.
            return self._run_work(work, self.peer_timeout if inline else float("inf"))

        return self.workers.submit(worker_key(lane_name, on_gpu), group, nbytes, job,
                                   lambda result: done(*result), may_inline=not on_gpu, inline_bytes=inline_bytes)

    def _run_work(self, work: Callable[[float], None], cap: float) -> tuple[str | None, str]:
        if self.chaos_delay_s:
            chaos = getattr(self._chaos, "rng", None)
            if chaos is None:
                chaos = self._chaos.rng = random.Random(self.chaos_seed + threading.get_ident())
            if chaos.random() < 0.3:
                time.sleep(chaos.random() * self.chaos_delay_s)
        try:
            if self.node.closing:
                return "daemon shutting down before the op could run", s.E_SHUTDOWN
            work(cap)
            return None, s.E_INTERNAL
        except LaneError as exc:
            return str(exc), exc.code
        except Exception as exc:
            log.exception("inter-node op failed")
            return f"inter-node phase failed: {exc}", s.E_INTERNAL

    def resolver(self, as_array: bool = False) -> Callable[[Submission, str], Any]:
        """Buffers of released ops (torch tensors, or NumPy arrays), with a stand-in for a rank that died."""
        find = self.node.resolve_array if as_array else self.node.resolve

        def resolve(sub: Submission, name: str) -> Any:
            try:
                return find(sub, name)
            except KeyError:  # the rank died after release: keep the lanes in step
                scratch = scratch_like(sub, name)
                return scratch.numpy() if as_array else scratch

        return resolve

    def done(self, op: ReadyOp, error: str | None, code: str, nodes: Sequence[int] = ()) -> None:
        """Complete ``op`` (run among ``nodes``).  A lane timeout on a node the fabric has declared dead
        meanwhile is that node's death: a lane without a way to be told (gloo, MPI) waits out its
        timeout on a silent node, and a timeout is not what the ranks must recover from."""
        if error is not None:
            verdict = self.unreachable(nodes) if code == s.E_TIMEOUT and nodes else None
            if verdict is not None:
                error, code = f"{error} ({verdict})", s.E_PEER_DIED
            error = f"{op.describe()} failed between nodes: {error}"
        self.node.complete(op, error, code)
        self.node.flush()
