"""The one interface every codec implements, and its one error.

A codec turns a contiguous array into bytes and back, chunk by chunk, into buffers the caller
owns and reuses (no allocation per chunk).  What a collective needs to know of it is here:
whether it loses precision and how much, which dtypes it takes, how large its output can get
(to size receive buffers), and whether coding its own output again changes nothing (a node
that forwards decoded data then forwards the same bits).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class CodecError(ValueError):
    """An input a codec cannot take, or bytes it cannot decode; the message names what is wrong."""


class Codec(ABC):
    """A named, fixed way of coding one chunk.

    ``encode(src, out)`` writes the coded form of ``src`` (a contiguous array of one of ``dtypes``)
    into the uint8 array ``out`` (at least ``max_encoded(src.nbytes)`` long) and returns how many
    bytes it wrote.  ``decode(src, dst)`` reads exactly those bytes and fills ``dst`` (the same
    dtype and element count as the encoded array); bytes that are not a valid coding of such an
    array are a CodecError, never a crash and never a partly written result taken as good.
    """

    #: the name users choose it by (``compression="bf16"``)
    name: str
    #: its number in frame headers (stable: nodes of a job must agree on it)
    wire_id: int
    #: whether decoding can give other values than were encoded
    lossy: bool
    #: dtype names it encodes
    dtypes: frozenset[str]
    #: whether encoding the decoded result again gives the same bytes (rounding twice changes nothing)
    idempotent: bool = True
    #: one line for people: what it does and how much it loses
    summary: str = ""
    #: whether a chunk whose coding does not shrink travels as its own bytes instead (flag ``RAW``).
    #: The 16-bit casts never do: their coding is at most half the bytes plus a header, and a raw
    #: chunk would leave one replica with values the others hold rounded.
    sends_raw: bool = True

    def wire_itemsize(self, itemsize: int) -> int:
        """The element size a collective cuts chunks by and counts raw bytes in: the array's own,
        but the wide dtype's for a codec on elements already narrowed (``Narrowed``), so that a node
        holding the narrow form and one holding the wide form cut the same chunks."""
        return itemsize

    @abstractmethod
    def max_encoded(self, nbytes: int) -> int:
        """The most bytes ``encode`` may write for an input of ``nbytes`` bytes."""

    @abstractmethod
    def encode(self, src: np.ndarray, out: np.ndarray) -> int:
        """Code ``src`` into ``out``; the number of bytes written."""

    @abstractmethod
    def decode(self, src: np.ndarray | memoryview | bytes, dst: np.ndarray) -> None:
        """Fill ``dst`` from the coded bytes ``src`` (CodecError if they are not a coding of it)."""

    def error_bound(self, dtype: str) -> tuple[float, float]:
        """(relative, absolute) bound on |decoded - original|: every finite element within
        ``max(relative * |x|, absolute)``; (0, 0) for a lossless codec."""
        self.check_dtype(dtype)
        return (0.0, 0.0)

    def round_in_place(self, arr: np.ndarray) -> None:
        """Give ``arr`` the values a receiver decodes (a lossy broadcast's root does this to its own
        copy, so that every replica holds the same bits); nothing for a lossless codec."""
        self.check_dtype(arr.dtype.name)

    def check_dtype(self, dtype: str) -> None:
        if dtype not in self.dtypes:
            raise CodecError(f"codec {self.name!r} does not take {dtype} (it takes {', '.join(sorted(self.dtypes))})")

    def check_encode(self, src: np.ndarray, out: np.ndarray) -> None:
        """The checks every ``encode`` makes: dtype, contiguity, room in ``out``."""
        self.check_dtype(src.dtype.name)
        if not src.flags.c_contiguous:
            raise CodecError(f"codec {self.name!r}: the input must be contiguous")
        if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous:
            raise CodecError(f"codec {self.name!r}: the output must be a flat contiguous uint8 array")
        if out.size < self.max_encoded(src.nbytes):
            raise CodecError(f"codec {self.name!r}: {out.size} output bytes, {self.max_encoded(src.nbytes)} needed "
                             f"for {src.nbytes} input bytes")

    def check_decode(self, dst: np.ndarray) -> None:
        self.check_dtype(dst.dtype.name)
        if not dst.flags.c_contiguous or not dst.flags.writeable:
            raise CodecError(f"codec {self.name!r}: the destination must be contiguous and writable")

    def __repr__(self) -> str:
        return f"<codec {self.name} (wire id {self.wire_id}, {'lossy' if self.lossy else 'lossless'})>"
