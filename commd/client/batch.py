"""Ops held back to travel together: a coalesced batch's packed op maps, cut into op-channel messages.

Between ``Client.hold(group)`` and ``Client.release(group)`` each op of the group is built,
numbered and pending as usual, but its packed map waits here; the held maps leave as one
``ops`` message (``protocol/schema.py``), a new message only where one would pass the
message limits (``MAX_MESSAGE_BYTES``, ``MAX_BATCH_OPS``).  One message instead of one per
op: the daemon wakes, decodes and checks once for the batch.
"""

from __future__ import annotations

from commd.client.handle import Handle
from commd.protocol import schema as s


class HeldOps:
    """One group's held ops: the packed maps not yet sent, and every handle held since ``hold``."""

    __slots__ = ("frames", "nbytes", "handles", "unsent")

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.nbytes = s.BATCH_OVERHEAD_BYTES
        #: every op held since the group's hold, sent or not (what its batch's Work covers)
        self.handles: list[Handle] = []
        #: the ops whose maps are in ``frames``
        self.unsent: list[Handle] = []

    def full_with(self, frame: bytes) -> bool:
        """Whether ``frame`` would push the held ops past one message's limits (send them first)."""
        return bool(self.frames) and (
            len(self.frames) >= s.MAX_BATCH_OPS or self.nbytes + len(frame) > s.MAX_MESSAGE_BYTES
        )

    def add(self, frame: bytes, handle: Handle) -> None:
        self.frames.append(frame)
        self.nbytes += len(frame)
        self.handles.append(handle)
        self.unsent.append(handle)

    def take(self) -> tuple[bytes, list[Handle]] | None:
        """The unsent ops as one message (a lone op as the plain ``op`` it is) and their handles, or
        None when nothing is unsent; from now on they count as sent."""
        if not self.frames:
            return None
        frames, unsent = self.frames, self.unsent
        self.frames, self.unsent, self.nbytes = [], [], s.BATCH_OVERHEAD_BYTES
        return (frames[0] if len(frames) == 1 else s.encode_op_batch(frames)), unsent
