"""The benchmark workloads (benchmarks/workloads: MoE, DLRM, Megatron GPT) over "commd", against
Gloo and against a single process.

Every rank trains the same seeded workload twice in one job, once on subgroups made with the
commd backend and once on Gloo subgroups of the same ranks: at world 2 every sum is a + b
whichever backend adds it, so losses and parameters must come out bit-identical.  Rank 0
also trains the single-process reference (all experts, tables and shards in one model, on
every rank's data) and the ranks' mean loss must match it, which checks the workloads'
parallelism itself, not only that two backends agree.  The worker script runs once under
``commd launch`` and is checked against the reference the same way.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_torch_backend import spawn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from workloads.groups import make_groups  # noqa: E402
from workloads.models import ParallelGPT, build, local_groups  # noqa: E402

WORKER = ROOT / "benchmarks" / "workloads" / "worker.py"
OP_TIMEOUT = timedelta(seconds=60)
CASES = {
    "moe-capacity": ("moe", {"routing": "capacity"}),
    "moe-dropless": ("moe", {"routing": "dropless"}),
    "dlrm": ("dlrm", {}),
    "megatron": ("megatron", {}),
}


def _expected_ops(name: str, cfg: dict[str, Any], world: int) -> dict[tuple[str, str, str, str], float]:
    """The ops per step each workload is designed to issue itself (DDP's come on top)."""
    layers = cfg.get("layers", 2)
    if name == "moe":
        ops = {("all_to_all_single", "ep", phase, what): layers for phase in ("forward", "backward")
               for what in ("dispatch", "combine")}
        if cfg["routing"] == "dropless":
            ops[("all_to_all_single", "ep", "forward", "token counts")] = layers
            ops[("all_reduce", "ep", "forward", "max expert load (MAX)")] = layers
        if world > 2:
            ops[("all_reduce", "expert_dp", "backward", "expert grads")] = 1
        return ops
    if name == "dlrm":
        return {("all_to_all_single", "all", phase, "pooled embeddings"): 1 for phase in ("forward", "backward")}
    return {("all_reduce", "tp", "forward", "activations"): 2 * layers,
            ("all_reduce", "tp", "backward", "activation grads"): 2 * layers}


def _expected_ddp_bytes(workload: Any) -> int:
    """What DDP must all-reduce: MoE's parameters but the experts', DLRM's MLPs (not its tables),
    Megatron's shard where there is data parallelism (none at tp 2, world 2)."""
    named = workload.named_parameters()
    if workload.name == "moe":
        kept = [p for n, p in named if ".experts." not in n]
    elif workload.name == "dlrm":
        kept = [p for n, p in named if not n.startswith("2.")]
    else:
        kept = [p for _, p in named] if workload.groups.dp is not None else []
    return sum(p.numel() * p.element_size() for p in kept)


def _train(name: str, cfg: dict[str, Any], groups: Any, steps: int) -> tuple[list[float], list[torch.Tensor], Any]:
    workload = build(name, cfg, groups)
    losses = [workload.step(step) for step in range(steps)]
    return losses, [p.detach().clone() for p in workload.parameters()], workload


def _compare_rank(rank: int, world: int, cases: list[str], steps: int, exact: bool, reference: bool = True) -> None:
    """One rank of a job that checks each of ``cases`` in turn (one job: starting ranks costs
    more than training the tiny models)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd", timeout=OP_TIMEOUT)
    for case in cases:
        _compare_case(rank, world, case, steps, exact, reference)
    dist.destroy_process_group()


def _compare_case(rank: int, world: int, case: str, steps: int, exact: bool, reference: bool) -> None:
    """Train ``case`` on commd groups and on Gloo groups; compare them, the ops issued and (with
    ``reference``) the single-process model."""
    name, extra = CASES[case]
    cfg = {"preset": "tiny", "seed": 3, **extra}
    groups = {backend: make_groups(name, world, backend) for backend in ("commd", "gloo")}
    initial = [p.detach().clone() for p in build(name, cfg, groups["gloo"]).parameters()]
    runs = {backend: _train(name, cfg, g, steps) for backend, g in groups.items()}
    (losses_c, params_c, workload_c), (losses_g, params_g, _) = runs["commd"], runs["gloo"]

    assert all(math.isfinite(x) for x in losses_c), losses_c
    if exact:
        assert losses_c == losses_g, f"{case} rank {rank}: losses differ\ncommd {losses_c}\ngloo  {losses_g}"
    else:
        torch.testing.assert_close(torch.tensor(losses_c), torch.tensor(losses_g), rtol=1e-5, atol=1e-6)
    for i, (a, b) in enumerate(zip(params_c, params_g, strict=True)):
        if exact:
            assert torch.equal(a, b), f"{case} rank {rank}: parameter {i} differs (max {(a - b).abs().max()})"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"parameter {i}: {m}")
    assert not all(torch.equal(a, b) for a, b in zip(params_c, initial, strict=True)), "training changed nothing"

    described = workload_c.describe()["ops_per_step"]
    issued = {(o["op"], o["group"], o["phase"], o["what"]): o["count"] for o in described if "DDP" not in o["what"]}
    assert issued == _expected_ops(name, workload_c.cfg, world), f"{case}: {issued}"
    ddp_bytes = sum(o["bytes_sent"] for o in described if "DDP" in o["what"])
    assert ddp_bytes == _expected_ddp_bytes(workload_c), f"{case}: DDP all-reduces {ddp_bytes} bytes"

    if reference:
        _assert_matches_one_process(rank, world, case, cfg, steps, losses_c, params_c, workload_c)


def _assert_matches_one_process(rank: int, world: int, case: str, cfg: dict[str, Any], steps: int,
                                losses_c: list[float], params_c: list[torch.Tensor], workload_c: Any) -> None:
    """The ranks' mean loss and this rank's parameters against the single-process model."""
    name = CASES[case][0]
    everyone: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(everyone, losses_c)
    data_ranks = world // 2 if name == "megatron" else world  # Megatron: tp 2, the rest data parallel
    reference, ref_params, ref_workload = _train(name, {**cfg, "data_ranks": data_ranks}, local_groups(), steps)
    if name == "megatron":  # a rank's loss is its data-parallel replica's
        mean = [sum(everyone[2 * r][s] for r in range(data_ranks)) / data_ranks for s in range(steps)]
    else:
        mean = [sum(losses[s] for losses in everyone) / world for s in range(steps)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(reference), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{case}: parallel vs single-process losses: {m}")
    whole = dict(zip([n for n, _ in ref_workload.named_parameters()], ref_params, strict=True))
    compared = 0
    for (local_name, _), got in zip(workload_c.named_parameters(), params_c, strict=True):
        if (name_there := workload_c.reference_name(local_name)) is not None:
            torch.testing.assert_close(got, whole[name_there], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=local_name: f"{case} rank {rank} {n} vs one process: {m}")
            compared += 1
    assert compared >= len(params_c) // 3, f"{case}: only {compared} parameters map onto the single process"
    if name == "megatron":
        _assert_shard_matches(workload_c.cfg, ref_params, params_c, workload_c.groups.tp_rank)


def _assert_shard_matches(cfg: dict[str, Any], full: list[torch.Tensor], mine: list[torch.Tensor],
                          tp_rank: int) -> None:
    """This rank's trained tensor-parallel shard equals the same slices of the trained full model."""
    whole, shard = ParallelGPT(cfg, None, 1), ParallelGPT(cfg, None, 2)
    with torch.no_grad():
        for p, value in zip(whole.parameters(), full, strict=True):
            p.copy_(value)
    shard.load_shard(whole, tp_rank)
    for i, (want, got) in enumerate(zip(shard.parameters(), mine, strict=True)):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, i=i: f"shard param {i} of TP rank {tp_rank}: {m}")


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
@pytest.mark.timeout(150)
def test_workloads_commd_match_gloo_bit_for_bit_and_one_process(backend_env: Path) -> None:
    """MoE (both routings), DLRM and Megatron, 5 steps each at world 2."""
    spawn(_compare_rank, (2, list(CASES), 5, True), timeout=130, nprocs=2)


