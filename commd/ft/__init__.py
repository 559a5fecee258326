"""commd.ft: a training loop (DDP, or FSDP2 as HSDP) that goes on when a rank dies, and takes a replacement back in.

A :class:`Guard` runs each training step in three parts: the user's forward and backward,
a *commit* (one tiny all-reduce: every rank of the group got through its backward), then
the optimizer step.  A rank that dies before the commit fails the step on every survivor
before any of them has stepped its optimizer, so the survivors still hold the same
parameters and optimizer state.  The guard then:

1. reads from its node daemon which ranks are gone (``commd status``'s ``membership``:
   each daemon hears of a dead rank within ~0.1 s, of a dead node within the peer timeout);
2. builds a group of the survivors (``new_group(..., use_local_synchronization=True)``:
   only they take part) and checks that every survivor saw the same losses (one MAX
   all-reduce of the gone ranks; a survivor that saw more makes all of them go again
   without those ranks, so a second failure during recovery converges or runs out of time);
3. wraps the same module in DDP on the new group (which broadcasts the lowest survivor's
   parameters) and checks that the optimizer states agree; then redoes the failed step.

A *replacement*, the same rank started again (``commd launch --max-restarts``), finds in the
job's store that the job went on without it, asks to be taken in, and waits.  The survivors
see the request in a commit (the lowest survivor reads the store; the commit's MAX tells the
others), finish that step, and at its end build a group with the replacement, send it the
model and optimizer state (broadcasts through the daemons, no checkpoint), and go on at the
full size.

Anything the guard cannot carry the job past (this rank not among the survivors, too few
left, the survivors disagreeing past the deadline, the job's store gone with the failed
rank) raises :class:`UnrecoverableError` on every survivor.  Only peer deaths
(:class:`PeerDiedError`, also inside DDP's errors) are recovered; any other error of the
step propagates unchanged.
"""

from commd.client.errors import UnrecoverableError
from commd.ft.ddp import Guard
from commd.ft.hsdp import ShardedGuard
from commd.ft.seats import Join, Recovery, is_peer_failure

__all__ = ["Guard", "Join", "Recovery", "ShardedGuard", "UnrecoverableError", "is_peer_failure"]
