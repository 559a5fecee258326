"""Agreement: ``parse_submission`` validates one rank's op message against the schema and its own
buffers; ``find_mismatch`` compares the submissions of all members of a group for one sequence
number, so disagreeing ranks get an error naming the fields instead of a hang."""

from __future__ import annotations

import functools
from typing import Any

from commd.core.ops import COMPRESSED_KINDS, COUNTED, REDUCING, ROOTED, BufferRef, Submission
from commd.protocol import schema as s
from commd.protocol.cuda import CudaRef
from commd.protocol.fabric import MAX_ALGO_NAME
from commd.protocol.schema import LANE_NAMES


def _ref(msg: dict[str, Any], name: str) -> BufferRef | None:
    raw = msg.get(name)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise s.ProtocolError(f"buffer '{name}' must be a map")
    if "data" in raw:
        data = s.field(raw, "data", bytes)
        return BufferRef(s.check_inline_size(name, len(data)), inline=bytearray(data))
    if "cuda" in raw:
        cuda = s.field(raw, "cuda", dict)
        return BufferRef(
            nbytes=s.int_field(raw, "n", 0), offset=s.int_field(raw, "off", 0), cuda=CudaRef(cuda)
        )
    if "inline" in raw:
        nbytes = s.check_inline_size(name, s.int_field(raw, "inline", 0, s.MAX_MESSAGE_BYTES))
        return BufferRef(nbytes, inline=bytearray(nbytes))
    staged = raw.get("st")
    if staged is not None and (type(staged) is not int or staged != 1):
        raise s.ProtocolError(f"buffer '{name}': field 'st' (staged) must be 1 when present, got {staged!r}")
    return BufferRef(
        nbytes=s.int_field(raw, "n", 0),
        segment=s.int_field(raw, "seg", 0, s.MAX_SEGMENT_ID),
        offset=s.int_field(raw, "off", 0),
        staged=staged is not None,
    )


def _int_list(msg: dict[str, Any], name: str, length: int) -> list[int] | None:
    raw = msg.get(name)
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != length:
        raise s.ProtocolError(f"field '{name}' must be a list of {length} integers")
    for value in raw:
        if type(value) is not int or value < 0:
            raise s.ProtocolError(f"field '{name}' must hold non-negative integers")
    return raw


