"""Local matching: turn per-rank submissions into ready ops, in order.

Collectives are matched by (group, sequence number): an op becomes ready when
every member of its group has submitted that sequence number and the
submissions agree.  Each rank submits its ops of a group in sequence order,
so a group's ops become ready in sequence order too; the daemon executes
ready ops in the order they became ready (one global order), which is what
makes a mix of groups deadlock-free: an op waits only for its own members.

Point-to-point ops are matched FIFO per (group, source, destination, tag),
as MPI and Gloo do; a receive from any source takes the oldest matching send.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from commd.core.ops import MatchError, ReadyOp, Submission
from commd.observe.stats import Stats
from commd.protocol import schema as s
from commd.scheduler.agreement import find_mismatch


@dataclass
class Group:
    name: str
    ranks: list[int]  # global ranks, index = group rank
    local: list[int] = field(default_factory=list)  # group ranks served by this daemon
    pending: dict[int, dict[int, Submission]] = field(default_factory=dict)
    failed: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    next_seq: int = 0  # lowest sequence number not yet seen ready or failed
    dead: dict[int, str] = field(default_factory=dict)  # group rank -> why


class LocalScheduler:
    """Holds waiting submissions; hands back ReadyOps or MatchErrors."""

    def __init__(self, stats: Stats) -> None:
        self.groups: dict[str, Group] = {}
        self.sends: dict[tuple[str, int, int, int], collections.deque[Submission]] = {}
        self.recvs: dict[tuple[str, int, int], collections.deque[Submission]] = {}
        self.stats = stats

    # ---- groups -------------------------------------------------------
    def register_group(self, name: str, ranks: list[int], local: list[int] | None = None) -> Group:
        """``local``: the group ranks on this node (default: all); matching waits for those only."""
        group = self.groups.get(name)
        if group is None:
            group = self.groups[name] = Group(name, list(ranks), list(local if local is not None else range(len(ranks))))
            self.stats.group_added(name, len(ranks))
        elif group.ranks != list(ranks):
            raise ValueError(
                f"group '{name}' is already registered with ranks {group.ranks}, not {list(ranks)}"
            )
        return group

    # ---- submission ---------------------------------------------------
    def submit(self, sub: Submission) -> ReadyOp | None:
        """Record one submission; return the op if it completed a match."""
        group = self.groups[sub.group]
        if group.dead:
            rank, why = next(iter(group.dead.items()))
            op = sub.kind if sub.kind in ("send", "recv") else f"{sub.kind} #{sub.seq}"
            raise MatchError(
                f"{op} on group '{group.name}' cannot run: group rank {rank} {why}",
                "peer_died",
                [sub],
            )
        if sub.kind in ("send", "recv"):
            return self._submit_p2p(group, sub)
        return self._submit_collective(group, sub)

    def _submit_collective(self, group: Group, sub: Submission) -> ReadyOp | None:
        if sub.seq in group.failed:
            message, code = group.failed[sub.seq]
            raise MatchError(message, code, [sub])
        waiting = group.pending.setdefault(sub.seq, {})
        if sub.group_rank in waiting:
            raise MatchError(
                f"rank {sub.group_rank} submitted sequence number {sub.seq} of group "
                f"'{group.name}' twice",
                "protocol",
                [sub],
            )
        waiting[sub.group_rank] = sub
        if len(waiting) < len(group.local):
            return None
        del group.pending[sub.seq]
        subs = [waiting[r] for r in group.local]
        first_at = min(x.submitted_at for x in subs)
        signature = subs[0].signature
        problem = None
        if any(x.signature != signature for x in subs) or subs[0].kind == "alltoall":
            problem = find_mismatch(subs)
        if problem is not None:
            message = (
                f"mismatched collective #{sub.seq} on group '{group.name}': {problem}"
            )
            self._remember_failure(group, sub.seq, message, "mismatch")
            raise MatchError(message, "mismatch", subs)
        return ReadyOp(sub.kind, group.name, sub.seq, subs, first_at)

    def fail_seq(self, name: str, seq: int, message: str, code: str) -> list[Submission] | None:
        """Collective ``seq`` of group ``name`` failed where this scheduler did not match it (an
        exchange ring): remembered, so a late submission of it fails on arrival; the submissions that
        already wait for it are returned, to be failed (None when the group is unknown or the failure
        known already)."""
        group = self.groups.get(name)
        if group is None or seq < 0 or seq in group.failed:
            return None
        self._remember_failure(group, seq, message, code)
        return list(group.pending.pop(seq, {}).values())

    def _remember_failure(self, group: Group, seq: int, message: str, code: str) -> None:
        group.failed[seq] = (message, code)
        while len(group.failed) > 1024:
            group.failed.popitem(last=False)

    def _submit_p2p(self, group: Group, sub: Submission) -> ReadyOp | None:
        if sub.kind == "send":
            recv = self._take_recv(group.name, sub.group_rank, sub.peer, sub.tag)
            if recv is None:
                key = (group.name, sub.group_rank, sub.peer, sub.tag)
                self.sends.setdefault(key, collections.deque()).append(sub)
                return None
            send = sub
        else:
            send = self._take_send(group.name, sub.peer, sub.group_rank, sub.tag)
            if send is None:
                key = (group.name, sub.group_rank, sub.tag)
                self.recvs.setdefault(key, collections.deque()).append(sub)
                return None
            recv = sub
        if send.dtype != recv.dtype or send.count != recv.count:
            subs = [send, recv]
            raise MatchError(
                f"send from rank {send.group_rank} ({send.count} x {send.dtype}) does not match "
                f"recv at rank {recv.group_rank} ({recv.count} x {recv.dtype}) with tag {send.tag} "
                f"on group '{group.name}'",
                "mismatch",
                subs,
            )
        first_at = min(send.submitted_at, recv.submitted_at)
        return ReadyOp("sendrecv", group.name, 0, [send, recv], first_at)

    def _take_recv(self, group: str, src: int, dst: int, tag: int) -> Submission | None:
        queue = self.recvs.get((group, dst, tag))
        if not queue:
            return None
        for i, recv in enumerate(queue):
            if recv.peer in (src, -1):
                del queue[i]
                return recv
        return None

    def _take_send(self, group: str, src: int, dst: int, tag: int) -> Submission | None:
        if src >= 0:
            queue = self.sends.get((group, src, dst, tag))
            return queue.popleft() if queue else None
        oldest: collections.deque[Submission] | None = None
        for (g, _, d, t), queue in self.sends.items():
            if g == group and d == dst and t == tag and queue:
                if oldest is None or queue[0].submitted_at < oldest[0].submitted_at:
                    oldest = queue
        return oldest.popleft() if oldest else None

    # ---- failures -----------------------------------------------------
    def rank_died(self, global_rank: int, why: str) -> list[tuple[Submission, str]]:
        """Fail every waiting op that involves ``global_rank``; mark its groups dead."""
        failed: list[tuple[Submission, str]] = []
        for group in self.groups.values():
            if global_rank not in group.ranks:
                continue
            dead_rank = group.ranks.index(global_rank)
            group.dead[dead_rank] = why
            message = f"group rank {dead_rank} (global rank {global_rank}) {why}"
            for seq, waiting in list(group.pending.items()):
                del group.pending[seq]
                failed.extend((sub, message) for sub in waiting.values())
            failed.extend((sub, message) for sub in self._drop_p2p(group.name, None))
        return [(sub, msg) for sub, msg in failed if self.groups[sub.group].ranks[sub.group_rank] != global_rank]

    def _drop_p2p(self, group: str, predicate) -> list[Submission]:
        dropped: list[Submission] = []
        for table in (self.sends, self.recvs):
            for key, queue in list(table.items()):
                if key[0] != group:
                    continue
                keep = collections.deque()
                for sub in queue:
                    (dropped if predicate is None or predicate(sub) else keep).append(sub)
                if keep:
                    table[key] = keep
                else:
                    del table[key]
        return dropped

    def expire(self, now: float) -> list[tuple[Submission, str]]:
        """Fail ops that waited longer than their timeout for missing ranks."""
        expired: list[tuple[Submission, str]] = []
        for group in self.groups.values():
            for seq, waiting in list(group.pending.items()):
                oldest = min(x.submitted_at for x in waiting.values())
                timeout = min(x.timeout for x in waiting.values())
                if now - oldest < timeout:
                    continue
                missing = sorted(set(group.local) - set(waiting))
                first = next(iter(waiting.values()))
                message = s.not_submitted(f"{first.kind} #{seq} on group '{group.name}'", f"group ranks {missing}",
                                          [group.ranks[r] for r in missing], timeout)
                del group.pending[seq]
                self._remember_failure(group, seq, message, "timeout")
                expired.extend((sub, message) for sub in waiting.values())
            stale = self._drop_p2p(group.name, lambda sub: now - sub.submitted_at >= sub.timeout)
            for sub in stale:
                other = "any rank" if sub.peer < 0 else f"group rank {sub.peer}"
                expired.append(
                    (
                        sub,
                        f"{sub.kind} at group rank {sub.group_rank} on group '{group.name}' "
                        f"(tag {sub.tag}) timed out after {sub.timeout:.1f}s: {other} never "
                        f"posted the matching {'recv' if sub.kind == 'send' else 'send'}",
                    )
                )
        return expired

    def drain_all(self) -> list[Submission]:
        """Remove and return every waiting submission (daemon shutdown)."""
        subs: list[Submission] = []
        for group in self.groups.values():
            for waiting in group.pending.values():
                subs.extend(waiting.values())
            group.pending.clear()
        for table in (self.sends, self.recvs):
            for queue in table.values():
                subs.extend(queue)
            table.clear()
        return subs

    def forget_client_groups(self, live_ranks: set[int]) -> None:
        """Drop groups none of whose members is connected any more."""
        for name, group in list(self.groups.items()):
            if not live_ranks.intersection(group.ranks):
                del self.groups[name]
                self.stats.group_removed(name)

    # ---- status -------------------------------------------------------
    def waiting_summary(self) -> list[dict]:
        rows = []
        for group in self.groups.values():
            for seq, waiting in group.pending.items():
                first = next(iter(waiting.values()))
                missing = sorted(set(group.local) - set(waiting))
                rows.append(
                    {
                        "group": group.name,
                        "seq": seq,
                        "kind": first.kind,
                        "waiting_s": round(time.monotonic() - min(x.submitted_at for x in waiting.values()), 6),
                        "missing_ranks": [group.ranks[r] for r in missing],
                    }
                )
        for table in (self.sends, self.recvs):
            for key, queue in table.items():
                group = self.groups.get(key[0])
                for sub in queue:
                    peer = sub.peer if sub.peer >= 0 or group is None else -1
                    rows.append(
                        {
                            "group": key[0],
                            "seq": None,
                            "kind": sub.kind,
                            "waiting_s": round(time.monotonic() - sub.submitted_at, 6),
                            "missing_ranks": [group.ranks[peer]] if group and peer >= 0 else ["any"],
                        }
                    )
        rows.sort(key=lambda r: -r["waiting_s"])
        return rows
