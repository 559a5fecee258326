"""Large all-reduces, which the daemon splits across its kernel threads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from commd.execution.local import PARALLEL_MIN_BYTES

REFERENCE = {
    "sum": lambda a, b: a + b,
    "max": np.maximum,
    "avg": lambda a, b: (a + b) / 2,
    "product": lambda a, b: a * b,
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parallel_allreduce_matches_numpy(daemon: Any, connect: Callable[..., Any], dtype: torch.dtype) -> None:
    """Buffers above the parallel threshold (and not a multiple of the block size) reduce exactly."""
    from commd.client import ops

    clients = [connect(r, 2) for r in range(2)]
    n = PARALLEL_MIN_BYTES // torch.empty((), dtype=dtype).element_size() * 3 + 13
    for op, reference in REFERENCE.items():
        sources = [torch.rand(n, generator=torch.Generator().manual_seed(7 * r + 1)).to(dtype) for r in range(2)]
        bufs = []
        for client, src in zip(clients, sources, strict=True):
            buf = client.empty(n, dtype)
            buf.copy_(src)
            bufs.append(buf)
        handles = [ops.all_reduce(c, b, op=op) for c, b in zip(clients, bufs, strict=True)]
        for handle in handles:
            handle.wait(60)
        expected = reference(*(s.double().numpy() for s in sources))
        rtol = 1e-6 if dtype == torch.float32 else 1e-2
        for rank, buf in enumerate(bufs):
            np.testing.assert_allclose(buf.double().numpy(), expected, rtol=rtol, err_msg=f"{op} rank {rank}")
