"""The worker pool and the stall inspector on their own (no daemon)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from commd.execution.workers import INLINE_BYTES, LOCAL_KEY, WorkerPool, worker_key
from commd.observe.stalls import StallInspector


def run_on_loop(body, timeout: float = 10.0):
    """Run the coroutine ``body(loop)`` on a fresh event loop, bounded by ``timeout``."""
    async def main():
        return await asyncio.wait_for(body(asyncio.get_running_loop()), timeout)

    return asyncio.run(main())


def test_small_op_on_an_idle_key_runs_inline_and_large_one_on_a_thread() -> None:
    async def body(loop):
        pool = WorkerPool()
        pool.start(loop)
        threads: list[str] = []
        finished = loop.create_future()

        def job(inline: bool) -> bool:
            threads.append(threading.current_thread().name)
            return inline

        run_now = pool.submit(LOCAL_KEY, None, INLINE_BYTES, job, lambda inline: threads.append(f"done {inline}"))
        assert run_now is not None, "a small op on an idle key must be handed back to run inline"
        run_now()
        assert pool.submit(LOCAL_KEY, None, INLINE_BYTES + 1, job, finished.set_result) is None
        assert pool.busy() == 1
        assert await finished is False
        assert pool.busy() == 0
        pool.close(timeout=5)
        return threads

    threads = run_on_loop(body)
    assert threads[0] == threading.main_thread().name and threads[1] == "done True"
    assert threads[2] == f"commd-worker-{LOCAL_KEY}"


def test_inline_bytes_raises_the_size_limit_per_submission() -> None:
    """The fabric lets a lone medium op run inline (a larger ``inline_bytes``); the default stays."""
    async def body(loop):
        pool = WorkerPool()
        pool.start(loop)
        finished = loop.create_future()
        run_now = pool.submit("tcp", "g", 4 << 20, lambda inline: inline, lambda r: None, inline_bytes=4 << 20)
        assert run_now is not None, "an op within inline_bytes on an idle key must be handed back"
        run_now()
        assert pool.submit("tcp", "g", (4 << 20) + 1, lambda inline: inline, finished.set_result,
                           inline_bytes=4 << 20) is None
        assert await finished is False
        pool.close(timeout=5)

    run_on_loop(body)


def test_no_inline_while_the_key_is_busy_or_the_group_unfinished_and_program_order_across_keys() -> None:
    async def body(loop):
        pool = WorkerPool()
        pool.start(loop)
        release = threading.Event()
        order: list[str] = []
        done = [loop.create_future() for _ in range(3)]

        def slow(inline: bool) -> str:
            assert release.wait(10)
            order.append("first")
            return "first"

        def fast(inline: bool) -> str:
            order.append("later")
            return "later"

        assert pool.submit("tcp", "g", INLINE_BYTES + 1, slow, done[0].set_result) is None
        assert not pool.group_done("g")
        # Another key, small and idle, but its group's previous op is still running: queued, and it waits.
        assert pool.submit("gloo", "g", 16, fast, done[1].set_result) is None
        # The busy key itself never runs inline.
        assert pool.submit("tcp", None, 16, fast, done[2].set_result) is None
        await asyncio.sleep(0.2)
        assert order == [], "ops behind a running op of their key or group must wait"
        release.set()
        assert [await d for d in done] == ["first", "later", "later"]
        assert order == ["first", "later", "later"]
        assert pool.group_done("g") and pool.busy() == 0
        pool.close(timeout=5)

    run_on_loop(body)


def test_gpu_exclusive_lanes_share_one_key() -> None:
    assert worker_key("nccl", True) == worker_key("mpi", True) == "gpu-exclusive"
    assert worker_key("mpi", False) == "mpi" and worker_key("tcp", True) == "tcp"


def test_stall_inspector_warns_once_per_op_and_names_the_shutdown(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("commd.test-stalls")
    inspector = StallInspector(warning_s=5.0, shutdown_s=60.0, logger=logger)
    row = {"group": "g", "seq": 3, "kind": "allreduce", "waiting_s": 6.0, "missing_ranks": [1]}
    fresh = dict(row, seq=4, waiting_s=1.0)
    unsequenced = dict(row, seq=None, waiting_s=100.0)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        assert inspector.inspect([row, fresh, unsequenced]) is None
        assert inspector.inspect([dict(row, waiting_s=7.0)]) is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["stalled: allreduce #3 on group 'g' has waited 6s for ranks [1] to submit it"]
    late = dict(row, waiting_s=61.0)
    assert inspector.inspect([late], may_shut_down=False) is None
    assert inspector.inspect([late]) == "allreduce #3 on group 'g' stalled for 61s waiting for ranks [1]"
    fabric = StallInspector(5.0, 0.0, logger, name_nodes=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=logger.name):
        assert fabric.inspect([dict(late, missing_nodes=[2])]) is None  # 0: never shuts down
    assert [r.getMessage() for r in caplog.records] == [
        "stalled: allreduce #3 on group 'g' has waited 61s for ranks [1] (nodes [2])"]
