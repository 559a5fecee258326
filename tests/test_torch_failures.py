"""Failures reach torch users through every API: wait(), the future, exception(), DDP.

Ranks are separate processes (spawned, not forked) that report what happened
through a queue, so a rank that dies or hangs on purpose does not take the
test's view of the others with it.  No daemon is started here: the first rank
starts one, as in a real job.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.timeout(240)

WORLD = 2
#: Bound on a whole test's ranks; every wait below is shorter.
RANKS_BOUND_S = 90.0


class Ranks:
    """WORLD spawned rank processes running ``target(rank, events, *args)``."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.events: Any = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, args=(target, r, self.events, args)) for r in range(WORLD)]
        for proc in self.procs:
            proc.start()
        self.seen: list[tuple[int, str, Any]] = []

    def next_event(self, rank: int, timeout: float) -> tuple[str, Any]:
        """The next event of ``rank`` (earlier events of other ranks are kept in ``seen``)."""
        deadline = time.monotonic() + timeout
        for i, (r, name, payload) in enumerate(self.seen):
            if r == rank:
                del self.seen[i]
                return name, payload
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"rank {rank} reported nothing within {timeout:.0f}s")
            try:
                r, name, payload = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if r == rank:
                return name, payload
            self.seen.append((r, name, payload))

    def outcome(self, rank: int, timeout: float) -> tuple[list[int], tuple[str, str] | None, float]:
        """Steps ``rank`` completed, the error it raised (type, message) if any, and when it stopped."""
        steps: list[int] = []
        while True:
            name, payload = self.next_event(rank, timeout)
            if name == "step":
                steps.append(payload)
            elif name == "error":
                return steps, payload, time.monotonic()
            elif name == "done":
                return steps, None, time.monotonic()

    def close(self) -> None:
        for proc in self.procs:
            proc.join(timeout=15)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def _rank_main(target: Callable[..., None], rank: int, events: Any, args: tuple[Any, ...]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    try:
        target(rank, events, *args)
    except BaseException as exc:  # reported to the test, which judges it
        events.put((rank, "error", (type(exc).__name__, str(exc))))
    else:
        events.put((rank, "done", None))
    # Leave without running exit handlers (a failed job's client may not close cleanly),
    # but only after the queue's feeder thread has delivered every event.
    events.close()
    events.join_thread()
    os._exit(0)


# ---- the ranks' programs -------------------------------------------------------
def _mismatch_everywhere(rank: int, events: Any) -> None:
    """Three mismatched all_reduces (one per way of learning the result), then a good one."""
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd")
    seen = {}
    work = dist.all_reduce(torch.ones(100 + rank), async_op=True)
    try:
        work.get_future().wait()
        seen["future"] = None
    except Exception as exc:
        seen["future"] = f"{type(exc).__name__}: {exc}"
    work = dist.all_reduce(torch.ones(100 + rank), async_op=True)
    try:
        work.wait()
        seen["wait"] = None
    except Exception as exc:
        seen["wait"] = f"{type(exc).__name__}: {exc}"
    work = dist.all_reduce(torch.ones(100 + rank), async_op=True)
    try:
        work.wait()
    except Exception:
        pass
    error = work.exception()
    seen["exception"] = None if error is None else f"{type(error).__name__}: {error}"
    seen["is_success"] = work.is_success()
    good = torch.full((10,), float(rank + 1))
    dist.all_reduce(good)
    seen["good"] = good.tolist()
    events.put((rank, "seen", seen))
    dist.destroy_process_group()


def _ddp_training(rank: int, events: Any, failure: str, pg_timeout_s: float | None) -> None:
    """DDP steps; rank 1 fails at step 3 (``exit``: dies; ``stall``: stops calling)."""
    import commd  # noqa: F401

    kwargs = {} if pg_timeout_s is None else {"timeout": timedelta(seconds=pg_timeout_s)}
    dist.init_process_group("commd", **kwargs)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        if rank == 1 and step == 3:
            if failure == "exit":
                os._exit(3)
            events.put((rank, "stalled", step))
            time.sleep(3600)  # the test kills this rank
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step * WORLD + rank))
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
        events.put((rank, "step", step))


