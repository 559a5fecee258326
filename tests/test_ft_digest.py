"""commd.ft's state digest (``seats.tensor_digest``): the CRC32 of the tensors' bytes, for any dtype.

The survivors and a replacement compare it before they go on; a bfloat16 model (no NumPy type)
made the comparison itself raise TypeError, which ended the recovery.  The reference here is
zlib over each tensor's bytes taken another way (an integer view of the same width).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from commd.ft.seats import tensor_digest

SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def reference(tensors: list[torch.Tensor]) -> int:
    digest = 0
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1)
        if flat.dtype != torch.bool:
            flat = flat.view(SAME_WIDTH_INT[flat.element_size()])
        digest = zlib.crc32(flat.numpy().tobytes(), digest)
    return digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.bool, torch.uint8])
def test_the_digest_is_the_crc32_of_the_bytes_for_every_dtype(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    tensors = [(torch.randn(33, 5, generator=g) * 100).to(dtype), torch.tensor(3).to(dtype),
               torch.empty(0, dtype=dtype), (torch.randn(8, 6, generator=g) * 10).to(dtype).t()]  # a view
    assert tensor_digest(tensors) == reference(tensors)


def test_one_changed_bit_or_a_swap_changes_the_digest() -> None:
    a, b = torch.randn(1000, dtype=torch.float32), torch.randn(10, dtype=torch.bfloat16)
    base = tensor_digest([a, b])
    flipped = a.clone()
    flipped.view(torch.int32)[123] ^= 1
    assert tensor_digest([flipped, b]) != base
    assert tensor_digest([b, a]) != base
    assert tensor_digest([a, b]) == base  # and it is a function of the bytes alone
