"""The fabric's wire vocabulary: every item a member and the coordinator exchange, typed.

The coordinator (``scheduler/coordinator.py``) and each node's fabric member
(``fabric/member.py``) speak only these types: an item is decoded once when it
arrives (``decode_batch``, which validates every field) and encoded once when it
leaves (``batch``).  ``to_wire`` builds exactly the map the fabric has always
sent — same one- or two-letter keys, in the same order, optional keys omitted
the same way — so the bytes on the control channel (``fabric/channel.py``:
length-prefixed msgpack frames) do not depend on this module.

Items travel in a ``batch`` envelope, ``{"t": "batch", "items": [item, ...],
"v": PROTOCOL_VERSION}``: reports and releases are coalesced per event-loop turn.
Two vocabularies, one per direction (``p2p_fail`` and ``hb`` mean different
things each way):

| type | class | direction | meaning | fields (wire key) |
|---|---|---|---|---|
| ``ready`` | ``Ready`` | member → coordinator | this node's ranks of a collective are all ready (report) | group ``g``, seq ``s``; either the full pattern (``OpPattern``: kind ``k``, signature ``sig``, ranks ``ranks``, placement ``pl``, nodes ``n``, mine ``mine``, nbytes ``nb``, timeout ``to``, alltoall_splits ``a2a`` for all-to-all) or its cache_id ``c``; contribution ``d`` (tiny all-reduce, optional), no_fusion ``nf`` (1, optional), waited ``w`` (seconds the op waited on a schedule that ended, optional) |
| ``p2p_send`` | ``P2pSend`` | member → coordinator | a send whose receiver lives on another node | key ``key``, dst_node ``dn``, group ``g``, src ``src``, dst ``dst``, tag ``tag``, dtype ``dtype``, count ``count``, nbytes ``nb``, timeout ``to``, lane_hint ``h`` |
| ``p2p_match`` | ``P2pMatch`` | member → coordinator | a forwarded send met its receive: order the transfer | sender_node ``sn``, key ``key`` |
| ``p2p_fail`` | ``SendFailed`` | member → coordinator | the receiver's node failed a forwarded send (mismatch, timeout) | sender_node ``sn``, key ``key``, code ``code``, message ``m`` |
| ``hb`` | ``Heartbeat`` | member → coordinator | liveness, with the ops this node's ranks partly submitted | stalled ``stalled``: [group, seq, missing ranks] |
| ``go`` | ``Go`` | coordinator → member | release: run the op at this place of the global order | group ``g``, seq ``s``, order ``o``, lane ``l``; cache_id ``c``, result ``r`` (bytes), fused_with ``fz`` (the fused set's first order), algorithm ``a`` with its sha256 ``ah`` (hex; both or neither), codec ``z`` (a ``commd.codecs`` choice the op runs with, named or chosen by the coordinator), each optional |
| ``fail`` | ``Fail`` | coordinator → member | the collective fails on every node | group ``g``, seq ``s``, code ``code``, message ``m`` |
| ``early`` | ``Early`` | coordinator → member | node 0's contribution to a tiny all-reduce of a 2-node group, sent before the other node reported | group ``g``, seq ``s``, cache_id ``c``, contribution ``d`` (bytes) |
| ``remote_send`` | ``RemoteSend`` | coordinator → member | a send forwarded to its receiver's node | the ``p2p_send`` fields, then sender_node ``sn`` |
| ``p2p_go`` | ``P2pGo`` | coordinator → member | release of a cross-node transfer | key ``key``, sender_node ``sn`` (receiver only), order ``o``, lane ``l``, role ``role`` (send/recv), peer ``peer`` |
| ``p2p_fail`` | ``P2pFail`` | coordinator → member | a cross-node transfer fails | key ``key``, sender_node ``sn`` (optional), code ``code``, message ``m`` |
| ``node_dead`` | ``NodeDead`` | coordinator → member | a node is gone | node ``node``, why ``why`` |
| ``hb`` | ``CoordinatorHeartbeat`` | coordinator → member | liveness, with the fabric's stall rows | stalls ``stalls`` |
| ``shutdown`` | ``Shutdown`` | coordinator → member | stop the node (a stall passed its limit) | why ``why`` |
| ``trace`` | ``Trace`` | coordinator → member | start/stop the per-op trace | action ``a``, path ``p`` |
| ``rank_died`` | ``RankDied`` | both | a rank is gone: fail what waits for it | rank ``rank``, why ``why`` |
| ``leaving`` | ``Leaving`` | both | this node leaves the fabric (shutdown) | why ``why`` |
| ``sched`` | ``Schedule`` | coordinator → member | from a sequence number on, the group's ops follow a cycle of patterns: every node releases them itself | epoch ``e``, group ``g``, nodes ``n``, order ``o`` (of the first), start seq ``s``, slots ``sl``: [cache id, lane, program, its sha256, codec] each |
| ``sched_stop`` | ``StopSchedule`` | both | end the schedule at the first slot not yet released (a member asks when an op waited its timeout on it) | epoch ``e`` |
| ``sched_end`` | ``ScheduleEnded`` | member → coordinator | this node ran the schedule up to (not including) an order | epoch ``e``, order ``o`` |
| ``ring`` | ``RingPart`` | both | a node's part of a bridged exchange-ring all-reduce (the coordinator relays it) | group ``g``, seq ``s``, index ``i``, node ``sn``, to ``to``, dtype ``dt``, op ``o``, count ``n``, contribution ``d`` (bytes or nil); error ``e`` and message ``m`` when it failed there |
| ``ready_set`` | ``ReadySet`` | relay → parent | the nodes in ``r`` all reported the op by one cache id (control tree) | group ``g``, seq ``s``, cache_id ``c``, node ranges ``r`` ([lo, hi) runs) |
| ``via`` | ``Via`` | relay → parent | items of one node of the relay's subtree, in its order | node ``n``, items ``items`` |
| ``to`` | ``Routed`` | parent → relay | items (wire maps) for the nodes in ``r`` | node ranges ``r``, items ``items`` |

Plain data only: nothing here imports above ``protocol/``.  The classes are slotted
dataclasses, not frozen ones: a frozen dataclass's constructor sets each field through
``object.__setattr__`` and costs about ten times as much, and a report and a release
are built and decoded on the critical path of every multi-node op.  Slots still refuse
any attribute that is not a field, so nothing local can be written into a received
message; the code treats every message as immutable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn

from commd.protocol.schema import ProtocolError

#: The envelope's type: several items in one control frame.
BATCH = "batch"


class FabricMessageError(ProtocolError):
    """A fabric item that does not follow this vocabulary; the text names the type and the field."""


# ---- field checks (one place; the text names type, key and meaning) ---------------------------------

#: A release's program: its name (a catalogue name: a library name or a file's stem) and sha256.
MAX_ALGO_NAME = 200
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _bad(t: str, key: str, name: str, want: str, value: Any) -> NoReturn:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise FabricMessageError(f"fabric message {t!r}: field {key!r} ({name}) must be {want}, got {shown}")


def _get(item: dict[str, Any], t: str, key: str, name: str) -> Any:
    try:
        return item[key]
    except KeyError:
        raise FabricMessageError(f"fabric message {t!r}: field {key!r} ({name}) is missing") from None


def _int(item: dict[str, Any], t: str, key: str, name: str) -> int:
    value = _get(item, t, key, name)
    if type(value) is not int:
        _bad(t, key, name, "an integer", value)
    return value


def _opt_int(item: dict[str, Any], t: str, key: str, name: str) -> int | None:
    value = item.get(key)
    if value is not None and type(value) is not int:
        _bad(t, key, name, "an integer", value)
    return value


def _str(item: dict[str, Any], t: str, key: str, name: str) -> str:
    value = _get(item, t, key, name)
    if type(value) is not str:
        _bad(t, key, name, "a string", value)
    return value


def _opt_str(item: dict[str, Any], t: str, key: str, name: str) -> str | None:
    value = item.get(key)
    if value is not None and type(value) is not str:
        _bad(t, key, name, "a string", value)
    return value


def _number(item: dict[str, Any], t: str, key: str, name: str) -> float:
    value = _get(item, t, key, name)
    if type(value) is not float and type(value) is not int:
        _bad(t, key, name, "a number", value)
    return value


def _opt_bytes(item: dict[str, Any], t: str, key: str, name: str) -> bytes | None:
    value = item.get(key)
    if value is not None and type(value) is not bytes:
        _bad(t, key, name, "bytes", value)
    return value


def _ints(item: dict[str, Any], t: str, key: str, name: str) -> list[int]:
    value = _get(item, t, key, name)
    if type(value) is not list or not all(type(v) is int for v in value):
        _bad(t, key, name, "a list of integers", value)
    return value


def _map(item: dict[str, Any], t: str, key: str, name: str) -> dict[str, Any]:
    value = _get(item, t, key, name)
    if type(value) is not dict:
        _bad(t, key, name, "a map", value)
    return value


# ---- member → coordinator ----------------------------------------------------------------------------


@dataclass(slots=True)
class OpPattern:
    """What a full report says about a collective besides its sequence number (cached by id)."""

    kind: str
    #: The values the members must agree on, by name (``scheduler.agreement.agreed_values``).
    signature: dict[str, Any]
    ranks: list[int]  # the group's global ranks
    placement: list[int]  # node of each group rank
    nodes: list[int]  # the nodes the group spans, ascending
    mine: list[int]  # the group ranks on the reporting node
    nbytes: int
    timeout: float
    #: All-to-all only: [group rank, splits in, splits out] per rank on the reporting node.
    alltoall_splits: list[list[Any]] | None = None

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> OpPattern:
        t = "ready"
        kind = _str(item, t, "k", "kind")
        ranks = _ints(item, t, "ranks", "ranks")
        placement = _ints(item, t, "pl", "placement")
        if len(placement) != len(ranks):
            _bad(t, "pl", "placement", f"one node per rank ({len(ranks)})", placement)
        splits = item.get("a2a")
        if kind == "alltoall" or splits is not None:
            if type(splits) is not list or not all(
                type(x) is list and len(x) == 3 and type(x[0]) is int and type(x[1]) is list and type(x[2]) is list
                for x in splits
            ):
                _bad(t, "a2a", "alltoall splits", "a list of [rank, splits in, splits out]", splits)
        return cls(kind, _map(item, t, "sig", "signature"), ranks, placement, _ints(item, t, "n", "nodes"),
                   _ints(item, t, "mine", "mine"), _int(item, t, "nb", "nbytes"), _number(item, t, "to", "timeout"),
                   splits)


@dataclass(slots=True)
class Ready:
    """A report: every local rank of a collective has submitted it."""

    TYPE: ClassVar[str] = "ready"
    group: str
    seq: int
    pattern: OpPattern | None = None  # the full report; None on the cached fast path
    cache_id: int | None = None  # the pattern's cache id (fast path)
    contribution: bytes | None = None  # this node's reduced part of a tiny all-reduce
    no_fusion: bool = False  # its buffers overlap an earlier reported all-reduce of this node
    #: Seconds the op already waited here before this report (on a schedule that then ended):
    #: its timeout runs from when it was ready, as on negotiation.
    waited: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        item: dict[str, Any] = {"t": "ready", "g": self.group, "s": self.seq}
        pattern = self.pattern
        if pattern is None:
            item["c"] = self.cache_id
        else:
            item["k"] = pattern.kind
            item["sig"] = pattern.signature
            item["ranks"] = pattern.ranks
            item["pl"] = pattern.placement
            item["n"] = pattern.nodes
            item["mine"] = pattern.mine
            item["nb"] = pattern.nbytes
            item["to"] = pattern.timeout
            if pattern.alltoall_splits is not None:
                item["a2a"] = pattern.alltoall_splits
        if self.contribution is not None:
            item["d"] = self.contribution
        if self.no_fusion:
            item["nf"] = 1
        if self.waited:
            item["w"] = self.waited
        return item

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> Ready:
        try:
            group, seq, cache_id = item["g"], item["s"], item["c"]
        except KeyError:
            return cls.checked(item)
        data = item.get("d")
        if (type(cache_id) is int and type(group) is str and type(seq) is int
                and (data is None or type(data) is bytes) and "w" not in item):  # the cached fast path, valid
            return cls(group, seq, None, cache_id, data, bool(item.get("nf")))
        return cls.checked(item)

    @classmethod
    def checked(cls, item: dict[str, Any]) -> Ready:
        """``from_wire`` field by field (names the first bad field)."""
        group, seq = _str(item, "ready", "g", "group"), _int(item, "ready", "s", "seq")
        cache_id = _opt_int(item, "ready", "c", "cache id")
        pattern = OpPattern.from_wire(item) if cache_id is None else None
        waited = item.get("w", 0.0)
        if type(waited) not in (int, float) or not 0 <= waited < 1e9:
            _bad("ready", "w", "waited", "a number of seconds, 0 or more", waited)
        return cls(group, seq, pattern, cache_id, _opt_bytes(item, "ready", "d", "contribution"), bool(item.get("nf")),
                   float(waited))


@dataclass(slots=True)
class P2pSend:
    """A send whose receiver lives on another node (``key``: the sender's node numbers its sends)."""

    TYPE: ClassVar[str] = "p2p_send"
    key: int
    dst_node: int
    group: str
    src: int  # group ranks
    dst: int
    tag: int
    dtype: str
    count: int
    nbytes: int
    timeout: float
    lane_hint: str | None

    def to_wire(self) -> dict[str, Any]:
        return {"t": "p2p_send", "key": self.key, "dn": self.dst_node, "g": self.group, "src": self.src,
                "dst": self.dst, "tag": self.tag, "dtype": self.dtype, "count": self.count, "nb": self.nbytes,
                "to": self.timeout, "h": self.lane_hint}

    @classmethod
    def from_wire(cls, item: dict[str, Any], t: str = "p2p_send") -> P2pSend:
        return cls(_int(item, t, "key", "key"), _int(item, t, "dn", "receiver's node"), _str(item, t, "g", "group"),
                   _int(item, t, "src", "source rank"), _int(item, t, "dst", "destination rank"),
                   _int(item, t, "tag", "tag"), _str(item, t, "dtype", "dtype"), _int(item, t, "count", "count"),
                   _int(item, t, "nb", "nbytes"), _number(item, t, "to", "timeout"),
                   _opt_str(item, t, "h", "lane hint"))


@dataclass(slots=True)
class P2pMatch:
    """The receiver's node matched a forwarded send: the coordinator orders the transfer."""

    TYPE: ClassVar[str] = "p2p_match"
    sender_node: int
    key: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": "p2p_match", "sn": self.sender_node, "key": self.key}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> P2pMatch:
        return cls(_int(item, "p2p_match", "sn", "sender's node"), _int(item, "p2p_match", "key", "key"))


@dataclass(slots=True)
class SendFailed:
    """The receiver's node failed a forwarded send (mismatch, timeout): the sender must hear of it."""

    TYPE: ClassVar[str] = "p2p_fail"
    sender_node: int
    key: int
    code: str
    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": "p2p_fail", "sn": self.sender_node, "key": self.key, "code": self.code, "m": self.message}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> SendFailed:
        t = "p2p_fail"
        return cls(_int(item, t, "sn", "sender's node"), _int(item, t, "key", "key"), _str(item, t, "code", "code"),
                   _str(item, t, "m", "message"))


@dataclass(slots=True)
class Heartbeat:
    """A member's liveness beat, with the ops its ranks have partly submitted (for stall rows)."""

    TYPE: ClassVar[str] = "hb"
    #: (group, seq, group ranks that have not submitted) per op waiting at least a second.
    stalled: list[tuple[str, int, list[int]]]

    def to_wire(self) -> dict[str, Any]:
        return {"t": "hb", "stalled": [[g, q, missing] for g, q, missing in self.stalled]}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> Heartbeat:
        stalled = item.get("stalled", [])
        if type(stalled) is not list or not all(
            type(x) is list and len(x) == 3 and type(x[0]) is str and type(x[1]) is int and type(x[2]) is list
            for x in stalled
        ):
            _bad("hb", "stalled", "stalled ops", "a list of [group, seq, ranks]", stalled)
        return cls([(g, q, missing) for g, q, missing in stalled])


# ---- coordinator → member ----------------------------------------------------------------------------


@dataclass(slots=True)
class Go:
    """A release: run the collective at place ``order`` of the global order, on ``lane``
    (with program ``algo``, whose sha256 is ``algo_hash``, when the coordinator chose one;
    compressed with ``codec`` when the op named one or the coordinator chose one for it)."""

    TYPE: ClassVar[str] = "go"
    group: str
    seq: int
    order: int
    lane: str
    cache_id: int | None = None  # the pattern's cache id, for a node that does not know it yet
    result: bytes | None = None  # a tiny all-reduce the coordinator reduced itself
    fused_with: int | None = None  # the order of the fused set's first op this one joins
    algo: str | None = None  # the program's catalogue name (None: the lane's own algorithm)
    algo_hash: str | None = None  # its sha256, hex (with ``algo``, and only with it)
    codec: str | None = None  # "NAME" or "NAME/per-hop" (``commd.codecs``; None: uncompressed)

    def to_wire(self) -> dict[str, Any]:
        item: dict[str, Any] = {"t": "go", "g": self.group, "s": self.seq, "o": self.order, "l": self.lane}
        if self.cache_id is not None:
            item["c"] = self.cache_id
        if self.result is not None:
            item["r"] = self.result
        if self.fused_with is not None:
            item["fz"] = self.fused_with
        if self.algo is not None:
            item["a"] = self.algo
            item["ah"] = self.algo_hash
        if self.codec is not None:
            item["z"] = self.codec
        return item

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> Go:
        try:
            group, seq, order, lane = item["g"], item["s"], item["o"], item["l"]
        except KeyError:
            return cls.checked(item)
        cache_id, result, fused_with = item.get("c"), item.get("r"), item.get("fz")
        if (type(group) is str and type(seq) is int and type(order) is int and type(lane) is str
                and (cache_id is None or type(cache_id) is int) and (result is None or type(result) is bytes)
                and (fused_with is None or type(fused_with) is int)
                and "a" not in item and "ah" not in item and "z" not in item):  # valid: no more checks
            return cls(group, seq, order, lane, cache_id, result, fused_with)
        return cls.checked(item)

    @classmethod
    def checked(cls, item: dict[str, Any]) -> Go:
        """``from_wire`` field by field (names the first bad field)."""
        algo, algo_hash = _opt_str(item, "go", "a", "algorithm"), _opt_str(item, "go", "ah", "algorithm hash")
        if algo is not None and not 0 < len(algo) <= MAX_ALGO_NAME:
            _bad("go", "a", "algorithm", f"1 to {MAX_ALGO_NAME} characters", algo)
        if (algo is None) != (algo_hash is None):
            _bad("go", "ah", "algorithm hash", "given exactly when 'a' (algorithm) is", algo_hash)
        if algo_hash is not None and not SHA256_HEX.fullmatch(algo_hash):
            _bad("go", "ah", "algorithm hash", "64 lowercase hex digits (sha256)", algo_hash)
        codec = _opt_str(item, "go", "z", "codec")
        if codec is not None:
            from commd.codecs import CodecError, names, parse_choice  # (a sibling base layer: no cycle)

            try:
                parse_choice(codec)
            except CodecError:
                _bad("go", "z", "codec", f"a codec ({', '.join(names())}), optionally /per-hop", codec)
        return cls(_str(item, "go", "g", "group"), _int(item, "go", "s", "seq"), _int(item, "go", "o", "order"),
                   _str(item, "go", "l", "lane"), _opt_int(item, "go", "c", "cache id"),
                   _opt_bytes(item, "go", "r", "result"), _opt_int(item, "go", "fz", "fused set"), algo, algo_hash,
                   codec)


@dataclass(slots=True)
class Fail:
    """A collective fails on every node that holds a part of it."""

    TYPE: ClassVar[str] = "fail"
    group: str
    seq: int
    code: str
    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": "fail", "g": self.group, "s": self.seq, "code": self.code, "m": self.message}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> Fail:
        return cls(_str(item, "fail", "g", "group"), _int(item, "fail", "s", "seq"), _str(item, "fail", "code", "code"),
                   _str(item, "fail", "m", "message"))


@dataclass(slots=True)
class Early:
    """Node 0's contribution to a tiny all-reduce (cached pattern, tcp lane) of a group of two
    nodes, sent to the other node as soon as node 0 reported it: that node, once ready with the
    same cache id, combines both itself and does not wait for the release."""

    TYPE: ClassVar[str] = "early"
    group: str
    seq: int
    cache_id: int
    contribution: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"t": "early", "g": self.group, "s": self.seq, "c": self.cache_id, "d": self.contribution}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> Early:
        contribution = _opt_bytes(item, "early", "d", "contribution")
        if contribution is None:
            _bad("early", "d", "contribution", "bytes", None)
        return cls(_str(item, "early", "g", "group"), _int(item, "early", "s", "seq"),
                   _int(item, "early", "c", "cache id"), contribution)