@pytest.mark.extended  # make test-extended: 200 steps of each workload on both backends
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_workload_commd_matches_gloo_for_200_steps(backend_env: Path, case: str) -> None:
    # bitwise against Gloo all along; the single process is left out: 200 steps of float
    # rounding (and the routing decisions it may flip) would measure the CPU, not the workload
    spawn(_compare_rank, (2, [case], 200, True, False), timeout=280, nprocs=2)


@pytest.mark.extended  # make test-extended: four ranks on two cores
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", list(CASES))
def test_workload_commd_matches_gloo_at_world_4(backend_env: Path, case: str) -> None:
    """Four ranks: sums of four may be added in another order, so close rather than equal (and
    MoE gets an expert-data-parallel all-reduce, Megatron a data-parallel DDP)."""
    spawn(_compare_rank, (4, [case], 5, False), timeout=180, nprocs=4)


@pytest.mark.timeout(150)
@pytest.mark.extended
def test_worker_under_commd_launch_matches_one_process(runtime_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """worker.py, as the benchmarks run it: Megatron with tp=2, dp=1 under ``commd launch``; both
    ranks report the losses of a single process training the unsplit model."""
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "COMMD_OP_TIMEOUT"):
        monkeypatch.delenv(variable, raising=False)
    cfg = {"workload": "megatron", "backend": "commd", "lane": None, "steps": 4, "warmup": 2, "seed": 5,
           "preset": "tiny", "out": str(tmp_path / "rank{rank}.json")}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "commd", "launch", "--nproc-per-node", "2", str(WORKER),
                           str(tmp_path / "cfg.json")], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    reference = build("megatron", {k: v for k, v in cfg.items() if k != "out"}, local_groups())
    want = [reference.step(step) for step in range(6)]
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["world"] == 2 and result["config"] == cfg
        assert len(result["losses"]) == 6 and len(result["step_times"]) == 4
        assert all(t > 0 for t in result["step_times"])
        assert len(result["params_digest"]) == 64
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, rank=rank: f"rank {rank} vs one process: {m}")
        ops = {(o["op"], o["group"], o["phase"]): o for o in result["description"]["ops_per_step"]}
        assert ops[("all_reduce", "tp", "forward")]["count"] == 4  # two per layer, two layers
        assert ops[("all_reduce", "tp", "backward")]["bytes_sent"] == 4 * 2 * 16 * 16 * 4  # [batch, seq, d_model]
        assert result["description"]["groups"]["tp"] == [0, 1]
    assert results[0]["params_digest"] != results[1]["params_digest"]  # two different shards
