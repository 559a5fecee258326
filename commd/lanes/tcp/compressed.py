"""Compressed collectives over any :class:`~commd.lanes.base.Transport`: the chunked-chain broadcast,
and the ring all-gather and all-reduce built on the same coded transfers.

The root cuts its buffer into chunks and codes each one once; the chain forwards the coded
bytes unchanged (no node decodes to encode again, the per-hop baseline's cost); every
receiver decodes its own copy.  Each chunk travels as two transfers: a frame (codec wire id,
flags, payload length) and the payload, whose length only the frame tells — so a receiver
posts one chunk's receives at a time, the payload's once its frame is in.

Where the work happens, so that a node's codec time hides behind the wire:

- a sender keeps two chunks coded and posted ahead; each later chunk is coded when a payload
  before it has left (from the transport's completion), while the socket's buffer still feeds
  the link with the chunks already written;
- a middle node forwards chunk i from its receive callback (the transport writes it on its
  next turn) and decodes chunk i only when chunk i + 1's frame arrives, or after the last
  chunk: the forward is on the wire before the decode starts.

A chunk that does not shrink travels raw (the ``RAW`` flag; codecs whose ``sends_raw`` is
False, the 16-bit casts, always travel coded); the root of a lossy codec rounds its own copy in
place as receivers decode it (unless told to stay exact), so that every replica ends with the
same bits.  Chunks are cut by the codec's ``wire_itemsize``: a node that holds bits a GPU
already rounded (``Narrowed``) cuts the same chunks as one holding the float32 values.  A frame naming another codec,
another length than the chunk can have, or a payload that does not decode is a
``TransportError`` naming the node it came from, never a hang and never a half-written
buffer taken as good.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from commd.codecs import Codec, CodecError
from commd.kernels.small import reduce_into
from commd.lanes.base import Done, Transport, TransportError

#: A chunk's frame: codec wire id, flags, two reserved bytes, payload length.
FRAME = struct.Struct("!BBxxI")
#: Frame flag: the payload is the chunk's raw bytes (it did not shrink).
RAW = 1
#: Chunk sizes: about a sixteenth of the message, within these bounds (bytes).
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 256 << 10, 1 << 20


def chunk_elements(nbytes: int, itemsize: int) -> int:
    """Elements per chunk for a message of ``nbytes``: about nbytes/16, 256 KiB to 1 MiB."""
    target = min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, nbytes // 16))
    return max(1, target // itemsize)


@dataclass
class ChainCounts:
    """What one node's part of a compressed broadcast, all-gather or all-reduce coded: for ``commd status``."""

    raw_bytes: int = 0  # the bytes of the chunks this node sent or received, uncoded
    wire_bytes: int = 0  # their payloads as they travelled
    raw_chunks: int = 0  # chunks that travelled uncoded (they did not shrink)
    codec_seconds: float = 0.0  # encoding (root, per-hop) and decoding (others)


def compressed_chain_broadcast(tp: Transport, nodes: tuple[int, ...], me: int, root: int, arr: np.ndarray,
                               codec: Codec, exact_root: bool = False, per_hop: bool = False) -> ChainCounts:
    """``root``'s ``arr`` into every node's ``arr`` (flat, contiguous) along the chain from ``root``,
    coded by ``codec``.  With a lossy codec every node ends with the decoded values, the root too
    unless ``exact_root``.  ``per_hop``: the baseline this algorithm exists to beat — every middle
    node decodes a chunk and codes it again before forwarding it (benchmarks only)."""
    order = nodes[nodes.index(root):] + nodes[:nodes.index(root)]
    q = order.index(nodes[me])
    nxt = order[q + 1] if q + 1 < len(order) else None
    pieces = _pieces(arr, codec)
    counts = ChainCounts()
    if q == 0:
        assert nxt is not None
        _send_coded(tp, nxt, pieces, None if exact_root else pieces, codec, counts)
        tp.wait()
        return counts
    receiver = _Receiver(tp, order[q - 1], [_Chunk(piece, nxt) for piece in pieces], codec, per_hop, counts)
    receiver.start()
    tp.wait()
    receiver.decode_pending()  # a middle node's last chunk: decoded once it was forwarded
    return counts


