"""commd's failures are torch.distributed's error types, and ``commd.monitored_barrier`` names who is missing.

User code written for torch's backends catches ``torch.distributed.DistBackendError``
(NCCL raises it; its subclasses ``DistNetworkError`` and ``DistStoreError`` for network
and store failures).  Each failure a user can provoke through the torch backend is
provoked here on spawned ranks of the commd backend, and caught there with exactly that
``except`` clause; where Gloo can meet the same failure it runs the same rank program
as the reference: what torch's own tests expect of Gloo (a barrier's timeout message,
monitored_barrier's report) commd must meet too.  The class hierarchy itself, pickling
and the import orders are checked in process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from datetime import timedelta
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cluster import free_port

import commd
from commd.client import errors
from commd.protocol import schema as s

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
#: Bound on one run's ranks reporting (they start torch and, for commd, a daemon, on a busy machine).
RANKS_BOUND_S = 120.0
#: What torch's DistributedTest._test_barrier_timeout expects of a barrier that timed out (Gloo only there).
TORCH_TIMEOUT_MESSAGE = re.compile(" (Timed out|closed|timeout) ")
TORCH_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError", "TimeoutError")


# ---- the class hierarchy (in process) ----------------------------------------------------
#: Each commd error and the torch.distributed types (and TimeoutError) it must also be.
EXPECTED_TYPES: dict[type, set[str]] = {
    errors.CommdError: {"DistBackendError"},
    errors.ConnectError: {"DistBackendError", "DistNetworkError"},
    errors.UntrustedDaemonError: {"DistBackendError", "DistNetworkError"},
    errors.StoreError: {"DistBackendError", "DistStoreError"},
    errors.AuthError: {"DistBackendError"},
    errors.RequestError: {"DistBackendError"},
    errors.LimitExceededError: {"DistBackendError"},
    errors.MismatchError: {"DistBackendError"},
    errors.PeerDiedError: {"DistBackendError", "DistNetworkError"},
    errors.CommTimeoutError: {"DistBackendError", "TimeoutError"},
    errors.DaemonShutdownError: {"DistBackendError"},
    errors.DaemonDiedError: {"DistBackendError", "DistNetworkError"},
    errors.UnrecoverableError: {"DistBackendError"},
}


def _torch_types(exc: BaseException) -> set[str]:
    kinds = {"DistBackendError": dist.DistBackendError, "DistNetworkError": dist.DistNetworkError,
             "DistStoreError": dist.DistStoreError, "TimeoutError": TimeoutError}
    return {name for name, kind in kinds.items() if isinstance(exc, kind)}


def test_every_commd_error_is_listed() -> None:
    public = {v for v in vars(errors).values()
              if isinstance(v, type) and issubclass(v, errors.CommdError) and not v.__name__.startswith("_")}
    assert public == set(EXPECTED_TYPES), public ^ set(EXPECTED_TYPES)


@pytest.mark.parametrize("cls", list(EXPECTED_TYPES), ids=lambda c: c.__name__)
def test_each_commd_error_is_the_matching_torch_type_keeping_name_and_message(cls: type) -> None:
    message = f"{cls.__name__} happened on rank 1"
    exc = cls(message)
    assert _torch_types(exc) == EXPECTED_TYPES[cls]
    assert isinstance(exc, RuntimeError) and isinstance(exc, errors.CommdError)
    assert (type(exc).__name__, type(exc).__module__) == (cls.__name__, "commd.client.errors")
    assert str(exc) == message and exc.args == (message,)
    with pytest.raises(dist.DistError, match="happened on rank 1"):  # torch's base of all its types
        raise exc


@pytest.mark.parametrize("cls", list(EXPECTED_TYPES), ids=lambda c: c.__name__)
def test_errors_survive_pickling_with_their_type_and_message(cls: type) -> None:
    exc = pickle.loads(pickle.dumps(cls("lost rank 3")))
    assert type(exc) is cls and str(exc) == "lost rank 3" and _torch_types(exc) == EXPECTED_TYPES[cls]


@pytest.mark.parametrize(("code", "cls"), [(s.E_MISMATCH, errors.MismatchError), (s.E_TIMEOUT, errors.CommTimeoutError),
                                           (s.E_PEER_DIED, errors.PeerDiedError), (s.E_LIMIT, errors.LimitExceededError),
                                           (s.E_BOUNDS, errors.RequestError), ("no such code", errors.CommdError)])
def test_daemon_replies_map_to_the_torch_typed_errors(code: str, cls: type) -> None:
    exc = errors.from_reply(code, "the daemon's words")
    assert type(exc) is cls and str(exc) == "the daemon's words" and "DistBackendError" in _torch_types(exc)


def test_a_timeout_names_its_missing_ranks_and_reads_as_torch_expects() -> None:
    message = s.not_submitted("barrier #4 on group 'g'", "group ranks [0, 2]", [7, 3], 1.5)
    exc = errors.CommTimeoutError(message)
    assert exc.missing_ranks == [3, 7]
    assert TORCH_TIMEOUT_MESSAGE.search(message), message
    assert errors.CommTimeoutError("no answer from the commd daemon in time").missing_ranks is None
    try:
        raise exc
    except TimeoutError as caught:  # Python's own timeout, as before
        assert caught is exc and caught.errno is None


#: Imports commd and torch in the order given, raises a PeerDiedError made before torch (if it
#: was), and says how it was caught; the last line is the verdict.
_IMPORT_ORDER_PROBE = """
import sys
{before}
import commd.client.errors as errors
early = errors.PeerDiedError("rank 1 died")
torch_before_commd_names = "torch" in sys.modules
{after}
import torch.distributed as dist
try:
    raise early
