"""What a fabric member needs from the node daemon that hosts it — and nothing more.

The member (``fabric/member.py``) negotiates, releases and runs multi-node ops, but the
clients, their buffers and the reply path belong to the node.  This protocol is the only
way the member reaches them, so the member never sees the daemon and the daemon's
internals can change without touching the fabric.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from commd.core.ops import ReadyOp, Submission
    from commd.observe.stats import Stats
    from commd.observe.trace import NullTrace, Tracer


class NodeServices(Protocol):
    """The node daemon as a fabric member sees it (implemented by ``daemon.node.Daemon``)."""

    stats: Stats
    tracer: Tracer | NullTrace

    @property
    def closing(self) -> bool:
        """True once the node is shutting down: queued work fails instead of running."""

    def resolve(self, sub: Submission, name: str) -> torch.Tensor:
        """A submission's buffer as a tensor (KeyError: its rank is gone)."""

    def resolve_array(self, sub: Submission, name: str) -> np.ndarray:
        """A CPU submission's buffer as a NumPy array (KeyError: its rank is gone)."""

    def group_size(self, name: str) -> int | None:
        """The size of a group some local rank registered, None if none has yet."""

    def match(self, sub: Submission) -> ReadyOp | None:
        """Hand a forwarded send to local matching; None: it waits, or it mismatched and was failed."""

    def waiting_summary(self) -> list[dict[str, Any]]:
        """Ops this node's ranks have partly submitted, oldest first."""

    def complete(self, op: ReadyOp, error: str | None, code: str | None = None) -> None:
        """Answer the op's local ranks: done, or failed with ``error``."""

    def fail_op(self, subs: Sequence[Submission], code: str, message: str) -> None:
        """Fail one op to each of its submissions' ranks (logged and counted once)."""

    def fail_seq(self, group: str, seq: int, code: str, message: str) -> None:
        """Collective ``seq`` of ``group`` failed off the daemon's path (a bridged ring): a local rank's
        op of that number, waiting or late, fails with ``message`` (as the daemon fails a timed-out op's)."""

    def fail_ops_waiting_on(self, rank: int, why: str) -> None:
        """A rank is gone: fail what waits for it on this node."""

    def fail_ops_of_node(self, node: int, message: str) -> None:
        """Node ``node`` is dead: each of its ranks is gone (``fail_ops_waiting_on``), so an op of a group
        spanning it that still waits for a local rank fails too, instead of waiting out its timeout."""

    def apply_trace(self, action: str, path: str | None) -> None:
        """A trace start/stop forwarded by the coordinator."""

    def shutdown(self, reason: str) -> None:
        """Stop the node (the coordinator shut the fabric down)."""

    def flush(self) -> None:
        """Send what is queued for clients now (called after handling fabric traffic)."""
