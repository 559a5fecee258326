"""commd.ft: a DDP training loop that goes on when a rank dies, on the survivors, without a restart.

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

DDP then averages gradients over the survivors.  Anything it cannot carry the job past
(this rank not among the survivors, too few left, the survivors disagreeing past the
deadline, the job's store gone with the failed rank) raises :class:`UnrecoverableError`
on every survivor.  Only peer deaths (:class:`PeerDiedError`, also inside DDP's errors)
are recovered; any other error of the step propagates unchanged.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commd.client.errors import CommdError, PeerDiedError, UnrecoverableError
from commd.client.status import StatusError, query_status
from commd.torch_backend.process_group import current_client

log = logging.getLogger("commd.ft")

#: How long a recovery may take, by default, before it gives up (UnrecoverableError).
RECOVER_TIMEOUT_S = 60.0
#: How long one attempt to build the survivors' group may wait for them (then it goes again).
ATTEMPT_TIMEOUT_S = 15.0
#: How often the guard reads its daemon's view while waiting to learn which rank is gone.
POLL_S = 0.02


@dataclass(frozen=True)
class Recovery:
    """One failure the guard carried the job past."""

    epoch: int  # 1 for the first recovery
    step: int  # the guard's step number that was redone
    gone: tuple[int, ...]  # global ranks lost at this recovery
    survivors: tuple[int, ...]  # the group's global ranks from now on
    seconds: float  # from the failure reaching this rank to the rebuilt group
    error: str  # what the step raised
    failed_at: float  # when the failure reached this rank (time.time(), to compare across processes)


def is_peer_failure(exc: BaseException) -> bool:
    """A rank of the op died or left: the failure a guard recovers from (DDP wraps the backend's
    error in a RuntimeError that names it)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, PeerDiedError) or "PeerDiedError" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