except dist.DistNetworkError as exc:
    caught = type(exc).__name__
print("torch-first" if torch_before_commd_names else "torch-later", caught,
      issubclass(errors.CommTimeoutError, (dist.DistBackendError, TimeoutError)))
"""


@pytest.mark.parametrize(("before", "after", "expected_start", "autoload"), [
    ("", "import commd, torch", "torch-later", "0"),
    ("import torch", "import commd", "torch-first", "0"),
    ("import torch.distributed", "", "torch-first", "0"),
    ("", "import torch", "torch-later", "0"),
    ("import torch", "", "torch-first", "1"),
], ids=["commd-then-torch", "torch-then-commd", "torch.distributed-then-errors", "errors-alone-then-torch",
        "torch-autoloads-commd"])
def test_errors_become_torch_types_in_any_import_order(before: str, after: str, expected_start: str,
                                                       autoload: str) -> None:
    if autoload == "1" and not any(e.value.startswith("commd.") for e in entry_points(group="torch.backends")):
        pytest.skip("commd is not installed (no torch.backends entry point)")
    code = textwrap.dedent(_IMPORT_ORDER_PROBE).format(before=before, after=after)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD=autoload), check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [expected_start, "PeerDiedError", "True"], proc.stdout


def test_importing_commd_still_does_not_import_torch() -> None:
    code = "import sys, commd\nassert 'torch' not in sys.modules\nprint(commd.CommdError.__mro__[1].__name__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"), check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "_DistLayout", proc.stdout  # a plain RuntimeError until torch loads


# ---- ranks ------------------------------------------------------------------------------
def run_ranks(target: Callable[..., dict[str, Any]], world: int, reporters: list[int], *args: Any
              ) -> dict[int, dict[str, Any]]:
    """Spawn ``world`` ranks running ``target(rank, *args)`` (each returns what it saw) and collect the
    reports of ``reporters``; the other ranks (those that stay away on purpose) are killed after."""
    ctx = mp.get_context("spawn")
    events: Any = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(target, r, world, port, events, args)) for r in range(world)]
    for proc in procs:
        proc.start()
    reports: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + RANKS_BOUND_S
    try:
        while not set(reporters) <= set(reports):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"ranks {sorted(set(reporters) - set(reports))} reported nothing within "
                                     f"{RANKS_BOUND_S:.0f}s (got {reports})")
            try:
                rank, report = events.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            reports[rank] = report
    finally:
        for rank, proc in enumerate(procs):
            if rank in reports:
                proc.join(timeout=20)  # it leaves right after reporting
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    return reports


def _rank_main(target: Callable[..., dict[str, Any]], rank: int, world: int, port: int, events: Any,
               args: tuple[Any, ...]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        report = target(rank, *args)
    except BaseException as exc:  # the rank's program itself failed: the test says so
        report = {"crashed": f"{type(exc).__name__}: {exc}"}
    events.put((rank, report))
    events.close()
    events.join_thread()
    os._exit(0)  # no exit handlers: a failed job's client may not close cleanly


def observe(call: Callable[[], Any]) -> dict[str, Any]:
    """Run ``call`` the way user code written for torch's backends does, and say what it raised."""
    start = time.monotonic()
    try:
        call()
    except dist.DistBackendError as exc:
        return _seen(exc, "DistBackendError", start)
    except Exception as exc:  # what torch's Gloo raises: a plain RuntimeError
        return _seen(exc, "Exception", start)
    return {"raised": False, "elapsed": time.monotonic() - start}


