"""Codecs for compressing inside collectives: chunk by chunk, into buffers the caller reuses.

A leaf package (NumPy, and blosc2 loaded on first use): ``get(name)`` / ``by_wire_id(n)`` give
a :class:`Codec`; ``names()`` lists them.  See ``registry.py`` for what each does and loses.
"""

from commd.codecs.base import Codec, CodecError
from commd.codecs.registry import CODECS, PER_HOP, HalfCast, Narrowed, by_wire_id, get, names, parse_choice

__all__ = ["CODECS", "PER_HOP", "Codec", "CodecError", "HalfCast", "Narrowed", "by_wire_id", "get", "names", "parse_choice"]
