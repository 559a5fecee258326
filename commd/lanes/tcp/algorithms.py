"""Collective algorithms over a :class:`~commd.lanes.base.Transport`: ring, chain, pairwise, dissemination.

Plain functions of (transport, nodes, this node's index, buffers): they post
transfers and wait, and know nothing of sockets, headers or deadlines, so any
transport that keeps the Transport contract runs them (the tcp lane's
:class:`~commd.lanes.tcp.transport.Exchange`, a test's in-memory fake).
``nodes`` is the sorted tuple of node ranks taking part and ``me`` this node's
index in it; every node calls the same function with matching arguments.
Reductions are bit-identical on every node (each chunk is reduced once, in
ring order, then distributed; or every node reduces all parts in node order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from commd.kernels.reduce import reduce_into
from commd.lanes.base import Done, Transport, TransportError, memory_view


def chunks(offset: int, length: int, chunk: int) -> list[tuple[int, int]]:
    """(offset, length) pieces of at most ``chunk`` bytes covering [offset, offset + length)."""
    return [(offset + s, min(chunk, length - s)) for s in range(0, length, chunk)]


def ring(tp: Transport, nxt: int, prv: int, me: int, view: memoryview, blocks: list[tuple[int, int]],
         steps: int, chunk: int, combine: Callable[[int, int], None] | None = None,
         scratch: memoryview | None = None, combine_steps: int = 0) -> None:
    """Pipelined ring over byte ``blocks`` of ``view`` (block i starts at ring position i).

    Step t sends block (me - t) to ``nxt`` and receives block (me - t - 1) from
    ``prv``, chunk by chunk; a received chunk is forwarded at step t + 1 as soon
    as it is complete, so the chunks stream round the ring.  For the first
    ``combine_steps`` steps a chunk lands in ``scratch`` and ``combine(offset,
    length)`` folds it into ``view`` before it goes on (reduce-scatter); later
    chunks land in place (all-gather).

    One scratch chunk is enough: receives from ``prv`` complete strictly in
    order and each is folded in by its completion callback before the next one
    reads a byte.  Receiving in place is safe too: a block comes back to a node
    only after the ring has consumed what the node sent from that place.
    """
    n = len(blocks)

    def received(t: int, off: int, length: int) -> Done:
        def done() -> None:
            if t < combine_steps:
                assert combine is not None
                combine(off, length)
            if t + 1 < steps:
                tp.post_send(nxt, view[off:off + length])
        return done

    for off, length in chunks(*blocks[me % n], chunk):
        tp.post_send(nxt, view[off:off + length])
    for t in range(steps):
        for off, length in chunks(*blocks[(me - t - 1) % n], chunk):
            target = scratch[:length] if t < combine_steps and scratch is not None else view[off:off + length]
            tp.post_recv(prv, target, received(t, off, length))
    tp.wait()


def ring_allreduce(tp: Transport, nodes: tuple[int, ...], me: int, flat: torch.Tensor, op: str) -> None:
    """Ring reduce-scatter then ring all-gather: each segment is reduced along the ring and the
    finished bytes go round from their owner, so every node ends with the same bits."""
    n, numel, es = len(nodes), flat.numel(), flat.element_size()
    base, rem = divmod(numel, n)
    blocks = [((k * base + min(k, rem)) * es, (base + (k < rem)) * es) for k in range(n)]
    chunk = max(es, tp.chunk_bytes // es * es)
    scratch = torch.empty(chunk // es, dtype=flat.dtype)

    def combine(off: int, length: int) -> None:
        out = flat[off // es:(off + length) // es]
        reduce_into(out, [out, scratch[:length // es]], op)

    ring(tp, nodes[(me + 1) % n], nodes[(me - 1) % n], me, memory_view(flat), blocks, 2 * (n - 1), chunk,
         combine, memory_view(scratch), n - 1)


def direct_allreduce(tp: Transport, nodes: tuple[int, ...], me: int, flat: torch.Tensor, op: str) -> None:
    """Everyone sends its whole buffer to everyone; each reduces all contributions in node order."""
    parts = [flat if i == me else torch.empty_like(flat) for i in range(len(nodes))]
    mine = memory_view(flat)
    for i, node in enumerate(nodes):
        if i != me:
            tp.post_send(node, mine)
            tp.post_recv(node, memory_view(parts[i]))
    tp.wait()
    if me > 1:  # reduce_into lets ``out`` alias only inputs[0] or inputs[1]
        parts[me] = flat.clone()
    reduce_into(flat, parts, op)


def direct_broadcast(tp: Transport, nodes: tuple[int, ...], me: int, root: int, view: memoryview) -> None:
    """Root sends to each node itself: one hop, for small messages."""
    if nodes[me] == root:
        for node in nodes:
            if node != root:
                tp.post_send(node, view)
    else:
        tp.post_recv(root, view)
    tp.wait()


def chain_broadcast(tp: Transport, nodes: tuple[int, ...], me: int, root: int, view: memoryview) -> None:
    """Chunked chain from ``root`` along ``nodes`` (rotated to start there): node k forwards chunk c
    while it receives chunk c + 1, so the time is ~size/bandwidth + (n - 2) chunks."""
    r = nodes.index(root)
    order = nodes[r:] + nodes[:r]
    q = order.index(nodes[me])
    nxt = order[q + 1] if q + 1 < len(order) else None
    pieces = chunks(0, len(view), tp.chunk_bytes)
    if q == 0:
        assert nxt is not None
        for off, length in pieces:
            tp.post_send(nxt, view[off:off + length])
    else:
        for off, length in pieces:
            piece = view[off:off + length]
            forward = (lambda p=piece: tp.post_send(nxt, p)) if nxt is not None else None
            tp.post_recv(order[q - 1], piece, forward)
    tp.wait()


def ring_allgatherv(tp: Transport, nodes: tuple[int, ...], me: int, inp: memoryview, out: memoryview,
                    sizes: list[int]) -> None:
    """Own block into place, then n - 1 pipelined ring steps forwarding the others' blocks."""
    n = len(nodes)
    offsets = [sum(sizes[:i]) for i in range(n)]
    out[offsets[me]:offsets[me] + sizes[me]] = inp
    blocks = list(zip(offsets, sizes, strict=True))
    ring(tp, nodes[(me + 1) % n], nodes[(me - 1) % n], me, out, blocks, n - 1, tp.chunk_bytes)


