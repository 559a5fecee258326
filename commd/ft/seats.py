"""The membership of a guarded training loop: who runs, who is gone, who comes back.

``Seats`` holds what every guard shares, whatever model it keeps: the step with its commit, the
recovery when a rank dies (learn who is gone from the node daemon, agree on the survivors, rebuild,
redo the step), the admission of replacements at a step boundary, and what they leave in the job's
store.  A guard (``ddp.Guard``, ``hsdp.ShardedGuard``) says how its model is rebuilt on a new set of
ranks, how state reaches a replacement, and which ranks go on after a loss.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import logging
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commd.client.errors import CommdError, PeerDiedError, UnrecoverableError
from commd.client.status import StatusError, query_status
from commd.torch_backend.process_group import current_client, job_store, named_group

log = logging.getLogger("commd.ft")

#: How long a recovery may take, by default, before it gives up (UnrecoverableError).
RECOVER_TIMEOUT_S = 60.0
#: How long one attempt to build the survivors' group may wait for them; then it goes again, having
#: asked its daemon who else is gone (a second rank that died during the first attempt is left out
#: of the next).  The built group keeps the guarded group's own op timeout.
ATTEMPT_TIMEOUT_S = 4.0
#: How long the group of the running ranks and those taken back in may wait for them (each side
#: comes at the end of its step, so the ranks' skew within a step is what it waits out).
ENTER_TIMEOUT_S = 15.0
#: How often the guard reads its daemon's view while waiting to learn which rank is gone.
POLL_S = 0.02
#: Once the guard has lost ranks, how long a recovery waits for this rank's daemon to list a loss in
#: the guard's own group before it concludes that the failed op ran on another group, one that
#: still holds a rank lost earlier (the default group, say): a new death reaches the daemon's list
#: within about 0.1 s, or before the error does.
STRAY_GRACE_S = 5.0
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
    """Ranks taken back in at a step boundary."""

    epoch: int  # the membership epoch it started
    step: int  # the first step the enlarged group runs
    joined: tuple[int, ...]  # the global ranks taken back in
    members: tuple[int, ...]  # the group's global ranks from now on
    seconds: float  # on a running rank: its stall; on one taken in: from asking to be taken in
    state_bytes: int  # model and optimizer state this rank sent or received


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


def restart_count() -> int:
    """How often ``commd launch --max-restarts`` started this rank before (0: a first start)."""
    text = os.environ.get("COMMD_RESTART_COUNT", "0")
    if not text.isdigit():
        raise ValueError(f"COMMD_RESTART_COUNT must be a whole number, not {text!r}")
    return int(text)


def store_prefix() -> str:
    """The guard's keys in the job's store.  Under torchrun, whose restarts start every rank
    again, each round of the job keeps its own (a restarted job is not a replacement)."""
    if "COMMD_RESTART_COUNT" in os.environ:
        return "commd.ft/"
    return f"commd.ft/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def members_digest(members: list[int]) -> str:
    return f"{zlib.crc32(','.join(map(str, members)).encode()):08x}"


def new_group(members: list[int], tag: str, timeout: float, op_timeout: float | None = None) -> Any:
    """A group of ``members`` named alike on each of them (a replacement has made fewer groups
    than the ranks that went on, so torch's own names would differ).  ``timeout`` bounds the wait
    for the members; ``op_timeout`` (None: the same) is the op timeout the group keeps."""
    with named_group(f"ft.{tag}.{members_digest(members)}"):
        group = dist.new_group(members, timeout=timedelta(seconds=timeout), use_local_synchronization=True)
    if op_timeout is not None and group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        group.set_op_timeout(op_timeout)
    return group


def agree_equal(digest: int, group: Any, members: list[int], what: str) -> None:
    """Every rank of ``group`` holds the same ``digest`` (one MAX all-reduce of it and its
    negation), else UnrecoverableError: going on would train diverged copies."""
    both = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) != digest or -int(both[1]) != digest:
        raise UnrecoverableError(f"the ranks {members} hold different {what} after the membership changed; "
                                 "going on would train diverged copies")


def tensor_digest(tensors: list[torch.Tensor], digest: int = 0) -> int:
    """CRC32 over the tensors' bytes, in order.  Read as bytes in place: any dtype (bfloat16 has no
    NumPy type), and no copy of a contiguous CPU tensor (the digest is on the admission's stall)."""
    for tensor in tensors:
        data = tensor.detach().cpu().contiguous().reshape(-1)
        digest = zlib.crc32(data.view(torch.uint8).numpy() if data.numel() else b"", digest)
    return digest


def broadcast_bytes(payload: bytes, source: int, group: Any) -> bytes:
    """``source``'s ``payload`` on every rank of ``group`` (two broadcasts: the size, the bytes)."""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=source, group=group)
    if dist.get_rank() == source:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    else:
        data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=source, group=group)
    return payload if dist.get_rank() == source else data.numpy().tobytes()


