"""FSDP2, DTensor tensor parallelism and distributed checkpoint over "commd", against Gloo.

Every rank trains the same seeded model twice, once on a device mesh over the
commd default group and once over a Gloo group of the same ranks, and the
parameters must come out bit-identical (a two-rank sum is a + b whichever
backend adds it).  Checkpoints written through one backend are read through
the other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_torch_backend import spawn

pytestmark = pytest.mark.timeout(240)

WORLD = 2
STEPS = 3


def _init(rank: int) -> Any:
    """The commd default group and a Gloo group of the same ranks."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd")
    assert dist.get_backend() == "commd"
    return dist.new_group(backend="gloo")


def _meshes(gloo: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    return {"commd": init_device_mesh("cpu", (WORLD,)), "gloo": DeviceMesh.from_group(gloo, "cpu")}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))


def _train(model: torch.nn.Module, rank: int, same_input: bool) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        seed = step if same_input else step * WORLD + rank
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed))
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _assert_identical(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{what}: parameter {i} differs (max |diff| {(a - b).abs().max().item()})"


def _fsdp2_rank(rank: int) -> None:
    from torch.distributed.fsdp import fully_shard

    gloo = _init(rank)
    params = {}
    for name, mesh in _meshes(gloo).items():
        model = _mlp()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train(model, rank, same_input=False)
        params[name] = _full(model)
    _assert_identical(params["commd"], params["gloo"], f"FSDP2 rank {rank}")
    reference = _mlp()
    assert not all(torch.equal(a, b) for a, b in zip(params["commd"], reference.parameters(), strict=True)), (
        "training changed nothing: the comparison would prove nothing"
    )
    dist.destroy_process_group()


def _tensor_parallel_rank(rank: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    gloo = _init(rank)
    params = {}
    for name, mesh in _meshes(gloo).items():
        model = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        _train(model, rank, same_input=True)  # tensor parallelism: every rank sees the same batch
        params[name] = _full(model)
    _assert_identical(params["commd"], params["gloo"], f"tensor parallel rank {rank}")
    single = _mlp()  # one process, no parallelism: the independent reference
    _train(single, rank, same_input=True)
    for i, (a, b) in enumerate(zip(params["commd"], single.parameters(), strict=True)):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"param {i}: {m}")
    dist.destroy_process_group()


def _checkpoint_rank(rank: int, directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    gloo = _init(rank)
    meshes = _meshes(gloo)
    trained = _mlp()
    fully_shard(trained, mesh=meshes["commd"])
    _train(trained, rank, same_input=False)
    want = _full(trained)
    for writer, reader in (("commd", "gloo"), ("gloo", "commd")):
        path = os.path.join(directory, f"written-by-{writer}")
        dcp.save({"model": trained.state_dict()}, checkpoint_id=path,
                 process_group=None if writer == "commd" else gloo)
        fresh = _mlp()
        fully_shard(fresh, mesh=meshes[reader])
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=path, process_group=None if reader == "commd" else gloo)
        fresh.load_state_dict(state["model"])
        _assert_identical(_full(fresh), want, f"checkpoint written by {writer}, read by {reader}, rank {rank}")
    dist.destroy_process_group()


def test_fsdp2_matches_gloo_bit_for_bit(backend_env: Path) -> None:
    spawn(_fsdp2_rank, ())


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
def test_dtensor_tensor_parallel_matches_gloo_and_one_process(backend_env: Path) -> None:
    spawn(_tensor_parallel_rank, ())


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
def test_distributed_checkpoint_round_trips_between_backends(backend_env: Path, tmp_path: Path) -> None:
    spawn(_checkpoint_rank, (str(tmp_path),))
