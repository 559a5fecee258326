#!/usr/bin/env python
"""Run PyTorch's own ``DistributedTest`` suite against a c10d backend.

The suite lives in the torch wheel
(``torch.testing._internal.distributed.distributed_test``).  PyTorch drives it
from ``test/distributed/test_distributed_spawn.py``, which is not shipped, so
this script rebuilds that driver: a ``TestDistBackendWithSpawn(TestDistBackend,
DistributedTest._DistTestBase)`` class whose ``setUp`` spawns ``WORLD_SIZE``
rank processes per test.

Usage::

    python tests/conformance/run_distributed_suite.py --backend gloo --subset full \
        --json out.json
    python tests/conformance/run_distributed_suite.py --backend commd --subset fast \
        --compare tests/conformance/gloo_baseline.json
    python tests/conformance/run_distributed_suite.py --backend commd --gates gloo \
        --subset full --compare tests/conformance/gloo_baseline.json

Gates.  The suite decides many skips at import time from the backend's *name*
(``BACKEND != "gloo"``), so a plugin backend is never asked most of what Gloo
is asked.  ``--gates own`` (the default) evaluates those gates for the backend
under test, as PyTorch's CI would.  ``--gates gloo`` imports the suite with
``BACKEND=gloo`` -- every test Gloo may run is collected -- and then, before
any test runs, points the suite's module-level ``BACKEND`` and
``os.environ["BACKEND"]`` (which test bodies and ``init_process_group`` read at
run time) at the backend under test, in the worker and in every rank process.
With ``--backend gloo`` both modes are the same run, so one Gloo baseline
(``gloo_baseline.json``) serves both.  A rank checks that its default group
runs on the backend under test before each test body, so no test can pass by
running on Gloo instead.  ``GLOO_GATE_DIFFERENCES`` lists the Gloo tests that
need more than the gates, with the reason:

* tests whose *body* branches on the name (``if BACKEND == "gloo"``: build a
  CPU model) run with the suite's ``BACKEND`` reading "gloo" during the body
  only -- the group still runs on the backend under test, as the check above
  makes sure -- or, with ``--name-bound exclude``, are reported ``excluded``;
* tests that fail whatever the backend does (torch refuses
  ``dist.monitored_barrier`` for any backend but Gloo) are reported
  ``xfailed`` when they fail for exactly that reason, and as failures
  otherwise.

How it is put together (and why):

* The orchestrator (``main``) never imports the suite itself.  It starts a
  *worker* (this same file with ``--worker``) that runs pytest in-process on
  this file.  pytest imports this file as a module; with the worker env var set
  the module-level code registers the backend and defines the test class.
  Spawned rank processes unpickle ``TestDistBackendWithSpawn._run`` by module
  name, so they import this module again and get the same preparation
  (``import commd``, ``DistTestCases`` feature sets) before the suite module is
  imported -- the suite evaluates its skip decorators at import time.
* Time is bounded at three levels: the suite's own join timeout
  (``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``), a per-test pytest-timeout (signal
  method, so a hang fails only that test and ``tearDown`` still terminates the
  ranks), and an orchestrator watchdog that kills the worker's whole process
  group if even that does not fire, records the test as failed, and restarts a
  worker on the remaining tests.
* The worker streams one JSON line per test start/result, so a killed worker
  never loses results already obtained.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
BUILTIN_BACKENDS = frozenset({"gloo", "nccl", "mpi", "ucc"})
WORLD_SIZE = 2

# Environment variables through which the orchestrator configures workers (and,
# by inheritance, the rank processes the suite spawns).
_ENV_WORKER = "COMMD_CONFORMANCE_WORKER"
_ENV_PLUGIN_MODULE = "COMMD_CONFORMANCE_PLUGIN_MODULE"
_ENV_GATES = "COMMD_CONFORMANCE_GATES"
SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
# --gates: "own" evaluates the suite's import-time gates for the backend under
# test; "gloo" evaluates them as for Gloo (see the module docstring).
GATE_CHOICES = ("own", "gloo")

# Extra seconds on top of the suite's own join timeout before pytest-timeout
# fires (spawning two ranks, traceback collection and tearDown need time), and
# on top of that before the orchestrator watchdog kills the worker.
PYTEST_TIMEOUT_GRACE_S = 45
WATCHDOG_GRACE_S = 60
# A worker must emit an event at least this often while no test is running
# (covers start-up, collection and interpreter exit).
WORKER_STARTUP_LIMIT_S = 300
MESSAGE_LIMIT = 4000

# Curated "fast" subset: regexes matched (``re.fullmatch``) against test method
# names.  Covers the core collectives, p2p, barrier, subgroups and basic DDP
# on CPU: 37 tests; with --gates gloo 34 spawn two ranks (~4-5 s apiece on 2
# cores for commd), with --gates own 27 (the Gloo-only ones are skipped).
# Notes on coverage (torch 2.13 suite, WORLD_SIZE=2):
# * CPU all_to_all / all_to_all_single are tested only for MPI, and
#   reduce_scatter only for NCCL on CUDA; the CPU all_to_all names are kept
#   so that the gap shows up as skipped (decorator skips spawn nothing).
# * The *_group variants need WORLD_SIZE >= 8; subgroups are exercised via the
#   *_full_group tests (dist.new_group()) and the object-collective subgroup test.
# * test_batch_isend_irecv_gloo*, test_all_reduce_coalesced_*, the barrier
#   timeout tests and test_sparse_all_reduce_sum are gated on BACKEND == "gloo"
#   by the suite itself: they run for gloo, and for a plugin only with
#   ``--gates gloo`` (skipped with ``--gates own``).
FAST_PATTERNS: tuple[str, ...] = (
    # Backend name plumbing, rank/size, group creation and destruction.
    r"test_get_backend",
    r"test_Backend_enum_class",
    r"test_get_rank_size_group",
    r"test_destroy_group",
    # all_reduce (+ coalesced).
    r"test_all_reduce_sum",
    r"test_all_reduce_max",
    r"test_all_reduce_sum_async",
    r"test_all_reduce_sum_complex",
    r"test_all_reduce_full_group_sum",
    r"test_all_reduce_coalesced_sum",
    # reduce.
    r"test_reduce_sum",
    # broadcast.
    r"test_broadcast",
    # all_gather / gather / scatter (+ object variants and argument checks).
    r"test_all_gather",
    r"test_all_gather_coalesced_simple",
    r"test_all_gather_object_default_pg",
    r"test_all_gather_object_subgroup",
    r"test_gather",
    r"test_gather_checks",
    r"test_scatter",
    # all_to_all: CPU variants are MPI-only in the suite (reported as skipped).
    r"test_all_to_all",
    r"test_all_to_all_single_(un)?equal_split",
    # Point-to-point.
    r"test_send_recv",
    r"test_send_recv_with_tag",
    r"test_send_recv_any_source",
    r"test_isend",
    r"test_irecv",
    r"test_batch_isend_irecv_gloo(_tags)?",
    # Barrier.
    r"test_barrier",
    r"test_barrier_full_group",
    r"test_barrier_timeout_full_group",
    # Sparse COO all_reduce (gated on gloo).
    r"test_sparse_all_reduce_sum",
    # Known differences under --gates gloo (see GLOO_GATE_DIFFERENCES).
    r"test_monitored_barrier_gloo",
    r"test_accumulate_gradients_no_sync",
    # Basic DistributedDataParallel on CPU (logging_data checks getBackendName()).
    r"test_DistributedDataParallelCPU",
    r"test_ddp_logging_data_cpu",
)

# "gated" subset: one test of each kind the suite runs only when BACKEND is
# "gloo" and a plugin is expected to pass under ``--gates gloo``: barrier
# timeout, sparse all_reduce, coalesced all_reduce, batched isend/irecv.
# Small enough for ``make test`` (4 tests, 30-90 s on a loaded 2-core
# machine); the fast subset adds the known differences.
GATED_PATTERNS: tuple[str, ...] = (
    r"test_barrier_timeout_full_group",
    r"test_sparse_all_reduce_sum",
    r"test_all_reduce_coalesced_sum",
    r"test_batch_isend_irecv_gloo",
)
SUBSETS: dict[str, tuple[str, ...] | None] = {
    "full": None,
    "fast": FAST_PATTERNS,
    "gated": GATED_PATTERNS,
}


@dataclass(frozen=True)
class KnownDifference:
    """A Gloo test that needs more than Gloo's gates under another backend, and why.

    ``action``: "gloo_body" (the body branches on the backend's name: it runs
    with the suite's ``BACKEND`` reading "gloo", or is excluded with
    ``--name-bound exclude``) or "xfail" (run; reported as ``xfailed`` only if
    the failure message matches ``failure``, so any other failure still counts
    as one).
    """

    pattern: str
    action: str
    reason: str
    failure: str = ""


# Apply with --gates gloo to any backend other than gloo.
GLOO_GATE_DIFFERENCES: tuple[KnownDifference, ...] = (
    KnownDifference(
        r"test_accumulate_gradients_no_sync.*",
        "gloo_body",
        "cannot run under another name: the test body builds its model only when "
        "BACKEND is gloo, mpi or nccl (not the backend's to fix)",
    ),
    KnownDifference(
        r"test_monitored_barrier_gloo_rank_0_timeout",
        "xfail",
        "calls the group's monitored_barrier with a 0 s timeout: Gloo's rank 0 times out at "
        "once, commd.monitored_barrier refuses timeouts under 1 ms",
        failure=r"ValueError: monitored_barrier: timeout 0\.0s must lie in",
    ),
    KnownDifference(
        r"test_monitored_barrier_gloo.*",
        "xfail",
        "torch refuses monitored_barrier for non-Gloo backends; use commd.monitored_barrier",
        failure=r"monitored_barrier is only implemented for GLOO backend",
    ),
)


def known_differences(backend: str, gates: str) -> tuple[KnownDifference, ...]:
    """The known differences that apply to this backend under these gates."""
    if gates == "gloo" and backend != "gloo":
        return GLOO_GATE_DIFFERENCES
    return ()


def find_difference(name: str, differences: tuple[KnownDifference, ...]) -> KnownDifference | None:
    """The first known difference whose pattern matches test ``name``, if any."""
    for difference in differences:
        if re.fullmatch(difference.pattern, name):
            return difference
    return None


# --------------------------------------------------------------------------
# Shared helpers (worker and rank processes)
# --------------------------------------------------------------------------


def _ensure_expecttest() -> None:
    """Provide a tiny ``expecttest`` stand-in when the real package is absent.

    ``torch.testing._internal.common_utils`` imports ``expecttest`` only to use
    ``expecttest.TestCase`` as a base class and read ``expecttest.ACCEPT``; the
    distributed suite never calls the inline-expectation asserts.  Installing
    ``expecttest`` is still preferred (it is a PyTorch test dependency).
    """
    try:
        importlib.import_module("expecttest")
    except ImportError:
        import unittest

        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        stub.ACCEPT = False  # type: ignore[attr-defined]
        sys.modules["expecttest"] = stub
        print(
            "run_distributed_suite: 'expecttest' not installed; using a stub",
            file=sys.stderr,
        )


def _prepare_backend(backend: str, plugin_module: str | None) -> list[str]:
    """Register a plugin backend and make the suite treat it like gloo.

    Must run before ``distributed_test`` is imported: the suite reads
    ``DistTestCases`` inside decorators evaluated at class-definition time.
    Returns the ``DistTestCases.backend_feature`` keys the backend was added to.
    """
    if backend in BUILTIN_BACKENDS:
        return []
    if plugin_module:
        # Importing the plugin registers it via dist.Backend.register_backend.
        importlib.import_module(plugin_module)
    from torch.testing._internal.common_distributed import DistTestCases

    features = DistTestCases.backend_feature
    added = ["plugin"]
    features["plugin"].add(backend)
    for name, members in features.items():
        if "gloo" in members and backend not in members:
            members.add(backend)
            added.append(name)
    return added


def _import_suite(backend: str, gates: str) -> types.ModuleType:
    """Import the suite with its import-time gates evaluated for ``gates``.

    With ``gates="gloo"`` the skip decorators see ``BACKEND == "gloo"``; then
    the module's ``BACKEND`` and ``os.environ["BACKEND"]`` -- read at run time
    by ``TestDistBackend._run`` (``init_process_group``), by test bodies
    (``test_get_backend``, the object collectives, ``skip_if_small_worldsize``)
    -- are pointed back at ``backend``.  Rank processes inherit the restored
    environment and run this again when they import this module.
    """
    gate_name = backend if gates == "own" else gates
    os.environ["BACKEND"] = gate_name
    try:
        suite = importlib.import_module(SUITE_MODULE)
    finally:
        os.environ["BACKEND"] = backend
    if suite.BACKEND not in (gate_name, backend):
        raise RuntimeError(
            f"{SUITE_MODULE} was imported before the runner set BACKEND "
            f"(it saw {suite.BACKEND!r}); its gates are not those asked for"
        )
    suite.BACKEND = backend
    return suite


def _check_rank_backend() -> None:
    """Fail unless the rank's default group runs on the backend under test.

    With ``--gates gloo`` the suite was imported as for Gloo; this guards
    against a test silently running on Gloo instead of the plugin.
    """
    import torch.distributed as dist

    expected = os.environ["BACKEND"]
    actual = dist.get_backend() if dist.is_initialized() else None
    if actual != expected:
        raise AssertionError(
            f"conformance runner: this rank's default group runs on backend {actual!r}, "
            f"not on {expected!r} under test"
        )


def _build_suite_class(suite: types.ModuleType) -> type:
    """Define the spawn-driven test class exactly as test_distributed_spawn does."""
    DistributedTest = suite.DistributedTest
    TestDistBackend = suite.TestDistBackend

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        """One test method per suite test; every test spawns WORLD_SIZE ranks."""

        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()

        def run_test(self, test_name: str, parent_pipe: Any) -> None:
            """In a rank: check the group runs on the backend under test, then run the test.

            The check runs as part of the test method so that a mismatch
            reaches the parent through the suite's own error pipe.  A body
            that branches on the backend's name (``gloo_body``) sees "gloo".
            """
            test = getattr(self, test_name)
            backend = os.environ["BACKEND"]
            difference = find_difference(
                test_name, known_differences(backend, os.environ.get(_ENV_GATES, "own"))
            )
            body_name = "gloo" if difference is not None and difference.action == "gloo_body" else backend

            def on_backend_under_test() -> None:
                _check_rank_backend()
                suite.BACKEND = body_name
                try:
                    test()
                finally:
                    suite.BACKEND = backend

            setattr(self, test_name, on_backend_under_test)
            super().run_test(test_name, parent_pipe)

    # Rank processes locate the class by qualified name when unpickling.
    TestDistBackendWithSpawn.__qualname__ = TestDistBackendWithSpawn.__name__
    return TestDistBackendWithSpawn


_FEATURES_ADDED: list[str] = []
if os.environ.get(_ENV_WORKER) == "1":
    # Runs in the worker (as imported by pytest) and in every rank process.
    _ensure_expecttest()
    _FEATURES_ADDED = _prepare_backend(os.environ["BACKEND"], os.environ.get(_ENV_PLUGIN_MODULE))
    TestDistBackendWithSpawn = _build_suite_class(
        _import_suite(os.environ["BACKEND"], os.environ.get(_ENV_GATES, "own"))
    )


# --------------------------------------------------------------------------
# Worker: pytest in-process, streaming JSON lines
# --------------------------------------------------------------------------


class _EventRecorder:
    """pytest plugin that streams collection, test starts and outcomes as JSON lines."""

    def __init__(self, events_path: Path, selection: set[str] | None) -> None:
        self._fh: TextIO = events_path.open("a", buffering=1, encoding="utf-8")
        self._selection = selection
        self._phases: dict[str, list[Any]] = {}
        # Tests carrying a unittest skip decorator that is already decided at
        # import time (e.g. ``BACKEND != "gloo"``): they never spawn ranks.
        self._static_skip: set[str] = set()

    def _emit(self, **event: Any) -> None:
        self._fh.write(json.dumps(event) + "\n")
        self._fh.flush()

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        """Keep only selected tests and give each a signal-based time limit."""
        import pytest
        from torch.testing._internal.common_distributed import get_timeout

        if self._selection is not None:
            keep = [item for item in items if item.name in self._selection]
            dropped = [item for item in items if item.name not in self._selection]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
            items[:] = keep
        for item in items:
            if getattr(item.obj, "__unittest_skip__", False):
                self._static_skip.add(item.name)
            limit = get_timeout(item.name) + PYTEST_TIMEOUT_GRACE_S
            item.add_marker(pytest.mark.timeout(limit, method="signal"))

    def pytest_collection_finish(self, session: Any) -> None:
        """Publish the names that will run (after -k and selection)."""
        self._emit(
            event="collected",
            tests=[item.name for item in session.items],
            features_added=_FEATURES_ADDED,
        )

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        """Tell the watchdog which test is now running and for how long it may."""
        name = nodeid.rsplit("::", 1)[-1]
        from torch.testing._internal.common_distributed import get_timeout

        limit = get_timeout(name) + PYTEST_TIMEOUT_GRACE_S
        self._emit(event="start", test=name, limit_s=limit, time=time.time())

    def pytest_runtest_logreport(self, report: Any) -> None:
        """Fold setup/call/teardown reports into a single outcome per test."""
        name = report.nodeid.rsplit("::", 1)[-1]
        self._phases.setdefault(name, []).append(report)
        if report.when != "teardown":
            return
        phases = self._phases.pop(name)
        outcome = "passed"
        message = ""
        for rep in phases:
            if rep.failed:
                outcome = "failed"
                message = _report_text(rep)
                break
            if rep.skipped and outcome == "passed":
                outcome = "skipped"
                message = _skip_reason(rep)
        duration = sum(rep.duration for rep in phases)
        self._emit(
            event="result",
            test=name,
            outcome=outcome,
            duration_s=round(duration, 3),
            message=message,
            static_skip=outcome == "skipped" and name in self._static_skip,
        )


def _report_text(report: Any) -> str:
    """Failure text: traceback tail plus captured stderr tail (rank logs)."""
    text = (report.longreprtext or "")[-MESSAGE_LIMIT:]
    captured = getattr(report, "capstderr", "") or ""
    if captured:
        text += "\n--- captured stderr (tail) ---\n" + captured[-MESSAGE_LIMIT // 2 :]
    return text


def _skip_reason(report: Any) -> str:
    """Extract the human-readable skip reason from a pytest report."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)[-MESSAGE_LIMIT:]