def _seen(exc: BaseException, caught_by: str, start: float) -> dict[str, Any]:
    return {"raised": True, "caught_by": caught_by, "type": type(exc).__name__, "module": type(exc).__module__,
            "torch_types": _torch_types(exc), "message": str(exc), "elapsed": time.monotonic() - start,
            "missing_ranks": getattr(exc, "missing_ranks", None)}


def _init(backend: str) -> None:
    if backend == "commd":
        import commd  # noqa: F401 - registers the backend
    dist.init_process_group(backend)


def _stay_away() -> dict[str, Any]:
    """A rank that never reaches the op: it stays alive (the run kills it) so that nobody sees it die."""
    time.sleep(RANKS_BOUND_S)
    return {}


# ---- the ranks' programs --------------------------------------------------------------
def _mismatched_sizes(rank: int, backend: str) -> dict[str, Any]:
    _init(backend)
    seen: dict[str, Any] = {}
    work = dist.all_reduce(torch.ones(100 + rank), async_op=True)
    seen["wait"] = observe(work.wait)
    error = work.exception()
    seen["exception"] = None if error is None else _seen(error, "exception()", time.monotonic())
    seen["future"] = observe(dist.all_reduce(torch.ones(100 + rank), async_op=True).get_future().wait)
    seen["sync"] = observe(lambda: dist.all_reduce(torch.ones(100 + rank)))
    return seen


def _barrier_alone(rank: int, backend: str, timeout_s: float) -> dict[str, Any]:
    """torch's _test_barrier_timeout on a full group with a timeout: only rank 0 calls the barrier."""
    _init(backend)
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    if rank != 0:
        return _stay_away()
    return observe(lambda: dist.barrier(group))


def _peer_exits(rank: int, backend: str) -> dict[str, Any]:
    _init(backend)
    dist.barrier()
    if rank == 1:
        os._exit(3)
    return {"small": observe(lambda: dist.all_reduce(torch.ones(4))),
            "large": observe(lambda: dist.all_reduce(torch.ones(1 << 17)))}


def _past_the_pending_limit(rank: int) -> dict[str, Any]:
    """COMMD_MAX_PENDING_OPS=2: rank 1 never joins rank 0's barriers, so the third is refused."""
    _init("commd")
    if rank != 0:
        return _stay_away()
    works = [dist.barrier(async_op=True) for _ in range(2)]
    return {"third": observe(lambda: dist.barrier(async_op=True).wait()), "pending": [w.is_completed() for w in works]}


def _daemon_killed(rank: int) -> dict[str, Any]:
    """Rank 0's all-reduce is pending (rank 1 stays away) when its node daemon dies."""
    import signal

    from commd.torch_backend.process_group import current_client

    _init("commd")
    if rank != 0:
        return _stay_away()
    work = dist.all_reduce(torch.ones(1 << 17), async_op=True)
    os.kill(current_client().daemon_pid, signal.SIGKILL)
    return {"pending": observe(work.wait), "next": observe(lambda: dist.all_reduce(torch.ones(1 << 17)))}


def _alone_in_a_file_store(rank: int, backend: str, store: str) -> dict[str, Any]:
    """Rank 0 of 2 creates the backend; rank 1 never calls init_process_group."""
    if backend == "commd":
        import commd  # noqa: F401
    if rank != 0:
        return _stay_away()
    return observe(lambda: dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=2,
                                                   timeout=timedelta(seconds=2)))


def _monitored(rank: int, backend: str, away: list[int], wait_all_ranks: bool) -> dict[str, Any]:
    _init(backend)
    if rank in away:
        return _stay_away()
    timeout = timedelta(seconds=1)
    if backend == "commd":
        return observe(lambda: commd.monitored_barrier(timeout=timeout, wait_all_ranks=wait_all_ranks))
    return observe(lambda: dist.monitored_barrier(timeout=timeout, wait_all_ranks=wait_all_ranks))


def _group_monitored(rank: int, backend: str, away: list[int]) -> dict[str, Any]:
    """torch's test_monitored_barrier_gloo_rank_0_timeout calls the group's own method, not dist's."""
    _init(backend)
    group = dist.new_group(ranks=list(range(dist.get_world_size())))
    if rank in away:
        return _stay_away()
    return observe(lambda: group.monitored_barrier(timedelta(seconds=1)))


def _monitored_then_sum(rank: int) -> dict[str, Any]:
    """Everyone arrives: the barrier passes, and the group's next op agrees (the barrier kept it in step)."""
    _init("commd")
    seen = {"barrier": observe(lambda: commd.monitored_barrier(timeout=timedelta(seconds=30)))}
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    seen["sum"] = total.item()
    return seen


