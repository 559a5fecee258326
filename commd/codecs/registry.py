"""The fixed, named codecs, by name and by wire id.

| name | what | lossy |
|---|---|---|
| ``bf16`` | float32 rounded to bfloat16 (nearest even), bit-shuffled, LZ4 | ≤ 2⁻⁸ relative |
| ``bf16-cast`` | float32 rounded to bfloat16, nothing else | ≤ 2⁻⁸ relative |
| ``lossless`` | bit-shuffle + LZ4, any dtype | exact |
| ``lossless-zstd`` | byte-shuffle + zstd level 1, any dtype | exact |
| ``fp16`` | float32 rounded to float16 — an explicit choice only: small gradients underflow | ≤ 2⁻¹¹ relative in float16's range |
"""

from __future__ import annotations

import numpy as np

from commd.codecs import blosc
from commd.codecs.base import Codec, CodecError
from commd.codecs.rounding import from_bf16_bits, to_bf16_bits

#: Every dtype a lossless codec takes (the lanes' dtypes that NumPy has; bfloat16 travels as bytes).
ANY_DTYPE = frozenset({"float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
                       "complex64", "complex128"})
#: bfloat16's bound: half a step of an 8-bit significand; below float32's normal range, half its
#: smallest subnormal step (2⁻¹³³).
BF16_BOUND = (2.0 ** -8, 2.0 ** -134)
#: float16's, inside its range (beyond ±65504 a value becomes infinite).
FP16_BOUND = (2.0 ** -11, 2.0 ** -25)


def _as_bytes(src: np.ndarray | memoryview | bytes) -> np.ndarray:
    """Coded bytes as a flat uint8 array (no copy)."""
    return src.reshape(-1).view(np.uint8) if isinstance(src, np.ndarray) else np.frombuffer(src, np.uint8)


def _empty_ok(codec: Codec, src: np.ndarray | memoryview | bytes, dst: np.ndarray) -> bool:
    """An empty array codes to no bytes: True (nothing to do) when ``dst`` is empty and ``src`` too."""
    if dst.size:
        return False
    if _as_bytes(src).size:
        raise CodecError(f"codec {codec.name!r}: bytes given for an empty array")
    return True


class HalfCast(Codec):
    """float32 rounded to a 16-bit float: the bits of each element's rounding, then ``pack``.

    Two stages, so that the first can run elsewhere (a GPU narrows CUDA tensors itself, see
    ``commd.kernels.narrow``) and the second on the narrowed bits alone (``narrowed()``), with the
    same bytes on the wire either way."""

    lossy, dtypes, sends_raw = True, frozenset({"float32"}), False
    bound: tuple[float, float]
    #: the 16-bit float it rounds to (``commd.kernels.narrow`` rounds to bfloat16 on GPUs)
    half_dtype: str

    def max_encoded(self, nbytes: int) -> int:
        return nbytes // 2

    def error_bound(self, dtype: str) -> tuple[float, float]:
        self.check_dtype(dtype)
        return self.bound

    def to_half(self, src: np.ndarray, out: np.ndarray) -> None:
        """``out`` (uint16 bits, same size) = ``src`` rounded."""
        raise NotImplementedError

    def from_half(self, bits: np.ndarray, dst: np.ndarray) -> None:
        """float32 ``dst`` = the values whose 16-bit patterns are ``bits`` (exact)."""
        raise NotImplementedError

    def pack(self, bits: np.ndarray, out: np.ndarray) -> int:
        """The second stage: 16-bit patterns ``bits`` into ``out``; the bytes written (here: as they are)."""
        n = bits.size * 2
        out[:n] = bits.reshape(-1).view(np.uint8)
        return n

    def unpack(self, src: np.ndarray | memoryview | bytes, bits: np.ndarray) -> None:
        """Undo ``pack``: fill ``bits`` (uint16 or int16, flat) from the coded bytes (CodecError if they
        are not a coding of that many)."""
        coded = _as_bytes(src)
        if coded.size != bits.size * 2:
            raise CodecError(f"codec {self.name!r}: {coded.size} bytes for {bits.size} elements "
                             f"(expected {bits.size * 2})")
        bits.reshape(-1).view(np.uint8)[:] = coded

    def round_in_place(self, arr: np.ndarray) -> None:
        bits = np.empty(arr.size, np.uint16)
        self.to_half(arr, bits)
        self.from_half(bits, arr)

    def encode(self, src: np.ndarray, out: np.ndarray) -> int:
        self.check_encode(src, out)
        n = src.size * 2
        self.to_half(src, out[:n].view(np.uint16))
        return n

    def decode(self, src: np.ndarray | memoryview | bytes, dst: np.ndarray) -> None:
        self.check_decode(dst)
        coded = _as_bytes(src)
        if coded.size != dst.size * 2:
            raise CodecError(f"codec {self.name!r}: {coded.size} bytes for {dst.size} elements (expected {dst.size * 2})")
        self.from_half(coded.view(np.uint16), dst)

    def narrowed(self) -> Narrowed:
        """This codec's second stage alone, for arrays of bits already rounded (see ``Narrowed``)."""
        return Narrowed(self)


