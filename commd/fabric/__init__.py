"""The daemons of one job joined into a fabric: rendezvous, lanes, control link.

``rendezvous.establish`` runs once when a multi-node daemon starts; it ends
with every daemon knowing every other (name, address, lanes), the data lanes
connected, and each daemon's authenticated ZeroMQ control link to the
coordinator (node 0) open.
"""