@dataclass(slots=True)
class RemoteSend:
    """A send forwarded by the coordinator to its receiver's node, to be matched there."""

    TYPE: ClassVar[str] = "remote_send"
    send: P2pSend
    sender_node: int

    def to_wire(self) -> dict[str, Any]:
        item = self.send.to_wire()
        item["t"] = "remote_send"  # (the key stays first)
        item["sn"] = self.sender_node
        return item

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> RemoteSend:
        return cls(P2pSend.from_wire(item, "remote_send"), _int(item, "remote_send", "sn", "sender's node"))


@dataclass(slots=True)
class P2pGo:
    """The release of a cross-node transfer, to both ends (the receiver also gets ``sender_node``)."""

    TYPE: ClassVar[str] = "p2p_go"
    key: int
    sender_node: int | None
    order: int
    lane: str
    role: str  # "send" or "recv"
    peer: int  # the other end's node

    def to_wire(self) -> dict[str, Any]:
        item: dict[str, Any] = {"t": "p2p_go", "key": self.key}
        if self.sender_node is not None:
            item["sn"] = self.sender_node
        item["o"] = self.order
        item["l"] = self.lane
        item["role"] = self.role
        item["peer"] = self.peer
        return item

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> P2pGo:
        t = "p2p_go"
        role = _str(item, t, "role", "role")
        if role not in ("send", "recv"):
            _bad(t, "role", "role", "'send' or 'recv'", role)
        sender = _int(item, t, "sn", "sender's node") if role == "recv" else _opt_int(item, t, "sn", "sender's node")
        return cls(_int(item, t, "key", "key"), sender, _int(item, t, "o", "order"), _str(item, t, "l", "lane"), role,
                   _int(item, t, "peer", "peer node"))


