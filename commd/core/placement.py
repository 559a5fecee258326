"""Where a group's ranks live, per node (no torch: a single-node daemon needs it too)."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupPlacement:
    """Where a group's ranks live: ``node_of[g]`` is the node of group rank g."""

    name: str
    ranks: tuple[int, ...]  # global rank per group rank
    node_of: tuple[int, ...]
    me: int

    # Derived once per group (a placement lives as long as its group), not per op.
    @functools.cached_property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.node_of)))

    @functools.cached_property
    def _members(self) -> dict[int, list[int]]:
        by_node: dict[int, list[int]] = {n: [] for n in self.nodes}
        for g, n in enumerate(self.node_of):
            by_node[n].append(g)
        return by_node

    def members(self, node: int) -> list[int]:
        """The group ranks on ``node``, in group-rank order."""
        return self._members.get(node, [])

    @property
    def local(self) -> list[int]:
        return self.members(self.me)

    @functools.cached_property
    def multi_node(self) -> bool:
        return self.nodes != (self.me,)