class Narrowed(Codec):
    """A 16-bit cast's ``pack`` alone, on the bits of elements a GPU already rounded.

    Same name, wire id and bytes on the wire as the whole codec on the float32 elements, and chunks
    cut by float32's size (``wire_itemsize``), so a node holding the bits and one holding the floats
    take part in one collective.  Lossless here: the rounding happened before."""

    lossy, dtypes, sends_raw = False, frozenset({"int16", "uint16"}), False

    def __init__(self, wide: HalfCast) -> None:
        self.wide = wide
        self.name, self.wire_id = wide.name, wide.wire_id
        self.summary = f"{wide.name} on elements already rounded to 16 bits"

    def wire_itemsize(self, itemsize: int) -> int:
        return 4

    def max_encoded(self, nbytes: int) -> int:
        return self.wide.max_encoded(nbytes * 2)

    def encode(self, src: np.ndarray, out: np.ndarray) -> int:
        self.check_encode(src, out)
        return self.wide.pack(src.reshape(-1).view(np.uint16), out) if src.size else 0

    def decode(self, src: np.ndarray | memoryview | bytes, dst: np.ndarray) -> None:
        self.check_decode(dst)
        if not _empty_ok(self, src, dst):
            self.wide.unpack(src, dst.reshape(-1).view(np.uint16))


class Bf16Cast(HalfCast):
    name, wire_id, bound, half_dtype = "bf16-cast", 2, BF16_BOUND, "bfloat16"
    summary = "float32 rounded to bfloat16 (nearest even): half the bytes, error <= 2^-8 relative"

    def to_half(self, src: np.ndarray, out: np.ndarray) -> None:
        to_bf16_bits(src, out)

    def from_half(self, bits: np.ndarray, dst: np.ndarray) -> None:
        from_bf16_bits(bits, dst)


class Fp16(HalfCast):
    name, wire_id, bound, half_dtype = "fp16", 5, FP16_BOUND, "float16"
    summary = ("float32 rounded to float16: half the bytes; values below 6e-5 lose precision or vanish, "
               "beyond 65504 become inf — choose it only where the data's range fits")

    def to_half(self, src: np.ndarray, out: np.ndarray) -> None:
        with np.errstate(over="ignore"):
            np.copyto(out.reshape(-1).view(np.float16), src.reshape(-1), casting="same_kind")

    def from_half(self, bits: np.ndarray, dst: np.ndarray) -> None:
        np.copyto(dst.reshape(-1), bits.reshape(-1).view(np.float16))


