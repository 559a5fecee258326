"""commd's own TCP lane (see :mod:`commd.lanes.tcp.lane`), and its reusable byte transport.

``transport``: the mesh of sockets and its progress engine (``Mesh``, ``Peer``,
``Exchange``, a :class:`~commd.lanes.base.Transport`); ``handshake``: connection
set-up and authentication; ``algorithms``: the collectives over any Transport;
``lane``: :class:`TcpLane`, the Lane the daemon uses.
"""

from commd.lanes.tcp.lane import MIN_CHUNK_BYTES, SMALL_ALLREDUCE_BYTES, SMALL_BROADCAST_BYTES, TcpLane
from commd.lanes.tcp.transport import Exchange, Mesh, Peer

__all__ = ["MIN_CHUNK_BYTES", "SMALL_ALLREDUCE_BYTES", "SMALL_BROADCAST_BYTES", "Exchange", "Mesh", "Peer",
           "TcpLane"]
