"""The compressed chunked-chain broadcast, over any :class:`~commd.lanes.base.Transport`.

The root cuts its buffer into chunks and codes each one once; the chain forwards the coded
bytes unchanged (no node decodes to encode again, the per-hop baseline's cost); every
receiver decodes its own copy.  Each chunk travels as two transfers: a frame (codec wire id,
flags, payload length) and the payload, whose length only the frame tells — so a receiver
posts one chunk's receives at a time, the payload's once its frame is in.

Where the work happens, so that a node's codec time hides behind the wire:

- the root posts chunk i's transfers as soon as it is coded, then codes chunk i + 1 while the
  kernel's socket buffer still feeds the link with chunk i;
- a middle node forwards chunk i from its receive callback (the transport writes it on its
  next turn) and decodes chunk i only when chunk i + 1's frame arrives, or after the last
  chunk: the forward is on the wire before the decode starts.

A chunk that does not shrink travels raw (the ``RAW`` flag); the root of a lossy codec then
keeps that chunk exact and rounds the others in place as receivers decode them (unless told to
stay exact), so that every replica ends with the same bits.  A frame naming another codec,
another length than the chunk can have, or a payload that does not decode is a
``TransportError`` naming the node it came from, never a hang and never a half-written
buffer taken as good.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import numpy as np

from commd.codecs import Codec, CodecError
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
    """What one node's part of a compressed broadcast coded: for ``commd status``."""

    raw_bytes: int = 0  # the chunks' bytes uncoded
    wire_bytes: int = 0  # their payloads as sent (root) or received (others)
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
    step = chunk_elements(arr.nbytes, arr.itemsize)
    pieces = [(lo, min(arr.size, lo + step)) for lo in range(0, arr.size, step)]
    room = [codec.max_encoded((hi - lo) * arr.itemsize) for lo, hi in pieces]
    starts = np.concatenate([[0], np.cumsum(room)]).astype(int)
    area = np.empty(int(starts[-1]), np.uint8)  # each chunk's coded bytes, alive until sent
    counts = ChainCounts(raw_bytes=arr.nbytes)
    if q == 0:
        assert nxt is not None
        _send_from_root(tp, nxt, arr, codec, pieces, area, starts, exact_root, counts)
        tp.wait()
        return counts
    receiver = _Receiver(tp, order[q - 1], nxt, arr, codec, pieces, area, starts, per_hop, counts)
    receiver.start()
    tp.wait()
    receiver.decode_pending()  # a middle node's last chunk: decoded once it was forwarded
    counts.wire_bytes = sum(receiver.lengths)
    counts.raw_chunks = sum(receiver.raw)
    return counts


def _send_from_root(tp: Transport, nxt: int, arr: np.ndarray, codec: Codec, pieces: list[tuple[int, int]],
                    area: np.ndarray, starts: np.ndarray, exact_root: bool, counts: ChainCounts) -> None:
    raw_bytes = arr.reshape(-1).view(np.uint8)
    for k, (lo, hi) in enumerate(pieces):
        piece = arr[lo:hi]
        slot = area[starts[k]:starts[k + 1]]
        began = time.perf_counter()
        n = codec.encode(piece, slot)
        counts.codec_seconds += time.perf_counter() - began
        raw = n >= piece.nbytes
        counts.raw_chunks += raw
        counts.wire_bytes += piece.nbytes if raw else n
        payload = raw_bytes[lo * arr.itemsize:hi * arr.itemsize] if raw else slot[:n]
        tp.post_send(nxt, memoryview(FRAME.pack(codec.wire_id, RAW if raw else 0, len(payload))))
        tp.post_send(nxt, memoryview(payload))
        if codec.lossy and not raw and not exact_root:
            codec.round_in_place(piece)  # (the coded bytes are sent, not the piece: free to change)