def _late_peer(rank: int, events: Any, pg_timeout_s: float | None) -> None:
    """Rank 0 all_reduces; rank 1 never does and leaves once rank 0 has its answer."""
    import commd  # noqa: F401

    kwargs = {} if pg_timeout_s is None else {"timeout": timedelta(seconds=pg_timeout_s)}
    dist.init_process_group("commd", **kwargs)
    dist.barrier()
    if rank == 0:
        start = time.monotonic()
        events.put((rank, "started", None))
        try:
            dist.all_reduce(torch.ones(16))
            events.put((rank, "result", ("none", time.monotonic() - start)))
        except Exception as exc:
            events.put((rank, "result", (type(exc).__name__ + ": " + str(exc), time.monotonic() - start)))
    else:
        time.sleep(RANKS_BOUND_S)  # the test ends this rank


# ---- tests ---------------------------------------------------------------------------
def test_mismatch_reaches_future_wait_and_exception_on_every_rank(backend_env: Path) -> None:
    ranks = Ranks(_mismatch_everywhere)
    try:
        for rank in range(WORLD):
            name, seen = ranks.next_event(rank, RANKS_BOUND_S)
            assert name == "seen", f"rank {rank} failed: {seen}"
            for api in ("future", "wait", "exception"):
                assert seen[api] is not None, f"rank {rank}: the mismatch did not reach {api}()"
                assert "MismatchError: mismatched collective" in seen[api], (rank, api, seen[api])
                assert "'count' differs" in seen[api], (rank, api, seen[api])
            assert seen["is_success"] is False
            assert seen["good"] == [3.0] * 10, "the group must keep working after the mismatches"
    finally:
        ranks.close()


def test_ddp_rank_exit_stops_every_rank(backend_env: Path) -> None:
    """Rank 1 hard-exits at step 3: rank 0 raises at step 3, naming rank 1, and never steps on."""
    ranks = Ranks(_ddp_training, "exit", 20.0)
    try:
        steps, error, _ = ranks.outcome(0, RANKS_BOUND_S)
        assert error is not None, f"rank 0 completed steps {steps} without noticing rank 1 died"
        assert steps == [0, 1, 2], f"rank 0 completed steps {steps}; rank 1 died before step 3"
        assert "rank 1" in error[1], f"the error should name rank 1: {error}"
    finally:
        ranks.close()


@pytest.mark.extended
def test_ddp_stalled_rank_times_out_within_the_group_timeout(backend_env: Path) -> None:
    """Rank 1 stops calling at step 3 under a 5 s group timeout: rank 0 raises and never steps on."""
    ranks = Ranks(_ddp_training, "stall", 5.0)
    try:
        steps_1: list[int] = []
        while (event := ranks.next_event(1, RANKS_BOUND_S))[0] == "step":
            steps_1.append(event[1])
        assert event == ("stalled", 3) and steps_1 == [0, 1, 2], (steps_1, event)
        stalled_at = time.monotonic()
        steps, error, stopped_at = ranks.outcome(0, 40.0)
        assert error is not None, f"rank 0 completed steps {steps} without its peer"
        assert steps == [0, 1, 2], steps
        assert "timed out" in error[1] and "1" in error[1], error
        assert stopped_at - stalled_at < 30.0, f"raised {stopped_at - stalled_at:.1f}s after the stall"
    finally:
        ranks.procs[1].kill()
        ranks.close()


@pytest.mark.parametrize(
    ("env_timeout", "pg_timeout", "expected"),
    [pytest.param("5", None, 5.0, id="COMMD_OP_TIMEOUT-without-timeout-arg"),
     pytest.param("60", 4.0, 4.0, id="explicit-timeout-arg-wins", marks=pytest.mark.extended)],  # (make test-extended)
)
def test_op_timeout_rule(
    backend_env: Path, monkeypatch: pytest.MonkeyPatch, env_timeout: str, pg_timeout: float | None, expected: float
) -> None:
    """torch's default group timeout no longer hides commd's: COMMD_OP_TIMEOUT, or an explicit timeout=."""
    monkeypatch.setenv("COMMD_OP_TIMEOUT", env_timeout)
    ranks = Ranks(_late_peer, pg_timeout)
    try:
        assert ranks.next_event(0, RANKS_BOUND_S)[0] == "started"
        name, (outcome, elapsed) = ranks.next_event(0, 45.0)
        assert "CommTimeoutError" in outcome and "timed out" in outcome, outcome
        assert "1" in outcome.split("timed out")[-1], f"the error should name the missing rank: {outcome}"
        assert expected - 0.5 <= elapsed < expected + 10.0, f"timed out after {elapsed:.1f}s, expected ~{expected}s"
    finally:
        ranks.procs[1].kill()
        ranks.close()