@dataclass(slots=True)
class P2pFail:
    """A cross-node transfer fails (``sender_node`` set: the receiver's side of it)."""

    TYPE: ClassVar[str] = "p2p_fail"
    key: int
    sender_node: int | None
    code: str
    message: str

    def to_wire(self) -> dict[str, Any]:
        item: dict[str, Any] = {"t": "p2p_fail", "key": self.key}
        if self.sender_node is not None:
            item["sn"] = self.sender_node
        item["code"] = self.code
        item["m"] = self.message
        return item

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> P2pFail:
        t = "p2p_fail"
        return cls(_int(item, t, "key", "key"), _opt_int(item, t, "sn", "sender's node"), _str(item, t, "code", "code"),
                   _str(item, t, "m", "message"))


@dataclass(slots=True)
class NodeDead:
    """A node is gone (its control link closed, it left, or it fell silent)."""

    TYPE: ClassVar[str] = "node_dead"
    node: int
    why: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": "node_dead", "node": self.node, "why": self.why}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> NodeDead:
        return cls(_int(item, "node_dead", "node", "node"), _str(item, "node_dead", "why", "why"))


@dataclass(slots=True)
class CoordinatorHeartbeat:
    """The coordinator's liveness beat, with the fabric's stall rows (for ``commd status``)."""

    TYPE: ClassVar[str] = "hb"
    stalls: list[dict[str, Any]]

    def to_wire(self) -> dict[str, Any]:
        return {"t": "hb", "stalls": self.stalls}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> CoordinatorHeartbeat:
        stalls = item.get("stalls", [])
        if type(stalls) is not list or not all(type(row) is dict for row in stalls):
            _bad("hb", "stalls", "stall rows", "a list of maps", stalls)
        return cls(stalls)