# ---- failures through the torch backend ------------------------------------------------------
def test_a_mismatch_is_a_dist_backend_error_through_wait_exception_and_sync_ops(backend_env: Path) -> None:
    reports = run_ranks(_mismatched_sizes, 2, [0, 1], "commd")
    for rank, seen in reports.items():
        assert "crashed" not in seen, seen
        for api in ("wait", "exception", "sync"):
            got = seen[api]
            assert got is not None and got["type"] == "MismatchError", (rank, api, got)
            assert got["caught_by"] in ("DistBackendError", "exception()") and got["torch_types"] == {
                "DistBackendError"}, (rank, api, got)
            assert "'count' differs: ranks [0] 100, ranks [1] 101" in got["message"], (rank, api, got)
        # torch's futures fail in C++ with a RuntimeError made from the text (Gloo's fail as RuntimeErrors too)
        future = seen["future"]
        assert future["raised"] and future["caught_by"] == "Exception", future
        assert "MismatchError: mismatched collective" in future["message"], future


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
@pytest.mark.parametrize("backend", ["commd", "gloo"])
def test_a_barrier_timeout_meets_torchs_barrier_timeout_test(backend_env: Path, backend: str) -> None:
    """torch's test_barrier_timeout_full_group (run there on Gloo only): same regex, no earlier than the timeout."""
    timeout_s = 1.0
    seen = run_ranks(_barrier_alone, 2, [0], backend, timeout_s)[0]
    assert seen.get("raised"), seen
    assert TORCH_TIMEOUT_MESSAGE.search(seen["message"]), seen["message"]
    assert timeout_s - 0.1 <= seen["elapsed"] < timeout_s + 10, seen
    if backend == "commd":
        assert seen["caught_by"] == "DistBackendError" and seen["type"] == "CommTimeoutError", seen
        assert seen["torch_types"] == {"DistBackendError", "TimeoutError"}, seen
        assert seen["missing_ranks"] == [1] and "group ranks [1]" in seen["message"], seen
    else:
        assert seen["type"] == "RuntimeError", seen  # the reference: Gloo raises a plain RuntimeError


@pytest.mark.parametrize("backend", ["commd", "gloo"])
def test_a_peer_that_exits_is_a_dist_network_error_naming_it(backend_env: Path, backend: str) -> None:
    seen = run_ranks(_peer_exits, 2, [0], backend)[0]
    assert "crashed" not in seen, seen
    for size in ("small", "large"):  # the exchange ring's path and the daemon's
        got = seen[size]
        assert got["raised"], (size, got)
        if backend == "commd":
            assert got["caught_by"] == "DistBackendError" and got["type"] == "PeerDiedError", (size, got)
            assert got["torch_types"] == {"DistBackendError", "DistNetworkError"}, (size, got)
            assert "group rank 1 " in got["message"] and "died" in got["message"], (size, got)
        else:
            assert got["type"] == "RuntimeError", (size, got)  # Gloo: "Connection closed by peer"


