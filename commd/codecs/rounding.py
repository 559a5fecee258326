"""float32 to bfloat16 and float16 and back, in NumPy (no torch: the codecs stay a leaf).

bfloat16 is float32's top 16 bits.  Rounding to nearest, ties to even, is adding 0x7FFF plus
the lowest kept bit before cutting — the same bits as torch's ``.to(torch.bfloat16)``.  NaN
needs its own rule (the addition could carry a NaN's payload into the sign bit): a NaN stays a
quiet NaN with its sign.  Values within half a bfloat16 step of float32's largest round to
infinity, as in torch.
"""

from __future__ import annotations

import numpy as np

_QUIET = np.uint16(0x0040)  # the quiet bit of a bfloat16 NaN's mantissa


def to_bf16_bits(src: np.ndarray, out: np.ndarray) -> None:
    """``out`` (uint16, same size) = the bfloat16 bits of float32 ``src``, rounded to nearest even."""
    bits = src.reshape(-1).view(np.uint32)
    wide = np.right_shift(bits, 16)
    np.bitwise_and(wide, 1, out=wide)
    np.add(wide, 0x7FFF, out=wide)
    np.add(wide, bits, out=wide)  # (wraps only for NaNs, fixed below)
    np.right_shift(wide, 16, out=wide)
    flat = out.reshape(-1)
    np.copyto(flat, wide, casting="unsafe")
    nan = np.isnan(src.reshape(-1))
    if nan.any():
        flat[nan] = np.right_shift(bits[nan], 16).astype(np.uint16) | _QUIET


def from_bf16_bits(src: np.ndarray, dst: np.ndarray) -> None:
    """float32 ``dst`` = the bfloat16 values whose bits are ``src`` (uint16, same size); exact."""
    np.left_shift(src.reshape(-1), 16, out=dst.reshape(-1).view(np.uint32), dtype=np.uint32)
