"""Wire schema shared by the client library and the daemon.

Every control message is one msgpack map with a protocol version ``v`` and a
type ``t``.  Both sides import this module so that the field names, the
limits and the validation live in exactly one place: a message that passes
``validate_*`` here is safe for the daemon to act on (types, ranges and
lengths checked), and everything else is answered with a ``ProtocolError``
naming the offending field.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgpack

PROTOCOL_VERSION = 2  # 2: arena segments are memfds passed by descriptor

#: Largest control message the daemon accepts; tensor data travels through
#: shared memory, so only small inline tensors ever come near this.
MAX_MESSAGE_BYTES = 1 << 20
#: Tensors up to this many bytes travel inline in the control message
#: instead of through the arena: one message beats a copy plus a handle.
INLINE_MAX_BYTES = 4096
MAX_GROUP_SIZE = 1 << 16
MAX_TENSORS_PER_OP = 1024
MAX_NAME_LEN = 256
#: The most ops one ``ops`` message carries; a client splits a longer batch into several messages.
MAX_BATCH_OPS = 1024
#: What an ``ops`` message adds to its items' bytes, at most: the map, "v", "t", "items", the array header.
BATCH_OVERHEAD_BYTES = 32
#: The longest op timeout anything accepts (a week); the daemon may cap it lower.
MAX_OP_TIMEOUT_S = 7 * 24 * 3600
#: The transports a fabric may have; an op's lane hint names one of them.
LANE_NAMES = ("tcp", "gloo", "mpi", "nccl")
#: An op's ``codec`` field beside a codec's name (``commd.codecs``): "" lets the daemons choose a
#: lossless codec where a rule or the tuning table says it pays; AUTO lets them choose a lossy one
#: too (the user allowed the precision loss); NO_CODEC never compresses the op.
CODEC_AUTO = "auto"
NO_CODEC = "none"

# Message types.
HELLO = "hello"
WELCOME = "welcome"
SEGMENT = "segment"
#: A local group's exchange ring (protocol/fastring.py): its memfd comes back beside the ACK.
FASTRING = "fastring"
#: On the op channel, for a bridged ring (a group that spans nodes): ``{"t": "ringop", "g": group,
#: "k": op number}`` — every local rank has published ring op k; or ``{"t": "ringop", "g": group,
#: "left": reason}`` — this rank left the ring.  No reply.
RINGOP = "ringop"
GROUP = "group"
OP = "op"
DONE = "done"
#: Several op replies (DONE/ERROR) in one op-channel frame: {"t": "batch", "items": [reply, ...]}.
BATCH = "batch"
#: Several ops submitted together on the op channel (a coalesced batch): {"t": "ops", "items": [op, ...]},
#: each item an ``op`` map.  The daemon checks every item before it takes any, so a bad item refuses the
#: whole batch (an ERROR for each item's id naming the bad item); it then routes them in order, exactly
#: as if they had come one message each (``encode_op_batch``, ``op_batch_items``).
OPS = "ops"
ERROR = "error"
STATUS = "status"
#: Turn the per-op trace on or off: {"t": "trace", "secret", "action": "start"|"stop", "path"}.
TRACE = "trace"
BYE = "bye"
PING = "ping"
ACK = "ack"
#: Forget a registered storage segment: {"t": "unregister", "seg": id}, on the op channel, in order
#: after the ops that used it; no reply unless it is refused.
UNREGISTER = "unregister"
#: What ``commd.ft`` did about a lost rank, on the op channel, for ``commd status``, the metrics and the trace
#: (the daemons see the losses, only the guard sees the recoveries): {"t": "membership", "event": one of
#: FT_EVENTS, "epoch", "step", "gone": [rank], "members": [rank], "seconds", "group"?, "why"?}.  No reply
#: unless it is refused (``check_membership_report``).
MEMBERSHIP = "membership"
#: ``recovered``: the survivors rebuilt their group without the ``gone`` ranks; ``joined``: a replacement was
#: taken back in (``members``: the whole group again); ``gave_up``: the guard raised UnrecoverableError.
FT_EVENTS = ("recovered", "joined", "gave_up")
#: The longest ``seconds`` a membership report may carry (a week: anything longer is a wrong clock).
MAX_FT_SECONDS = 7 * 24 * 3600.0
#: A membership report's ``why`` is cut to this many characters.
MAX_WHY_CHARS = 1024

#: Segment ids: an arena's are dense from 0; registered storages take ids from REGISTERED_SEG_BASE
#: up, never reused within a client, so a late unregister can never hit a newer registration.
ARENA_SEG_MAX = (1 << 20) - 1
REGISTERED_SEG_BASE = 1 << 20
MAX_SEGMENT_ID = (1 << 31) - 1
#: How a segment registration says what its memfd holds (field "kind"; absent: an arena segment).
SEGMENT_KINDS = ("arena", "registered")

COLLECTIVES = frozenset(
    {
        "allreduce",
        "reduce",
        "broadcast",
        "allgather",
        "gather",
        "scatter",
        "reduce_scatter",
        "alltoall",
        "barrier",
        # rank r's "out" = rank r - 1's "in" (rank 0's "out" untouched; the last rank's "in" unused)
        "alltonext",
    }
)
POINT_TO_POINT = frozenset({"send", "recv"})
OP_KINDS = COLLECTIVES | POINT_TO_POINT

REDUCE_OPS = frozenset(
    {"sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"}
)
DTYPES = frozenset(
    {
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
        "complex64",
        "complex128",
    }
)
ITEMSIZE = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}

# Error codes carried in ERROR replies; the client maps them to exceptions.
E_PROTOCOL = "protocol"
E_AUTH = "auth"
E_VERSION = "version"
E_BOUNDS = "bounds"
E_MISMATCH = "mismatch"
E_PEER_DIED = "peer_died"
E_TIMEOUT = "timeout"
E_SHUTDOWN = "shutdown"
E_INTERNAL = "internal"
#: A per-client limit of the daemon (inline size, pending ops or bytes): the op is refused, nothing else changes.
E_LIMIT = "limit"
#: The name of the inline-size limit in a ``LimitError`` (and in the daemon's ``limits_hit`` counters).
INLINE_LIMIT = "inline_bytes"

_MISSING_RANKS = re.compile(r"\(global ranks \[([0-9, ]*)\]\) did not submit it")


def not_submitted(op: str, who: str, missing_global: list[int], timeout_s: float) -> str:
    """The message of a collective that timed out waiting for ranks.

    ``who``: the waited-for as the daemon knows them (group ranks, nodes).  The global ranks are
    written so that ``missing_ranks_in`` reads them back (the client's CommTimeoutError
    .missing_ranks), and the words match what torch's tests expect of a timeout (" timeout ")."""
    return (f"{op} timed out: {who} (global ranks {sorted(missing_global)}) did not submit it "
            f"within the op timeout of {timeout_s:.1f}s")


