"""NumPy kernels for tiny buffers, where per-call overhead is the whole cost.

torch spends several microseconds per call on dispatch; NumPy about one.
These cover the latency-critical small ops (all-reduce, reduce, broadcast)
for every dtype NumPy has (all but bfloat16); semantics match
commd.kernels.reduce exactly.
"""

from __future__ import annotations

import warnings

import numpy as np

# A float sum that overflows gives inf, as torch's does, without a word; NumPy would warn, and
# entering np.errstate costs more than a tiny reduction itself (reduce_into_unchecked skips it).
warnings.filterwarnings("ignore", r"(overflow|invalid value|divide by zero) encountered",
                        RuntimeWarning, r"commd\.kernels\.small")

NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64",
        "bool", "complex64", "complex128",
    )
}

_BOOL_OPS = {
    "sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
    "product": np.logical_and, "min": np.logical_and, "band": np.logical_and,
    "bxor": np.logical_xor,
}
_OPS = {
    "sum": np.add, "avg": np.add, "premul_sum": np.add, "product": np.multiply,
    "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}


def reduce_into(out: np.ndarray, inputs: list[np.ndarray], op: str, scale: float = 1.0) -> None:
    """out = op(inputs); ``out`` may alias ``inputs[0]``."""
    with np.errstate(all="ignore"):  # overflow wraps or saturates silently, as in torch
        _reduce(out, inputs, op, scale)


def reduce_into_unchecked(out: np.ndarray, inputs: list[np.ndarray], op: str, scale: float = 1.0) -> None:
    """``reduce_into`` without entering ``np.errstate`` (a few µs): for callers on the
    latency-critical path; an overflow is silent all the same (the warning filter above)."""
    _reduce(out, inputs, op, scale)


def _reduce(out: np.ndarray, inputs: list[np.ndarray], op: str, scale: float) -> None:
    ufunc = (_BOOL_OPS if out.dtype == np.bool_ else _OPS)[op]
    first = inputs[0]
    if len(inputs) == 1:
        if out is not first:
            np.copyto(out, first)
    else:
        ufunc(first, inputs[1], out=out)
        for other in inputs[2:]:
            ufunc(out, other, out=out)
    if op == "avg":
        np.divide(out, len(inputs), out=out, casting="unsafe")
    elif op == "premul_sum":
        np.multiply(out, scale, out=out, casting="unsafe")
