"""ShardedTensor and checkpoint resharding over "commd" on a CPU-only torch, as PyTorch's own tests do them.

torch asks a group's backend for its preferred device (``ShardedTensor.gather``,
distributed checkpoint's planning); a backend registered for ``cuda`` on a torch
without CUDA sends those calls to a CUDA that does not exist.  The expected
tensors are built independently, in one process, from the same seed.
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
ROWS, COLS = 8, 6


def _full_tensor() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(7))


def _spec(dim: int) -> Any:
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(WORLD)])


def _sharded(dim: int, values: torch.Tensor | None) -> Any:
    """A ShardedTensor of the full tensor's shape, chunked along ``dim``; filled from ``values`` or zeros."""
    from torch.distributed._shard import sharded_tensor

    st = sharded_tensor.zeros(_spec(dim), ROWS, COLS)
    if values is not None:
        for shard in st.local_shards():
            offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.copy_(values[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]])
    return st


def _init(rank: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd")
    assert dist.get_backend() == "commd"


def _gather_rank(rank: int) -> None:
    _init(rank)
    full = _full_tensor()
    for dim in (0, 1):
        st = _sharded(dim, full)
        out = torch.zeros(ROWS, COLS) if rank == 0 else None
        st.gather(dst=0, out=out)
        if rank == 0:
            assert torch.equal(out, full), f"gather of a tensor chunked along dim {dim} differs"
    dist.destroy_process_group()


def _reshard_rank(rank: int, directory: str) -> None:
    import torch.distributed.checkpoint as dcp

    _init(rank)
    full = _full_tensor()
    path = Path(directory) / "rows"
    dcp.save({"w": _sharded(0, full)}, checkpoint_id=path)
    # load chunked along the other dimension: every rank reads parts of both ranks' shards
    columns = {"w": _sharded(1, None)}
    dcp.load(columns, checkpoint_id=path)
    for shard in columns["w"].local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        want = full[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]]
        assert torch.equal(shard.tensor, want), f"rank {rank}: the column shard read back differs"
    # a sharded checkpoint read into a plain tensor, and a plain one read into a sharded tensor
    plain = {"w": torch.zeros(ROWS, COLS)}
    dcp.load(plain, checkpoint_id=path)
    assert torch.equal(plain["w"], full), f"rank {rank}: the plain tensor read from the sharded checkpoint differs"
    plain_path = Path(directory) / "plain"
    dcp.save({"w": full.clone()}, checkpoint_id=plain_path)
    rows = {"w": _sharded(0, None)}
    dcp.load(rows, checkpoint_id=plain_path)
    gathered = torch.zeros(ROWS, COLS) if rank == 0 else None
    rows["w"].gather(dst=0, out=gathered)
    if rank == 0:
        assert torch.equal(gathered, full), "the sharded tensor read from a plain checkpoint differs"
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without CUDA (this one has a GPU)")
def test_the_backend_is_registered_only_for_the_devices_this_torch_has() -> None:
    import commd  # noqa: F401

    assert dist.Backend.backend_capability["commd"] == ["cpu"]
    assert dist.Backend.default_device_backend_map.get("cuda") != "commd"


def test_sharded_tensor_gather(backend_env: Path) -> None:
    spawn(_gather_rank, ())


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
def test_a_checkpoint_resharded_on_load_and_switched_between_sharded_and_plain(backend_env: Path,
                                                                                 tmp_path: Path) -> None:
    spawn(_reshard_rank, (str(tmp_path),))