def pairwise_alltoallv(tp: Transport, nodes: tuple[int, ...], me: int, inp: memoryview, in_sizes: list[int],
                       out: memoryview, out_sizes: list[int]) -> None:
    """Own block copied; step s sends to (me + s) and receives from (me - s), one pair at a time."""
    n = len(nodes)
    in_off = [sum(in_sizes[:i]) for i in range(n)]
    out_off = [sum(out_sizes[:i]) for i in range(n)]
    out[out_off[me]:out_off[me] + out_sizes[me]] = inp[in_off[me]:in_off[me] + in_sizes[me]]
    for s in range(1, n):
        dst, src = (me + s) % n, (me - s) % n
        if in_sizes[dst]:
            tp.post_send(nodes[dst], inp[in_off[dst]:in_off[dst] + in_sizes[dst]])
        if out_sizes[src]:
            tp.post_recv(nodes[src], out[out_off[src]:out_off[src] + out_sizes[src]])
        tp.wait()


def send_to(tp: Transport, peer: int, view: memoryview) -> None:
    """One direct transfer to ``peer`` (the transport still moves it in pieces)."""
    tp.post_send(peer, view)
    tp.wait()


def recv_from(tp: Transport, peer: int, view: memoryview) -> None:
    """One direct transfer from ``peer`` into ``view``."""
    tp.post_recv(peer, view)
    tp.wait()


def dissemination_barrier(tp: Transport, nodes: tuple[int, ...], me: int) -> None:
    """ceil(log2 n) rounds of empty messages at distance 1, 2, 4 ...: after the last round every
    node has (transitively) heard from every other one."""
    n, empty, d = len(nodes), memoryview(b""), 1
    while d < n:
        tp.post_send(nodes[(me + d) % n], empty)
        tp.post_recv(nodes[(me - d) % n], memoryview(bytearray(0)))
        tp.wait()
        d *= 2


