"""The reductions of tiny all-reduces that travel with the fabric's negotiation (kernels/eager.py).

Each is checked against a NumPy reference and, byte for byte, against the torch kernels
the lanes use (commd.kernels.reduce): a node must get the same bits whichever path ran.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from commd.kernels import eager
from commd.kernels.reduce import TORCH_DTYPES, reduce_into
from commd.kernels.split import split_reduce

CASES = [
    ("sum", "float32"), ("sum", "float16"), ("sum", "complex64"), ("sum", "int64"), ("sum", "bool"),
    ("product", "float64"), ("product", "int32"), ("product", "bool"), ("min", "int8"), ("max", "uint8"),
    ("band", "int32"), ("bor", "int64"), ("bxor", "uint8"), ("avg", "float32"), ("avg", "float16"),
    ("premul_sum", "float64"), ("premul_sum", "float32"),
]


def _arrays(op: str, dtype: str, count: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return [rng.integers(0, 2, n).astype(np.bool_) for _ in range(count)]
    if op == "product":
        return [rng.integers(1, 4, n).astype(dtype) for _ in range(count)]
    if dtype.startswith("float") or dtype.startswith("complex"):
        return [(rng.standard_normal(n) * 3).astype(dtype) for _ in range(count)]
    return [rng.integers(0, 100, n).astype(dtype) for _ in range(count)]


def _torch_path(arrays: list[list[np.ndarray]], op: str, dtype: str, scale: float, group: int) -> np.ndarray:
    """What the torch kernels compute: local reduce per node, lane op across nodes, finish."""
    split = split_reduce(op)
    parts = []
    for node in arrays:
        tensors = [torch.from_numpy(a.copy()) for a in node]
        out = torch.empty_like(tensors[0])
        reduce_into(out, tensors, split.local_op, scale)
        parts.append(out)
    acc = torch.empty_like(parts[0])
    reduce_into(acc, parts, split.lane_op, 1.0)
    split.finish(acc, group)
    return acc.numpy()


@pytest.mark.parametrize(("op", "dtype"), CASES)
def test_numpy_path_matches_torch_kernels_bit_for_bit(op: str, dtype: str) -> None:
    assert eager.on_numpy(dtype, op)
    nodes = [_arrays(op, dtype, 2, 37, seed) for seed in (1, 2, 3)]  # 3 nodes x 2 ranks
    scale = 0.37 if op == "premul_sum" else 1.0
    contributions = [eager.contribution(node, op, scale) for node in nodes]
    result = eager.combine(contributions, dtype, op)
    bufs = [np.zeros(37, dtype=dtype) for _ in range(2)]
    eager.write_result(result, dtype, op, 6, bufs)
    want = _torch_path(nodes, op, dtype, scale, 6)
    for buf in bufs:
        assert buf.tobytes() == want.tobytes(), f"{op} {dtype}: {buf[:4]} != {want[:4]}"


def test_against_numpy_reference() -> None:
    nodes = [[np.arange(8, dtype=np.float32) * (r + 1) for r in range(2)] for _ in range(2)]
    parts = [eager.contribution(node, "avg", 1.0) for node in nodes]
    bufs = [np.zeros(8, dtype=np.float32)]
    eager.write_result(eager.combine(parts, "float32", "avg"), "float32", "avg", 4, bufs)
    np.testing.assert_array_equal(bufs[0], np.arange(8, dtype=np.float32) * 1.5)  # (1+2+1+2)/4
    scaled = eager.contribution([np.full(4, 2.0), np.full(4, 4.0)], "premul_sum", 0.5)
    np.testing.assert_array_equal(np.frombuffer(scaled), np.full(4, 3.0))


def test_torch_only_dtypes_and_integer_avg_stay_on_torch() -> None:
    assert not eager.on_numpy("bfloat16", "sum")
    assert not eager.on_numpy("int32", "avg") and not eager.on_numpy("bool", "avg")
    assert eager.on_numpy("int32", "sum") and eager.on_numpy("float16", "avg")
    values = [torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16), torch.tensor([4.0, 8.0, 16.0],
                                                                                  dtype=torch.bfloat16)]
    part = eager.contribution(values, "sum", 1.0)
    result = eager.combine([part, part], "bfloat16", "sum")
    out = [torch.zeros(3, dtype=TORCH_DTYPES["bfloat16"])]
    eager.write_result(result, "bfloat16", "sum", 4, out)
    assert out[0].float().tolist() == [10.0, 20.0, 38.0]
