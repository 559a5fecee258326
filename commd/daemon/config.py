"""The node daemon's settings, as ``commd daemon`` resolves them from flags, environment and config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from commd.daemon.limits import ClientLimits
from commd.observe.settings import MetricsSettings
from commd.runtime import JobPaths
from commd.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from commd.fabric.rendezvous import Fabric


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
    #: Bytes of registered storages (ordinary tensors moved into memfds) one client may have mapped here:
    #: they pin the client's memory in the daemon until unregistered; 0 turns registration off.
    max_registered_bytes: int = 1 << 40
    node_name: str = "localhost"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fabric: Fabric | None = None
    peer_timeout: float = 10.0
    limits: ClientLimits = field(default_factory=ClientLimits)
    metrics: MetricsSettings | None = None  # None: no metrics endpoint or textfile
    trace: str | None = None  # trace every op into this file from the start

    @property
    def node_rank(self) -> int:
        """This node's rank in the fabric (0 on a single node)."""
        return self.fabric.node_rank if self.fabric is not None else 0
