"""A daemon busy answering ``commd status`` queries still notices a dead rank.

commd.ft's survivors poll their daemon's status (every 20 ms each) while they wait to learn which
rank died.  The daemon answers the control socket from one callback of its event loop; that callback
must hand the loop back now and then, or a steady stream of queries keeps the watchdog (dead ranks,
op timeouts) from ever running: the survivors then wait out their whole recovery timeout for news
the daemon would have had within 0.1 s (seen under load in tests/test_ft_random.py).
"""

from __future__ import annotations

import threading
import time

import pytest

from commd.client.status import StatusError, query_status

pytestmark = [pytest.mark.extended, pytest.mark.timeout(120)]

POLLERS = 4
#: How soon the daemon must list the killed rank as gone while it is flooded with status queries.
BOUND_S = 3.0


def _idle(ctx) -> None:
    ctx.connect()
    ctx.command(timeout=100)


def test_a_flood_of_status_queries_does_not_keep_the_watchdog_from_seeing_a_dead_rank(daemon, start_workers) -> None:
    workers = start_workers(_idle, 2)
    paths = daemon.paths
    deadline = time.monotonic() + 30
    while len(query_status(paths)["clients"]) < 2:
        assert time.monotonic() < deadline, "the ranks did not connect"
        time.sleep(0.05)
    stop = threading.Event()
    seen: dict[str, float] = {}
    answered = [0]

    def poll() -> None:
        while not stop.is_set():
            try:
                status = query_status(paths, timeout=5.0)
            except StatusError:
                continue
            answered[0] += 1
            if "1" in status["membership"]["gone_ranks"]:
                seen.setdefault("gone", time.monotonic())

    threads = [threading.Thread(target=poll, daemon=True) for _ in range(POLLERS)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the queries flow
    killed = time.monotonic()
    workers.kill(1)  # SIGKILL, reaped at once: only the daemon's watchdog can tell
    while "gone" not in seen and time.monotonic() - killed < 20:
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    detected = seen.get("gone", float("inf")) - killed
    print(f"{answered[0]} status queries answered; rank 1 listed as gone {detected:.2f}s after its death")
    assert detected < BOUND_S, f"the daemon listed the dead rank as gone only after {detected:.1f}s"