@dataclass(slots=True)
class Shutdown:
    """Stop this node: the coordinator shuts the fabric down."""

    TYPE: ClassVar[str] = "shutdown"
    why: str | None

    def to_wire(self) -> dict[str, Any]:
        return {"t": "shutdown", "why": self.why}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> Shutdown:
        return cls(_opt_str(item, "shutdown", "why", "why"))


@dataclass(slots=True)
class Trace:
    """Start or stop the per-op trace on this node (``commd trace`` on node 0)."""

    TYPE: ClassVar[str] = "trace"
    action: str
    path: str | None

    def to_wire(self) -> dict[str, Any]:
        return {"t": "trace", "a": self.action, "p": self.path}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> Trace:
        return cls(_str(item, "trace", "a", "action"), _opt_str(item, "trace", "p", "path"))


# ---- both directions ---------------------------------------------------------------------------------


@dataclass(slots=True)
class RankDied:
    """A rank is gone (up: from its node; down: to every other node)."""

    TYPE: ClassVar[str] = "rank_died"
    rank: int
    why: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": "rank_died", "rank": self.rank, "why": self.why}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> RankDied:
        return cls(_int(item, "rank_died", "rank", "rank"), _str(item, "rank_died", "why", "why"))


@dataclass(slots=True)
class Leaving:
    """The sender leaves the fabric (it shuts down): no need to wait out the peer timeout."""

    TYPE: ClassVar[str] = "leaving"
    why: str | None

    def to_wire(self) -> dict[str, Any]:
        return {"t": "leaving", "why": self.why}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> Leaving:
        return cls(_opt_str(item, "leaving", "why", "why"))


