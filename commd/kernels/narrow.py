"""float32 tensors to the bit patterns of their bfloat16 rounding and back, on the tensors' device.

The daemon narrows CUDA tensors on the GPU before they cross to host memory for a compressed
collective: half the bytes over PCIe, and no rounding left for the CPU, whose coding is what
limits a compressed chain on fast links.  The bits are exactly those ``commd.codecs`` computes
in NumPy (round to nearest, ties to even; a NaN keeps its sign and top payload bits with the
quiet bit set), so a node that narrows on its GPU and one that codes on its CPU put the same
bytes on the wire.  On a GPU with CuPy installed the rounding is one fused kernel on the current
torch stream; otherwise it is torch's own cast plus the NaN rule (a few kernels, same bits).
Widening is exact and is one torch copy.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: The quiet bit of a bfloat16 NaN's mantissa.
_QUIET = 0x0040

_ROUND_SOURCE = r"""
unsigned int magnitude = x & 0x7fffffffu;
y = (unsigned short)(magnitude > 0x7f800000u ? ((x >> 16) | 0x0040u)
                                             : ((x + 0x7fffu + ((x >> 16) & 1u)) >> 16));
"""


@functools.cache
def _cupy_kernel() -> Any:
    """The fused rounding kernel, or None where CuPy is missing or cannot build it."""
    try:
        import cupy
        return cupy, cupy.ElementwiseKernel("uint32 x", "uint16 y", _ROUND_SOURCE, "commd_bf16_round")
    except Exception:  # no CuPy, or no CUDA toolchain for it: torch's ops give the same bits
        return None


def _cupy_stream(cupy: Any, stream: torch.cuda.Stream) -> Any:
    """CuPy's handle on torch's current stream, so the kernel is ordered with the daemon's other work."""
    try:
        return cupy.cuda.Stream.from_external(stream)  # CuPy 14: any object with __cuda_stream__
    except (AttributeError, TypeError, ValueError):
        return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)


def uses_cupy(src: torch.Tensor) -> bool:
    """Whether ``bf16_bits`` takes the fused CuPy kernel for this tensor."""
    return src.is_cuda and _cupy_kernel() is not None


def bf16_bits(src: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """The bfloat16 bit patterns (int16, flat, on ``src``'s device) of float32 ``src`` rounded to
    nearest even; ``fused=False`` takes the torch ops even where CuPy is there (to compare them)."""
    if src.dtype != torch.float32:
        raise TypeError(f"bf16_bits takes float32 tensors, not {src.dtype}")
    flat = src.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.empty(flat.numel(), dtype=torch.int16, device=flat.device)
    if flat.numel() == 0:
        return out
    if fused and uses_cupy(flat):
        cupy, kernel = _cupy_kernel()
        with _cupy_stream(cupy, torch.cuda.current_stream(flat.device)):
            kernel(cupy.asarray(flat.view(torch.int32)).view(cupy.uint32), cupy.asarray(out).view(cupy.uint16))
        return out
    out.copy_(flat.to(torch.bfloat16).view(torch.int16))
    nan = torch.isnan(flat)
    # an arithmetic shift of the int32 bits by 16 is their top half, which int16 holds exactly
    top = torch.bitwise_or((flat.view(torch.int32) >> 16).to(torch.int16), _QUIET)
    return torch.where(nan, top, out)


def from_bf16_bits(bits: torch.Tensor, dst: torch.Tensor) -> None:
    """float32 ``dst`` (contiguous, as many elements) = the bfloat16 values ``bits`` (int16) name: exact."""
    if bits.dtype != torch.int16 or dst.dtype != torch.float32 or bits.numel() != dst.numel():
        raise TypeError(f"from_bf16_bits: int16 bits into as many float32 elements, not {bits.dtype} "
                        f"({bits.numel()}) into {dst.dtype} ({dst.numel()})")
    dst.view(-1).copy_(bits.reshape(-1).view(torch.bfloat16))
