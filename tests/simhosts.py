"""pytest fixture ``sim_hosts``: simulated multi-node setups that are always torn down.

tests/conftest.py re-exports it (``from simhosts import sim_hosts``; tests/ is on
sys.path because conftest.py sits there and there is no __init__.py), so any
test can ask for it by name.

    def test_two_nodes(sim_hosts):
        hosts = sim_hosts(2, delay_ms=0.1, rate="10gbit")
        server = hosts[0].popen([...])

Tests skip (with the reason) where namespaces, or the requested shaping, are
not available: not root, no iproute2, a kernel without netem, ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from commd.sim.hosts import (
    DEFAULT_PREFIX,
    SimHostsError,
    SimulatedHosts,
    cleanup_stale,
    netns_unavailable,
    shaping_unavailable,
)

_stale_cleaned = False


def _cleanup_stale_once() -> None:
    """Remove leftovers of crashed earlier runs once per process, before the first instance."""
    global _stale_cleaned
    if not _stale_cleaned:
        _stale_cleaned = True
        cleanup_stale(DEFAULT_PREFIX)


@pytest.fixture
def sim_hosts() -> Iterator[Callable[..., SimulatedHosts]]:
    """Factory: ``sim_hosts(count, delay_ms=None, rate=None, prefix=None)`` -> an up SimulatedHosts.

    Every instance made is torn down at teardown (processes killed, namespaces,
    links and runtime dirs removed), whether the test passed or not.
    """
    made: list[SimulatedHosts] = []

    def make(count: int, delay_ms: float | None = None, rate: str | None = None,
             prefix: str | None = None) -> SimulatedHosts:
        sim = SimulatedHosts(count, delay_ms=delay_ms, rate=rate, prefix=prefix)  # validates first
        reason = netns_unavailable() or shaping_unavailable(delay_ms, rate)
        if reason:
            pytest.skip(reason)
        _cleanup_stale_once()
        made.append(sim)
        return sim.up()

    yield make
    problems = []
    for sim in reversed(made):
        try:
            sim.down()
        except SimHostsError as exc:
            problems.append(str(exc))
    if problems:
        pytest.fail("sim_hosts teardown left things behind: " + "; ".join(problems), pytrace=False)