def missing_ranks_in(message: str) -> list[int] | None:
    """The global ranks a ``not_submitted`` message names, or None for any other message."""
    found = _MISSING_RANKS.search(message)
    if found is None:
        return None
    return [int(r) for r in found.group(1).split(",") if r.strip()]


_SEGMENT_NAME = re.compile(r"^commd-[A-Za-z0-9_.-]{1,200}$")
_GROUP_NAME = re.compile(r"^[A-Za-z0-9_.:/-]{1,256}$")


class ProtocolError(ValueError):
    """A message that does not follow the schema; the text names the field."""

    def __init__(self, message: str, code: str = E_PROTOCOL) -> None:
        super().__init__(message)
        self.code = code


class LimitError(ProtocolError):
    """A message within the schema that would pass one of the daemon's limits; ``limit`` names which."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message, E_LIMIT)
        self.limit = limit


def check_inline_size(name: str, nbytes: int) -> int:
    """Inline tensors are for small buffers only: larger ones go through the arena."""
    if nbytes > INLINE_MAX_BYTES:
        raise LimitError(
            f"buffer '{name}': 'inline' tensor of {nbytes} bytes exceeds the inline limit of "
            f"{INLINE_MAX_BYTES} bytes (larger tensors travel through the arena)",
            INLINE_LIMIT,
        )
    return nbytes


def encode(message: dict[str, Any]) -> bytes:
    """Serialize one control message (adds the protocol version)."""
    message.setdefault("v", PROTOCOL_VERSION)
    return msgpack.packb(message, use_bin_type=True)


def decode(frame: bytes, limit: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Parse one control message, checking size (at most ``limit`` bytes), shape and version."""
    if not frame:
        raise ProtocolError("empty message (a message must be a msgpack map)")
    if len(frame) > limit:
        raise ProtocolError(
            f"message of {len(frame)} bytes exceeds the limit of {limit}"
        )
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"message is not valid msgpack: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("message must be a msgpack map")
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {version!r} (daemon speaks {PROTOCOL_VERSION})",
            E_VERSION,
        )
    if not isinstance(message.get("t"), str):
        raise ProtocolError("field 't' (message type) must be a string")
    return message


def encode_op_batch(items: list[bytes]) -> bytes:
    """One ``ops`` message from already packed op maps (each packed once, by whoever submitted it)."""
    if not 1 <= len(items) <= MAX_BATCH_OPS:
        raise ValueError(f"an op batch holds 1 to {MAX_BATCH_OPS} ops, not {len(items)}")
    packer = msgpack.Packer(use_bin_type=True)
    head = b"".join((packer.pack_map_header(3), packer.pack("v"), packer.pack(PROTOCOL_VERSION), packer.pack("t"),
                     packer.pack(OPS), packer.pack("items"), packer.pack_array_header(len(items))))
    return head + b"".join(items)


def op_batch_ids(msg: dict[str, Any]) -> list[int]:
    """The integer ids of an ``ops`` message's items, as far as it has them (whom to tell it was refused)."""
    items = msg.get("items")
    if not isinstance(items, list):
        return []
    return [item["id"] for item in items[:MAX_BATCH_OPS] if isinstance(item, dict) and type(item.get("id")) is int]