def _int(msg: dict[str, Any], name: str, default: int | None, low: int, high: int = 1 << 62) -> int:
    """An integer field in [low, high]; ``default=None`` makes it required."""
    value = msg.get(name)
    if value is None:
        if default is None:
            raise s.ProtocolError(f"missing field '{name}'")
        return default
    if type(value) is not int:
        raise s.ProtocolError(f"field '{name}' must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise s.ProtocolError(f"field '{name}'={value} outside [{low}, {high}]")
    return value


def _str(msg: dict[str, Any], name: str, default: str | None) -> str:
    value = msg.get(name, default)
    if value is None:
        raise s.ProtocolError(f"missing field '{name}'")
    if type(value) is not str:
        raise s.ProtocolError(f"field '{name}' must be a string, got {type(value).__name__}")
    return value


_MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000


def parse_submission(
    msg: dict[str, Any], client_id: int, group_rank: int, group_size: int, default_timeout: float
) -> Submission:
    """Build a Submission from an OP message, checking every field and size.

    Written as straight-line checks: this runs for every op of every rank.
    """
    kind = _str(msg, "kind", None)
    if kind not in s.OP_KINDS:
        s.check_kind(kind)
    dtype = _str(msg, "dtype", "uint8")
    if dtype not in s.DTYPES:
        s.check_dtype(dtype)
    reduce_op = _str(msg, "op", "sum")
    if reduce_op not in s.REDUCE_OPS:
        s.check_reduce_op(reduce_op)
    scale = msg.get("scale", 1.0)
    if scale is None:
        scale = 1.0
    elif type(scale) not in (int, float):
        raise s.ProtocolError("field 'scale' must be a number")
    sub = Submission(
        client_id=client_id,
        op_id=_int(msg, "id", None, 0),
        group=_str(msg, "group", None),
        group_rank=group_rank,
        group_size=group_size,
        seq=_int(msg, "seq", None, 0) if kind in s.COLLECTIVES else 0,
        kind=kind,
        dtype=dtype,
        count=_int(msg, "count", 0, 0),
        reduce_op=reduce_op,
        root=_int(msg, "root", 0, -(1 << 31), 1 << 31),
        peer=_int(msg, "peer", -1, -(1 << 31), 1 << 31),
        tag=_int(msg, "tag", 0, -(1 << 62)),
        scale=float(scale),
        counts=_int_list(msg, "counts", group_size),
        splits_in=_int_list(msg, "splits_in", group_size),
        splits_out=_int_list(msg, "splits_out", group_size),
        timeout=_int(msg, "timeout_ms", int(default_timeout * 1000), 1, _MAX_TIMEOUT_MS) / 1000.0,
        lane=_str(msg, "lane", ""),
        algo=_str(msg, "algo", ""),
        codec=_str(msg, "codec", ""),
    )
    if sub.lane and sub.lane not in LANE_NAMES:
        raise s.ProtocolError(f"unknown lane {sub.lane!r}; known: {list(LANE_NAMES)}")
    if len(sub.algo) > MAX_ALGO_NAME:
        raise s.ProtocolError(f"field 'algo' (an algorithm's name) is longer than {MAX_ALGO_NAME} characters")
    if sub.codec and sub.codec not in _CHOOSING:
        _check_codec(sub)
    for name in ("buf", "in", "out"):
        if name in msg:
            ref = _ref(msg, name)
            if ref is not None:
                sub.buffers[name] = ref
                if ref.nbytes > sub.nbytes:
                    sub.nbytes = ref.nbytes
                if ref.cuda is not None:
                    sub.on_gpu = True
    _check_shape(sub)
    sub.signature = tuple([getattr(sub, name) for name in _agreed_fields(kind)])
    return sub


def _need(sub: Submission, name: str, elements: int) -> None:
    ref = sub.buffers.get(name)
    if ref is None:
        raise s.ProtocolError(f"{sub.kind} needs buffer '{name}'")
    want = elements * s.ITEMSIZE[sub.dtype]
    if ref.nbytes != want:
        raise s.ProtocolError(
            f"{sub.kind} buffer '{name}' holds {ref.nbytes} bytes but "
            f"{elements} x {sub.dtype} needs {want}"
        )


def _check_shape(sub: Submission) -> None:
    """Per-kind checks that need only this rank's own message."""
    kind, me, n = sub.kind, sub.group_rank, sub.group_size
    if sub.count < 0:
        raise s.ProtocolError("field 'count' must be non-negative")
    if kind in ROOTED and not 0 <= sub.root < n:
        raise s.ProtocolError(f"root {sub.root} is not a rank of a group of size {n}")
    if kind in COUNTED and sub.counts is None:
        raise s.ProtocolError(f"{kind} needs field 'counts' (elements per rank)")
    if kind in ("allreduce", "reduce", "broadcast"):
        _need(sub, "buf", sub.count)
    elif kind == "allgather":
        _need(sub, "in", sub.counts[me])
        _need(sub, "out", sum(sub.counts))
    elif kind == "gather":
        _need(sub, "in", sub.counts[me])
        if me == sub.root:
            _need(sub, "out", sum(sub.counts))
    elif kind == "scatter":
        _need(sub, "out", sub.counts[me])
        if me == sub.root:
            _need(sub, "in", sum(sub.counts))
    elif kind == "reduce_scatter":
        _need(sub, "in", sum(sub.counts))
        _need(sub, "out", sub.counts[me])
    elif kind == "alltoall":
        if sub.splits_in is None or sub.splits_out is None:
            raise s.ProtocolError("alltoall needs fields 'splits_in' and 'splits_out'")
        _need(sub, "in", sum(sub.splits_in))
        _need(sub, "out", sum(sub.splits_out))
    elif kind == "alltonext":
        _need(sub, "in", sub.count)
        _need(sub, "out", sub.count)
    elif kind in ("send", "recv"):
        if kind == "send" and not 0 <= sub.peer < n:
            raise s.ProtocolError(f"send destination {sub.peer} is not a rank of a group of size {n}")
        if kind == "recv" and not -1 <= sub.peer < n:
            raise s.ProtocolError(f"recv source {sub.peer} is not a rank of a group of size {n}")
        if sub.peer == me:
            raise s.ProtocolError(f"rank {me} cannot {kind} to itself")
        _need(sub, "in" if kind == "send" else "out", sub.count)
    if kind in REDUCING:
        from commd.kernels.dtypes import UnsupportedReduction, check_supported

        try:
            check_supported(sub.reduce_op, sub.dtype)
        except UnsupportedReduction as exc:
            raise s.ProtocolError(str(exc)) from None


#: Codec field values that name no codec ("auto": the daemons choose, lossy allowed; "none": never
#: compressed): valid on every kind and dtype, the coordinator fits its choice to the op.
_CHOOSING = frozenset({s.CODEC_AUTO, s.NO_CODEC})


def _check_codec(sub: Submission) -> None:
    """A compressed op names a known codec that takes its dtype, on a kind that compresses."""
    from commd.codecs import CodecError, parse_choice

    if len(sub.codec) > MAX_ALGO_NAME:
        raise s.ProtocolError(f"field 'codec' (a codec's name) is longer than {MAX_ALGO_NAME} characters")
    if sub.kind not in COMPRESSED_KINDS:
        raise s.ProtocolError(f"field 'codec': {sub.kind} does not compress (compressed kinds: "
                              f"{', '.join(sorted(COMPRESSED_KINDS))})")
    try:
        parse_choice(sub.codec)[0].check_dtype(sub.dtype)
    except CodecError as exc:
        raise s.ProtocolError(f"field 'codec': {exc} (or {s.CODEC_AUTO!r}: the daemons choose, lossy codecs too; "
                              f"{s.NO_CODEC!r}: never compressed)") from None



@functools.cache
def _agreed_fields(kind: str) -> tuple[str, ...]:
    fields: tuple[str, ...] = ("kind", "lane", "algo")
    if kind == "barrier":
        return fields
    fields += ("dtype",)
    if kind in ("allreduce", "reduce", "broadcast", "alltonext"):
        fields += ("count",)
    if kind in COUNTED:
        fields += ("counts",)
    if kind in REDUCING:
        fields += ("reduce_op", "scale")
    if kind in ROOTED:
        fields += ("root",)
    if kind in COMPRESSED_KINDS:
        fields += ("codec",)
    return fields


def agreed_values(sub: Submission) -> dict[str, Any]:
    """The fields the members of a collective must agree on, by name (for cross-node checks)."""
    return {name: getattr(sub, name) for name in _agreed_fields(sub.kind) if name != "kind"}


def find_mismatch(subs: list[Submission]) -> str | None:
    """Describe how the members' submissions disagree, or None if they agree."""
    problems = []
    first = subs[0]
    for name in _agreed_fields(first.kind) if all(x.kind == first.kind for x in subs) else ("kind",):
        values: dict[str, list[int]] = {}
        for sub in subs:
            values.setdefault(repr(getattr(sub, name)), []).append(sub.group_rank)
        if len(values) > 1:
            parts = ", ".join(f"ranks {ranks} {value}" for value, ranks in values.items())
            problems.append(f"'{name}' differs: {parts}")
    if not problems and first.kind == "alltoall":
        for a in subs:
            for b in subs:
                if a.splits_in[b.group_rank] != b.splits_out[a.group_rank]:
                    problems.append(
                        f"rank {a.group_rank} sends {a.splits_in[b.group_rank]} elements to "
                        f"rank {b.group_rank}, which expects {b.splits_out[a.group_rank]}"
                    )
    return "; ".join(problems) if problems else None


def frozen(value: Any) -> Any:
    """``value`` (lists, tuples and maps, nested) as a hashable tuple: what keys a pattern by value."""
    if isinstance(value, list | tuple):
        return tuple(frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, frozen(v)) for k, v in value.items()))
    return value