@dataclass(slots=True)
class RingPart:
    """One node's part of a bridged exchange-ring all-reduce (``fabric/bridge.py``): its local
    ranks' contribution, or why the op fails there.  A member sends it to the coordinator, which
    relays it to the group's other nodes (``to``); node 0 sends its own straight to them."""

    TYPE: ClassVar[str] = "ring"
    group: str
    seq: int  # the ring's op number
    index: int  # the op's place among the group's collectives
    node: int  # the node it comes from
    to: list[int]
    dtype: int  # codes of protocol/fastring.py
    op: int
    count: int
    contribution: bytes | None
    error: str | None = None
    message: str | None = None

    def to_wire(self) -> dict[str, Any]:
        item = {"t": "ring", "g": self.group, "s": self.seq, "i": self.index, "sn": self.node, "to": self.to,
                "dt": self.dtype, "o": self.op, "n": self.count, "d": self.contribution}
        if self.error is not None:
            item["e"], item["m"] = self.error, self.message
        return item

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> RingPart:
        t = "ring"
        return cls(_str(item, t, "g", "group"), _int(item, t, "s", "seq"), _int(item, t, "i", "index"),
                   _int(item, t, "sn", "node"), _ints(item, t, "to", "to"), _int(item, t, "dt", "dtype"),
                   _int(item, t, "o", "op"), _int(item, t, "n", "count"), _opt_bytes(item, t, "d", "contribution"),
                   _opt_str(item, t, "e", "error"), _opt_str(item, t, "m", "message"))


