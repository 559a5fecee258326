"""The node daemon: builds its parts, runs them on one event loop (uvloop), shuts them down.

The parts, each in its own module: the control socket (``ingress``) and the op channel
(``opingress``) take messages in; ``router`` sends each accepted op local, to the fabric
member, matched or forwarded; the execution ``WorkerPool`` runs single-node ops;
``completion`` answers the ranks; ``watchdog`` watches liveness; ``status`` reports.
To the fabric member this object is a ``fabric.services.NodeServices`` and nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from commd.core.ops import ReadyOp, Submission
from commd.core.placement import GroupPlacement
from commd.daemon import notify
from commd.daemon.clients import BufferResolver, ClientRecord, ClientRegistry
from commd.daemon.completion import Completions
from commd.daemon.config import DaemonConfig
from commd.daemon.cuda import CudaImporter
from commd.daemon.failure_log import OpFailureLog
from commd.daemon.ingress import ControlIngress
from commd.daemon.limits import LimitGuard
from commd.daemon.loglimit import RateLimitedLog
from commd.daemon.opchannel import OpListener
from commd.daemon.opingress import OpIngress
from commd.daemon.router import OpRouter
from commd.daemon.state import NodeState
from commd.daemon.status import status_document
from commd.daemon.watchdog import Watchdog
from commd.execution.workers import WorkerPool
from commd.observe.hooks import DaemonObservers
from commd.observe.stats import Stats
from commd.observe.trace import NullTrace, Tracer
from commd.protocol import schema as s
from commd.runtime import MAX_SOCKET_PATH
from commd.scheduler.local import LocalScheduler

if TYPE_CHECKING:
    import numpy as np
    import torch

    from commd.fabric.member import FabricMember

__all__ = ["Daemon", "DaemonConfig"]

log = logging.getLogger("commd.daemon")


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.state = NodeState()
        self.stats = Stats()
        self.limits = LimitGuard(config.limits, self.stats.limit_hit)
        self.scheduler = LocalScheduler(self.stats)
        #: Every line a client can cause goes through this limiter (a bad client cannot flood the log).
        self.log_limit = RateLimitedLog(log)
        self.failures = OpFailureLog(self.log_limit, self._group_members)
        self.cuda = CudaImporter()
        self.clients = ClientRegistry()
        self.buffers = BufferResolver(self.clients, self.cuda)
        #: Where each registered group's ranks live, by group name.
        self.placements: dict[str, GroupPlacement] = {}
        self.completions = Completions(self.state, self.stats, self.failures, self.clients)
        self.workers = WorkerPool(after_queued=self.flush)
        self.router = OpRouter(self.state, self.scheduler, self.completions, self.buffers, self.cuda, self.stats,
                               self.workers)
        self.watchdog = Watchdog(config, self.state, self.clients, self.buffers, self.scheduler, self.completions,
                                 self.stats, self.limits, self.log_limit, self.shutdown, self.flush)
        self.op_ingress = OpIngress(config, self.state, self.clients, self.buffers, self.scheduler, self.placements,
                                    self.router, self.completions, self.limits, self.stats, self.log_limit)
        self._stopped: asyncio.Event | None = None  # created in run(), on the loop
        self.observers = DaemonObservers(self, config.metrics, config.trace)  # sets self.tracer
        self.control = ControlIngress(config, self.state, self.clients, self.scheduler, self.placements,
                                      self.cuda, self.stats, self.log_limit, self.observers, self.status,
                                      self.watchdog.drop_client, self._read_queued_ops)

    # ---- what the observers swap and read ------------------------------------------
    @property
    def tracer(self) -> Tracer | NullTrace:
        return self.state.tracer

    @tracer.setter
    def tracer(self, tracer: Tracer | NullTrace) -> None:
        self.state.tracer = tracer
        self.op_ingress.rings.set_tracing(tracer.on)  # the rings' ranks send their ops' times while on

    @property
    def fabric_member(self) -> FabricMember | None:
        return self.state.member

    # ---- lifecycle ----------------------------------------------------
    def bind(self) -> None:
        paths = self.config.paths.ensure()
        if paths.socket.exists():
            paths.socket.unlink()
        old_umask = os.umask(0o177)
        try:
            self.control.sock.bind(paths.endpoint)
        finally:
            os.umask(old_umask)
        os.chmod(paths.socket, 0o600)
        paths.write_secret(self.config.secret)
        paths.pid_file.write_text(str(os.getpid()))

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT or, if configured, until the job's last client left."""
        self.loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self.control.start(self.loop)
        self.ops = OpListener(
            self.config.paths.ops_socket, self.loop, self.op_ingress.on_message, self.watchdog.channel_closed,
            self.config.limits.max_reply_backlog, self.watchdog.channel_overflow,
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.shutdown, f"signal {signal.Signals(sig).name}")
        self.workers.start(self.loop)
        if self.config.fabric is not None:
            from commd.fabric.member import FabricMember

            self.state.member = FabricMember(self, self.config.fabric, self.config.peer_timeout)
            self.state.member.start(self.loop)
        self.observers.start(self.loop)
        watchdog = asyncio.ensure_future(self.watchdog.run())
        log.info("daemon for job %s listening on %s", self.config.paths.job, self.config.paths.endpoint)
        if self.config.paths.socket_dir != self.config.paths.directory:
            log.info("sockets in %s: a socket path in the job directory %s would pass the %d bytes a Unix socket "
                     "address holds", self.config.paths.socket_dir, self.config.paths.directory, MAX_SOCKET_PATH)
        self.clients.idle_since = time.monotonic()  # serving from now: the first client's grace starts here
        await self._stopped.wait()
        watchdog.cancel()
        self.workers.close(timeout=10)
        if self.state.member is not None:
            self.state.member.close(self.state.shutdown_reason)
        self.observers.close()
        self._cleanup()

    def shutdown(self, reason: str = "shutdown requested") -> None:
        """Stop accepting, fail everything in flight, then stop the loop."""
        if self.state.closing:
            return
        self.state.closing = True
        self.state.shutdown_reason = reason
        log.info("shutting down: %s", reason)
        notify.stopping(reason)
        message = f"daemon shutting down ({reason})"
        self.fail_each([(sub, message) for sub in self.scheduler.drain_all()], s.E_SHUTDOWN)
        # Queued ops are failed by the worker as it drains; wait for the running one.
        self.loop.create_task(self._finish_shutdown())

    async def _finish_shutdown(self) -> None:
        deadline = time.monotonic() + 10
        while self.workers.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.flush()
        self._stopped.set()

    def _cleanup(self) -> None:
        notice = s.encode({"t": s.ERROR, "code": s.E_SHUTDOWN, "message": "daemon shutting down", "id": -1})
        for client in self.clients:
            if client.op_channel is not None:
                client.op_channel.send(notice)  # tells the client the close that follows is orderly
        self.ops.close()
        self.control.close()
        paths = self.config.paths
        for path in (paths.socket, paths.pid_file, paths.secret_file):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        if paths.socket_dir != paths.directory:
            with contextlib.suppress(OSError):  # left if anything else is still in it
                paths.socket_dir.rmdir()
        for client in self.clients:
            self.buffers.release(client)
        log.info("daemon stopped")

    def _read_queued_ops(self, client: ClientRecord) -> None:
        """Handle what ``client``'s op channel holds unread (it said goodbye on the control socket)."""
        if client.op_channel is not None:
            self.ops.read_queued(client.op_channel)

    def flush(self) -> None:
        """Send what is queued for clients now (the control socket's read edge, see ``ControlIngress``)."""
        self.control.flush()

    def status(self) -> dict[str, Any]:
        document = status_document(self.config, self.state, self.stats, self.scheduler, self.clients, self.observers)
        document["rings"] = self.op_ingress.rings.status()  # local groups' small all-reduces (daemon/fastring.py)
        return document

    def _group_members(self, name: str) -> list[int] | None:
        group = self.scheduler.groups.get(name)
        return group.ranks if group is not None else None

    # ---- what the fabric member may use (fabric.services.NodeServices) ----------
    @property
    def closing(self) -> bool:
        return self.state.closing

    def resolve(self, sub: Submission, name: str) -> torch.Tensor:
        return self.buffers.resolve(sub, name)

    def resolve_array(self, sub: Submission, name: str) -> np.ndarray:
        return self.buffers.resolve_array(sub, name)

    def group_size(self, name: str) -> int | None:
        group = self.scheduler.groups.get(name)
        return len(group.ranks) if group is not None else None

    def match(self, sub: Submission) -> ReadyOp | None:
        return self.router.match(sub)

    def waiting_summary(self) -> list[dict[str, Any]]:
        return self.scheduler.waiting_summary()

    def complete(self, op: ReadyOp, error: str | None, code: str | None = None) -> None:
        self.completions.complete(op, error, code)

    def fail_op(self, subs: Sequence[Submission], code: str, message: str) -> None:
        self.completions.fail_op(subs, code, message)

    def fail_each(self, failed: Sequence[tuple[Submission, str]], code: str) -> None:
        self.completions.fail_each(failed, code)

    def fail_seq(self, group: str, seq: int, code: str, message: str) -> None:
        self.completions.fail_numbered(self.scheduler, group, seq, code, message)

    def fail_ops_waiting_on(self, rank: int, why: str) -> None:
        self.watchdog.fail_ops_waiting_on(rank, why)

    def fail_ops_of_node(self, node: int, message: str) -> None:
        node_of = self.clients.placement or []
        for rank in (r for r, n in enumerate(node_of) if n == node):
            self.watchdog.fail_ops_waiting_on(rank, f"is gone with its node: {message}")

    def apply_trace(self, action: str, path: str | None) -> None:
        self.observers.apply_forwarded(action, path)
