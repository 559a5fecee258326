"""The codecs built on blosc2 (LZ4 or zstd behind a shuffle filter), loaded on first use.

blosc2 is imported when a codec first codes something, not when commd is imported: a daemon
that never compresses never loads it.  A blosc2 chunk states its own decoded and coded sizes;
``decode`` checks both against what the caller expects before anything is written, and any
failure inside blosc2 is a CodecError.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from commd.codecs.base import CodecError

#: The most bytes blosc2 adds to its input (its chunk header; incompressible data is stored).
OVERHEAD = 32


@functools.cache
def blosc2() -> Any:
    """The blosc2 module (CodecError naming the package if it is missing)."""
    try:
        import blosc2 as module
    except ImportError as exc:  # pragma: no cover - a dependency of the project
        raise CodecError(f"the compression codecs need the blosc2 package: {exc}") from exc
    return module


def compress(data: np.ndarray, out: np.ndarray, codec: str, level: int, typesize: int, shuffle: str) -> int:
    """``data``'s bytes coded into ``out``; the coded length."""
    b = blosc2()
    coded = b.compress2(data.reshape(-1).view(np.uint8), codec=getattr(b.Codec, codec), clevel=level,
                        typesize=typesize, filters=[getattr(b.Filter, shuffle)], nthreads=1)
    n = len(coded)
    if n > out.size:
        raise CodecError(f"blosc2 wrote {n} bytes, more than the {out.size} expected at most")
    out[:n] = np.frombuffer(coded, np.uint8)
    return n


def decompress(name: str, src: np.ndarray | memoryview | bytes, dst: np.ndarray) -> None:
    """Fill ``dst``'s bytes from the blosc2 chunk ``src`` (exactly one chunk of ``dst.nbytes``)."""
    b = blosc2()
    view = memoryview(src).cast("B") if not isinstance(src, np.ndarray) else memoryview(src.reshape(-1).view(np.uint8))
    if len(view) < 16:
        raise CodecError(f"codec {name!r}: {len(view)} bytes are too few for a blosc2 chunk")
    try:
        nbytes, cbytes, _ = b.get_cbuffer_sizes(view)
    except Exception as exc:
        raise CodecError(f"codec {name!r}: not a blosc2 chunk ({exc})") from None
    if nbytes != dst.nbytes or cbytes != len(view):
        raise CodecError(f"codec {name!r}: the chunk says {nbytes} bytes coded into {cbytes}; expected "
                         f"{dst.nbytes} coded into {len(view)}")
    try:
        b.decompress2(view, dst=dst.reshape(-1).view(np.uint8))
    except Exception as exc:
        raise CodecError(f"codec {name!r}: the chunk does not decode ({exc})") from None
