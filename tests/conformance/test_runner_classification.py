"""How the DistributedTest runner classifies tests under ``--gates gloo``.

Pure orchestrator logic (no ranks spawned): which tests a subset selects,
which known differences apply, when a failure counts as the known one, and
how a run compares with the Gloo baseline.  The live runs are in
test_conformance_fast.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import run_distributed_suite as runner
from run_distributed_suite import SuiteResult

# What torch raises when monitored_barrier is called on a non-Gloo group
# (torch/distributed/distributed_c10d.py), as it reaches the runner: the
# parent's report of a rank's traceback.
TORCH_REFUSAL = (
    "E RuntimeError: Process 0 exited with error code 10 and exception:\n"
    "E Traceback (most recent call last):\n"
    'E   File "distributed_c10d.py", line 5419, in monitored_barrier\n'
    "E ValueError: monitored_barrier is only implemented for GLOO backend.\n"
)
# What commd.monitored_barrier raises for test_monitored_barrier_gloo_rank_0_timeout's 0 s timeout.
COMMD_ZERO_TIMEOUT = (
    "E RuntimeError: Process 0 exited with error code 10 and exception:\n"
    "E ValueError: monitored_barrier: timeout 0.0s must lie in [0.001, 604800] seconds\n"
)
OTHER_FAILURE = (
    "E RuntimeError: Process 1 exited with error code 10 and exception:\n"
    "E AssertionError: Tensor-likes are not close!\n"
)


def _differences() -> tuple[runner.KnownDifference, ...]:
    return runner.known_differences("commd", "gloo")


def test_gated_subset_is_the_gloo_only_tests() -> None:
    names = [
        "test_accumulate_gradients_no_sync",
        "test_accumulate_gradients_no_sync_grad_is_view",
        "test_all_reduce_coalesced_sum",
        "test_all_reduce_coalesced_max",
        "test_barrier_timeout_full_group",
        "test_barrier_timeout_global",
        "test_batch_isend_irecv_gloo",
        "test_batch_isend_irecv_gloo_tags",
        "test_batch_isend_irecv_nccl",
        "test_sparse_all_reduce_sum",
        "test_sparse_all_reduce_sum_cuda",
    ]
    assert runner.select_tests(names, "gated") == [
        "test_all_reduce_coalesced_sum",
        "test_barrier_timeout_full_group",
        "test_batch_isend_irecv_gloo",
        "test_sparse_all_reduce_sum",
    ]
    assert runner.select_tests(names, "full") == names


def test_known_differences_apply_only_to_another_backend_under_gloo_gates() -> None:
    assert runner.known_differences("commd", "gloo")
    assert runner.known_differences("commd", "own") == ()
    assert runner.known_differences("gloo", "gloo") == ()


def test_name_bound_tests_are_excluded_and_never_run_on_request(tmp_path: Path) -> None:
    """An all-excluded selection records the reason and starts no worker."""
    args = runner._parse_args(["--backend", "commd", "--gates", "gloo", "--name-bound", "exclude"])
    orch = runner.Orchestrator(args, tmp_path)
    names = [
        "test_accumulate_gradients_no_sync",
        "test_accumulate_gradients_no_sync_allreduce_hook",
    ]
    orch.run(names)
    assert [orch.results[n].outcome for n in names] == ["excluded", "excluded"]
    assert "cannot run under another name" in orch.results[names[0]].message
    assert not list(tmp_path.glob("worker*")), "a worker was started for excluded tests"


def test_name_bound_results_say_the_body_saw_gloo(tmp_path: Path) -> None:
    args = runner._parse_args(["--backend", "commd", "--gates", "gloo"])
    orch = runner.Orchestrator(args, tmp_path)
    orch._record("test_accumulate_gradients_no_sync_grad_is_view", SuiteResult("passed", 6.0))
    orch._record("test_barrier", SuiteResult("passed", 4.0))
    assert orch.results["test_accumulate_gradients_no_sync_grad_is_view"].note == runner.GLOO_BODY_NOTE
    assert orch.results["test_barrier"].note == ""


def test_monitored_barrier_failure_is_xfailed_only_for_torchs_refusal() -> None:
    name = "test_monitored_barrier_gloo_subgroup"
    refused = runner.expect_known_failure(name, SuiteResult("failed", 3.0, TORCH_REFUSAL), _differences())
    assert refused.outcome == "xfailed"
    assert refused.message.splitlines()[0].endswith("use commd.monitored_barrier")
    assert TORCH_REFUSAL in refused.message

    other = runner.expect_known_failure(name, SuiteResult("failed", 3.0, OTHER_FAILURE), _differences())
    assert other.outcome == "failed"
    passed = runner.expect_known_failure(name, SuiteResult("passed", 3.0), _differences())
    assert passed.outcome == "passed"
    unrelated = runner.expect_known_failure(
        "test_barrier", SuiteResult("failed", 3.0, TORCH_REFUSAL), _differences()
    )
    assert unrelated.outcome == "failed"
    zero = "test_monitored_barrier_gloo_rank_0_timeout"
    assert runner.expect_known_failure(
        zero, SuiteResult("failed", 3.0, COMMD_ZERO_TIMEOUT), _differences()).outcome == "xfailed"
    assert runner.expect_known_failure(
        zero, SuiteResult("failed", 3.0, TORCH_REFUSAL), _differences()).outcome == "failed"
    under_own_gates = runner.expect_known_failure(
        name, SuiteResult("failed", 3.0, TORCH_REFUSAL), runner.known_differences("commd", "own")
    )
    assert under_own_gates.outcome == "failed"


def test_comparison_sets_known_differences_apart_from_regressions(tmp_path: Path) -> None:
    baseline = tmp_path / "baseline.json"
    gloo_passes = [
        "test_accumulate_gradients_no_sync",
        "test_barrier",
        "test_broadcast",
        "test_gather",
        "test_monitored_barrier_gloo",
        "test_scatter",
    ]
    baseline.write_text(json.dumps({"passed_tests": gloo_passes}))
    results = {
        "test_accumulate_gradients_no_sync": SuiteResult("excluded", 0.0, "cannot run under another name"),
        "test_barrier": SuiteResult("passed", 1.0),
        "test_broadcast": SuiteResult("failed", 1.0, OTHER_FAILURE),
        "test_gather": SuiteResult("skipped", 0.0, "Only gloo", static_skip=True),
        "test_monitored_barrier_gloo": SuiteResult("xfailed", 1.0, "torch refuses\n" + TORCH_REFUSAL),
    }
    comparison = runner.compare_with_baseline(results, baseline)
    assert [line.split()[1] for line in comparison.regressions] == ["test_broadcast"]
    assert [line.split()[1] for line in comparison.gated] == ["test_gather"]
    assert [line.split()[1] for line in comparison.known] == [
        "test_accumulate_gradients_no_sync",
        "test_monitored_barrier_gloo",
    ]
    assert comparison.not_run == ["test_scatter"]
    counts = runner.counts_of(results)
    assert counts == {"passed": 1, "failed": 1, "skipped": 1, "excluded": 1, "xfailed": 1}