class Guard:
    """Runs training steps of a DDP model so that the survivors go on when a rank dies.

    ``model``: a ``DistributedDataParallel`` on a ``commd`` group; ``ddp_kwargs``: what it was
    built with (the guard builds it again on the survivors); ``min_ranks``: fewer survivors
    than this is unrecoverable.
    """

    def __init__(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer, *,
                 ddp_kwargs: dict[str, Any] | None = None, min_ranks: int = 1,
                 recover_timeout: float = RECOVER_TIMEOUT_S) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"commd.ft.Guard needs a DistributedDataParallel model, not {type(model).__name__}")
        group = model.process_group
        if dist.get_backend(group) != "commd":
            raise ValueError(f"commd.ft.Guard needs a model on a 'commd' group, not {dist.get_backend(group)!r}")
        if min_ranks < 1 or recover_timeout <= 0:
            raise ValueError(f"min_ranks must be >= 1 and recover_timeout > 0 (got {min_ranks}, {recover_timeout})")
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.ranks: tuple[int, ...] = tuple(dist.get_process_group_ranks(group))
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.min_ranks = min_ranks
        self.recover_timeout = recover_timeout
        self.steps = 0
        self.recoveries: list[Recovery] = []

    @property
    def epoch(self) -> int:
        """How many failures this guard has carried the job past."""
        return len(self.recoveries)

    def step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One training step: zero the gradients, ``fn(model, *args, **kwargs)`` (forward and
        backward; it must not step the optimizer), the commit, then ``optimizer.step()``.
        If a rank dies before the commit, rebuild on the survivors and run ``fn`` again.
        Returns what ``fn`` returned."""
        while True:
            try:
                self.optimizer.zero_grad(set_to_none=True)
                result = fn(self.model, *args, **kwargs)
                dist.all_reduce(torch.ones(1), group=self.group)  # the commit: every rank got here
            except Exception as exc:
                if not is_peer_failure(exc):
                    raise
                self._recover(exc, time.monotonic(), time.time())
                continue
            self.optimizer.step()
            self.steps += 1
            return result

    # ---- recovery --------------------------------------------------------------------
    def _recover(self, error: BaseException, started: float, wall: float) -> None:
        deadline = started + self.recover_timeout
        me = dist.get_rank()
        known: set[int] = set()
        last: BaseException = error
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise UnrecoverableError(
                    f"rank {me}: the survivors of group {list(self.ranks)} did not settle on a group within "
                    f"{self.recover_timeout:.0f}s (ranks known gone: {sorted(known)}); last error: {last}")
            known |= self._wait_gone(deadline)
            survivors = [r for r in self.ranks if r not in known]
            if me not in survivors:
                raise UnrecoverableError(f"rank {me} is counted among the lost ranks {sorted(known)}")
            if len(survivors) < self.min_ranks:
                raise UnrecoverableError(f"{len(survivors)} of {len(self.ranks)} ranks survive (ranks {survivors}); "
                                         f"the guard needs at least {self.min_ranks}")
            try:
                group = dist.new_group(survivors, timeout=timedelta(seconds=min(left, ATTEMPT_TIMEOUT_S)),
                                       use_local_synchronization=True)
                seen = self._union_of_views(group, known)
                if seen - known:  # another survivor knows of more losses: all go again without them
                    known |= seen
                    continue
                model = DistributedDataParallel(self.model.module, process_group=group, **self.ddp_kwargs)
                self._check_optimizer_states(group, survivors)
            except UnrecoverableError:
                raise
            except Exception as exc:  # a second failure during recovery, or a survivor not there yet
                if not is_peer_failure(exc) and not isinstance(exc, (CommdError, RuntimeError)):
                    raise
                last = exc
                log.warning("commd.ft: rank %d: building the survivors' group %s failed (%s); going again",
                            me, survivors, exc)
                continue
            break
        gone = tuple(r for r in self.ranks if r not in survivors)
        self.model, self.group, self.ranks = model, group, tuple(survivors)
        recovery = Recovery(len(self.recoveries) + 1, self.steps, gone, self.ranks,
                            time.monotonic() - started, f"{type(error).__name__}: {error}", wall)
        self.recoveries.append(recovery)
        log.warning("commd.ft: rank %d: ranks %s lost; going on with %d ranks %s (%.2fs); redoing step %d",
                    me, list(gone), len(survivors), survivors, recovery.seconds, self.steps)

    def _wait_gone(self, deadline: float) -> set[int]:
        """The group's ranks this rank's daemon knows are gone (dead ranks, and the ranks of dead
        nodes); waits until there is at least one (the error can reach a rank just before the
        news of the death reaches its daemon's list)."""
        paths = current_client().paths
        while True:
            try:
                status = query_status(paths, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except StatusError as exc:
                raise UnrecoverableError(f"cannot read this node's daemon to learn which ranks are gone: {exc}") from None
            # (a dead node's ranks are listed too: the daemon marks them gone with it)
            gone = {int(rank) for rank in (status.get("membership") or {}).get("gone_ranks") or {}}
            gone &= set(self.ranks)
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(POLL_S)

    def _union_of_views(self, group: Any, known: set[int]) -> set[int]:
        """Every survivor's set of lost ranks, united (one MAX all-reduce of flags)."""
        flags = torch.zeros(max(self.ranks) + 1, dtype=torch.int32)
        for rank in known:
            flags[rank] = 1
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return {rank for rank in range(len(flags)) if flags[rank]}

    def _check_optimizer_states(self, group: Any, survivors: list[int]) -> None:
        """The survivors' optimizer states must be equal (DDP made the parameters so): a survivor
        that had stepped where another had not would diverge silently."""
        digest = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    digest = zlib.crc32(value.detach().cpu().contiguous().numpy().tobytes(), digest)
        both = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if int(both[0]) != digest or -int(both[1]) != digest:
            raise UnrecoverableError(f"the survivors {survivors} hold different optimizer states after the failure; "
                                     "going on would train diverged copies")
