"""One daemon log line per failed op: what failed, where, for whom and why.

The ranks of a failed op receive the error as an exception; the daemon's log
must say the same thing, or a post-mortem that starts from the log finds
nothing (mismatches, timeouts, dead peers and lane errors used to leave no
line at all).  A line names the op kind, the group, the sequence number, the
global ranks of the op's local participants and the reason, at WARNING for
errors of the ranks' own making (mismatch, timeout, bad input, shutdown) and
ERROR for failures of the machinery (a peer or node died, a lane or internal
error).  Lines go through the daemon's rate limiter, keyed by group and error
code, so a loop of failing ops cannot flood the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from commd.core.ops import Submission
from commd.daemon.loglimit import RateLimitedLog
from commd.protocol import schema as s

#: Error codes that the ranks' own requests cause; the rest are failures of the system.
RANK_CAUSED = frozenset({s.E_MISMATCH, s.E_TIMEOUT, s.E_PROTOCOL, s.E_BOUNDS, s.E_AUTH, s.E_VERSION, s.E_SHUTDOWN})
P2P_KINDS = ("send", "recv")


def describe_op(subs: Sequence[Submission]) -> str:
    """'allreduce #3 on group 'world'', or 'send/recv on group 'g'' for point-to-point."""
    first = subs[0]
    if first.kind in P2P_KINDS:
        kinds = "/".join(k for k in P2P_KINDS if any(sub.kind == k for sub in subs))
        return f"{kinds} on group '{first.group}'"
    return f"{first.kind} #{first.seq} on group '{first.group}'"


class OpFailureLog:
    """Writes the failure line of an op (``record``); ``group_ranks`` maps a group to its global ranks."""

    def __init__(self, limiter: RateLimitedLog, group_ranks: Callable[[str], Sequence[int] | None]) -> None:
        self.limiter = limiter
        self.group_ranks = group_ranks

    def record(self, code: str, message: str, subs: Sequence[Submission]) -> None:
        if not subs:
            return
        self.record_op(code, message, subs[0].group, describe_op(subs), sorted({sub.group_rank for sub in subs}))

    def record_op(self, code: str, message: str, group: str, what: str, group_ranks: Sequence[int]) -> None:
        """The line of op ``what`` ('allreduce #3 on group 'g'') of ``group_ranks``: also an op the
        daemon did not run (an exchange ring's), so every path leaves the same line."""
        members = self.group_ranks(group)
        if members is not None and all(r < len(members) for r in group_ranks):
            ranks = f"ranks {sorted(members[r] for r in group_ranks)}"
        else:
            ranks = f"group ranks {group_ranks}"
        level = logging.WARNING if code in RANK_CAUSED else logging.ERROR
        self.limiter.log(level, ("op", group, code), f"op failures ({code}) on group '{group}'",
                         "op failed (%s): %s, %s: %s", code, what, ranks, message)
