"""Reduction kernels on flat CPU tensors (torch, vectorized and multi-threaded).

torch rather than NumPy because it covers every dtype the torch backend must
(bfloat16 included), runs large element-wise ops on all cores, and releases
the GIL while doing so.  Semantics follow torch's Gloo backend:

* bool: SUM and MAX are logical OR, PRODUCT and MIN logical AND;
* AVG divides the sum by the number of contributors (floating and complex only);
* PREMUL_SUM multiplies the sum by a scalar (same result as scaling each input);
* bitwise ops need integer or bool dtypes, MIN/MAX need ordered dtypes.
"""

from __future__ import annotations

import torch

from commd.kernels.dtypes import UnsupportedReduction, check_supported

__all__ = ["DTYPE_NAMES", "TORCH_DTYPES", "UnsupportedReduction", "check_supported", "reduce_into",
           "reduce_pair_into"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def _accumulate(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    if other.device != acc.device:  # ranks on different GPUs (or host and GPU)
        other = other.to(acc.device, non_blocking=True)
    if acc.dtype == torch.bool:
        if op in ("sum", "max", "bor"):
            torch.logical_or(acc, other, out=acc)
        elif op in ("product", "min", "band"):
            torch.logical_and(acc, other, out=acc)
        elif op == "bxor":
            torch.logical_xor(acc, other, out=acc)
        else:
            raise UnsupportedReduction(f"reduce op {op.upper()} is undefined for bool")
        return
    if op in ("sum", "avg", "premul_sum"):
        acc.add_(other)
    elif op == "product":
        acc.mul_(other)
    elif op == "min":
        torch.minimum(acc, other, out=acc)
    elif op == "max":
        torch.maximum(acc, other, out=acc)
    elif op == "band":
        acc.bitwise_and_(other)
    elif op == "bor":
        acc.bitwise_or_(other)
    elif op == "bxor":
        acc.bitwise_xor_(other)
    else:
        raise UnsupportedReduction(f"unknown reduce op {op!r}")


def _finish(acc: torch.Tensor, op: str, contributors: int, scale: float) -> None:
    if op == "avg":
        acc.div_(contributors)
    elif op == "premul_sum":
        acc.mul_(scale)


def reduce_into(
    out: torch.Tensor, inputs: list[torch.Tensor], op: str, scale: float = 1.0
) -> None:
    """out = op(inputs).  ``out`` may alias ``inputs[0]`` or ``inputs[1]``, no other."""
    if len(inputs) == 1:
        if out.data_ptr() != inputs[0].data_ptr():
            out.copy_(inputs[0])
    elif out.data_ptr() == inputs[0].data_ptr():
        for other in inputs[1:]:
            _accumulate(out, other, op)
    else:
        reduce_pair_into(out, inputs[0], inputs[1], op)
        for other in inputs[2:]:
            _accumulate(out, other, op)
    _finish(out, op, len(inputs), scale)


def reduce_pair_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    """out = a op b in one pass when torch has an out= kernel (avoids a copy)."""
    if a.device != out.device:
        a = a.to(out.device, non_blocking=True)
    if b.device != out.device:
        b = b.to(out.device, non_blocking=True)
    if out.dtype != torch.bool and op in ("sum", "avg", "premul_sum"):
        torch.add(a, b, out=out)
    elif out.dtype != torch.bool and op == "product":
        torch.mul(a, b, out=out)
    elif out.dtype != torch.bool and op == "min":
        torch.minimum(a, b, out=out)
    elif out.dtype != torch.bool and op == "max":
        torch.maximum(a, b, out=out)
    else:
        if out.data_ptr() == b.data_ptr():
            a, b = b, a  # every reduce op commutes; never overwrite b before reading it
        if out.data_ptr() != a.data_ptr():
            out.copy_(a)
        _accumulate(out, b, op)
