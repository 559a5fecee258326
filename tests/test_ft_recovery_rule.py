"""The rule that ends a recovery's agreement (commd.ft.seats.Seats._recover), driven by hand.

After the survivors unite their views of who is gone, every one of them holds the same union.  They
must then all go again or all go on: again exactly when the union leaves out more ranks than the
group they built.  A survivor that learns of a loss which changes no survivor (a sharded guard's
second loss in a replica already gone) must go on with the others, not build the group again alone
while they wait for it in the next step of the recovery (found by benchmarks/ft.py --fsdp: 30 s).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import commd.ft.seats as seats_module
from commd.ft.seats import Seats


class _Survivor(Seats):
    """Rank 1 of 4, recovering: its daemon knows of ``known``; the other survivors add ``others``."""

    def __init__(self, known: set[int], others: set[int], replicas: bool) -> None:  # no process group
        self.min_ranks, self.recover_timeout, self.join_timeout = 1, 10.0, 10.0
        self.seats = self.ranks = (0, 1, 2, 3)
        self.group, self.steps, self.membership_epoch = None, 0, 0
        self.recoveries, self.joins, self.commit_seconds = [], [], 0.0
        self._me, self.op_timeout, self._prefix, self._store = 1, 30.0, "", None
        self.known, self.others, self.replicas = known, others, replicas
        self.installed: list[Any] = []

    def _survivors(self, known: set[int]) -> list[int]:
        if not self.replicas:
            return super()._survivors(known)
        broken = {rank // 2 for rank in known}  # replicas of 2 ranks, as ShardedGuard(shards=2)
        return [rank for rank in self.ranks if rank // 2 not in broken]

    def _wait_gone(self, deadline: float, known_any: bool, error: BaseException) -> set[int]:
        return set(self.known)

    def _attempt(self, epoch: int, survivors: list[int]) -> int:
        return 0

    def _union_of_views(self, group: Any, known: set[int]) -> set[int]:
        return known | self.others

    def _rebuild(self, group: Any, members: list[int], joining: list[int], tag: str) -> tuple[Any, int]:
        return ("model on", tuple(members)), 0

    def _check_states(self, built: Any, group: Any, members: list[int]) -> None:
        pass

    def _install(self, built: Any) -> None:
        self.installed.append(built)

    def _publish(self, epoch: int) -> None:
        pass

    def _report(self, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.mark.parametrize(("replicas", "groups", "survivors"), [
    (True, [[0, 1]], (0, 1)),  # rank 2's loss takes no one more: on with the group built
    (False, [[0, 1, 2], [0, 1]], (0, 1)),  # rank 2's loss changes the survivors: all go again
])
def test_survivors_go_again_exactly_when_the_united_view_changes_who_survives(
        monkeypatch: pytest.MonkeyPatch, replicas: bool, groups: list[list[int]], survivors: tuple[int, ...]) -> None:
    built: list[list[int]] = []
    monkeypatch.setattr(seats_module, "new_group",
                        lambda members, tag, timeout, op_timeout=None: built.append(list(members)) or object())
    guard = _Survivor(known={3}, others={2}, replicas=replicas)
    guard._recover(RuntimeError("PeerDiedError: rank 3 died"), time.monotonic(), time.time(), None)
    assert built == groups
    assert guard.ranks == survivors and guard.installed == [("model on", survivors)]
    assert [(r.gone, r.survivors) for r in guard.recoveries] == [((2, 3), survivors)]