@dataclass(slots=True)
class ScheduleSlot:
    """One place of a schedule's cycle: the op pattern (cache id) expected there and how it runs.

    ``gather``: the slot's agreement also gathers each node's contribution (a tiny all-reduce on
    more than 2 nodes, ``TcpLane.agree_gather``); every node takes the same kind of agreement
    for a slot, whatever op it has there."""

    cache_id: int
    lane: str
    algo: str | None = None
    algo_hash: str | None = None
    codec: str | None = None
    gather: bool = False

    def to_wire(self) -> list[Any]:
        return [self.cache_id, self.lane, self.algo, self.algo_hash, self.codec, self.gather]

    @classmethod
    def from_wire(cls, value: Any) -> ScheduleSlot:
        if (type(value) is not list or len(value) != 6 or type(value[0]) is not int or type(value[1]) is not str
                or not all(v is None or type(v) is str for v in value[2:5]) or type(value[5]) is not bool):
            _bad("sched", "sl", "slots", "a list of [cache id, lane, program, its sha256, codec, gather]", value)
        slot = cls(*value)
        if (slot.algo is None) != (slot.algo_hash is None) or (
                slot.algo_hash is not None and not SHA256_HEX.fullmatch(slot.algo_hash)):
            _bad("sched", "sl", "slots", "a program name with its sha256 (64 hex digits), or neither", value)
        return slot


