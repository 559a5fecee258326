"""Exchange rings: one sealed memfd per group, handed to each local member that asks.

The ranks of a group that lives on this node only exchange small all-reduces in
this shared memory themselves (layout: ``protocol/fastring.py``); the daemon only
creates it, once per group, and gives its descriptor to the group's authenticated
members over the op socket (a short connection each, like a segment registration).
A group that spans nodes gets a *bridged* ring: one more line, the bridge's, played
by the fabric's ``RingBridges`` (``fabric/bridge.py``, driven by ``RINGOP`` messages on
the op channel) or, when the ranks ask for it, by the node's first rank of the group
(``client/ringbridge.py``: the reply then carries what that rank needs to connect).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from commd.core.placement import GroupPlacement
from commd.daemon.clients import ClientRegistry
from commd.daemon.opchannel import OpConnection
from commd.memory.arena import Segment
from commd.protocol import fastring as fr
from commd.protocol import schema as s
from commd.protocol.fdpass import send_with_fd

if TYPE_CHECKING:
    from commd.daemon.state import NodeState

log = logging.getLogger("commd.daemon")

#: All rings of the node together stay below this (a group is 17-20 MiB, a bridged one 2-11 MiB);
#: past it, groups keep the daemon path.
MAX_RING_BYTES = 256 << 20


class RingRegions:
    """The rings of this node's local groups, created on first request and kept while the daemon runs."""

    def __init__(self, clients: ClientRegistry, placements: dict[str, GroupPlacement], state: NodeState) -> None:
        self.clients = clients
        self.placements = placements
        self.state = state
        self.regions: dict[str, Segment] = {}
        #: a bridged ring's bridge line: played by the daemon or by the node's first rank of the group
        self.hosts: dict[str, str] = {}
        self.total_bytes = 0

    def grant(self, channel: OpConnection, msg: dict[str, Any]) -> None:
        """Answer a ``FASTRING`` request (secret already checked): ACK with the memfd, or a ProtocolError."""
        client = self.clients.find(s.int_field(msg, "client_id", 0))
        if client is None:
            raise s.ProtocolError("ring request names an unknown client id", s.E_AUTH)
        group = s.field(msg, "group", str)
        host = s.optional(msg, "bridge", str, "daemon")
        if host not in ("daemon", "rank"):
            raise s.ProtocolError(f"field 'bridge'={host!r}: the bridge line is played by 'daemon' or 'rank'")
        if group not in client.groups:
            raise s.ProtocolError(f"rank {client.rank} has not registered group {group!r}")
        placement = self.placements.get(group)
        member = self.state.member
        bridged = placement is not None and placement.multi_node
        nranks = (len(placement.local) + 1 if bridged else len(placement.ranks)) if placement is not None else 0
        if placement is None or not 2 <= nranks <= fr.MAX_RANKS + bridged or (bridged and member is None):
            raise s.ProtocolError(f"group {group!r} has no exchange ring (it needs 2..{fr.MAX_RANKS} ranks on "
                                  "this node, or a fabric when it spans nodes)")
        large = fr.large_bytes(nranks)
        if bridged:
            # A rank's bridge takes large ops, over its own connections.  The daemon's only ops of
            # one entry: its parts cross the control links and its loop, where a 128-512 KiB op
            # was slower than on the daemons' own path (docs/performance.md).  Every node of the
            # group takes the same ops: sized by its most crowded node.
            crowd = max(len(placement.members(n)) for n in placement.nodes)
            large = (fr.bridged_large_bytes(crowd, len(placement.nodes))
                     if self.hosts.get(group, host) == "rank" else fr.SLOT_BYTES)
        region = self.regions.get(group)
        if region is None:
            size = fr.region_bytes(nranks, fr.DEPTH, fr.SLOT_BYTES, fr.LARGE_DEPTH, large)
            if self.total_bytes + size > MAX_RING_BYTES:
                raise s.ProtocolError(f"no exchange ring for group {group!r}: the node's rings already hold "
                                      f"{self.total_bytes} bytes (at most {MAX_RING_BYTES})", s.E_LIMIT)
            try:
                region = Segment.create(0, f"commd-ring-{os.getpid()}", size)
            except (OSError, ValueError, MemoryError) as exc:
                raise s.ProtocolError(f"no exchange ring for group {group!r}: {exc}", s.E_LIMIT) from None
            self.total_bytes += size
            header = region.array[: fr.HEADER_BYTES].view("u8")
            header[0] = fr.MAGIC
            meta = region.array[8:36].view("u4")
            meta[:] = (fr.VERSION, nranks, fr.DEPTH, fr.SLOT_BYTES, fr.LARGE_DEPTH, large, int(bridged))
            region.array[fr.TRACING_U32 * 4: fr.TRACING_U32 * 4 + 4].view("u4")[0] = int(self.state.tracer.on)
            self.regions[group] = region
            if bridged:
                assert member is not None
                if host == "rank":
                    member.bridges.attach_hosted(group, region, placement, os.getpid())
                else:
                    member.bridges.attach(group, region, placement)
                self.hosts[group] = host
            log.debug("exchange ring for group %s: %d ranks, %d bytes", group, nranks, size)
        assert region.fd is not None
        line = placement.local.index(client.groups[group]) if bridged else client.groups[group]
        reply = {"t": s.ACK, "size": region.size, "nranks": nranks, "depth": fr.DEPTH,
                 "slot_bytes": fr.SLOT_BYTES, "large_depth": fr.LARGE_DEPTH, "large_bytes": large,
                 "rank": line, "bridged": bridged, "members": placement.local if bridged else None}
        if bridged:
            assert member is not None
            reply["bridge"] = self.hosts[group]
            if reply["bridge"] == "rank":
                reply.update(member.bridge_host_grant(group))
        send_with_fd(channel.sock, s.encode(reply), region.fd)

    def set_tracing(self, on: bool) -> None:
        """Tell every ring's ranks whether the daemon traces (they then send their ops' times)."""
        for region in self.regions.values():
            region.array[fr.TRACING_U32 * 4: fr.TRACING_U32 * 4 + 4].view("u4")[0] = int(on)

    def status(self) -> dict[str, Any]:
        """Per ring, how many all-reduces each group rank has published (they never reach the scheduler)."""
        rows = {}
        for group, region in self.regions.items():
            nranks = int(region.array[12:16].view("u4")[0])
            control = region.array[fr.CONTROL_OFFSET: fr.CONTROL_OFFSET + nranks * fr.CONTROL_BYTES].view("i8")
            posted = [int(x) for x in control.reshape(nranks, -1)[:, fr.POSTED]]
            rows[group] = {"ranks": nranks, "ops": min(posted), "posted": posted}
        return rows
