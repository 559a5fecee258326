"""Conformance gate: torch's DistributedTest "fast" subset must pass on commd.

The suite is run out of process by ``run_distributed_suite.py`` (it spawns two
rank processes per test and needs the backend registered in each of them), so
this test only launches the runner, bounds it in time and reads its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "run_distributed_suite.py"
BASELINE = HERE / "gloo_baseline.json"

# The fast subset takes ~2-3 minutes with gloo on a 2-core machine; leave room
# for a slower backend and for a few hung tests (each bounded by the runner).
SUITE_TIMEOUT_S = 900
PER_TEST_TIMEOUT_S = 120
# Grace for the runner to kill its workers and write results after SIGTERM.
TERMINATE_GRACE_S = 120

# Minutes long: `make conformance` (or `make test-all`) runs it; `make test` leaves it out.
pytestmark = [pytest.mark.conformance, pytest.mark.slow]


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


@pytest.mark.timeout(SUITE_TIMEOUT_S + TERMINATE_GRACE_S + 60)
def test_distributed_suite_fast_subset_passes_on_commd(tmp_path: Path) -> None:
    """Every test of the fast subset that runs on commd passes, and some do."""
    error = _commd_import_error()
    if error is not None:
        pytest.skip(f"commd backend not importable: {error}")

    out_json = tmp_path / "commd_fast.json"
    cmd = [
        sys.executable,
        str(RUNNER),
        "--backend",
        "commd",
        "--subset",
        "fast",
        "--per-test-timeout",
        str(PER_TEST_TIMEOUT_S),
        "--json",
        str(out_json),
    ]
    if BASELINE.exists():
        # Only for the printed report: which gloo-passing tests did not pass.
        cmd += ["--compare", str(BASELINE)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=SUITE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM lets the runner kill its workers and rank processes first.
        proc.terminate()
        try:
            output, _ = proc.communicate(timeout=TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"conformance runner exceeded {SUITE_TIMEOUT_S}s\n{output[-8000:]}")
    print(output)

    assert out_json.exists(), f"runner wrote no results (rc={proc.returncode})\n{output[-8000:]}"
    data = json.loads(out_json.read_text())
    assert data["error"] is None, f"runner error: {data['error']}\n{output[-8000:]}"
    counts = data["counts"]
    failed = sorted(name for name, res in data["tests"].items() if res["outcome"] == "failed")
    tail = output[-8000:]
    assert counts["failed"] == 0, (
        f"{counts['failed']} DistributedTest tests failed on commd: {failed}\n{tail}"
    )
    assert counts["passed"] > 0, f"no DistributedTest test passed on commd: {counts}"