class Bf16Lz4(Bf16Cast):
    name, wire_id = "bf16", 1
    summary = "float32 rounded to bfloat16, bit-shuffled, LZ4: ~0.4 of the bytes, error <= 2^-8 relative"

    def max_encoded(self, nbytes: int) -> int:
        return nbytes // 2 + blosc.OVERHEAD

    def encode(self, src: np.ndarray, out: np.ndarray) -> int:
        self.check_encode(src, out)
        if not src.size:
            return 0
        bits = np.empty(src.size, np.uint16)
        to_bf16_bits(src, bits)
        return self.pack(bits, out)

    def pack(self, bits: np.ndarray, out: np.ndarray) -> int:
        return blosc.compress(bits, out, "LZ4", 1, 2, "BITSHUFFLE")

    def unpack(self, src: np.ndarray | memoryview | bytes, bits: np.ndarray) -> None:
        blosc.decompress(self.name, src, bits)

    def decode(self, src: np.ndarray | memoryview | bytes, dst: np.ndarray) -> None:
        self.check_decode(dst)
        if _empty_ok(self, src, dst):
            return
        bits = np.empty(dst.size, np.uint16)
        self.unpack(src, bits)
        self.from_half(bits, dst)


class Lossless(Codec):
    name, wire_id, lossy, dtypes = "lossless", 3, False, ANY_DTYPE
    summary = "bit-shuffle + LZ4: exact; ~0.9 of the bytes on float32 weights and gradients"
    _codec, _level, _shuffle = "LZ4", 1, "BITSHUFFLE"

    def max_encoded(self, nbytes: int) -> int:
        return nbytes + blosc.OVERHEAD

    def encode(self, src: np.ndarray, out: np.ndarray) -> int:
        self.check_encode(src, out)
        if not src.size:
            return 0
        return blosc.compress(src, out, self._codec, self._level, src.dtype.itemsize, self._shuffle)

    def decode(self, src: np.ndarray | memoryview | bytes, dst: np.ndarray) -> None:
        self.check_decode(dst)
        if _empty_ok(self, src, dst):
            return
        blosc.decompress(self.name, src, dst)


class LosslessZstd(Lossless):
    name, wire_id = "lossless-zstd", 4
    summary = "byte-shuffle + zstd level 1: exact; a little smaller than lossless, slower to encode"
    _codec, _level, _shuffle = "ZSTD", 1, "SHUFFLE"


#: Every codec, in the order ``commd`` lists them.
CODECS: tuple[Codec, ...] = (Bf16Lz4(), Bf16Cast(), Lossless(), LosslessZstd(), Fp16())
_BY_NAME = {c.name: c for c in CODECS}
_BY_WIRE = {c.wire_id: c for c in CODECS}


def names() -> list[str]:
    return [c.name for c in CODECS]


def get(name: str) -> Codec:
    """The codec called ``name``; CodecError naming the known ones otherwise."""
    codec = _BY_NAME.get(name) if isinstance(name, str) else None
    if codec is None:
        raise CodecError(f"unknown codec {name!r} (known: {', '.join(names())})")
    return codec


def by_wire_id(wire_id: int) -> Codec:
    """The codec a frame header names; CodecError for a number no codec has."""
    codec = _BY_WIRE.get(wire_id) if isinstance(wire_id, int) and not isinstance(wire_id, bool) else None
    if codec is None:
        raise CodecError(f"no codec has wire id {wire_id!r} (known: {sorted(_BY_WIRE)})")
    return codec


#: The variant of a codec choice that benchmarks the per-hop baseline (``"bf16/per-hop"``).
PER_HOP = "per-hop"


def parse_choice(text: str) -> tuple[Codec, bool]:
    """An op's codec field: ``NAME`` or ``NAME/per-hop`` (the baseline that decodes and codes again at
    every hop, for benchmarks) → (codec, per_hop); CodecError otherwise."""
    name, slash, variant = text.partition("/") if isinstance(text, str) else ("", "", "")
    if slash and variant != PER_HOP:
        raise CodecError(f"{text!r}: the only variant of a codec is {PER_HOP!r}")
    return get(name), bool(slash)
