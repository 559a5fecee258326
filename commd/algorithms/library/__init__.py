"""The built-in algorithms, written in the DSL: each a function of the node count (one DSL rank = one node).

``get(name, nranks)`` compiles one (cached: programs are pure functions of their
arguments); ``names()`` lists them; ``describe(name)`` says what each is and the message
sizes it is meant for, which the compiled IR also carries as ``min_bytes``/``max_bytes``
(``max_bytes`` 0: no upper bound).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from commd.algorithms.collectives import AllToNext, Collective
from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import Algorithm
from commd.algorithms.library import allreduce, movement

KiB, MiB = 1024, 1024 * 1024


@dataclass(frozen=True)
class Entry:
    """One built-in program: how to build it, what it does, where it pays off."""

    build: Callable[..., Algorithm]
    coll: str
    description: str
    min_bytes: int
    max_bytes: int  # 0: unbounded
    min_nodes: int = 2
    postcondition: Callable[[int], Collective] | None = None  # a custom program's collective, by node count


_LIBRARY: dict[str, Entry] = {
    "oneshot": Entry(allreduce.oneshot, "allreduce",
                     "one-shot all-reduce: every node sends its buffer to all, each reduces all n in rank order",
                     0, 64 * KiB),
    "twoshot": Entry(allreduce.twoshot, "allreduce",
                     "two-shot all-reduce: all-pairs reduce-scatter, then all-pairs all-gather",
                     16 * KiB, 4 * MiB),
    "halving_doubling": Entry(allreduce.halving_doubling, "allreduce",
                              "recursive halving-doubling all-reduce (extra nodes folded in for non-powers of two)",
                              64 * KiB, 16 * MiB),
    "ring": Entry(allreduce.ring, "allreduce",
                  "ring all-reduce, bit for bit the native ring's reduction order", 1 * MiB, 0),
    "alltoall": Entry(movement.alltoall, "alltoall", "direct all-to-all: each block straight to its node", 0, 0),
    "alltonext": Entry(movement.alltonext, "custom", "AllToNext: node n's buffer to node n + 1", 0, 0,
                       postcondition=AllToNext),
}


def names() -> list[str]:
    """The built-in programs' names."""
    return list(_LIBRARY)


def describe(name: str) -> Entry:
    """What ``name`` is: its collective, description and size range."""
    if name not in _LIBRARY:
        raise ProgramError(f"no built-in algorithm {name!r} (there are: {', '.join(_LIBRARY)})", source="<library>")
    return _LIBRARY[name]


def sidecar(name: str, nranks: int) -> dict[str, Any] | None:
    """The postcondition of a ``custom`` built-in program in the sidecar format (None for the others)."""
    entry = describe(name)
    if entry.coll != "custom":
        return None
    return entry.postcondition(nranks).sidecar(f"{name}.xml") if entry.postcondition else None


def get(name: str, nranks: int, **kw: int) -> Algorithm:
    """Built-in program ``name`` for ``nranks`` nodes, compiled (``kw``: e.g. ``instances=2``)."""
    return _compiled(name, nranks, tuple(sorted(kw.items())))


@functools.lru_cache(maxsize=256)
def _compiled(name: str, nranks: int, kw: tuple[tuple[str, int], ...]) -> Algorithm:
    entry = describe(name)
    unknown = sorted(k for k, _ in kw if k != "instances")
    if unknown:
        raise ProgramError(f"{name} takes no option {', '.join(unknown)} (only instances)", source="<library>")
    if any(not isinstance(v, int) or v < 1 for _, v in kw):
        raise ProgramError(f"{name}: instances must be a whole number ≥ 1, not {dict(kw)['instances']!r}",
                           source="<library>")
    if not isinstance(nranks, int) or nranks < entry.min_nodes:
        raise ProgramError(f"{name} needs at least {entry.min_nodes} nodes, not {nranks!r}", source="<library>")
    algo = entry.build(nranks, **dict(kw))
    return dataclasses.replace(algo, min_bytes=entry.min_bytes, max_bytes=entry.max_bytes)