def compressed_ring_allgather(tp: Transport, nodes: tuple[int, ...], me: int, inp: np.ndarray, out: np.ndarray,
                              sizes: list[int], codec: Codec) -> ChainCounts:
    """Every node's ``inp`` (``sizes[i]`` elements from node i), in node order, into everyone's
    ``out``, round a ring: each block is coded once by its owner, forwarded coded by the nodes after
    it and decoded by each.  With a lossy codec a node's own block in ``out`` holds the decoded values
    too, as everywhere else (``inp`` is left as it was)."""
    n = len(nodes)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    blocks = [out[offsets[i]:offsets[i + 1]] for i in range(n)]
    blocks[me][:] = inp
    counts = ChainCounts()
    # prv's own block arrives first, then the ones it forwards, as they reached it
    _ring_pass(tp, nodes[(me + 1) % n], nodes[(me - 1) % n], inp, blocks[me],
               [blocks[(me - j) % n] for j in range(1, n)], codec, counts)
    return counts


def _ring_pass(tp: Transport, nxt: int, prv: int, send: np.ndarray, keep: np.ndarray, arriving: list[np.ndarray],
               codec: Codec, counts: ChainCounts) -> None:
    """One pass of blocks round a ring: ``send`` coded once to ``nxt`` (``keep``, this node's copy of
    it, rounded as receivers decode it), and the blocks ``arriving`` from ``prv`` in that order, each
    decoded here and forwarded coded, but the last (``nxt`` owns it)."""
    outbox = _Outbox(tp, nxt)  # this node's own pieces reach nxt before any chunk it forwards there
    _send_coded(tp, nxt, _pieces(send, codec), _pieces(keep, codec), codec, counts, then=outbox.release)
    receiver = _Receiver(tp, prv, [_Chunk(piece, nxt if j < len(arriving) - 1 else None)
                                   for j, block in enumerate(arriving) for piece in _pieces(block, codec)],
                         codec, False, counts, outbox)
    receiver.start()
    tp.wait()
    receiver.decode_pending()


def _pieces(arr: np.ndarray, codec: Codec) -> list[np.ndarray]:
    """``arr`` (flat) in the chunks it travels in (``chunk_elements`` of the codec's element size:
    the same on every node)."""
    itemsize = codec.wire_itemsize(arr.itemsize)
    return _cut(arr, chunk_elements(arr.size * itemsize, itemsize))


def _cut(arr: np.ndarray, step: int) -> list[np.ndarray]:
    """``arr`` (flat) as consecutive views of ``step`` elements (the last shorter)."""
    return [arr[lo:lo + step] for lo in range(0, arr.size, step)]


#: Chunks a sender keeps coded and posted ahead of the transport: the next one is coded when one is out.
SEND_AHEAD = 2


class _Outbox:
    """Chunks forwarded to ``nxt`` held until ``release``: ``_send_coded`` posts a node's own pieces
    lazily (each when one before it has left), so a chunk forwarded the moment it arrives would
    otherwise land on the wire between them, where ``nxt`` expects the next own piece."""

    def __init__(self, tp: Transport, nxt: int) -> None:
        self.tp, self.nxt, self.open, self.held = tp, nxt, False, []

    def post(self, *views: memoryview) -> None:
        if self.open:
            for view in views:
                self.tp.post_send(self.nxt, view)
        else:
            self.held.append(views)

    def release(self) -> None:
        self.open = True
        held, self.held = self.held, []
        for views in held:
            self.post(*views)