def _worker_main(args: argparse.Namespace) -> int:
    """Run pytest on this file inside the worker process."""
    import pytest

    selection: set[str] | None = None
    if args.worker_selection:
        selection = set(json.loads(Path(args.worker_selection).read_text()))
    recorder = _EventRecorder(Path(args.worker_events), selection)
    pytest_args = [
        str(Path(__file__).resolve()),
        # Isolate from the project's pytest config, conftest files and cache.
        "-c",
        os.devnull,
        "--rootdir",
        str(HERE),
        "--noconftest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rN",
        "--tb=short",
    ]
    if args.worker_collect_only:
        pytest_args.append("--collect-only")
    if args.k:
        pytest_args += ["-k", args.k]
    return int(pytest.main(pytest_args, plugins=[recorder]))


# --------------------------------------------------------------------------
# Orchestrator
# --------------------------------------------------------------------------


@dataclass
class SuiteResult:
    """Outcome of one suite test."""

    outcome: str
    duration_s: float
    message: str = ""
    # Skipped by a decorator evaluated when the suite was imported (typically
    # a backend-name check), as opposed to a skip decided inside the ranks.
    static_skip: bool = False
    # How the test ran, when not plainly (e.g. its body saw the name "gloo").
    note: str = ""


def _result_from_event(event: dict[str, Any]) -> SuiteResult:
    """Build a SuiteResult from a worker "result" event."""
    return SuiteResult(
        outcome=event["outcome"],
        duration_s=event["duration_s"],
        message=event["message"],
        static_skip=bool(event.get("static_skip", False)),
    )


