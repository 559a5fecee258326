"""Choosing one candidate per node of a graph at the least total cost: exact solvers and a descent.

The planner reduces a model to this problem (``Problem``): every node (a layer) has candidates
(its strategies), each with a cost of its own (compute, parameter sync), and every edge a cost
per pair of candidates at its two ends (the layout conversions, forward and backward).  The
total is the sum of the chosen candidates' costs and of the chosen pairs' edge costs.

- ``exact_chain``: dynamic programming, for a chain (each node's only predecessor is the node
  before it): O(n·k²).
- ``exact_dag``: an integer program (scipy's MILP, HiGHS) for any graph: a binary per candidate
  and a continuous per candidate pair of each edge, tied to its ends.
- ``descent``: coordinate descent over windows of adjacent nodes (every combination of the
  window's candidates, the rest held; on a graph, each edge's ends too) from several starts, until
  no window improves.  Measured on 200 seeded random problems of 3-11 nodes and 2-4 candidates with
  arbitrary costs: windows of two from 4 random starts missed the optimum on 9 chains and 8 graphs,
  from 16 on 1 chain and 1 graph; windows of three from 16 on 1 graph, from 32 on none.  On the
  planner's own problems (200 random models, tests/test_planner.py) windows of two from the
  planner's starts missed 2, windows of three none, so the planner uses three; without Megatron's
  column/row pairs in both phases among the starts, windows of three missed 4 (shifting every
  pair by one layer changes four or more layers at once).  ``--search both`` checks any plan
  against the exact optimum.  A window's every combination is one NumPy array.
- ``brute_force``: every combination, for checking the others on small graphs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

#: Relative tolerance when comparing totals (costs are floats).
TOLERANCE = 1e-9


class SearchError(ValueError):
    """A problem a solver cannot take, or one it found no solution for; the message says which."""


@dataclass
class Problem:
    """``node_costs[v][s]``: candidate s of node v; ``edges[(u, v)][s][t]``: the edge u → v with u at
    candidate s and v at t (u < v: nodes are numbered in a topological order)."""

    node_costs: list[list[float]]
    edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for v, costs in enumerate(self.node_costs):
            if not costs:
                raise SearchError(f"node {v} has no candidate")
        for (u, v), matrix in self.edges.items():
            if not 0 <= u < v < len(self.node_costs):
                raise SearchError(f"edge {u} -> {v}: nodes must be numbered in a topological order")
            if matrix.shape != (len(self.node_costs[u]), len(self.node_costs[v])):
                raise SearchError(f"edge {u} -> {v}: a {matrix.shape} cost matrix for "
                                  f"{len(self.node_costs[u])} x {len(self.node_costs[v])} candidates")

    @property
    def size(self) -> int:
        return len(self.node_costs)

    def total(self, choice: Sequence[int]) -> float:
        """The cost of one candidate per node."""
        cost = sum(self.node_costs[v][s] for v, s in enumerate(choice))
        return cost + sum(float(m[choice[u], choice[v]]) for (u, v), m in self.edges.items())

    def is_chain(self) -> bool:
        return all(v == u + 1 for u, v in self.edges) and len(self.edges) == len({v for _, v in self.edges})

    def neighbours(self) -> list[list[tuple[int, np.ndarray, bool]]]:
        """Per node, its edges as (other node, matrix, whether this node is the edge's source)."""
        near: list[list[tuple[int, np.ndarray, bool]]] = [[] for _ in self.node_costs]
        for (u, v), m in self.edges.items():
            near[u].append((v, m, True))
            near[v].append((u, m, False))
        return near


@dataclass
class Solution:
    choice: list[int]
    total: float
    method: str


def exact_chain(problem: Problem) -> Solution:
    """The optimum of a chain by dynamic programming."""
    if not problem.is_chain():
        raise SearchError("exact_chain takes a chain (each node's only predecessor is the node before it)")
    best = np.asarray(problem.node_costs[0], dtype=float)
    back: list[np.ndarray] = []
    for v in range(1, problem.size):
        own = np.asarray(problem.node_costs[v], dtype=float)
        edge = problem.edges.get((v - 1, v))
        if edge is None:
            k = int(np.argmin(best))
            back.append(np.full(len(own), k))
            best = best[k] + own
            continue
        through = best[:, None] + edge  # [previous candidate, this candidate]
        back.append(np.argmin(through, axis=0))
        best = through.min(axis=0) + own
    choice = [int(np.argmin(best))]
    for pointers in reversed(back):
        choice.append(int(pointers[choice[-1]]))
    choice.reverse()
    return Solution(choice, problem.total(choice), "dynamic programming")


def exact_dag(problem: Problem, time_limit_s: float = 60.0) -> Solution:
    """The optimum of any graph as an integer program: x[v, s] binary, sum_s x[v, s] = 1; for each
    edge a y[s, t] >= 0 with sum_t y[s, t] = x[u, s] and sum_s y[s, t] = x[v, t] (so y is the pair's
    indicator once the x are whole); minimise the node and edge costs."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_array

    x_at: list[int] = []
    n = 0
    for costs in problem.node_costs:
        x_at.append(n)
        n += len(costs)
    y_at: dict[tuple[int, int], int] = {}
    for key, m in problem.edges.items():
        y_at[key] = n
        n += m.size
    c = np.zeros(n)
    for v, costs in enumerate(problem.node_costs):
        c[x_at[v]:x_at[v] + len(costs)] = costs
    for key, m in problem.edges.items():
        c[y_at[key]:y_at[key] + m.size] = m.reshape(-1)
    rows = problem.size + sum(m.shape[0] + m.shape[1] for m in problem.edges.values())
    a = lil_array((rows, n))
    r = 0
    for v, costs in enumerate(problem.node_costs):
        a[r, x_at[v]:x_at[v] + len(costs)] = 1
        r += 1
    for (u, v), m in problem.edges.items():
        ku, kv = m.shape
        base = y_at[(u, v)]
        for s in range(ku):  # sum_t y[s, t] - x[u, s] = 0
            a[r, base + s * kv: base + (s + 1) * kv] = 1
            a[r, x_at[u] + s] = -1
            r += 1
        for t in range(kv):  # sum_s y[s, t] - x[v, t] = 0
            for s in range(ku):
                a[r, base + s * kv + t] = 1
            a[r, x_at[v] + t] = -1
            r += 1
    lower = np.zeros(rows)
    lower[[x for x in range(rows) if x < problem.size]] = 1
    integrality = np.zeros(n)
    integrality[:x_at[-1] + len(problem.node_costs[-1])] = 1
    result = milp(c, constraints=LinearConstraint(a.tocsr(), lower, lower), integrality=integrality,
                  bounds=Bounds(0, 1), options={"time_limit": time_limit_s})
    if result.x is None or result.status not in (0,):
        raise SearchError(f"the integer program found no optimum: {result.message}")
    choice = [int(np.argmax(result.x[x_at[v]:x_at[v] + len(costs)])) for v, costs in enumerate(problem.node_costs)]
    return Solution(choice, problem.total(choice), "integer program")


def exact(problem: Problem) -> Solution:
    """The optimum: dynamic programming on a chain, the integer program otherwise."""
    return exact_chain(problem) if problem.is_chain() else exact_dag(problem)


def descent(problem: Problem, window: int = 2, starts: Iterable[Sequence[int]] | None = None,
            random_starts: int = 16, seed: int = 0, max_rounds: int = 100) -> Solution:
    """Coordinate descent over windows of ``window`` adjacent nodes, from each start (the cheapest
    candidate of every node on its own, the given ``starts``, ``random_starts`` random ones); the
    best end point."""
    if window < 1:
        raise SearchError("the window must hold at least one node")
    rng = np.random.default_rng(seed)
    begins = [[int(np.argmin(costs)) for costs in problem.node_costs]]
    begins += [list(s) for s in (starts or [])]
    begins += [[int(rng.integers(len(costs))) for costs in problem.node_costs] for _ in range(random_starts)]
    near = problem.neighbours()
    best: Solution | None = None
    for begin in begins:
        if len(begin) != problem.size:
            raise SearchError(f"a start names {len(begin)} candidates for {problem.size} nodes")
        choice = _descend(problem, near, list(begin), window, max_rounds)
        total = problem.total(choice)
        if best is None or total < best.total * (1 - TOLERANCE) - TOLERANCE:
            best = Solution(choice, total, f"coordinate descent (windows of {window})")
    assert best is not None
    return best


def _windows(problem: Problem, window: int) -> list[list[int]]:
    """Runs of ``window`` consecutive nodes, and on a graph that is not a chain each edge's two ends
    too (their neighbours in the graph, which need not be neighbours in the numbering)."""
    width = min(window, problem.size)
    runs = [list(range(lo, lo + width)) for lo in range(problem.size - width + 1)]
    if width >= 2 and not problem.is_chain():
        runs += [[u, v] for u, v in problem.edges if v != u + 1]
    return runs


def _descend(problem: Problem, near: list[list[tuple[int, np.ndarray, bool]]], choice: list[int], window: int,
             max_rounds: int) -> list[int]:
    windows = _windows(problem, window)
    for _ in range(max_rounds):
        improved = False
        for nodes in windows:
            table = _window_table(problem, near, choice, nodes)
            current = float(table[tuple(choice[v] for v in nodes)])
            best = np.unravel_index(int(np.argmin(table)), table.shape)
            if float(table[best]) < current - TOLERANCE * max(1.0, abs(current)):
                for v, s in zip(nodes, best, strict=True):
                    choice[v] = int(s)
                improved = True
        if not improved:
            break
    return choice


def _window_table(problem: Problem, near: list[list[tuple[int, np.ndarray, bool]]], choice: list[int],
                  nodes: list[int]) -> np.ndarray:
    """The part of the total that depends on the window's candidates, for every combination of them
    (an array with one axis per window node), the other nodes held at ``choice``."""
    axis = {v: a for a, v in enumerate(nodes)}
    shape = [len(problem.node_costs[v]) for v in nodes]
    table = np.zeros(shape)

    def along(a: int, values: np.ndarray) -> np.ndarray:
        return values.reshape([-1 if b == a else 1 for b in range(len(nodes))])

    for v in nodes:
        a = axis[v]
        own = np.asarray(problem.node_costs[v], dtype=float)
        for other, m, source in near[v]:
            if other in axis:
                if source:  # an edge inside the window, counted once from its source
                    b = axis[other]
                    pair = m if a < b else m.T
                    table = table + pair.reshape([shape[x] if x in (a, b) else 1 for x in range(len(nodes))])
            else:
                own = own + (m[:, choice[other]] if source else m[choice[other], :])
        table = table + along(a, own)
    return table


def brute_force(problem: Problem, limit: int = 1_000_000) -> Solution:
    """Every combination (for tests on small problems)."""
    count = int(np.prod([len(c) for c in problem.node_costs], dtype=float))
    if count > limit:
        raise SearchError(f"{count} combinations are too many to enumerate (limit {limit})")
    best = min(itertools.product(*(range(len(c)) for c in problem.node_costs)), key=problem.total)
    return Solution(list(best), problem.total(best), "every combination")
