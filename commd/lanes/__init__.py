"""Inter-node lanes: one per backend (tcp, gloo, mpi, nccl).

A lane moves bytes among the *daemons* of a job (one per node); the local
phases (all ranks of a node into one buffer and back) happen in the daemon
around each lane call.  Every lane implements :class:`commd.lanes.base.Lane`.
"""