class _Receiver:
    """One non-root node: the chunks' frames and payloads in order, forwarded on, decoded one late."""

    def __init__(self, tp: Transport, prv: int, nxt: int | None, arr: np.ndarray, codec: Codec,
                 pieces: list[tuple[int, int]], area: np.ndarray, starts: np.ndarray, per_hop: bool,
                 counts: ChainCounts) -> None:
        self.tp, self.prv, self.nxt, self.arr, self.codec, self.per_hop = tp, prv, nxt, arr, codec, per_hop
        self.counts = counts
        self.pieces, self.area, self.starts = pieces, area, starts
        self.frames = [bytearray(FRAME.size) for _ in pieces]
        self.lengths = [0] * len(pieces)
        self.raw = [False] * len(pieces)
        self.pending: int | None = None  # the chunk received and not yet decoded

    def start(self) -> None:
        self._expect_frame(0)

    def _expect_frame(self, k: int) -> None:
        self.tp.post_recv(self.prv, memoryview(self.frames[k]), self._on_frame(k))

    def _on_frame(self, k: int) -> Done:
        def done() -> None:
            self.decode_pending()  # chunk k - 1 went on to the next node in the transport's last turn
            wire_id, flags, length = FRAME.unpack(self.frames[k])
            lo, hi = self.pieces[k]
            raw_size = (hi - lo) * self.arr.itemsize
            if wire_id != self.codec.wire_id:
                self._corrupt(k, f"its frame names codec wire id {wire_id}, this node expects "
                                 f"{self.codec.wire_id} ({self.codec.name}): do the nodes agree on the codec?")
            if flags & ~RAW or (flags & RAW and length != raw_size) or length > self.starts[k + 1] - self.starts[k]:
                self._corrupt(k, f"its frame says {length} bytes (flags {flags:#x}) for a chunk of {raw_size} bytes")
            self.lengths[k], self.raw[k] = length, bool(flags & RAW)
            slot = self.area[self.starts[k]:self.starts[k] + length]
            self.tp.post_recv(self.prv, memoryview(slot), self._on_payload(k))
        return done

    def _on_payload(self, k: int) -> Done:
        def done() -> None:
            if self.per_hop and self.nxt is not None and not self.raw[k]:
                self.pending = k
                self.decode_pending()  # the baseline: decode here, code again, then forward
                lo, hi = self.pieces[k]
                slot = self.area[self.starts[k]:self.starts[k + 1]]
                began = time.perf_counter()
                self.lengths[k] = self.codec.encode(self.arr[lo:hi], slot)
                self.counts.codec_seconds += time.perf_counter() - began
                self.frames[k][:] = FRAME.pack(self.codec.wire_id, 0, self.lengths[k])
                self.tp.post_send(self.nxt, memoryview(self.frames[k]))
                self.tp.post_send(self.nxt, memoryview(slot[:self.lengths[k]]))
                if k + 1 < len(self.pieces):
                    self._expect_frame(k + 1)
                return
            if self.nxt is not None:
                self.tp.post_send(self.nxt, memoryview(self.frames[k]))
                self.tp.post_send(self.nxt, memoryview(self.area[self.starts[k]:self.starts[k] + self.lengths[k]]))
            self.pending = k
            if k + 1 < len(self.pieces):
                self._expect_frame(k + 1)
            elif self.nxt is None:
                self.decode_pending()  # the chain's end: nothing to forward first
        return done

    def decode_pending(self) -> None:
        """Decode the chunk received last, if it is not decoded yet."""
        k, self.pending = self.pending, None
        if k is None:
            return
        lo, hi = self.pieces[k]
        payload = self.area[self.starts[k]:self.starts[k] + self.lengths[k]]
        if self.raw[k]:
            self.arr.reshape(-1).view(np.uint8)[lo * self.arr.itemsize:hi * self.arr.itemsize] = payload
            return
        began = time.perf_counter()
        try:
            self.codec.decode(payload, self.arr[lo:hi])
        except CodecError as exc:
            self._corrupt(k, f"it does not decode: {exc}")
        self.counts.codec_seconds += time.perf_counter() - began

    def _corrupt(self, k: int, why: str) -> None:
        raise TransportError(self.prv, "internal", f"compressed broadcast: chunk {k} of {len(self.pieces)} from "
                                                   f"node {self.prv} is corrupt: {why}")