def dissemination_max(tp: Transport, nodes: tuple[int, ...], me: int, values: memoryview) -> None:
    """Element-wise maximum of every node's int64 ``values``, in place: the dissemination
    pattern (distance 1, 2, 4 ...), so ceil(log2 n) rounds and as many messages each way per
    node.  The maximum is exact and order-free, so every node ends with the same values."""
    n, d = len(nodes), 1
    mine = values.cast("B").cast("q")
    theirs = memoryview(bytearray(len(mine) * 8)).cast("q")
    while d < n:
        tp.post_send(nodes[(me + d) % n], mine.cast("B"))
        tp.post_recv(nodes[(me - d) % n], theirs.cast("B"))
        tp.wait()
        for i, value in enumerate(theirs):
            if value > mine[i]:
                mine[i] = value
        d *= 2


def dissemination_gather(tp: Transport, nodes: tuple[int, ...], me: int, block: bytes,
                         limit: int) -> list[bytes]:
    """Every node's ``block`` (of any length up to ``limit`` bytes), in the order of ``nodes``:
    Bruck's all-gather, ceil(log2 n) rounds at distance 1, 2, 4 ....  In each round a node sends
    the blocks it holds that the receiver lacks, their lengths first, so blocks of different
    lengths (a node that deviates from a schedule sends no payload) need no round more.  The
    receiver posts the blocks' read from the lengths' completion: both directions progress
    together, whatever the sizes.  An event loop may run the same rounds one at a time
    (``gather_send``, ``gather_recv``): the bytes on the wire are the same."""
    n, held = len(nodes), [bytes(block)]
    for count, to, frm in gather_rounds(n, me):
        gather_send(tp, nodes[to], held[:count])
        finish = gather_recv(tp, nodes[frm], count, limit)
        tp.wait()
        held.extend(finish())
    return in_node_order(held, me)


def in_node_order(held: list[bytes], me: int) -> list[bytes]:
    """The blocks a node holds after every round of ``dissemination_gather`` (its own first, then
    those of the nodes after it), in the order of ``nodes``."""
    n = len(held)
    return [held[(i - me) % n] for i in range(n)]


def gather_rounds(n: int, me: int) -> list[tuple[int, int, int]]:
    """The rounds of ``dissemination_gather`` on ``n`` nodes for index ``me``: (blocks sent, the
    index sent to, the index received from)."""
    rounds, d = [], 1
    while d < n:
        rounds.append((min(d, n - d), (me - d) % n, (me + d) % n))
        d *= 2
    return rounds


def gather_send(tp: Transport, to: int, blocks: list[bytes]) -> None:
    """Post one round's send of ``dissemination_gather``: the blocks' lengths, then the blocks."""
    lengths = memoryview(bytearray(8 * len(blocks))).cast("q")
    for i, block in enumerate(blocks):
        lengths[i] = len(block)
    tp.post_send(to, lengths.cast("B"))
    if any(lengths):
        tp.post_send(to, memoryview(b"".join(blocks)))


def gather_recv(tp: Transport, frm: int, count: int, limit: int) -> Callable[[], list[bytes]]:
    """Post one round's receive of ``dissemination_gather`` (``count`` blocks from ``frm``); after
    the wait, the returned function gives the blocks (TransportError: a length over ``limit``)."""
    lengths = memoryview(bytearray(8 * count)).cast("q")
    got: list[tuple[list[int], bytearray]] = []

    def lengths_in() -> None:
        sizes = list(lengths)
        if any(not 0 <= size <= limit for size in sizes):
            got.append((sizes, bytearray()))  # refused after the wait: the stream is out of step
            return
        body = bytearray(sum(sizes))
        got.append((sizes, body))
        if body:
            tp.post_recv(frm, memoryview(body))

    tp.post_recv(frm, lengths.cast("B"), lengths_in)

    def blocks() -> list[bytes]:
        sizes, body = got[0]
        if any(not 0 <= size <= limit for size in sizes):
            raise TransportError(frm, "protocol", f"node {frm} sent blocks of {sizes} bytes "
                                 f"(at most {limit} each) in an all-gather")
        out, offset = [], 0
        for size in sizes:
            out.append(bytes(body[offset:offset + size]))
            offset += size
        return out

    return blocks
