"""DTensor sequence parallelism and a 2x2 ``dp x tp`` mesh over "commd", against Gloo and one process.

As in test_torch_parallel.py, every rank trains the same seeded model on a mesh over the commd
groups and on a mesh over Gloo groups of the same ranks: the parameters must come out
bit-identical.  A single process without parallelism, trained on the same (concatenated) batches,
is the independent reference, within float tolerance (sums run in another order there).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_torch_backend import spawn

pytestmark = pytest.mark.timeout(300)

STEPS = 2
SEQ, HIDDEN = 4, 8


def _init(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd")
    assert dist.get_backend() == "commd"


def _sp_model() -> torch.nn.Module:
    """Megatron-SP's shape: column, row, a LayerNorm on the sequence-split activation, column, row."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.ReLU(), torch.nn.Linear(2 * HIDDEN, HIDDEN),
        torch.nn.LayerNorm(HIDDEN),
        torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.ReLU(), torch.nn.Linear(2 * HIDDEN, HIDDEN),
    )


def _batch(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _train(model: torch.nn.Module, batches: list[torch.Tensor], scale: float = 1.0) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x in batches:
        optimizer.zero_grad()
        (model(x).pow(2).sum() * scale).backward()
        optimizer.step()


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in model.parameters()]


def _assert_identical(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{what}: parameter {i} differs (max |diff| {(a - b).abs().max().item()})"


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"{what}: param {i}: {m}")
    assert not all(torch.equal(a, b) for a, b in zip(want, _full(_sp_model()), strict=True)), (
        "training changed nothing: the comparison would prove nothing")


def _assert_backends(meshes: dict[str, Any]) -> None:
    """Each mesh's groups (every dimension's) run on the backend it is named after."""
    for name, mesh in meshes.items():
        for dim in range(mesh.ndim):
            assert dist.get_backend(mesh.get_group(dim)) == name, f"{name} mesh dimension {dim}"


def _sequence_parallel_plan() -> dict[str, Any]:
    """torch's Megatron-SP example: the row layer reduce-scatters onto the sequence dimension, the
    LayerNorm runs on its sequence shard, the column layer all-gathers it back."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel(output_layouts=Shard(1)), "3": SequenceParallel(),
            "4": ColwiseParallel(input_layouts=Shard(1)), "6": RowwiseParallel()}


def _sequence_parallel_rank(rank: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    _init(rank, 2)
    gloo = dist.new_group(backend="gloo")
    meshes = {"commd": init_device_mesh("cpu", (2,)), "gloo": DeviceMesh.from_group(gloo, "cpu")}
    batches = [_batch(step) for step in range(STEPS)]  # tensor parallel: every rank the same batch
    _assert_backends(meshes)
    params = {}
    for name, mesh in meshes.items():
        model = parallelize_module(_sp_model(), mesh, _sequence_parallel_plan())
        _train(model, batches)
        params[name] = _full(model)
    _assert_identical(params["commd"], params["gloo"], f"sequence parallel rank {rank}")
    single = _sp_model()
    _train(single, batches)
    _assert_close(params["commd"], _full(single), f"sequence parallel rank {rank} against one process")
    dist.destroy_process_group()


def _gloo_mesh_2x2() -> Any:
    """The 2x2 mesh over Gloo groups: rank = 2 * dp + tp (row-major, as init_device_mesh lays it)."""
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    groups = {}
    for kind, members in (("tp", [[0, 1], [2, 3]]), ("dp", [[0, 2], [1, 3]])):
        for ranks in members:  # every rank creates every group, in the same order
            group = dist.new_group(ranks, backend="gloo")
            if rank in ranks:
                groups[kind] = group
    return DeviceMesh.from_group([groups["dp"], groups["tp"]], "cpu", mesh=torch.arange(4).view(2, 2),
                                 mesh_dim_names=("dp", "tp"))


def _dp_tp_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.ReLU(), torch.nn.Linear(2 * HIDDEN, HIDDEN))


def _dp_tp_rank(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _init(rank, 4)
    meshes = {"commd": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), "gloo": _gloo_mesh_2x2()}
    _assert_backends(meshes)
    dp = rank // 2
    params = {}
    for name, mesh in meshes.items():
        assert mesh["dp"].get_local_rank() == dp
        model = parallelize_module(_dp_tp_model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        _train(model, [_batch(2 * step + dp) for step in range(STEPS)])
        params[name] = _full(model)
    _assert_identical(params["commd"], params["gloo"], f"dp x tp rank {rank}")
    single = _dp_tp_model()  # FSDP averages over dp: the mean of the two dp ranks' losses
    _train(single, [torch.cat([_batch(2 * step), _batch(2 * step + 1)]) for step in range(STEPS)], scale=0.5)
    want = _full(single)
    for i, (a, b) in enumerate(zip(params["commd"], want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"dp x tp param {i}: {m}")
    assert not all(torch.equal(a, b) for a, b in zip(want, _full(_dp_tp_model()), strict=True))
    dist.destroy_process_group()


@pytest.mark.extended
def test_sequence_parallel_matches_gloo_and_one_process(backend_env: Path) -> None:
    spawn(_sequence_parallel_rank, ())


@pytest.mark.extended
def test_dp_by_tp_mesh_matches_gloo_and_one_process(backend_env: Path) -> None:
    spawn(_dp_tp_rank, (), timeout=240, nprocs=4)