def op_batch_items(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """The op maps of an ``ops`` message: a list of 1 to MAX_BATCH_OPS maps, each an op (or ProtocolError)."""
    items = field(msg, "items", list)
    if not 1 <= len(items) <= MAX_BATCH_OPS:
        raise ProtocolError(f"field 'items' of an op batch must hold 1 to {MAX_BATCH_OPS} ops, not {len(items)}")
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise ProtocolError(f"op batch item {index} must be a map, got {type(item).__name__}")
        if item.get("t", OP) != OP:
            raise ProtocolError(f"op batch item {index} must be an {OP!r} message, not {item.get('t')!r}")
        if item.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
            raise ProtocolError(f"op batch item {index} has protocol version {item.get('v')!r}, "
                                f"not {PROTOCOL_VERSION}", E_VERSION)
    return items


def field(msg: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """Fetch a required field of the given type or raise naming it."""
    if name not in msg:
        raise ProtocolError(f"missing field '{name}'")
    value = msg[name]
    if kind is int and isinstance(value, bool):
        raise ProtocolError(f"field '{name}' must be an integer, got bool")
    if not isinstance(value, kind):
        raise ProtocolError(
            f"field '{name}' must be {_kind_name(kind)}, got {type(value).__name__}"
        )
    return value


def int_field(
    msg: dict[str, Any], name: str, low: int = 0, high: int = (1 << 62)
) -> int:
    """Fetch a required integer field within [low, high]."""
    value = field(msg, name, int)
    if not low <= value <= high:
        raise ProtocolError(f"field '{name}'={value} outside [{low}, {high}]")
    return value


def optional(msg: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    """Fetch an optional field, checking its type when present."""
    if msg.get(name) is None:
        return default
    return field(msg, name, kind)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def check_segment_name(name: str) -> str:
    """Segment names label memfds (seen in /proc/<pid>/maps and in logs); refuse anything path-like."""
    if not _SEGMENT_NAME.match(name):
        raise ProtocolError(f"segment name {name!r} is not a valid commd segment name")
    return name


def check_group_name(name: str) -> str:
    if not _GROUP_NAME.match(name):
        raise ProtocolError(f"group name {name!r} is not valid")
    return name


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ProtocolError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}")
    return dtype


def check_reduce_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ProtocolError(f"unsupported reduce op {op!r}; supported: {sorted(REDUCE_OPS)}")
    return op


def check_kind(kind: str) -> str:
    if kind not in OP_KINDS:
        raise ProtocolError(f"unknown op kind {kind!r}; known: {sorted(OP_KINDS)}")
    return kind


def _rank_list(msg: dict[str, Any], name: str, world_size: int) -> list[int]:
    """A list of distinct global ranks in [0, world_size) (at most world_size of them)."""
    ranks = field(msg, name, list)
    if len(ranks) > world_size:
        raise ProtocolError(f"field '{name}' lists {len(ranks)} ranks, more than the job's {world_size}")
    if any(type(r) is not int or not 0 <= r < world_size for r in ranks):
        raise ProtocolError(f"field '{name}' must list ranks: integers in [0, {world_size})")
    if len(set(ranks)) != len(ranks):
        raise ProtocolError(f"field '{name}' lists a rank twice")
    return ranks


def check_membership_report(msg: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """A ``membership`` message from ``rank`` of a job of ``world_size`` ranks, checked field by field and
    for sense (a survivor reports, no rank both gone and a member); the fields the daemon keeps."""
    event = field(msg, "event", str)
    if event not in FT_EVENTS:
        raise ProtocolError(f"field 'event' must be one of {list(FT_EVENTS)}, not {event[:64]!r}")
    epoch = int_field(msg, "epoch", 0, 1 << 31)
    step = int_field(msg, "step")
    seconds = field(msg, "seconds", (int, float))
    if isinstance(seconds, bool) or not math.isfinite(seconds) or not 0 <= seconds <= MAX_FT_SECONDS:
        raise ProtocolError(f"field 'seconds' must be a finite number in [0, {MAX_FT_SECONDS:.0f}], got {seconds!r}")
    gone = _rank_list(msg, "gone", world_size)
    members = _rank_list(msg, "members", world_size)
    if set(gone) & set(members):
        raise ProtocolError(f"ranks {sorted(set(gone) & set(members))} are listed both gone and members")
    if event != "gave_up" and rank not in members:
        raise ProtocolError(f"a '{event}' report comes from a member: rank {rank} is not in 'members' {members}")
    if event == "recovered" and not gone:
        raise ProtocolError("a 'recovered' report names the ranks gone (field 'gone' is empty)")
    if event == "joined" and gone:
        raise ProtocolError("a 'joined' report lists no rank gone (field 'gone' must be empty)")
    report: dict[str, Any] = {"event": event, "epoch": epoch, "step": step, "gone": sorted(gone),
                              "members": sorted(members), "seconds": float(seconds)}
    group = optional(msg, "group", str, None)
    if group is not None:
        if len(group) > MAX_NAME_LEN:
            raise ProtocolError(f"field 'group' is longer than {MAX_NAME_LEN} characters")
        report["group"] = check_group_name(group)
    why = optional(msg, "why", str, None)
    if why:
        report["why"] = why[:MAX_WHY_CHARS]
    return report
