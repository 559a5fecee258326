"""Conformance gates: torch's DistributedTest must pass on commd.

The suite is run out of process by ``run_distributed_suite.py`` (it spawns two
rank processes per test and needs the backend registered in each of them), so
these tests only launch the runner, bound it in time and read its JSON.  Both
run with ``--gates gloo``: the suite is imported as for Gloo, so the tests it
would run only for Gloo run too, on commd.

* ``gated`` subset (``make test-all``, about half a minute): one Gloo-only test each
  of barrier timeouts, sparse all_reduce, coalesced all_reduce and batched
  isend/irecv.
* ``fast`` subset (``make conformance`` / ``make test-all``, minutes): core
  collectives, p2p, barrier, subgroups, basic DDP and the known differences
  (DDP no_sync, whose body branches on the backend's name; monitored_barrier).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "run_distributed_suite.py"
BASELINE = HERE / "gloo_baseline.json"

# The fast subset takes ~4-5 minutes on a 2-core machine; leave room for a
# loaded machine and for a few hung tests (each bounded by the runner).
FAST_SUITE_TIMEOUT_S = 900
# The gated subset: 4 tests that spawn ranks, ~5-15 s apiece on a loaded 2-core machine.
GATED_SUITE_TIMEOUT_S = 420
PER_TEST_TIMEOUT_S = 120
# Grace for the runner to kill its workers and write results after SIGTERM.
TERMINATE_GRACE_S = 120

# Gloo-only tests of the gated subset that commd must pass (not skip).
GATED_MUST_PASS = (
    "test_barrier_timeout_full_group",
    "test_sparse_all_reduce_sum",
    "test_all_reduce_coalesced_sum",
    "test_batch_isend_irecv_gloo",
)


def _commd_import_error() -> str | None:
    """Try ``import commd`` in a fresh interpreter; return the error text, if any.

    A subprocess keeps a broken or hanging import from taking this pytest
    process down, and mirrors what the runner's rank processes will do.
    """
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import commd"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "import commd did not finish within 120s"
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return lines[-1] if lines else f"exit code {proc.returncode}"
    return None


def _run_suite(subset: str, out_json: Path, timeout_s: int) -> tuple[dict[str, Any], str]:
    """Run the runner on commd with Gloo's gates; return its JSON and output."""
    error = _commd_import_error()
    if error is not None:
        pytest.skip(f"commd backend not importable: {error}")
    cmd = [
        sys.executable,
        str(RUNNER),
        "--backend",
        "commd",
        "--gates",
        "gloo",
        "--subset",
        subset,
        "--per-test-timeout",
        str(PER_TEST_TIMEOUT_S),
        "--json",
        str(out_json),
        "--compare",
        str(BASELINE),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # SIGTERM lets the runner kill its workers and rank processes first.
        proc.terminate()
        try:
            output, _ = proc.communicate(timeout=TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"conformance runner exceeded {timeout_s}s\n{output[-8000:]}")
    print(output)
    assert out_json.exists(), f"runner wrote no results (rc={proc.returncode})\n{output[-8000:]}"
    data = json.loads(out_json.read_text())
    assert data["error"] is None, f"runner error: {data['error']}\n{output[-8000:]}"
    assert data["gates"] == "gloo", data["gates"]
    return data, output[-8000:]


def _assert_no_failures(data: dict[str, Any], tail: str) -> None:
    """No test failed, and every Gloo pass in the selection passed or is a known difference."""
    failed = sorted(name for name, res in data["tests"].items() if res["outcome"] == "failed")
    assert not failed, f"{len(failed)} DistributedTest tests failed on commd: {failed}\n{tail}"
    regressions = data["compare"]["regressions"] + data["compare"]["gated"]
    assert not regressions, "Gloo passes that did not pass on commd:\n" + "\n".join(regressions)


@pytest.mark.conformance
@pytest.mark.slow  # make conformance-gloo-gates and make test-all run it
@pytest.mark.timeout(GATED_SUITE_TIMEOUT_S + TERMINATE_GRACE_S + 60)
def test_gloo_only_tests_pass_on_commd_under_gloo_gates(tmp_path: Path) -> None:
    """The suite's Gloo-only tests run on commd and pass."""
    data, tail = _run_suite("gated", tmp_path / "commd_gated.json", GATED_SUITE_TIMEOUT_S)
    _assert_no_failures(data, tail)
    outcomes = {name: res["outcome"] for name, res in data["tests"].items()}
    for name in GATED_MUST_PASS:
        assert outcomes.get(name) == "passed", f"{name}: {outcomes.get(name)}\n{tail}"


@pytest.mark.conformance
@pytest.mark.slow  # minutes long: `make conformance` (or `make test-all`) runs it
@pytest.mark.timeout(FAST_SUITE_TIMEOUT_S + TERMINATE_GRACE_S + 60)
def test_distributed_suite_fast_subset_passes_on_commd(tmp_path: Path) -> None:
    """Every test of the fast subset that runs on commd passes, and some do."""
    data, tail = _run_suite("fast", tmp_path / "commd_fast.json", FAST_SUITE_TIMEOUT_S)
    _assert_no_failures(data, tail)
    counts = data["counts"]
    assert counts["passed"] > 0, f"no DistributedTest test passed on commd: {counts}"
    xfailed = data["tests"]["test_monitored_barrier_gloo"]
    assert xfailed["outcome"] == "xfailed", xfailed
    assert "commd.monitored_barrier" in xfailed["message"]
    name_bound = data["tests"]["test_accumulate_gradients_no_sync"]
    assert name_bound["outcome"] == "passed", name_bound
    assert "body saw BACKEND='gloo'" in name_bound["note"], name_bound
