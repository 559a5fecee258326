"""``monitored_barrier`` for commd groups: torch's ``dist.monitored_barrier`` runs on Gloo only.

torch's version has rank 0 ping every rank and name the first one (or, with
``wait_all_ranks``, every one) that did not answer in time.  The commd daemon already
knows which ranks have not submitted an op: a barrier with the monitor's timeout
fails on every waiting rank with a CommTimeoutError whose ``missing_ranks`` are those
ranks, which this turns into torch's message ("[Rank 0]: Rank 1 failed to pass
monitoredBarrier in 1000 ms"), on every waiting rank rather than on rank 0 alone.

The public ``monitored_barrier(group, ...)`` and the group's own method
(``ProcessGroupCommd.monitored_barrier``) live in process_group.py, which imports this
module; this one names what it needs of a group as a Protocol (``BarrierGroup``), so
the two never import each other, not even for type checking.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

from commd.client.errors import CommTimeoutError
from commd.protocol.schema import MAX_OP_TIMEOUT_S


class Waitable(Protocol):
    def wait(self) -> object: ...


class BarrierGroup(Protocol):
    """What a monitored barrier needs of a commd group (``ProcessGroupCommd`` is one)."""

    global_ranks: list[int]

    @property
    def op_timeout(self) -> float: ...

    def rank(self) -> int: ...

    def barrier_within(self, timeout: float) -> Waitable: ...


def monitored_barrier_on(pg: BarrierGroup, timeout: timedelta | float | None = None,
                         wait_all_ranks: bool = False) -> None:
    """Wait until every rank of the commd group ``pg`` calls this; torch's
    ``dist.monitored_barrier`` for commd groups.

    ``timeout``: a timedelta (or seconds), None for the group's op timeout.  When it passes
    before every rank arrived, every waiting rank raises a CommTimeoutError (a
    ``torch.distributed.DistBackendError`` and a ``TimeoutError``) naming the first group rank
    that did not arrive, or all of them with ``wait_all_ranks``, as torch words it.  A rank
    that died instead raises the PeerDiedError naming it at once."""
    seconds = _seconds(timeout, pg)
    try:
        pg.barrier_within(seconds).wait()
    except CommTimeoutError as exc:
        missing = sorted(pg.global_ranks.index(r) for r in exc.missing_ranks or [] if r in pg.global_ranks)
        if not missing:
            raise
        raise CommTimeoutError(_not_passed(pg.rank(), missing, seconds, wait_all_ranks)
                               + f"\n Original exception: \n{exc}") from exc


def _seconds(timeout: timedelta | float | None, pg: BarrierGroup) -> float:
    if timeout is None:
        return pg.op_timeout
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"monitored_barrier: timeout must be a datetime.timedelta or seconds, got {timeout!r}")
    if not 0.001 <= seconds <= MAX_OP_TIMEOUT_S:
        raise ValueError(f"monitored_barrier: timeout {seconds}s must lie in [0.001, {MAX_OP_TIMEOUT_S:.0f}] seconds")
    return seconds


def _not_passed(rank: int, missing: list[int], seconds: float, wait_all_ranks: bool) -> str:
    """torch's words: '[Rank 0]: Rank 1 failed...' (the first), or 'Ranks 1, 2 failed...' (all); group ranks."""
    which = f"Ranks {', '.join(map(str, missing))}" if wait_all_ranks else f"Rank {missing[0]}"
    return f"[Rank {rank}]: {which} failed to pass monitoredBarrier in {round(seconds * 1000)} ms"