def _send_coded(tp: Transport, nxt: int, pieces: list[np.ndarray], copies: list[np.ndarray] | None, codec: Codec,
                counts: ChainCounts, then: Callable[[], None] | None = None) -> None:
    """Code each piece once and post it to ``nxt`` (frame, payload); ``copies``: this node's own copy
    of each piece, rounded as receivers decode it when the codec is lossy (None: left exact).

    The first ``SEND_AHEAD`` pieces are coded now; each later one when a payload before it has left
    (from the transport's completion, inside ``wait``), so the coding of piece k overlaps the link
    draining the pieces already in the socket's buffer instead of all coding preceding all sending.
    (The posted memoryviews keep the coded bytes alive until the transport has sent them.)  ``then``
    runs once the last piece is posted."""
    room = [codec.max_encoded(piece.nbytes) for piece in pieces]
    starts = np.concatenate([[0], np.cumsum(room)]).astype(int)
    area = np.empty(int(starts[-1]), np.uint8)
    following = iter(range(len(pieces)))

    def post_next() -> None:
        k = next(following, None)
        if k is None:
            return
        piece, slot = pieces[k], area[starts[k]:starts[k + 1]]
        began = time.perf_counter()
        n = codec.encode(piece, slot)
        counts.codec_seconds += time.perf_counter() - began
        raw = codec.sends_raw and n >= piece.nbytes
        counts.raw_chunks += raw
        counts.raw_bytes += piece.size * codec.wire_itemsize(piece.itemsize)
        counts.wire_bytes += piece.nbytes if raw else n
        payload = piece.reshape(-1).view(np.uint8) if raw else slot[:n]
        tp.post_send(nxt, memoryview(FRAME.pack(codec.wire_id, RAW if raw else 0, len(payload))))
        tp.post_send(nxt, memoryview(payload), post_next)
        if copies is not None and codec.lossy and not raw:
            if copies[k] is not piece:
                copies[k][:] = piece
            codec.round_in_place(copies[k])  # (the coded bytes are sent, not the piece: free to change)
        if k == len(pieces) - 1 and then is not None:
            then()

    if not pieces and then is not None:
        then()
    for _ in range(SEND_AHEAD):
        post_next()


@dataclass
class _Chunk:
    """One chunk a node receives: where it decodes, and the node it goes on to (coded as it came)."""

    dst: np.ndarray
    forward: int | None


class _Receiver:
    """The chunks a node receives from ``prv``, in order: each forwarded, then decoded one chunk late."""

    def __init__(self, tp: Transport, prv: int, chunks: list[_Chunk], codec: Codec, per_hop: bool,
                 counts: ChainCounts, outbox: _Outbox | None = None) -> None:
        self.tp, self.prv, self.chunks, self.codec, self.per_hop, self.counts = tp, prv, chunks, codec, per_hop, counts
        self.outbox = outbox  # forwards to its node go through it (after this node's own pieces)
        room = [codec.max_encoded(c.dst.nbytes) for c in chunks]
        self.starts = np.concatenate([[0], np.cumsum(room)]).astype(int)
        self.area = np.empty(int(self.starts[-1]), np.uint8)  # each chunk's coded bytes, alive until forwarded
        self.frames = [bytearray(FRAME.size) for _ in chunks]
        self.lengths = [0] * len(chunks)
        self.raw = [False] * len(chunks)
        self.pending: int | None = None  # the chunk received and not yet decoded

    def start(self) -> None:
        if self.chunks:
            self._expect_frame(0)

    def _expect_frame(self, k: int) -> None:
        self.tp.post_recv(self.prv, memoryview(self.frames[k]), self._on_frame(k))

    def _slot(self, k: int, length: int | None = None) -> np.ndarray:
        return self.area[self.starts[k]:self.starts[k] + (self.lengths[k] if length is None else length)]

    def _on_frame(self, k: int) -> Done:
        def done() -> None:
            self.decode_pending()  # chunk k - 1 went on to the next node in the transport's last turn
            wire_id, flags, length = FRAME.unpack(self.frames[k])
            dst = self.chunks[k].dst
            raw_size = dst.size * self.codec.wire_itemsize(dst.itemsize)
            if wire_id != self.codec.wire_id:
                self._corrupt(k, f"its frame names codec wire id {wire_id}, this node expects "
                                 f"{self.codec.wire_id} ({self.codec.name}): do the nodes agree on the codec?")
            if (flags & ~RAW or (flags & RAW and (length != dst.nbytes or not self.codec.sends_raw))
                    or length > self.starts[k + 1] - self.starts[k]):
                self._corrupt(k, f"its frame says {length} bytes (flags {flags:#x}) for a chunk of {raw_size} bytes"
                                 + ("" if self.codec.sends_raw else f", but {self.codec.name} never travels raw"))
            self.lengths[k], self.raw[k] = length, bool(flags & RAW)
            self.counts.raw_bytes += raw_size
            self.counts.wire_bytes += length
            self.counts.raw_chunks += self.raw[k]
            self.tp.post_recv(self.prv, memoryview(self._slot(k)), self._on_payload(k))
        return done

    def _on_payload(self, k: int) -> Done:
        def done() -> None:
            forward = self.chunks[k].forward
            self.pending = k
            if self.per_hop and forward is not None and not self.raw[k]:
                self.decode_pending()  # the baseline: decode here, code again, then forward
                began = time.perf_counter()
                self.lengths[k] = self.codec.encode(self.chunks[k].dst, self._slot(k, self.starts[k + 1] - self.starts[k]))
                self.counts.codec_seconds += time.perf_counter() - began
                self.frames[k][:] = FRAME.pack(self.codec.wire_id, 0, self.lengths[k])
            if forward is not None and self.outbox is not None and forward == self.outbox.nxt:
                self.outbox.post(memoryview(self.frames[k]), memoryview(self._slot(k)))
            elif forward is not None:
                self.tp.post_send(forward, memoryview(self.frames[k]))
                self.tp.post_send(forward, memoryview(self._slot(k)))
            if k + 1 < len(self.chunks):
                self._expect_frame(k + 1)
            elif forward is None:
                self.decode_pending()  # the chain's end: nothing to forward first
        return done

    def decode_pending(self) -> None:
        """Decode the chunk received last, if it is not decoded yet."""
        k, self.pending = self.pending, None
        if k is None:
            return
        dst, payload = self.chunks[k].dst, self._slot(k)
        if self.raw[k]:
            dst.reshape(-1).view(np.uint8)[:] = payload
            return
        began = time.perf_counter()
        try:
            self.codec.decode(payload, dst)
        except CodecError as exc:
            self._corrupt(k, f"it does not decode: {exc}")
        self.counts.codec_seconds += time.perf_counter() - began

    def _corrupt(self, k: int, why: str) -> None:
        raise TransportError(self.prv, "internal", f"compressed transfer: chunk {k} of {len(self.chunks)} from "
                                                   f"node {self.prv} is corrupt: {why}")


