"""The node daemon: the composition root (``node.Daemon``) and its parts — ingress, routing, completion, liveness."""