#: Slots in one schedule cycle at most (a training step of a few hundred ops).
MAX_SCHEDULE_SLOTS = 1024


@dataclass(slots=True)
class Schedule:
    """The coordinator saw group ``group`` repeat the same cycle of op patterns twice: from its
    sequence number ``start_seq`` on, every node releases the group's ops itself, the i-th that
    reaches the fabric at place ``order + i`` of the global order, if it matches slot ``i % len(slots)``
    (``fabric/scheduled.py``)."""

    TYPE: ClassVar[str] = "sched"
    epoch: int
    group: str
    nodes: list[int]  # the group's nodes (every live node), ascending
    order: int
    start_seq: int
    slots: list[ScheduleSlot]

    def to_wire(self) -> dict[str, Any]:
        return {"t": "sched", "e": self.epoch, "g": self.group, "n": self.nodes, "o": self.order, "s": self.start_seq,
                "sl": [slot.to_wire() for slot in self.slots]}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> Schedule:
        t = "sched"
        slots = _get(item, t, "sl", "slots")
        if type(slots) is not list or not 0 < len(slots) <= MAX_SCHEDULE_SLOTS:
            _bad(t, "sl", "slots", f"a list of 1 to {MAX_SCHEDULE_SLOTS} slots", slots)
        nodes = _ints(item, t, "n", "nodes")
        if len(nodes) < 2 or nodes != sorted(set(nodes)):
            _bad(t, "n", "nodes", "two or more node ranks, ascending", nodes)
        return cls(_int(item, t, "e", "epoch"), _str(item, t, "g", "group"), nodes, _int(item, t, "o", "order"),
                   _int(item, t, "s", "start seq"), [ScheduleSlot.from_wire(v) for v in slots])


@dataclass(slots=True)
class StopSchedule:
    """Something outside schedule ``epoch`` needs ordering (another group's op, a transfer, a dead
    node): every node ends the schedule at the first slot it has not yet released."""

    TYPE: ClassVar[str] = "sched_stop"
    epoch: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": "sched_stop", "e": self.epoch}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> StopSchedule:
        return cls(_int(item, "sched_stop", "e", "epoch"))


@dataclass(slots=True)
class ScheduleEnded:
    """This node ran schedule ``epoch`` up to, not including, place ``order`` of the global order;
    its later ops of the group are reported again (sent before any of those reports)."""

    TYPE: ClassVar[str] = "sched_end"
    epoch: int
    order: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": "sched_end", "e": self.epoch, "o": self.order}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> ScheduleEnded:
        return cls(_int(item, "sched_end", "e", "epoch"), _int(item, "sched_end", "o", "order"))


# ---- the control tree (scheduler/tree.py): relays between node 0 and the other nodes -------------------


def _ranges(item: dict[str, Any], t: str) -> tuple[tuple[int, int], ...]:
    """Node ranges ``r``: sorted, disjoint, non-empty [lo, hi) runs of non-negative node numbers (the
    receiver checks them against its fabric)."""
    runs = item.get("r")
    last = 0
    if type(runs) is not list or not runs or len(runs) > MAX_RANGES:
        _bad(t, "r", "node ranges", f"a list of 1 to {MAX_RANGES} [lo, hi) runs", runs)
    for run in runs:
        if (type(run) is not list or len(run) != 2 or type(run[0]) is not int or type(run[1]) is not int
                or not last <= run[0] < run[1]):
            _bad(t, "r", "node ranges", "sorted, disjoint, non-empty [lo, hi) runs of node numbers", runs)
        last = run[1]
    return tuple((lo, hi) for lo, hi in runs)


#: Runs in one range list at most (a group's nodes, clipped to a subtree).
MAX_RANGES = 4096


@dataclass(slots=True)
class ReadySet:
    """A relay's merge of its subtree's cached reports of one op: these nodes all reported
    ``(group, seq)`` by cache id ``cache_id``, with nothing else."""

    TYPE: ClassVar[str] = "ready_set"
    group: str
    seq: int
    cache_id: int
    ranges: tuple[tuple[int, int], ...]

    def to_wire(self) -> dict[str, Any]:
        return {"t": "ready_set", "g": self.group, "s": self.seq, "c": self.cache_id,
                "r": [list(run) for run in self.ranges]}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> ReadySet:
        t = "ready_set"
        return cls(_str(item, t, "g", "group"), _int(item, t, "s", "seq"), _int(item, t, "c", "cache id"),
                   _ranges(item, t))