def test_an_op_past_a_daemon_limit_is_a_dist_backend_error(backend_env: Path, monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setenv("COMMD_MAX_PENDING_OPS", "2")  # the daemon rank 0 starts inherits it
    seen = run_ranks(_past_the_pending_limit, 2, [0])[0]
    assert "crashed" not in seen, seen
    third = seen["third"]
    assert third["caught_by"] == "DistBackendError" and third["type"] == "LimitExceededError", third
    assert "rank 0 already has 2 pending ops" in third["message"] and "--max-pending-ops 2" in third["message"], third
    assert seen["pending"] == [False, False], "the refused op must leave the pending ones alone"


def test_a_daemon_that_dies_is_a_dist_network_error(backend_env: Path) -> None:
    seen = run_ranks(_daemon_killed, 2, [0])[0]
    assert "crashed" not in seen, seen
    for when in ("pending", "next"):
        got = seen[when]
        assert got["caught_by"] == "DistBackendError" and got["type"] == "DaemonDiedError", (when, got)
        assert got["torch_types"] == {"DistBackendError", "DistNetworkError"}, (when, got)
        assert "daemon" in got["message"] and "died" in got["message"], (when, got)


@pytest.mark.extended  # make test-extended (CI runs it after make test)
@pytest.mark.parametrize("backend", ["commd", "gloo"])
def test_a_rank_that_never_initializes_is_a_dist_store_error_naming_it(backend_env: Path, tmp_path: Path,
                                                                       backend: str) -> None:
    seen = run_ranks(_alone_in_a_file_store, 2, [0], backend, str(tmp_path / "store"))[0]
    assert seen.get("raised"), seen
    assert seen["elapsed"] >= 1.9, seen  # both wait out the store's timeout (2 s)
    if backend == "commd":
        assert seen["type"] == "StoreError" and seen["caught_by"] == "DistBackendError", seen
        assert seen["torch_types"] == {"DistBackendError", "DistStoreError"}, seen
        assert "ranks [1] did not write their node name" in seen["message"], seen
    else:
        assert seen["type"] == "RuntimeError", seen  # Gloo: "Wait timeout", naming no rank


# ---- monitored_barrier ------------------------------------------------------------------------
@pytest.mark.extended  # make test-extended (CI runs it after make test)
@pytest.mark.parametrize(("away", "wait_all_ranks"), [([1], False), ([1, 2], True)], ids=["first", "all"])
def test_monitored_barrier_names_the_ranks_that_stay_away_as_gloo_does(
    backend_env: Path, away: list[int], wait_all_ranks: bool
) -> None:
    world = 3
    waiting = [r for r in range(world) if r not in away]
    gloo = run_ranks(_monitored, world, [0], "gloo", away, wait_all_ranks)[0]
    ours = run_ranks(_monitored, world, waiting, "commd", away, wait_all_ranks)
    which = "Ranks " + ", ".join(map(str, away)) if wait_all_ranks else f"Rank {away[0]}"
    expected = f"{which} failed to pass monitoredBarrier in 1000 ms"
    assert gloo["raised"] and gloo["message"].splitlines()[0] == f"[Rank 0]: {expected}", gloo
    for rank in waiting:  # Gloo names them on rank 0 only; commd on every rank that waits
        seen = ours[rank]
        assert seen.get("raised") and seen["message"].splitlines()[0] == f"[Rank {rank}]: {expected}", (rank, seen)
        assert seen["caught_by"] == "DistBackendError" and seen["type"] == "CommTimeoutError", (rank, seen)
        assert seen["torch_types"] == {"DistBackendError", "TimeoutError"}, (rank, seen)
        assert 0.9 <= seen["elapsed"] < 11, (rank, seen)


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_a_groups_own_monitored_barrier_names_the_missing_rank_as_gloos_does(backend_env: Path) -> None:
    """``ProcessGroup.monitored_barrier`` (which torch does not refuse) on a commd group is commd's."""
    gloo = run_ranks(_group_monitored, 2, [0], "gloo", [1])[0]
    ours = run_ranks(_group_monitored, 2, [0], "commd", [1])[0]
    expected = "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms"
    assert gloo["raised"] and gloo["message"].splitlines()[0] == expected, gloo
    assert ours.get("raised") and ours["message"].splitlines()[0] == expected, ours
    assert ours["type"] == "CommTimeoutError" and ours["caught_by"] == "DistBackendError", ours


def test_monitored_barrier_passes_when_every_rank_arrives(backend_env: Path) -> None:
    reports = run_ranks(_monitored_then_sum, 3, [0, 1, 2])
    for rank, seen in reports.items():
        assert "crashed" not in seen, (rank, seen)
        assert seen["barrier"]["raised"] is False, (rank, seen)
        assert seen["sum"] == 6.0, (rank, seen)


def _bad_monitored_arguments(rank: int) -> dict[str, Any]:
    _init("commd")
    gloo_group = dist.new_group(backend="gloo")
    return {"gloo group": observe(lambda: commd.monitored_barrier(gloo_group)),
            "text timeout": observe(lambda: commd.monitored_barrier(timeout="1s")),
            "zero timeout": observe(lambda: commd.monitored_barrier(timeout=timedelta(0))),
            "seconds": observe(lambda: commd.monitored_barrier(timeout=2))}


def test_monitored_barrier_rejects_bad_arguments(backend_env: Path) -> None:
    seen = run_ranks(_bad_monitored_arguments, 1, [0])[0]
    assert "crashed" not in seen, seen
    expected = {"gloo group": ("ValueError", "runs on commd process groups only"),
                "text timeout": ("TypeError", "must be a datetime.timedelta or seconds, got '1s'"),
                "zero timeout": ("ValueError", "timeout 0.0s must lie in [0.001, ")}
    for case, (kind, words) in expected.items():
        assert seen[case]["raised"] and seen[case]["type"] == kind and words in seen[case]["message"], (case, seen)
    assert seen["seconds"]["raised"] is False, seen  # a world of one passes at once
