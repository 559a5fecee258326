"""What every part of the node daemon reads and few change: closing, the tracer, the fabric member.

One small object passed to each part (ingress, router, completions, watchdog) instead of
the whole daemon, so no part reaches into another's internals to learn these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from commd.observe.trace import NullTrace, Tracer

if TYPE_CHECKING:
    from commd.fabric.member import FabricMember


@dataclass
class NodeState:
    #: True once shutdown started: no new ops, queued ones fail instead of running.
    closing: bool = False
    shutdown_reason: str = "shut down"
    #: A ``Tracer`` while a trace is on, else a ``NullTrace`` (one attribute test per op when off).
    tracer: Tracer | NullTrace = field(default_factory=NullTrace)
    #: This node's part in a multi-node fabric (None: single node).
    member: FabricMember | None = None