@dataclass(slots=True)
class Via:
    """Items a relay passes up for one node of its subtree, in the order that node sent them."""

    TYPE: ClassVar[str] = "via"
    node: int
    items: list[Any]  # messages of TO_COORDINATOR (never another Via)
    #: What was wrong with each inner item that was dropped (not on the wire).
    problems: list[str] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"t": "via", "n": self.node, "items": [m.to_wire() for m in self.items]}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> Via:
        node = _int(item, "via", "n", "node")
        raw = item.get("items")
        if type(raw) is not list:
            _bad("via", "items", "items", "a list", raw)
        messages, problems = decode_batch({"t": BATCH, "items": raw}, _ONE_NODE)
        return cls(node, messages, problems)


@dataclass(slots=True)
class Routed:
    """Messages for the nodes in ``ranges`` (a relay keeps its own and passes each child its part);
    ``items`` are wire maps, decoded only by the nodes they are for."""

    TYPE: ClassVar[str] = "to"
    ranges: tuple[tuple[int, int], ...]
    items: list[dict[str, Any]]

    def to_wire(self) -> dict[str, Any]:
        return {"t": "to", "r": [list(run) for run in self.ranges], "items": self.items}

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> Routed:
        raw = item.get("items")
        if type(raw) is not list or not all(type(x) is dict for x in raw):
            _bad("to", "items", "items", "a list of maps", raw)
        return cls(_ranges(item, "to"), raw)


ToCoordinator = (Ready | P2pSend | P2pMatch | SendFailed | RankDied | Heartbeat | Leaving | RingPart
                 | ScheduleEnded | StopSchedule | ReadySet | Via)
ToMember = (Go | Fail | Early | RemoteSend | P2pGo | P2pFail | NodeDead | RankDied | CoordinatorHeartbeat | Shutdown
            | Leaving | Trace | RingPart | Schedule | StopSchedule)
Message = ToCoordinator | ToMember

#: What a coordinator accepts, by wire type.
TO_COORDINATOR: dict[str, Any] = {
    cls.TYPE: cls
    for cls in (Ready, P2pSend, P2pMatch, SendFailed, RankDied, Heartbeat, Leaving, RingPart, ScheduleEnded,
                StopSchedule, ReadySet, Via)
}
#: What a relay passes up for one node (a node's own items: no merges, no relayed items).
_ONE_NODE: dict[str, Any] = {t: cls for t, cls in TO_COORDINATOR.items() if cls not in (ReadySet, Via)}
#: What a member accepts, by wire type.
TO_MEMBER: dict[str, Any] = {
    cls.TYPE: cls
    for cls in (Go, Fail, Early, RemoteSend, P2pGo, P2pFail, NodeDead, RankDied, CoordinatorHeartbeat, Shutdown, Leaving,
                Trace, RingPart, Schedule, StopSchedule, Routed)
}


def batch(messages: list[Any]) -> dict[str, Any]:
    """The envelope for one control frame (``channel.frame`` adds the protocol version)."""
    return {"t": BATCH, "items": [m.to_wire() for m in messages]}


def decode(item: Any, vocabulary: dict[str, Any]) -> Any:
    """One received item as its message type (``FabricMessageError``: malformed or not of this direction)."""
    if type(item) is not dict:
        raise FabricMessageError(f"fabric item must be a map, got {type(item).__name__}")
    t = item.get("t")
    cls = vocabulary.get(t) if type(t) is str else None
    if cls is None:
        raise FabricMessageError(f"fabric item of unknown type {item.get('t')!r} (expected one of {sorted(vocabulary)})")
    return cls.from_wire(item)


def decode_batch(envelope: dict[str, Any], vocabulary: dict[str, Any]) -> tuple[list[Any], list[str]]:
    """The messages of one received frame, and what was wrong with each item that was dropped.

    A malformed item is dropped alone (the rest still act); a frame that is not a batch is
    read as a single item.
    """
    items = envelope.get("items") if envelope.get("t") == BATCH else [envelope]
    if type(items) is not list:
        raise FabricMessageError(f"fabric batch: field 'items' must be a list, got {type(items).__name__}")
    messages: list[Any] = []
    problems: list[str] = []
    append = messages.append
    for item in items:
        try:
            try:
                cls = vocabulary[item["t"]] if type(item) is dict else None
            except (KeyError, TypeError):  # no type, or one this direction does not know
                cls = None
            append(cls.from_wire(item) if cls is not None else decode(item, vocabulary))
        except FabricMessageError as exc:
            problems.append(str(exc))
    return messages, problems