GLOO_BODY_NOTE = "body saw BACKEND='gloo' (it branches on the name); the group ran on the backend under test"


class RunnerError(RuntimeError):
    """The run could not make progress (e.g. the worker cannot even start)."""


def _free_port() -> int:
    """Ask the kernel for a currently free TCP port for MASTER_PORT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker_env(args: argparse.Namespace, temp_root: Path) -> dict[str, str]:
    """Environment the suite expects (see TestDistBackend / run_test.py)."""
    env = dict(os.environ)
    temp_dir = temp_root / "suite_tmp"
    for sub in ("barrier", "test_dir", "init_dir"):
        (temp_dir / sub).mkdir(parents=True, exist_ok=True)
    env.update(
        {
            _ENV_WORKER: "1",
            "BACKEND": args.backend,
            _ENV_GATES: args.gates,
            "WORLD_SIZE": str(WORLD_SIZE),
            # setUp() replaces TEMP_DIR/INIT_METHOD per test; the initial values
            # matter for import-time checks (a file:// INIT_METHOD enables
            # test_barrier_timeout_global).
            "TEMP_DIR": str(temp_dir),
            "INIT_METHOD": f"file://{temp_dir / 'init_dir' / 'shared_init_file'}",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(args.per_test_timeout),
            "PYTHONUNBUFFERED": "1",
            # torch's "run this from the base repo dir" hint names the wrong command.
            "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            # Installed packages can register torch device-backend entry points
            # that `import torch` loads implicitly; a broken one would take down
            # every rank process.  Plugins are imported explicitly instead.
            "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        }
    )
    if args.plugin_module:
        env[_ENV_PLUGIN_MODULE] = args.plugin_module
    else:
        env.pop(_ENV_PLUGIN_MODULE, None)
    return env


def _read_events(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Read complete JSON lines appended since ``offset``."""
    if not path.exists():
        return [], offset
    with path.open("rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    lines = data[: end + 1].decode("utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()], offset + end + 1


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the worker and every rank process it spawned (same session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


class Orchestrator:
    """Starts workers, watches them, and restarts after hangs or crashes."""

    def __init__(self, args: argparse.Namespace, temp_root: Path) -> None:
        self.args = args
        self.temp_root = temp_root
        self.env = _worker_env(args, temp_root)
        self.results: dict[str, SuiteResult] = {}
        self._worker_no = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self.features_added: list[str] = []
        self.differences = known_differences(args.backend, args.gates)

    def kill_worker(self) -> None:
        """Kill the running worker (if any) with all its rank processes."""
        if self._proc is not None and self._proc.poll() is None:
            _kill_group(self._proc)
        self._proc = None

    def _start_worker(
        self, *, collect_only: bool, selection: list[str] | None
    ) -> tuple[subprocess.Popen[bytes], Path, Path]:
        self._worker_no += 1
        tag = f"worker{self._worker_no:03d}"
        events = self.temp_root / f"{tag}.jsonl"
        log = self.temp_root / f"{tag}.log"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--backend",
            self.args.backend,
            "--worker-events",
            str(events),
        ]
        if collect_only:
            cmd.append("--worker-collect-only")
            if self.args.k:
                cmd += ["-k", self.args.k]
        if selection is not None:
            sel_path = self.temp_root / f"{tag}.selection.json"
            sel_path.write_text(json.dumps(selection))
            cmd += ["--worker-selection", str(sel_path)]
        with log.open("wb") as log_fh:
            proc = subprocess.Popen(
                cmd,
                env=self.env,
                stdout=log_fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._proc = proc
        return proc, events, log

    def collect(self) -> list[str]:
        """Names of all suite tests matching -k (import-time view of the worker)."""
        proc, events_path, log = self._start_worker(collect_only=True, selection=None)
        try:
            proc.wait(timeout=WORKER_STARTUP_LIMIT_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise RunnerError(f"collection timed out; see {log}") from None
        events, _ = _read_events(events_path, 0)
        for event in events:
            if event["event"] == "collected":
                self.features_added = list(event.get("features_added", []))
                return list(event["tests"])
        tail = log.read_text(errors="replace")[-MESSAGE_LIMIT:]
        raise RunnerError(f"collection failed (rc={proc.returncode}):\n{tail}")

    def run(self, names: list[str]) -> None:
        """Run ``names``, restarting the worker whenever it hangs or dies.

        With ``--name-bound exclude``, tests whose body branches on the
        backend's name are recorded as ``excluded`` with the reason instead.
        """
        for name in names:
            difference = find_difference(name, self.differences)
            if difference is not None and difference.action == "gloo_body" and self.args.name_bound == "exclude":
                self._record(name, SuiteResult("excluded", 0.0, difference.reason))
        remaining = [n for n in names if n not in self.results]
        while remaining:
            progressed = self._run_batch(remaining)
            remaining = [n for n in remaining if n not in self.results]
            if remaining and not progressed:
                for name in remaining:
                    self._record(
                        name,
                        SuiteResult("failed", 0.0, "not run: worker made no progress"),
                    )
                raise RunnerError("worker made no progress; see logs in " + str(self.temp_root))

    def _record(self, name: str, result: SuiteResult) -> None:
        result = expect_known_failure(name, result, self.differences)
        difference = find_difference(name, self.differences)
        if difference is not None and difference.action == "gloo_body" and result.outcome != "excluded":
            result = replace(result, note=GLOO_BODY_NOTE)
        self.results[name] = result
        line = f"{result.outcome.upper():8s} {name} ({result.duration_s:.1f}s)"
        if result.note:
            line += f"  [{result.note}]"
        if result.outcome == "failed":
            line += f"  -- {_headline(result.message)[:160]}"
        elif result.outcome in ("excluded", "xfailed"):
            line += f"  -- {result.message.splitlines()[0][:200]}"
        print(line, flush=True)

    def _run_batch(self, names: list[str]) -> bool:
        """One worker lifetime; returns whether any test got a result."""
        proc, events_path, log = self._start_worker(collect_only=False, selection=names)
        offset = 0
        current: str | None = None
        current_start = 0.0
        current_limit = 0.0
        last_event = time.monotonic()
        got_result = False
        while True:
            events, offset = _read_events(events_path, offset)
            if events:
                last_event = time.monotonic()
            for event in events:
                if event["event"] == "start":
                    current = event["test"]
                    current_start = time.monotonic()
                    current_limit = float(event["limit_s"]) + WATCHDOG_GRACE_S
                elif event["event"] == "result":
                    self._record(event["test"], _result_from_event(event))
                    got_result = True
                    current = None
            rc = proc.poll()
            if rc is not None:
                # Drain anything written between the last read and exit.
                events, offset = _read_events(events_path, offset)
                for event in events:
                    if event["event"] == "result":
                        self._record(event["test"], _result_from_event(event))
                        got_result = True
                        if event["test"] == current:
                            current = None
                if current is not None:
                    tail = log.read_text(errors="replace")[-MESSAGE_LIMIT:]
                    self._record(
                        current,
                        SuiteResult(
                            "failed",
                            round(time.monotonic() - current_start, 3),
                            f"worker process died (exit code {rc}) during this test\n{tail}",
                        ),
                    )
                    got_result = True
                return got_result
            now = time.monotonic()
            if current is not None and now - current_start > current_limit:
                _kill_group(proc)
                self._record(
                    current,
                    SuiteResult(
                        "failed",
                        round(now - current_start, 3),
                        f"hung: no result after {current_limit:.0f}s; "
                        "runner watchdog killed the worker and its rank processes",
                    ),
                )
                return True
            if current is None and now - last_event > WORKER_STARTUP_LIMIT_S:
                # Stuck outside any test (import, collection, or exit).
                _kill_group(proc)
                return got_result
            time.sleep(0.2)


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failed|Timeout|Interrupt)\w*: ")
_RANK_FAILURE = re.compile(r"^RuntimeError: Process (\d+) (exited|terminated)")


def _headline(message: str) -> str:
    """Most informative single line of a failure/skip message.

    A rank failure reads "RuntimeError: Process 1 exited with error code 10
    and exception:" followed by the rank's traceback; the root cause is the
    last exception line of that traceback, so report "rank 1: <cause>".
    """
    lines = [ln.strip() for ln in message.split("--- captured stderr")[0].splitlines() if ln.strip()]
    exc_lines = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    exc_lines = [ln for ln in exc_lines if _EXC_LINE.match(ln)] or exc_lines
    if not exc_lines:
        return lines[0] if lines else ""
    rank = _RANK_FAILURE.match(exc_lines[0])
    if rank and len(exc_lines) > 1:
        return f"rank {rank.group(1)}: {exc_lines[-1]}"
    return exc_lines[0]


def expect_known_failure(
    name: str, result: SuiteResult, differences: tuple[KnownDifference, ...]
) -> SuiteResult:
    """Turn a failure into ``xfailed`` when it fails for its known reason only."""
    difference = find_difference(name, differences)
    if (
        result.outcome != "failed"
        or difference is None
        or difference.action != "xfail"
        or not re.search(difference.failure, result.message)
    ):
        return result
    return replace(result, outcome="xfailed", message=f"{difference.reason}\n{result.message}")


def select_tests(names: list[str], subset: str) -> list[str]:
    """Apply the --subset filter to collected names, keeping suite order."""
    patterns = SUBSETS[subset]
    if patterns is None:
        return names
    compiled = [re.compile(p) for p in patterns]
    return [n for n in names if any(p.fullmatch(n) for p in compiled)]


OUTCOMES = ("passed", "failed", "skipped", "excluded", "xfailed")


def counts_of(results: dict[str, SuiteResult]) -> dict[str, int]:
    """Totals per outcome (``excluded``/``xfailed``: known differences)."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for result in results.values():
        counts[result.outcome] = counts.get(result.outcome, 0) + 1
    return counts


@dataclass
class Comparison:
    """Baseline-passing tests that did not pass in this run, by kind."""

    regressions: list[str]  # failed, or skipped inside the ranks
    gated: list[str]  # skipped by an import-time backend check (e.g. BACKEND != "gloo")
    known: list[str]  # excluded or xfailed: a known difference, with its reason
    not_run: list[str]  # outside this run's selection (--subset / -k)


def compare_with_baseline(results: dict[str, SuiteResult], baseline_path: Path) -> Comparison:
    """Find baseline-passing tests (e.g. gloo's) that failed or skipped here."""
    baseline = json.loads(baseline_path.read_text())
    passing = baseline.get("passed_tests")
    if passing is None:
        passing = [n for n, r in baseline.get("tests", {}).items() if r["outcome"] == "passed"]
    comparison = Comparison([], [], [], [])
    for name in passing:
        result = results.get(name)
        if result is None:
            comparison.not_run.append(name)
            continue
        if result.outcome == "passed":
            continue
        if result.outcome in ("excluded", "xfailed"):
            reason = result.message.splitlines()[0]
            comparison.known.append(f"{result.outcome.upper():8s} {name}  -- {reason}")
            continue
        line = f"{result.outcome.upper():8s} {name}  -- {_headline(result.message)[:200]}"
        if result.static_skip:
            comparison.gated.append(line)
        else:
            comparison.regressions.append(line)
    return comparison


def _torch_version() -> str:
    """Version of the torch wheel whose suite is being run (without importing it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "unknown"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run torch's DistributedTest suite (WORLD_SIZE=2) against a backend."
    )
    parser.add_argument("--backend", required=True, help="gloo, commd, or another plugin")
    parser.add_argument(
        "--subset",
        choices=tuple(SUBSETS),
        default="full",
        help="full: every collected test; fast: core collectives, p2p, barrier, subgroups, "
        "basic DDP; gated: the tests the suite runs only for gloo (use with --gates gloo)",
    )
    parser.add_argument(
        "--gates",
        choices=GATE_CHOICES,
        default="own",
        help="own: the suite's import-time backend-name gates see this backend; gloo: they "
        "see gloo (every test Gloo may run is collected) while the tests run on this backend",
    )
    parser.add_argument("-k", metavar="EXPR", default=None, help="pytest -k expression on test names")
    parser.add_argument("--json", type=Path, default=None, help="write per-test results here")
    parser.add_argument(
        "--per-test-timeout",
        type=int,
        default=180,
        help="seconds a test may take (suite overrides such as test_ddp_uneven_inputs=400 "
        "still apply); a hung test fails and the run goes on",
    )
    parser.add_argument("--compare", type=Path, default=None, help="baseline JSON (e.g. gloo_baseline.json)")
    parser.add_argument(
        "--plugin-module",
        default=None,
        help="module to import to register a plugin backend (default: the backend name "
        "for non-builtin backends)",
    )
    parser.add_argument(
        "--name-bound",
        choices=("gloo-body", "exclude"),
        default="gloo-body",
        help="with --gates gloo, tests whose body branches on the backend's name: run them with "
        "the body reading 'gloo' (the group stays on the backend under test), or exclude them",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep worker logs even if all tests pass")
    # Internal: worker mode.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-events", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-selection", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-collect-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.backend = args.backend.lower()
    if args.plugin_module is None and args.backend not in BUILTIN_BACKENDS:
        args.plugin_module = args.backend
    return args


def _check_plugin_importable(args: argparse.Namespace, env: dict[str, str]) -> None:
    """Fail fast, in the orchestrator, if the plugin backend cannot be imported."""
    if not args.plugin_module:
        return
    proc = subprocess.run(
        [sys.executable, "-c", f"import {args.plugin_module}"],
        env={k: v for k, v in env.items() if k != _ENV_WORKER},
        capture_output=True,
        text=True,
        timeout=WORKER_STARTUP_LIMIT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise RunnerError(
            f"cannot import plugin module {args.plugin_module!r}:\n{proc.stderr[-MESSAGE_LIMIT:]}"
        )


def main(argv: list[str] | None = None) -> int:
    """Orchestrate a run.

    Exit status 0 only if no test failed and, with --compare, every
    baseline-passing test in the selection passed, was gated by the suite, or
    is a known difference (excluded or xfailed, with its reason).
    """
    args = _parse_args(argv)
    if args.worker:
        return _worker_main(args)
    # `timeout` and CI cancellations send SIGTERM: treat it like Ctrl-C so that
    # workers are killed and partial results are still reported.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    started = time.monotonic()
    temp_root = Path(tempfile.mkdtemp(prefix=f"dist_suite_{args.backend}_"))
    orch = Orchestrator(args, temp_root)
    error: str | None = None
    try:
        _check_plugin_importable(args, orch.env)
        names = select_tests(orch.collect(), args.subset)
        if orch.features_added:
            print(
                f"{args.backend} added to DistTestCases.backend_feature: " + ", ".join(orch.features_added),
                flush=True,
            )
        print(
            f"Running {len(names)} tests of torch {_torch_version()} DistributedTest "
            f"with backend={args.backend} world_size={WORLD_SIZE} subset={args.subset} "
            f"gates={args.gates}",
            flush=True,
        )
        orch.run(names)
    except RunnerError as exc:
        error = str(exc)
        print(f"ERROR: {error}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        error = "interrupted"
    finally:
        orch.kill_worker()
    wall = time.monotonic() - started

    counts = counts_of(orch.results)
    as_gloo = sorted(n for n, r in orch.results.items() if r.note == GLOO_BODY_NOTE)
    if as_gloo:
        print(f"\n{len(as_gloo)} tests ran with their body reading BACKEND='gloo' on {args.backend}: "
              + ", ".join(as_gloo))
    comparison: Comparison | None = None
    if args.compare is not None:
        comparison = compare_with_baseline(orch.results, args.compare)
        print(f"\nCompared with {args.compare} (tests that passed there):")
        for line in comparison.regressions:
            print(f"  {line}")
        for line in comparison.gated:
            print(f"  {line}  [gated by the suite on backend name]")
        for line in comparison.known:
            print(f"  {line}")
        print(
            f"  {len(comparison.regressions)} failed or skipped at run time, "
            f"{len(comparison.gated)} skipped by import-time backend checks, "
            f"{len(comparison.known)} known differences, "
            f"{len(comparison.not_run)} not in this selection"
        )

    if args.json is not None:
        payload: dict[str, Any] = {
            "backend": args.backend,
            "subset": args.subset,
            "gates": args.gates,
            "name_bound": args.name_bound,
            "k": args.k,
            "world_size": WORLD_SIZE,
            "torch_version": _torch_version(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "per_test_timeout_s": args.per_test_timeout,
            "features_added": orch.features_added,
            "wall_time_s": round(wall, 1),
            "counts": counts,
            "error": error,
            "passed_tests": sorted(n for n, r in orch.results.items() if r.outcome == "passed"),
            "tests": {n: asdict(r) for n, r in sorted(orch.results.items())},
        }
        if comparison is not None:
            payload["compare"] = {"baseline": str(args.compare), **asdict(comparison)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n")

    failed = counts["failed"] > 0 or error is not None
    if comparison is not None and comparison.regressions:
        failed = True
    if failed or args.keep_logs:
        print(f"worker logs: {temp_root}")
    else:
        shutil.rmtree(temp_root, ignore_errors=True)
    print(f"wall time {wall:.1f}s")
    print(", ".join(f"{counts[outcome]} {outcome}" for outcome in OUTCOMES))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
