"""Which reduce ops make sense on which dtypes, by name (no torch).

Every submission is checked against this when the daemon parses it; keeping
the check free of torch lets a daemon that only runs NumPy kernels start and
serve without importing torch.
"""

from __future__ import annotations

FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})
COMPLEX = frozenset({"complex64", "complex128"})
INTEGER = frozenset({"int8", "uint8", "int16", "int32", "int64"})


class UnsupportedReduction(ValueError):
    """The reduce op is not defined for the dtype."""


def check_supported(op: str, dtype: str) -> None:
    """Raise UnsupportedReduction naming both if ``op`` makes no sense on ``dtype``."""
    if op in ("band", "bor", "bxor") and dtype not in INTEGER | {"bool"}:
        raise UnsupportedReduction(f"reduce op {op.upper()} needs an integer or bool dtype, got {dtype}")
    if op in ("min", "max") and dtype in COMPLEX:
        raise UnsupportedReduction(f"reduce op {op.upper()} is undefined for complex dtype {dtype}")
    if op in ("avg", "premul_sum") and dtype not in FLOATING | COMPLEX:
        raise UnsupportedReduction(f"reduce op {op.upper()} needs a floating or complex dtype, got {dtype}")
