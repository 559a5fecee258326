"""commd.ft: a DDP training loop that goes on when a rank dies, and takes a replacement back in.

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

from __future__ import annotations

import atexit
import io
import json
import logging
import os
import sys
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
from commd.torch_backend.process_group import current_client, job_store, named_group

log = logging.getLogger("commd.ft")

#: How long a recovery may take, by default, before it gives up (UnrecoverableError).
RECOVER_TIMEOUT_S = 60.0
#: How long one attempt to build the survivors' group may wait for them (then it goes again).
ATTEMPT_TIMEOUT_S = 15.0
#: How often the guard reads its daemon's view while waiting to learn which rank is gone.
POLL_S = 0.02
#: How long a replacement waits, by default, for the running ranks to take it in (they do so
#: at the end of their current step).
JOIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Recovery:
    """One failure the guard carried the job past."""

    epoch: int  # the membership epoch it started (1 for the job's first change)
    step: int  # the guard's step number that was redone
    gone: tuple[int, ...]  # global ranks lost at this recovery
    survivors: tuple[int, ...]  # the group's global ranks from now on
    seconds: float  # from the failure reaching this rank to the rebuilt group
    error: str  # what the step raised
    failed_at: float  # when the failure reached this rank (time.time(), to compare across processes)


@dataclass(frozen=True)
class Join:
    """Replacement ranks taken back in at a step boundary."""

    epoch: int  # the membership epoch it started
    step: int  # the first step the enlarged group runs
    joined: tuple[int, ...]  # the replacements' global ranks
    members: tuple[int, ...]  # the group's global ranks from now on
    seconds: float  # on a running rank: its stall; on the replacement: from asking to be taken in
    state_bytes: int  # model and optimizer state sent to the replacements


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


def _restart_count() -> int:
    """How often ``commd launch --max-restarts`` started this rank before (0: a first start)."""
    text = os.environ.get("COMMD_RESTART_COUNT", "0")
    if not text.isdigit():
        raise ValueError(f"COMMD_RESTART_COUNT must be a whole number, not {text!r}")
    return int(text)


def _store_prefix() -> str:
    """The guard's keys in the job's store.  Under torchrun, whose restarts start every rank
    again, each round of the job keeps its own (a restarted job is not a replacement)."""
    if "COMMD_RESTART_COUNT" in os.environ:
        return "commd.ft/"
    return f"commd.ft/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


class Guard:
    """Runs training steps of a DDP model so that the survivors go on when a rank dies, and a
    replacement of a lost rank rejoins.

    ``model``: a module (the guard wraps it in DDP on the default group, or joins it to the running
    job if this process replaces a lost rank) or a ``DistributedDataParallel`` on a ``commd`` group
    (no rejoining then: its constructor already needed every rank); ``ddp_kwargs``: the DDP options;
    ``min_ranks``: fewer survivors than this is unrecoverable.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 ddp_kwargs: dict[str, Any] | None = None, min_ranks: int = 1,
                 recover_timeout: float = RECOVER_TIMEOUT_S, join_timeout: float = JOIN_TIMEOUT_S) -> None:
        if isinstance(model, DistributedDataParallel):
            group, module = model.process_group, model.module
        elif isinstance(model, torch.nn.Module):
            group, module = dist.group.WORLD, model
        else:
            raise TypeError(f"commd.ft.Guard needs a torch module or a DistributedDataParallel, not {type(model).__name__}")
        if dist.get_backend(group) != "commd":
            raise ValueError(f"commd.ft.Guard needs a model on a 'commd' group, not {dist.get_backend(group)!r}")
        if min_ranks < 1 or recover_timeout <= 0 or join_timeout <= 0:
            raise ValueError("min_ranks must be >= 1, recover_timeout and join_timeout > 0 "
                             f"(got {min_ranks}, {recover_timeout}, {join_timeout})")
        self.optimizer = optimizer
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.min_ranks = min_ranks
        self.recover_timeout = recover_timeout
        self.join_timeout = join_timeout
        #: The group's ranks at the start: a lost one may come back.
        self.seats: tuple[int, ...] = tuple(dist.get_process_group_ranks(group))
        self.ranks: tuple[int, ...] = self.seats
        self.group = group
        self.steps = 0
        self.membership_epoch = 0
        self.recoveries: list[Recovery] = []
        self.joins: list[Join] = []
        self._me = dist.get_rank()
        self._prefix = _store_prefix()
        self._store = job_store()
        atexit.register(self._mark_ended)
        if isinstance(model, DistributedDataParallel):
            self.model = model
            return
        admission = self._admission()
        if admission is None:
            self.model = DistributedDataParallel(module, process_group=group, **self.ddp_kwargs)
        else:
            self._join(module, admission)

    @property
    def epoch(self) -> int:
        """How many failures this guard has carried the job past."""
        return len(self.recoveries)

    def step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One training step: zero the gradients, ``fn(model, *args, **kwargs)`` (forward and
        backward; it must not step the optimizer), the commit, then ``optimizer.step()``.
        If a rank dies before the commit, rebuild on the survivors and run ``fn`` again; if a
        replacement asked to come back, take it in after the optimizer step.
        Returns what ``fn`` returned."""
        while True:
            try:
                self.optimizer.zero_grad(set_to_none=True)
                result = fn(self.model, *args, **kwargs)
                joiners = self._commit()
            except Exception as exc:
                if not is_peer_failure(exc):
                    raise
                self._recover_or_report(exc, time.monotonic(), time.time())
                continue
            self.optimizer.step()
            self.steps += 1
            if joiners:
                self._take_in(joiners)
            return result

    def take_back(self, timeout: float = JOIN_TIMEOUT_S) -> list[int]:
        """Between steps, on every running rank: wait until each lost rank's replacement has asked to
        come back (or ``timeout`` seconds passed), then take in those that did.  Returns their ranks.

        Replacements are otherwise taken in at the end of whichever step first sees them ask; this is
        for a point where the full group matters, such as before a checkpoint or at the end."""
        empty = [rank for rank in self.seats if rank not in self.ranks]
        if not empty:
            return []
        deadline = time.monotonic() + timeout
        asked = [False] * len(empty)
        while not all(asked) and time.monotonic() < deadline:
            asked = [self._store.check([self._key(f"join/{rank}")]) for rank in empty]
            if not all(asked):
                time.sleep(POLL_S * 5)
        flags = torch.tensor([int(a) for a in asked], dtype=torch.int32)
        try:  # every running rank takes in the same ones: those any of them saw ask
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            self._recover_or_report(exc, time.monotonic(), time.time())
            return []
        joiners = [rank for i, rank in enumerate(empty) if flags[i]]
        if joiners:
            self._take_in(joiners)
        return [rank for rank in joiners if rank in self.ranks]

    def _report(self, event: str, epoch: int, gone: tuple[int, ...], seconds: float, why: str | None = None) -> None:
        """What the guard did, for ``commd status``, the metrics and the trace (never fails the step)."""
        try:
            current_client().report_membership(event, epoch=epoch, gone=list(gone), members=list(self.ranks),
                                               seconds=seconds, step=self.steps, why=why)
        except (CommdError, ValueError) as exc:
            log.warning("commd.ft: could not report %s to the daemon: %s", event, exc)

    # ---- the commit ------------------------------------------------------------------
    def _commit(self) -> list[int]:
        """Every rank of the group got through its backward.  While seats are empty, it also says
        which replacements asked to come back (the lowest rank reads the store; MAX tells all)."""
        empty = [rank for rank in self.seats if rank not in self.ranks]
        if not empty:
            dist.all_reduce(torch.ones(1), group=self.group)
            return []
        flags = torch.zeros(1 + len(empty), dtype=torch.int32)
        flags[0] = 1
        if dist.get_rank() == self.ranks[0]:
            for i, rank in enumerate(empty):
                flags[1 + i] = int(self._store.check([self._key(f"join/{rank}")]))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [rank for i, rank in enumerate(empty) if flags[1 + i]]

    # ---- recovery --------------------------------------------------------------------
    def _recover_or_report(self, error: BaseException, started: float, wall: float,
                           also_gone: set[int] | None = None) -> None:
        try:
            self._recover(error, started, wall, also_gone)
        except UnrecoverableError as exc:
            self._report("gave_up", self.membership_epoch + 1, (), time.monotonic() - started, str(exc))
            raise

    def _recover(self, error: BaseException, started: float, wall: float, also_gone: set[int] | None = None) -> None:
        deadline = started + self.recover_timeout
        me = dist.get_rank()
        known: set[int] = set(also_gone or ())
        last: BaseException = error
        epoch = self.membership_epoch + 1
        attempts: dict[tuple[int, ...], int] = {}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise UnrecoverableError(
                    f"rank {me}: the survivors of group {list(self.ranks)} did not settle on a group within "
                    f"{self.recover_timeout:.0f}s (ranks known gone: {sorted(known)}); last error: {last}")
            known |= self._wait_gone(deadline, bool(known))
            survivors = [r for r in self.ranks if r not in known]
            if me not in survivors:
                raise UnrecoverableError(f"rank {me} is counted among the lost ranks {sorted(known)}")
            if len(survivors) < self.min_ranks:
                raise UnrecoverableError(f"{len(survivors)} of {len(self.ranks)} ranks survive (ranks {survivors}); "
                                         f"the guard needs at least {self.min_ranks}")
            attempt = attempts[tuple(survivors)] = attempts.get(tuple(survivors), -1) + 1
            try:
                group = self._new_group(survivors, f"r{epoch}.{attempt}", min(left, ATTEMPT_TIMEOUT_S))
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
        # (a replacement that died while it was taken in was never among self.ranks)
        gone = tuple(sorted({r for r in self.ranks if r not in survivors} | set(also_gone or ())))
        self.model, self.group, self.ranks = model, group, tuple(survivors)
        self.membership_epoch = epoch
        self._publish(epoch)
        recovery = Recovery(epoch, self.steps, gone, self.ranks, time.monotonic() - started,
                            f"{type(error).__name__}: {error}", wall)
        self.recoveries.append(recovery)
        self._report("recovered", epoch, gone, recovery.seconds)
        log.warning("commd.ft: rank %d: ranks %s lost; going on with %d ranks %s (%.2fs); redoing step %d",
                    me, list(gone), len(survivors), survivors, recovery.seconds, self.steps)

    def _wait_gone(self, deadline: float, known_any: bool) -> set[int]:
        """The group's ranks this rank's daemon knows are gone (dead ranks, and the ranks of dead
        nodes); waits until there is at least one (the error can reach a rank just before the
        news of the death reaches its daemon's list), unless some are known already."""
        paths = current_client().paths
        while True:
            try:
                status = query_status(paths, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except StatusError as exc:
                raise UnrecoverableError(f"cannot read this node's daemon to learn which ranks are gone: {exc}") from None
            cut_off = (status.get("fabric") or {}).get("broken")
            if cut_off:  # the job's coordinator went on without this node, or is itself gone
                raise UnrecoverableError(f"rank {dist.get_rank()}'s node is cut off from the job: {cut_off}")
            # (a dead node's ranks are listed too: the daemon marks them gone with it)
            gone = {int(rank) for rank in (status.get("membership") or {}).get("gone_ranks") or {}}
            gone &= set(self.ranks)
            if gone or known_any or time.monotonic() >= deadline:
                return gone
            time.sleep(POLL_S)

    def _union_of_views(self, group: Any, known: set[int]) -> set[int]:
        """Every survivor's set of lost ranks, united (one MAX all-reduce of flags)."""
        flags = torch.zeros(max(self.seats) + 1, dtype=torch.int32)
        for rank in known:
            flags[rank] = 1
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return {rank for rank in range(len(flags)) if flags[rank]}

    def _check_optimizer_states(self, group: Any, members: list[int]) -> None:
        """The members' optimizer states must be equal (DDP made the parameters so): a survivor
        that had stepped where another had not would diverge silently."""
        digest = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    digest = zlib.crc32(value.detach().cpu().contiguous().numpy().tobytes(), digest)
        both = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if int(both[0]) != digest or -int(both[1]) != digest:
            raise UnrecoverableError(f"the ranks {members} hold different optimizer states after the membership "
                                     "changed; going on would train diverged copies")

    # ---- replacements ----------------------------------------------------------------
    def _key(self, name: str) -> str:
        return self._prefix + name

    def _new_group(self, members: list[int], tag: str, timeout: float) -> Any:
        """A group of ``members`` named alike on each of them (a replacement has made fewer groups
        than the ranks that went on, so torch's own names would differ)."""
        digest = zlib.crc32(",".join(map(str, members)).encode())
        with named_group(f"ft.{tag}.{digest:08x}"):
            return dist.new_group(members, timeout=timedelta(seconds=timeout), use_local_synchronization=True)

    def _publish(self, epoch: int) -> None:
        """The lowest member writes the group's membership into the job's store, where a
        replacement learns that the job went on without it."""
        if dist.get_rank() == self.ranks[0]:
            self._store.set(self._key("members"), json.dumps({"epoch": epoch, "members": list(self.ranks)}))

    def _admission(self) -> dict[str, Any] | None:
        """None for a rank of a job that never lost it; else, for a replacement, what the running
        ranks wrote when they took it in (it asks, then waits for them)."""
        me = dist.get_rank()
        restarted = _restart_count() > 0
        deadline = time.monotonic() + self.recover_timeout
        while True:
            members = self._members()
            if members is not None and me not in members:
                break
            # a restarted rank may start before the others have gone on without it: wait for that
            if not restarted:
                return None
            if time.monotonic() >= deadline:
                raise UnrecoverableError(f"rank {me} was started again, but the running ranks did not go on without "
                                         f"it within {self.recover_timeout:.0f}s (members: {members})")
            time.sleep(POLL_S * 5)
        asked = time.monotonic()
        self._store.delete_key(self._key(f"admit/{me}"))  # an earlier replacement's, if any
        self._store.set(self._key(f"join/{me}"), str(os.getpid()))
        log.warning("commd.ft: rank %d replaces a lost rank; asked the running ranks %s to take it in", me, members)
        deadline = asked + self.join_timeout
        while not self._store.check([self._key(f"admit/{me}")]):
            if self._store.check([self._key("ended")]):
                raise UnrecoverableError(f"rank {me}: the running ranks {members} finished (rank "
                                         f"{self._store.get(self._key('ended')).decode()} exited) before they took "
                                         "this replacement in")
            if time.monotonic() >= deadline:
                raise UnrecoverableError(f"rank {me}: the running ranks {members} did not take this replacement in "
                                         f"within {self.join_timeout:.0f}s")
            time.sleep(POLL_S * 5)
        admission = json.loads(self._store.get(self._key(f"admit/{me}")))
        admission["asked"] = asked
        return admission

    def _mark_ended(self) -> None:
        """At this process's normal exit: a replacement still waiting to be taken in stops waiting."""
        if getattr(sys, "last_value", None) is not None:
            return  # it died of an exception: a replacement may take its place
        try:
            self._store.set(self._key("ended"), str(self._me))
        except Exception:  # noqa: BLE001 - the store may be gone with the job; nothing is waiting then
            pass

    def _members(self) -> list[int] | None:
        if not self._store.check([self._key("members")]):
            return None
        return list(json.loads(self._store.get(self._key("members")))["members"])

    def _join(self, module: torch.nn.Module, admission: dict[str, Any]) -> None:
        """This replacement joins the running ranks: the group, then the state, then DDP."""
        me = dist.get_rank()
        epoch, members, source = int(admission["epoch"]), list(admission["members"]), int(admission["source"])
        try:
            group = self._new_group(members, f"j{epoch}", ATTEMPT_TIMEOUT_S)
            sent = self._transfer_state(group, module, source)
            model = DistributedDataParallel(module, process_group=group, **self.ddp_kwargs)
            self._check_optimizer_states(group, members)
        except UnrecoverableError:
            raise
        except Exception as exc:
            raise UnrecoverableError(f"rank {me}: taking this replacement in failed ({type(exc).__name__}: {exc}); "
                                     "it can be started again") from exc
        self.model, self.group, self.ranks = model, group, tuple(members)
        self.steps, self.membership_epoch = int(admission["step"]), epoch
        joined = tuple(int(rank) for rank in admission["joined"])
        self.joins.append(Join(epoch, self.steps, joined, self.ranks, time.monotonic() - admission["asked"], sent))
        self._report("joined", epoch, (), self.joins[-1].seconds)
        log.warning("commd.ft: rank %d rejoined the job at step %d; %d ranks %s (%d bytes of state)",
                    me, self.steps, len(members), members, sent)

    def _take_in(self, joiners: list[int]) -> None:
        """At a step boundary: the replacements ``joiners`` come back (this rank runs on)."""
        started = time.monotonic()
        me = dist.get_rank()
        epoch = self.membership_epoch + 1
        members = sorted({*self.ranks, *joiners})
        source = self.ranks[0]
        if me == source:
            admission = json.dumps({"epoch": epoch, "members": members, "step": self.steps,
                                    "source": source, "joined": joiners})
            for rank in joiners:
                self._store.delete_key(self._key(f"join/{rank}"))
                self._store.set(self._key(f"admit/{rank}"), admission)
        try:
            group = self._new_group(members, f"j{epoch}", ATTEMPT_TIMEOUT_S)
            sent = self._transfer_state(group, self.model.module, source)
            model = DistributedDataParallel(self.model.module, process_group=group, **self.ddp_kwargs)
            self._check_optimizer_states(group, members)
        except UnrecoverableError:
            raise
        except Exception as exc:
            if not is_peer_failure(exc) and not isinstance(exc, (CommdError, RuntimeError)):
                raise
            # the step is done on every running rank: go on without the replacements (and whoever else died)
            log.warning("commd.ft: rank %d: taking in %s failed (%s); going on without them", me, joiners, exc)
            self.membership_epoch = epoch
            self._recover_or_report(exc, time.monotonic(), time.time(), also_gone=set(joiners))
            return
        self.model, self.group, self.ranks = model, group, tuple(members)
        self.membership_epoch = epoch
        self._publish(epoch)
        self.joins.append(Join(epoch, self.steps, tuple(joiners), self.ranks, time.monotonic() - started, sent))
        self._report("joined", epoch, (), self.joins[-1].seconds)
        log.warning("commd.ft: rank %d: took ranks %s back in; %d ranks from step %d (%.2fs, %d bytes of state)",
                    me, joiners, len(members), self.steps, time.monotonic() - started, sent)

    def _transfer_state(self, group: Any, module: torch.nn.Module, source: int) -> int:
        """``source``'s parameters, buffers and optimizer state, broadcast to the group; returns the bytes sent."""
        sent = 0
        with torch.no_grad():
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for tensor in module.state_dict().values():
                by_dtype.setdefault(tensor.dtype, []).append(tensor)
            for tensors in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in tensors])
                dist.broadcast(flat, src=source, group=group)
                offset = 0
                for tensor in tensors:
                    tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
                sent += flat.nbytes
        me = dist.get_rank()
        payload = b""
        if me == source:
            buffer = io.BytesIO()
            torch.save(self.optimizer.state_dict(), buffer)
            payload = buffer.getvalue()
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=source, group=group)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, src=source, group=group)
        if me != source:
            self.optimizer.load_state_dict(torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True))
        return sent + int(size)
