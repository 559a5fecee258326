"""Registered storages on the daemon's side: admitting them, forgetting them, counting buffer paths.

A client moves an ordinary tensor storage it sees again (or a flat buffer others view) into a sealed memfd and registers it
like an arena segment (same descriptor checks in ``Segment.from_fd``), kind ``registered``:
ops then name it as ``{seg, off, n}`` and run in place, with no copy in or out.  Here:

- the registration's own rules: ids from ``schema.REGISTERED_SEG_BASE`` up, and the per-client
  cap on mapped registered bytes (``COMMD_MAX_REGISTERED_BYTES``);
- ``unregister``: the client forgets a storage (it died or was replaced); the message comes on
  the op channel after the ops that used it, so dropping the mapping here never pulls memory
  from under an accepted op — and one still pending is refused by name instead;
- ``count``: the bytes of every accepted op by how they arrived (registered, arena, staged,
  inline, cuda), per client and in total — how a user sees that nothing is staged any more.
"""

from __future__ import annotations

from typing import Any

from commd.core.ops import Submission
from commd.daemon.clients import ClientRecord
from commd.memory.arena import REGISTERED
from commd.observe.stats import Stats
from commd.protocol import schema as s

#: Answered ops are dropped from a client's ``registered_ops`` once it holds this many entries.
PURGE_AT = 256


class RegisteredSegments:
    """The daemon's rules for registered storage segments (one instance, on the event loop)."""

    def __init__(self, max_registered_bytes: int, stats: Stats) -> None:
        self.max_registered_bytes = max_registered_bytes
        self.stats = stats

    def check_registration(self, client: ClientRecord, seg_id: int, size: int) -> None:
        """Refuse a registration outside the registered id range or past the client's cap (counted)."""
        if not s.REGISTERED_SEG_BASE <= seg_id <= s.MAX_SEGMENT_ID:
            raise s.ProtocolError(f"registered segment id {seg_id} outside [{s.REGISTERED_SEG_BASE}, "
                                  f"{s.MAX_SEGMENT_ID}]")
        mapped = client.registered_bytes
        if mapped + size > self.max_registered_bytes:
            self.stats.limit_hit("max_registered_bytes")
            raise s.ProtocolError(
                f"rank {client.rank} has {mapped} bytes of registered tensors mapped; {size} more would pass "
                f"the limit of {self.max_registered_bytes} bytes per client (COMMD_MAX_REGISTERED_BYTES); "
                "the client stages this tensor instead",
                s.E_BOUNDS,
            )

    def unregister(self, client: ClientRecord, msg: dict[str, Any]) -> None:
        """Drop a registered segment's mapping; refuse an unknown one or one a pending op still uses."""
        seg_id = s.int_field(msg, "seg", 0, s.MAX_SEGMENT_ID)
        segment = client.segments.get(seg_id)
        if segment is None or segment.kind != REGISTERED:
            raise s.ProtocolError(f"rank {client.rank} unregisters segment {seg_id}, which is not a registered "
                                  "storage of this client", s.E_BOUNDS)
        users = self._pending_users(client, seg_id)
        if users:
            raise s.ProtocolError(
                f"rank {client.rank} unregisters segment {seg_id} while its pending op(s) {users[:8]} still use "
                "it; the mapping stays until the client leaves", s.E_BOUNDS)
        del client.segments[seg_id]
        # A running op's view keeps the mapping alive until it is done (as for a departed client).
        client.views.pop(seg_id, None)

    def _pending_users(self, client: ClientRecord, seg_id: int) -> list[int]:
        pending = client.pending.ops
        stale = [op_id for op_id in client.registered_ops if op_id not in pending]
        for op_id in stale:
            del client.registered_ops[op_id]
        return [op_id for op_id, segs in client.registered_ops.items() if seg_id in segs]

    def count(self, client: ClientRecord, sub: Submission) -> None:
        """Count an accepted op's buffers by path; remember which registered segments it uses."""
        used: tuple[int, ...] = ()
        for ref in sub.buffers.values():
            if ref.inline is not None:
                path = "inline"
            elif ref.cuda is not None:
                path = "cuda"
            elif ref.segment >= s.REGISTERED_SEG_BASE:
                path = "registered"
                used += (ref.segment,)
            elif ref.staged:
                path = "staged"
            else:
                path = "arena"
            client.bytes_by_path[path] = client.bytes_by_path.get(path, 0) + ref.nbytes
            self.stats.bytes_by_path[path] = self.stats.bytes_by_path.get(path, 0) + ref.nbytes
        if used:
            ops = client.registered_ops
            if len(ops) >= PURGE_AT and len(ops) >= 2 * len(client.pending.ops):
                for op_id in [op_id for op_id in ops if op_id not in client.pending.ops]:
                    del ops[op_id]
            ops[sub.op_id] = used

    @staticmethod
    def client_status(client: ClientRecord) -> dict[str, Any]:
        """The client's registered mappings and buffer paths, for ``commd status``."""
        registered = [seg for seg in client.segments.values() if seg.kind == REGISTERED]
        return {"registered_segments": len(registered), "registered_bytes": sum(seg.size for seg in registered),
                "bytes_by_path": dict(client.bytes_by_path)}