def to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


class Seats:
    """The membership protocol of a guard; subclasses keep the model (see the module doc)."""

    #: what a subclass rebuilds and keeps: set by ``_install``
    model: Any
    optimizer: torch.optim.Optimizer

    def __init__(self, seats: tuple[int, ...], group: Any, *, min_ranks: int, recover_timeout: float,
                 join_timeout: float) -> None:
        if min_ranks < 1 or recover_timeout <= 0 or join_timeout <= 0:
            raise ValueError("min_ranks must be >= 1, recover_timeout and join_timeout > 0 "
                             f"(got {min_ranks}, {recover_timeout}, {join_timeout})")
        self.min_ranks = min_ranks
        self.recover_timeout = recover_timeout
        self.join_timeout = join_timeout
        #: The group's ranks at the start: a lost one may come back.
        self.seats: tuple[int, ...] = seats
        #: The ranks that run now.
        self.ranks: tuple[int, ...] = seats
        self.group = group
        self.steps = 0
        self.membership_epoch = 0
        self.recoveries: list[Recovery] = []
        self.joins: list[Join] = []
        #: Set as this rank alone leaves a job that goes on (``_giving_up_told``).
        self._leaving = False
        #: Time spent in commits, all steps together: the guard's cost to a step that never fails.
        self.commit_seconds = 0.0
        self._me = dist.get_rank()
        #: the op timeout of the groups the guard builds: the guarded group's
        self.op_timeout: float = group.op_timeout if hasattr(group, "op_timeout") else current_client().op_timeout
        self._prefix = store_prefix()
        self._store = job_store()
        atexit.register(self._mark_ended)

    # ---- what a guard says about its model ---------------------------------------------
    def _survivors(self, known: set[int]) -> list[int]:
        """The ranks that go on when ``known`` are gone."""
        return [rank for rank in self.ranks if rank not in known]

    def _left_out(self, known: set[int]) -> None:
        """This rank is alive but not among the survivors: raise."""
        self._leaving = True
        raise UnrecoverableError(f"rank {self._me} is counted among the lost ranks {sorted(known)}")

    def _on_give_up(self, error: UnrecoverableError) -> None:
        """This rank gives up with ``error`` (reported already)."""

    def _joinable(self, asking: list[int]) -> list[int]:
        """Which of the ranks ``asking`` to come back can be taken in now."""
        return asking

    def _rebuild(self, group: Any, members: list[int], joining: list[int], tag: str) -> tuple[Any, int]:
        """The model on ``members`` (``group``: all of them, made under ``tag``), state sent to
        ``joining`` first; returns what ``_install`` takes and the bytes of state sent or received."""
        raise NotImplementedError

    def _install(self, built: Any) -> None:
        raise NotImplementedError

    def _check_states(self, built: Any, group: Any, members: list[int]) -> None:
        """The members must hold the same state where they should (else UnrecoverableError)."""
        raise NotImplementedError

    # ---- the step ------------------------------------------------------------------------
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
        with self._giving_up_told():
            return self._step(fn, *args, **kwargs)

    def _step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                self.optimizer.zero_grad(set_to_none=True)
                result = fn(self.model, *args, **kwargs)
                committing = time.perf_counter()
                asking = self._commit()
                self.commit_seconds += time.perf_counter() - committing
            except Exception as exc:
                if not is_peer_failure(exc):
                    raise
                self._recover_or_report(exc, time.monotonic(), time.time())
                continue
            self.optimizer.step()
            self.steps += 1
            joiners = self._joinable(asking)
            if joiners:
                self._take_in(joiners)
            return result

    def take_back(self, timeout: float = JOIN_TIMEOUT_S) -> list[int]:
        """Between steps, on every running rank: wait until each lost rank's replacement has asked to
        come back (or ``timeout`` seconds passed), then take in those that did.  Returns their ranks.

        Replacements are otherwise taken in at the end of whichever step first sees them ask; this is
        for a point where the full group matters, such as before a checkpoint or at the end."""
        with self._giving_up_told():
            return self._take_back(timeout)

    def _take_back(self, timeout: float) -> list[int]:
        empty = [rank for rank in self.seats if rank not in self.ranks]
        if not empty:
            return []
        deadline = time.monotonic() + timeout
        asked = [False] * len(empty)
        while not all(asked) and time.monotonic() < deadline:
            asked = [self._asked(rank) for rank in empty]
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
        joiners = self._joinable([rank for i, rank in enumerate(empty) if flags[i]])
        if joiners:
            self._take_in(joiners)
        return [rank for rank in joiners if rank in self.ranks]

    def _commit(self) -> list[int]:
        """Every rank of the group got through its backward.  While seats are empty, it also says
        which replacements asked to come back (the lowest rank reads the store; MAX tells all)."""
        empty = [rank for rank in self.seats if rank not in self.ranks]
        if not empty:
            dist.all_reduce(torch.ones(1), group=self.group)
            return []
        flags = torch.zeros(1 + len(empty), dtype=torch.int32)
        flags[0] = 1
        if self._me == self.ranks[0]:
            for i, rank in enumerate(empty):
                flags[1 + i] = int(self._asked(rank))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [rank for i, rank in enumerate(empty) if flags[1 + i]]

    def _asked(self, rank: int) -> bool:
        """Whether ``rank``'s replacement asked to be taken in."""
        return self._store.check([self._key(f"join/{rank}")])

    def _report(self, event: str, epoch: int, gone: tuple[int, ...], seconds: float, why: str | None = None) -> None:
        """What the guard did, for ``commd status``, the metrics and the trace (never fails the step)."""
        try:
            current_client().report_membership(event, epoch=epoch, gone=list(gone), members=list(self.ranks),
                                               seconds=seconds, step=self.steps, why=why)
        except (CommdError, ValueError) as exc:
            log.warning("commd.ft: could not report %s to the daemon: %s", event, exc)

    # ---- recovery ------------------------------------------------------------------------
    def _recover_or_report(self, error: BaseException, started: float, wall: float,
                           also_gone: set[int] | None = None) -> None:
        try:
            self._recover(error, started, wall, also_gone)
        except UnrecoverableError as exc:
            self._report("gave_up", self.membership_epoch + 1, (), time.monotonic() - started, str(exc))
            self._on_give_up(exc)
            raise

    def _recover(self, error: BaseException, started: float, wall: float, also_gone: set[int] | None) -> None:
        deadline = started + self.recover_timeout
        me = self._me
        known: set[int] = set(also_gone or ())
        last: BaseException = error
        epoch = self.membership_epoch + 1
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise UnrecoverableError(
                    f"rank {me}: the survivors of group {list(self.ranks)} did not settle on a group within "
                    f"{self.recover_timeout:.0f}s (ranks known gone: {sorted(known)}); last error: {last}")
            known |= self._wait_gone(deadline, bool(known), error)
            if time.monotonic() >= deadline:
                continue  # (says that it did not settle in time)
            survivors = self._survivors(known)
            if me not in survivors:
                self._left_out(known)
            if len(survivors) < self.min_ranks:
                raise UnrecoverableError(f"{len(survivors)} of {len(self.ranks)} ranks survive (ranks {survivors}); "
                                         f"the guard needs at least {self.min_ranks}")
            attempt = self._attempt(epoch, survivors)
            try:
                tag = f"r{epoch}.{attempt}"
                group = new_group(survivors, tag, min(left, ATTEMPT_TIMEOUT_S), self.op_timeout)
                # every member now holds the same union; if it leaves out more ranks, all go again
                # without them.  (The ranks it adds may leave the survivors as they are: a sharded
                # guard's survivors are whole replicas, and a replica's second loss changes none.)
                known |= self._union_of_views(group, known)
                if self._survivors(known) != survivors:
                    continue
                built, _ = self._rebuild(group, survivors, [], tag)
                self._check_states(built, group, survivors)
            except UnrecoverableError:
                raise
            except Exception as exc:  # a second failure during recovery, or a survivor not there yet
                if not is_peer_failure(exc) and not isinstance(exc, (CommdError, RuntimeError)):
                    raise
                self._check_store()
                self._abandon(epoch, survivors, attempt)
                last = exc
                log.warning("commd.ft: rank %d: building the survivors' group %s failed (%s); going again",
                            me, survivors, exc)
                continue
            break
        # (a replacement that died while it was taken in was never among self.ranks)
        gone = tuple(sorted({r for r in self.ranks if r not in survivors} | set(also_gone or ())))
        self._install(built)
        self.group, self.ranks = group, tuple(survivors)
        self.membership_epoch = epoch
        self._publish(epoch)
        recovery = Recovery(epoch, self.steps, gone, self.ranks, time.monotonic() - started,
                            f"{type(error).__name__}: {error}", wall)
        self.recoveries.append(recovery)
        self._report("recovered", epoch, gone, recovery.seconds)
        log.warning("commd.ft: rank %d: ranks %s lost; going on with %d ranks %s (%.2fs); redoing step %d",
                    me, list(gone), len(survivors), survivors, recovery.seconds, self.steps)

    def _attempt(self, epoch: int, survivors: list[int]) -> int:
        """Which attempt at the group of ``survivors`` to build: agreed through the job's store, so
        survivors that came to the same set by different routes (one failed an attempt the other
        never made) still name its group alike, and a survivor that arrives late joins the current one."""
        try:
            return int(self._store.add(self._key(f"attempt/{epoch}/{members_digest(survivors)}"), 0))
        except Exception:  # torch's store errors: a dead store ends the recovery (UnrecoverableError)
            self._check_store()
            raise

    def _abandon(self, epoch: int, survivors: list[int], attempt: int) -> None:
        """This attempt failed: the next one, for every survivor (the first to fail moves it on)."""
        try:
            self._store.compare_set(self._key(f"attempt/{epoch}/{members_digest(survivors)}"), str(attempt),
                                    str(attempt + 1))
        except Exception as exc:  # noqa: BLE001 - torch's store errors; the next _check_store says it
            log.warning("commd.ft: rank %d: could not move the attempt on: %s", self._me, exc)

    def _wait_gone(self, deadline: float, known_any: bool, error: BaseException) -> set[int]:
        """The group's ranks this rank's daemon knows are gone (dead ranks, and the ranks of dead
        nodes); waits until there is at least one (the error can reach a rank just before the
        news of the death reaches its daemon's list), unless some are known already.  ``error``
        came from an op on another group when, after ``STRAY_GRACE_S``, only ranks lost earlier
        are gone: UnrecoverableError saying so, not a recovery that waits for nothing."""
        paths = current_client().paths
        grace = time.monotonic() + STRAY_GRACE_S
        while True:
            try:
                status = query_status(paths, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except StatusError as exc:
                if time.monotonic() >= deadline:
                    return set()  # out of time: the caller says the survivors did not settle
                self._leaving = True  # (its daemon is gone: the other nodes' ranks may go on)
                raise UnrecoverableError(f"cannot read this node's daemon to learn which ranks are gone: {exc}") from None
            cut_off = (status.get("fabric") or {}).get("broken")
            if cut_off:  # the job's coordinator went on without this node, or is itself gone
                self._leaving = True
                raise UnrecoverableError(f"rank {self._me}'s node is cut off from the job: {cut_off}")
            # (a dead node's ranks are listed too: the daemon marks them gone with it)
            every_gone = {int(rank) for rank in (status.get("membership") or {}).get("gone_ranks") or {}}
            gone = every_gone & set(self.ranks)
            if gone or known_any or time.monotonic() >= deadline:
                return gone
            lost_before = sorted(every_gone & set(self.seats) - set(self.ranks))
            if lost_before and time.monotonic() >= grace:
                raise UnrecoverableError(
                    f"rank {self._me}: an op failed for a dead rank ({type(error).__name__}: {error}), but every "
                    f"rank of the guard's group {list(self.ranks)} is alive: the op ran on a group that still "
                    f"holds rank(s) {lost_before}, lost earlier (the default group, or a group made before the "
                    "loss). The guard rebuilds its own group only: inside the step, run your collectives on "
                    "guard.group")
            time.sleep(POLL_S)

    def _check_store(self) -> None:
        """The job's store must still answer: without it no group can be built, so retrying is vain
        (under a plain ``tcp://`` init rank 0 hosts it, and it dies with rank 0)."""
        try:
            self._store.check([self._key("members")])
        except Exception as exc:  # noqa: BLE001 - torch's store errors: DistStoreError, DistNetworkError, RuntimeError
            raise UnrecoverableError(
                f"rank {self._me}: the job's store does not answer ({exc}); it lived in a process that died? "
                "(commd launch and torchrun host it outside the ranks; a tcp:// init lets rank 0 host it)") from None

    def _union_of_views(self, group: Any, known: set[int]) -> set[int]:
        """Every survivor's set of lost ranks, united (one MAX all-reduce of flags)."""
        flags = torch.zeros(max(self.seats) + 1, dtype=torch.int32)
        for rank in known:
            flags[rank] = 1
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return {rank for rank in range(len(flags)) if flags[rank]}

    # ---- coming back -----------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return self._prefix + name

    def _publish(self, epoch: int) -> None:
        """The lowest member writes the group's membership into the job's store, where a
        replacement learns that the job went on without it."""
        if self._me == self.ranks[0]:
            self._store.set(self._key("members"), json.dumps({"epoch": epoch, "members": list(self.ranks)}))

    def _members(self) -> list[int] | None:
        if not self._store.check([self._key("members")]):
            return None
        return list(json.loads(self._store.get(self._key("members")))["members"])

    @contextlib.contextmanager
    def _giving_up_told(self) -> Iterator[None]:
        """An UnrecoverableError of a running rank is written into the job's store (best effort),
        where a replacement waiting to be taken in, or for the others to go on without it, reads
        it and raises at once instead of waiting out its timeout (``_replacement``).  Not when this
        rank alone leaves a job that goes on (``_leaving``: counted among the lost, its node cut
        off or its daemon gone, its replica broken): a replacement may be taken in then."""
        try:
            yield
        except UnrecoverableError as exc:
            if self._leaving:
                raise
            try:
                self._store.set(self._key("gave_up"), f"rank {self._me}: {exc}")
            except Exception:  # noqa: BLE001 - the store may be what failed; the error is raised anyway
                pass
            raise

    def _check_gave_up(self) -> None:
        """A running rank gave the job up: no one will take this replacement in."""
        if self._store.check([self._key("gave_up")]):
            raise UnrecoverableError(f"rank {self._me} was started again, but the running ranks gave the job up: "
                                     f"{self._store.get(self._key('gave_up')).decode(errors='replace')}")

    def _mark_ended(self) -> None:
        """At this process's normal exit: a replacement still waiting to be taken in stops waiting."""
        if getattr(sys, "last_value", None) is not None:
            return  # it died of an exception: a replacement may take its place
        try:
            self._store.set(self._key("ended"), str(self._me))
        except Exception:  # noqa: BLE001 - the store may be gone with the job; nothing is waiting then
            pass

    def _replacement(self) -> dict[str, Any] | None:
        """None for a rank of a job that never lost it; else, for a replacement, what the running
        ranks wrote when they took it in (it asks, then waits for them)."""
        restarted = restart_count() > 0
        deadline = time.monotonic() + self.recover_timeout
        while True:
            members = self._members()
            if members is not None and self._me not in members:
                break
            # a restarted rank may start before the others have gone on without it: wait for that
            if not restarted:
                return None
            self._check_gave_up()
            if time.monotonic() >= deadline:
                raise UnrecoverableError(f"rank {self._me} was started again, but the running ranks did not go on "
                                         f"without it within {self.recover_timeout:.0f}s (members: {members})")
            time.sleep(POLL_S * 5)
        log.warning("commd.ft: rank %d replaces a lost rank; asks the running ranks %s to take it in", self._me, members)
        return self._await_admission(members)

    def _await_admission(self, members: list[int] | None) -> dict[str, Any]:
        """Ask to be taken in (a key in the job's store) and wait until the running ranks do."""
        me = self._me
        asked = time.monotonic()
        self._store.delete_key(self._key(f"admit/{me}"))  # an earlier admission's, if any
        self._store.set(self._key(f"join/{me}"), str(os.getpid()))
        deadline = asked + self.join_timeout
        while not self._store.check([self._key(f"admit/{me}")]):
            self._check_gave_up()
            if self._store.check([self._key("ended")]):
                raise UnrecoverableError(f"rank {me}: the running ranks {members} finished (rank "
                                         f"{self._store.get(self._key('ended')).decode()} exited) before they took "
                                         "this rank back in")
            if time.monotonic() >= deadline:
                raise UnrecoverableError(f"rank {me}: the running ranks {members} did not take this rank back in "
                                         f"within {self.join_timeout:.0f}s")
            # the running ranks wait for this rank in the admission's group from the moment they write
            # the key: every poll's delay is theirs too (a store's wait would log each timed-out slice)
            time.sleep(POLL_S)
        admission = json.loads(self._store.get(self._key(f"admit/{me}")))
        admission["asked"] = asked
        return admission

    def _enter(self, members: list[int], joining: list[int], epoch: int) -> tuple[Any, Any, int]:
        """The group of ``members`` with ``joining`` among them, the model on it, the state checked."""
        group = new_group(members, f"j{epoch}", ENTER_TIMEOUT_S, self.op_timeout)
        built, moved = self._rebuild(group, members, joining, f"j{epoch}")
        self._check_states(built, group, members)
        return group, built, moved

    def _entered(self, group: Any, built: Any, members: list[int], joined: list[int], epoch: int, seconds: float,
                 moved: int) -> None:
        self._install(built)
        self.group, self.ranks, self.membership_epoch = group, tuple(members), epoch
        self.joins.append(Join(epoch, self.steps, tuple(joined), self.ranks, seconds, moved))
        self._report("joined", epoch, (), seconds)

    def _join(self, admission: dict[str, Any]) -> None:
        """This rank, taken back in, joins the running ranks: the group, the state, the model."""
        epoch, members = int(admission["epoch"]), list(admission["members"])
        joined = [int(rank) for rank in admission["joined"]]
        try:
            group, built, moved = self._enter(members, joined, epoch)
        except UnrecoverableError:
            raise
        except Exception as exc:
            raise UnrecoverableError(f"rank {self._me}: taking this rank back in failed ({type(exc).__name__}: "
                                     f"{exc}); it can be started again") from exc
        self.steps = int(admission["step"])
        self._entered(group, built, members, joined, epoch, time.monotonic() - admission["asked"], moved)
        log.warning("commd.ft: rank %d rejoined the job at step %d; %d ranks %s (%d bytes of state)",
                    self._me, self.steps, len(members), members, moved)

    def _take_in(self, joiners: list[int]) -> None:
        """At a step boundary: the ranks ``joiners`` come back (this rank runs on)."""
        started = time.monotonic()
        epoch = self.membership_epoch + 1
        members = sorted({*self.ranks, *joiners})
        if self._me == self.ranks[0]:
            admission = json.dumps({"epoch": epoch, "members": members, "step": self.steps, "joined": joiners})
            for rank in joiners:
                self._store.delete_key(self._key(f"join/{rank}"))
                self._store.set(self._key(f"admit/{rank}"), admission)
        try:
            group, built, moved = self._enter(members, joiners, epoch)
        except UnrecoverableError:
            raise
        except Exception as exc:
            if not is_peer_failure(exc) and not isinstance(exc, (CommdError, RuntimeError)):
                raise
            # the step is done on every running rank: go on without the joiners (and whoever else died)
            log.warning("commd.ft: rank %d: taking in %s failed (%s); going on without them", self._me, joiners, exc)
            self.membership_epoch = epoch
            self._recover_or_report(exc, time.monotonic(), time.time(), also_gone=set(joiners))
            return
        self._entered(group, built, members, joiners, epoch, time.monotonic() - started, moved)
        self._publish(epoch)
        log.warning("commd.ft: rank %d: took ranks %s back in; %d ranks from step %d (%.2fs, %d bytes of state)",
                    self._me, joiners, len(members), self.steps, time.monotonic() - started, moved)
