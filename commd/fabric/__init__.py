"""The daemons of one job joined into a fabric: rendezvous, lanes, control channel, membership.

``rendezvous.establish`` runs once when a multi-node daemon starts; it ends
with every daemon knowing every other (name, address, lanes), the data lanes
connected, and each daemon's authenticated control channel to the
coordinator (node 0) open: length-prefixed msgpack frames on a plain TCP
socket driven by the daemon's event loop (``channel.py``; not ZeroMQ, whose
I/O threads cost a wake-up per message on the critical path).
``member.FabricMember`` is then the daemon's part in the fabric (its parts:
``collectives``, ``p2p``, ``liveness``, ``runner``); it reaches its node only
through ``services.NodeServices``.
"""