def compressed_ring_allreduce(tp: Transport, nodes: tuple[int, ...], me: int, arr: np.ndarray, op: str,
                              codec: Codec) -> ChainCounts:
    """``arr`` (flat, in place) reduced with ``op`` over ``nodes``, with coded bytes on the wire and the
    reduction in ``arr``'s own precision: a ring reduce-scatter whose partial results travel coded
    (each node decodes what arrives and reduces it into its float32 block), then the compressed ring
    all-gather of the reduced blocks, each coded once by its owner.  With a lossy codec every node
    ends with the owner's rounding of each block: the same bits everywhere."""
    n = len(nodes)
    base, rem = divmod(arr.size, n)
    bounds = [k * base + min(k, rem) for k in range(n + 1)]

    def block(k: int) -> np.ndarray:
        k %= n
        return arr[bounds[k]:bounds[k + 1]]

    nxt, prv = nodes[(me + 1) % n], nodes[(me - 1) % n]
    counts = ChainCounts()
    for t in range(n - 1):  # step t: send block me - t, receive block me - t - 1 and reduce it in
        _send_coded(tp, nxt, _pieces(block(me - t), codec), None, codec, counts)
        into = block(me - t - 1)
        landed = np.empty_like(into)
        receiver = _Receiver(tp, prv, [_Chunk(piece, None) for piece in _pieces(landed, codec)], codec, False,
                             counts)
        receiver.start()
        tp.wait()
        receiver.decode_pending()
        reduce_into(into, [into, landed], op)
    # node me now holds block me + 1 reduced; the blocks travel round the ring from their owners
    _ring_pass(tp, nxt, prv, block(me + 1), block(me + 1), [block(me + 1 - j) for j in range(1, n)], codec, counts)
    return counts


