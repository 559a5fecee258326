"""Liveness: dead or departed clients, op timeouts, stalls, the idle exit — checked every 100 ms.

A client is gone when its pid is (checked every period), when its op channel closes and
its pid vanishes soon after, or when it stops reading its replies.  Whatever waited for a
gone rank fails with ``peer_died`` naming it, here and (through the fabric) on other nodes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from commd.daemon.clients import BufferResolver, ClientRecord, ClientRegistry
from commd.daemon.completion import Completions
from commd.daemon.config import DaemonConfig
from commd.daemon.limits import REPLY_BACKLOG, LimitGuard
from commd.daemon.loglimit import RateLimitedLog
from commd.daemon.opchannel import OpConnection
from commd.daemon.state import NodeState
from commd.observe.stalls import StallInspector
from commd.observe.stats import Stats
from commd.protocol import schema as s
from commd.runtime import pid_alive
from commd.scheduler.local import LocalScheduler

log = logging.getLogger("commd.daemon")

WATCHDOG_PERIOD_S = 0.1
#: After a client's op channel closes, how long to wait for its pid to vanish
#: before reporting it as disconnected rather than dead.
DISCONNECT_VERDICT_S = 1.0
#: Local stalls are looked for at most this often.
STALL_SCAN_S = 1.0


class Watchdog:
    def __init__(self, config: DaemonConfig, state: NodeState, clients: ClientRegistry, buffers: BufferResolver,
                 scheduler: LocalScheduler, completions: Completions, stats: Stats, limits: LimitGuard,
                 log_limit: RateLimitedLog, shutdown: Callable[[str], None], flush: Callable[[], None]) -> None:
        self.config = config
        self.state = state
        self.clients = clients
        self.buffers = buffers
        self.scheduler = scheduler
        self.completions = completions
        self.stats = stats
        self.limits = limits
        self.log_limit = log_limit
        self._shutdown = shutdown
        self._flush = flush
        self.stalls = StallInspector(config.scheduler.stall_warning_s, config.scheduler.stall_shutdown_s, log)
        self._last_stall_scan = 0.0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            try:
                self.check_clients()
                now = time.monotonic()
                self.completions.fail_each(self.scheduler.expire(now), s.E_TIMEOUT)
                if self.state.member is not None:
                    self.state.member.tick(now)
                self._inspect_stalls(now)
                self._check_idle()
                self.log_limit.flush()
                self._flush()
            except Exception:
                log.exception("watchdog failed")

    # ---- clients --------------------------------------------------------------------
    def check_clients(self) -> None:
        for client in self.clients:
            if not pid_alive(client.pid):
                self.drop_client(client, f"(pid {client.pid}) died", notify_peers=True)

    def drop_client(self, client: ClientRecord, why: str, notify_peers: bool, clean: bool = False) -> None:
        """``clean``: the rank said goodbye (a departure, not an error; ops it leaves behind still fail).

        A local rank whose process is gone is dropped first: a rank often leaves or fails because
        its exchange ring saw a node-mate's pid die (a dying process's fds, its connections with
        them, can close tens of ms after its pid reads dead), and the other nodes must hear of that
        death before the departure it caused, or their ranks' errors name the wrong rank."""
        if not self.clients.current(client):
            return  # (dropped already: as a dead node-mate of a rank dropped before it)
        if notify_peers:
            for other in list(self.clients):
                if other is not client and not pid_alive(other.pid):
                    self._drop(other, f"(pid {other.pid}) died", notify_peers=True)
        self._drop(client, why, notify_peers, clean)

    def _drop(self, client: ClientRecord, why: str, notify_peers: bool, clean: bool = False) -> None:
        log.info("client rank %d %s", client.rank, why)
        if clean:
            self.stats.departed(f"rank {client.rank} {why}")
        else:
            self.stats.error(f"rank {client.rank} {why}")
        self.clients.remove(client)
        if client.op_channel is not None:
            client.op_channel.close()
            client.op_channel = None
        if notify_peers:
            self.fail_ops_waiting_on(client.rank, why)
            if self.state.member is not None:
                self.state.member.rank_died(client.rank, why)
        self.buffers.release(client)
        self.limits.forget(client.rank)
        self.scheduler.forget_client_groups(self.clients.ranks())

    def fail_ops_waiting_on(self, rank: int, why: str) -> None:
        """Rank ``rank`` (of this node or another) is gone: fail what waits for it here."""
        if rank not in self.stats.gone_ranks and self.state.tracer.on:
            self.state.tracer.instant(f"rank {rank} gone", {"rank": rank, "why": why,
                                                             "epoch": self.stats.membership_epoch + 1})
        self.stats.rank_gone(rank, why)
        self.completions.fail_each(self.scheduler.rank_died(rank, why), s.E_PEER_DIED)
        if self.state.member is not None:  # and the bridged rings of its groups
            self.state.member.bridges.rank_died(rank, why)

    def channel_closed(self, channel: OpConnection) -> None:
        client = channel.client
        if client is None or not self.clients.current(client):
            return
        client.op_channel = None
        self._judge_disconnect(client, time.monotonic() + DISCONNECT_VERDICT_S)

    def channel_overflow(self, channel: OpConnection) -> None:
        """The client left more replies unread than the limit allows: drop it as if it had died."""
        client = channel.client
        if client is None or not self.clients.current(client):
            return
        client.op_channel = None
        why = (f"(pid {client.pid}) stopped reading replies ({channel.overflowed_at} bytes unread on its op "
               f"channel, limit {channel.max_backlog}: --max-reply-backlog)")
        self.limits.hit(REPLY_BACKLOG, client.rank, f"rank {client.rank} {why}")
        self.drop_client(client, why, notify_peers=True)
        self._flush()

    def _judge_disconnect(self, client: ClientRecord, deadline: float) -> None:
        """A closed op channel usually means the process is dying: give it a moment to be gone."""
        if not self.clients.current(client):
            return
        if not pid_alive(client.pid):
            self.drop_client(client, f"(pid {client.pid}) died", notify_peers=True)
        elif time.monotonic() >= deadline:
            self.drop_client(client, f"(pid {client.pid}) closed its op channel", notify_peers=True)
        else:
            asyncio.get_running_loop().call_later(0.01, self._judge_disconnect, client, deadline)
            return
        self._flush()

    # ---- stalls and idleness ----------------------------------------------------------
    def _inspect_stalls(self, now: float) -> None:
        """Log ops waiting longer than the stall threshold (once each); optionally shut down."""
        if now - self._last_stall_scan < STALL_SCAN_S:
            return
        self._last_stall_scan = now
        why = self.stalls.inspect(self.scheduler.waiting_summary(), may_shut_down=self.state.member is None)
        if why is not None:
            self._shutdown(why)

    def _check_idle(self) -> None:
        config = self.config
        if config.owner_pid is not None and not pid_alive(config.owner_pid):
            self._shutdown(f"its owner (pid {config.owner_pid}) is gone")
            return
        if not config.exit_when_idle or len(self.clients):
            return
        idle = time.monotonic() - self.clients.idle_since
        if self.clients.had_clients and idle >= config.idle_grace:
            self._shutdown("the job's last client left")
        elif not self.clients.had_clients and idle >= config.first_client_grace:
            self._shutdown(f"no client connected within {config.first_client_grace:g}s of the start")