class CodedTransport:
    """A :class:`~commd.lanes.base.Transport` whose every transfer travels coded by a lossless codec:
    what lets a collective program (the interpreter, which posts plain sends and receives) run
    compressed.  Each send is coded when it is posted (a frame, then the payload; raw where coding
    does not shrink it); receives from one peer are served in the order they were posted, each
    frame read before its payload's receive is posted, and decoded into the receiver's view.

    Lossless only: a program's partial results would otherwise be rounded at every hop, and a node
    that keeps a value it sent would hold other bits than the nodes it sent it to."""

    def __init__(self, inner: Transport, codec: Codec, dtype: np.dtype, counts: ChainCounts) -> None:
        if codec.lossy:
            raise ValueError(f"codec {codec.name!r} is lossy: programs run compressed with lossless codecs only")
        self.inner, self.codec, self.dtype, self.counts = inner, codec, np.dtype(dtype), counts
        self.chunk_bytes = inner.chunk_bytes
        self._waiting: dict[int, list[tuple[memoryview, Done | None]]] = {}  # per peer: receives not yet framed
        self._framing: set[int] = set()  # peers whose next frame's receive is posted

    def post_send(self, peer: int, view: memoryview, done: Done | None = None) -> None:
        data = np.frombuffer(view, np.uint8)
        elements = data.view(self._dtype_for(data.size))
        out = np.empty(self.codec.max_encoded(data.size), np.uint8)
        began = time.perf_counter()
        n = self.codec.encode(elements, out) if data.size else 0
        self.counts.codec_seconds += time.perf_counter() - began
        raw = n >= data.size
        payload = view if raw else memoryview(out[:n])
        self.counts.raw_chunks += raw
        self.counts.raw_bytes += data.size
        self.counts.wire_bytes += len(payload)
        self.inner.post_send(peer, memoryview(FRAME.pack(self.codec.wire_id, RAW if raw else 0, len(payload))))
        self.inner.post_send(peer, payload, done)

    def post_recv(self, peer: int, view: memoryview, done: Done | None = None) -> None:
        self._waiting.setdefault(peer, []).append((view, done))
        if peer not in self._framing:
            self._next_frame(peer)

    def wait(self) -> None:
        self.inner.wait()

    def _dtype_for(self, nbytes: int) -> np.dtype:
        """The elements a transfer of ``nbytes`` is coded as (its shuffle's width): the data's dtype, or
        bytes where a tile does not hold whole elements (sender and receiver decide alike)."""
        return self.dtype if nbytes % self.dtype.itemsize == 0 else np.dtype(np.uint8)

    def _next_frame(self, peer: int) -> None:
        queue = self._waiting.get(peer)
        if not queue:
            self._framing.discard(peer)
            return
        self._framing.add(peer)
        view, done = queue.pop(0)
        frame = bytearray(FRAME.size)
        self.inner.post_recv(peer, memoryview(frame), lambda: self._on_frame(peer, frame, view, done))

    def _on_frame(self, peer: int, frame: bytearray, view: memoryview, done: Done | None) -> None:
        wire_id, flags, length = FRAME.unpack(frame)
        size = len(view)
        if wire_id != self.codec.wire_id:
            raise TransportError(peer, "internal", f"coded transfer from node {peer}: its frame names codec wire id "
                                                   f"{wire_id}, this node expects {self.codec.wire_id} ({self.codec.name})")
        if flags & ~RAW or (flags & RAW and length != size) or length > self.codec.max_encoded(size):
            raise TransportError(peer, "internal", f"coded transfer from node {peer} is corrupt: its frame says "
                                                   f"{length} bytes (flags {flags:#x}) for {size}")
        self.counts.raw_bytes += size
        self.counts.wire_bytes += length
        self.counts.raw_chunks += bool(flags & RAW)
        if flags & RAW:
            self.inner.post_recv(peer, view, done)
        else:
            coded = np.empty(length, np.uint8)
            self.inner.post_recv(peer, memoryview(coded), lambda: self._decode(peer, coded, view, done))
        self._next_frame(peer)  # (its frame follows this payload on the stream)

    def _decode(self, peer: int, coded: np.ndarray, view: memoryview, done: Done | None) -> None:
        dst = np.frombuffer(view, np.uint8)
        dst = dst.view(self._dtype_for(dst.size))
        began = time.perf_counter()
        try:
            self.codec.decode(coded, dst)
        except CodecError as exc:
            raise TransportError(peer, "internal", f"coded transfer from node {peer} does not decode: {exc}") from None
        self.counts.codec_seconds += time.perf_counter() - began
        if done is not None:
            done()
