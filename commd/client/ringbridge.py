"""A bridged ring's bridge line, played by the node's first rank of the group instead of its daemon.

Played by the daemon, a small all-reduce across nodes crosses two event loops per node: the
ranks' ``ringop`` wakes the daemon, which reduces the node's inputs, and its part travels the
fabric's control links (through node 0 for a group on more than 2 nodes) to the other nodes'
daemons.  Here the node's first rank of the group runs the same line (``memory/ringbridge.py``)
on a thread of its own, with a direct TCP connection to the first rank of every other node of
the group: no daemon, no uvloop turn, no msgpack envelope of the control plane, and no relay.

Each connection is opened once, when the group is made (``form_mesh``): the lower node
listens, the higher connects and proves it holds the group's token (an HMAC of the fabric's
secret that every node's daemon derives, handed out with the ring) by answering a challenge.
Frames are a 4-byte length, the 4-byte length of a msgpack map, the map, and raw bytes: a
part's contribution, which travels beside the map rather than in it (no copy into msgpack's
buffer on the way out).  Each is validated on receipt: a ``RingPart``
(``protocol/fabric.py``), which must come from the node its connection was opened for, or
from 4 nodes on a round of the gather.  With fewer than 4 nodes a bridge sends its part to
every other node; from 4 on the parts travel Bruck's dissemination gather, ceil(log2 N)
rounds in which each bridge sends what it holds to the node 2**r places after it
(``gather_sent``), so a node handles 2 log2 N messages per op instead of 2 (N - 1).  A
failure still goes to every node at once.

The connections never block a sender: what a socket does not take at once (a large op's part)
waits in the peer's outbox, and the thread sends it as room comes.  Two bridges that sent each
other a large part at once would otherwise each wait for the other to read.

The thread sleeps in ``select`` on the connections and a datagram socket (``notice_address``):
the local ranks' ``k`` (every local rank published op k) and ``left`` notices, and the daemon's
``fail`` (the fabric saw a rank or node of the group die) arrive there, each checked against
the sender's pid (``SO_PASSCRED``).  Between ops it checks, every ``CHECK_S``, that the local
ranks and the daemon are alive.  A closed connection is the death of that node's bridge: the
op fails on every rank with ``peer_died``, as a dead node does on the daemon's path.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from commd.client.errors import CommdError
from commd.memory.arena import Segment
from commd.memory.ringbridge import (
    MAX_NOTICE_BYTES,
    RingBridge,
    host_notice,
    left_message,
    notice_address,
    read_notice,
    spanning_placement,
)
from commd.protocol import fabric as wire
from commd.protocol import fastring as fr
from commd.protocol import schema as s
from commd.runtime import pid_alive

log = logging.getLogger("commd.ring")

#: How often an idle bridge checks that its local ranks and its daemon are alive.
CHECK_S = 0.1
_LENGTH = struct.Struct("<I")
_FRAME = struct.Struct("<II")  # a frame's length (after these 4 bytes), its map's length
_CHALLENGE_BYTES = 16
_ACCEPTED = b"\x01"


def _proof(token: str, challenge: bytes, group: str, node: int) -> str:
    return hmac.new(token.encode(), challenge + f"/{group}/{node}".encode(), hashlib.sha256).hexdigest()


#: From this many nodes on, the parts travel in log2 N rounds (``gather_rounds``) instead of one
#: send to every other node: fewer messages per node, a longer chain.
GATHER_FROM_NODES = 4


def gather_rounds(nodes: int) -> int:
    """Rounds of the dissemination gather of ``nodes`` parts (Bruck's), 0: each part sent to every node."""
    return (nodes - 1).bit_length() if nodes >= GATHER_FROM_NODES else 0


def gather_sent(nodes: int, position: int, round_: int) -> list[int]:
    """The node positions whose parts the node at ``position`` sends in ``round_``, to the node
    2**round_ positions after it: the block it holds (itself and the 2**round_ - 1 before it),
    cut in the last round to what the receiver lacks."""
    step = 1 << round_
    return [(position - t) % nodes for t in range(min(step, nodes - step))]


def listen(ip: str) -> socket.socket:
    """The listener the other nodes' first ranks connect to (published through the group's store)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((ip, 0))
    listener.listen(64)
    return listener


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


def form_mesh(group: str, node: int, listener: socket.socket, endpoints: dict[int, tuple[str, int]],
              token: str, timeout: float) -> dict[int, socket.socket]:
    """A connection to each other node's first rank: lower nodes are dialled, higher ones accepted.
    Raises TransportError naming the node that could not be reached or failed the challenge."""
    deadline = time.monotonic() + timeout
    peers: dict[int, socket.socket] = {}
    try:
        for peer in sorted(p for p in endpoints if p < node):
            sock = socket.create_connection(endpoints[peer], timeout=max(0.1, deadline - time.monotonic()))
            challenge = _recv_exact(sock, _CHALLENGE_BYTES)
            hello = s.encode({"t": "bridge", "g": group, "n": node, "mac": _proof(token, challenge, group, node)})
            sock.sendall(_LENGTH.pack(len(hello)) + hello)
            peers[peer] = sock
            if _recv_exact(sock, 1) != _ACCEPTED:
                raise ConnectionError(f"node {peer}'s bridge refused this node's proof")
        awaited = {p for p in endpoints if p > node}
        while awaited:
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                raise CommdError(f"group {group!r}: the first ranks of nodes {sorted(awaited)} never connected "
                                     f"to this node's bridge within {timeout:.0f} s") from None
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            challenge = secrets.token_bytes(_CHALLENGE_BYTES)
            try:
                sock.sendall(challenge)
                (length,) = _LENGTH.unpack(_recv_exact(sock, 4))
                if length > 4096:
                    raise s.ProtocolError(f"a hello of {length} bytes")
                hello = s.decode(_recv_exact(sock, length))
                peer = s.int_field(hello, "n", 0)
                ok = (s.field(hello, "g", str) == group and peer in awaited
                      and hmac.compare_digest(s.field(hello, "mac", str), _proof(token, challenge, group, peer)))
            except (OSError, ConnectionError, s.ProtocolError) as exc:
                log.warning("group %s: dropped a bridge connection that failed its hello: %s", group, exc)
                sock.close()
                continue
            if not ok:
                log.warning("group %s: dropped a bridge connection with a wrong group, node or proof", group)
                sock.close()
                continue
            sock.sendall(_ACCEPTED)
            peers[peer] = sock
            awaited.discard(peer)
    except BaseException as exc:
        for sock in peers.values():
            sock.close()
        if isinstance(exc, OSError):  # (ConnectionError and TimeoutError are OSErrors)
            raise CommdError(f"group {group!r}: could not connect the nodes' bridges: {exc}") from None
        raise
    finally:
        listener.close()
    for sock in peers.values():
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return peers


class _Inbox:
    """What a peer sent and this bridge has not handled yet: a buffer read into in place."""

    INITIAL_BYTES = 256 << 10

    def __init__(self) -> None:
        self.data = bytearray(self.INITIAL_BYTES)
        self.filled = 0

    def keep_from(self, start: int, frame_bytes: int) -> None:
        """Drop the handled bytes before ``start``; make room for a frame of ``frame_bytes`` (with
        its length) and for the next read."""
        if start:
            self.data[: self.filled - start] = self.data[start: self.filled]
            self.filled -= start
        room = max(frame_bytes, self.filled) + (64 << 10)
        if room > len(self.data):
            self.data.extend(bytes(room - len(self.data)))


class BridgeHost:
    """The bridge line of one group's bridged ring on this node, run by this rank on a thread."""

    def __init__(self, group: str, region: Segment, ranks: list[int], node_of: list[int], node: int,
                 peers: dict[int, socket.socket], daemon_pid: int,
                 on_failed: Callable[[int, str, str], Any] | None = None) -> None:
        self.group = group
        self.node = node
        self.daemon_pid = daemon_pid
        self.peers = peers
        self.by_socket = {sock.fileno(): peer for peer, sock in peers.items()}
        self.inboxes = {peer: _Inbox() for peer in peers}
        self.on_failed = on_failed
        placement = spanning_placement(group, ranks, node_of, node)
        self.global_ranks = ranks
        self.bridge = RingBridge(group, region, placement, node, self._send, self._failed)
        #: the nodes in gather order, this node's place, and the gather's rounds (0: none)
        self.order = list(placement.nodes)
        self.position = self.order.index(node)
        self.rounds = gather_rounds(len(self.order))
        #: per op in flight: the parts this node holds, by node, and the rounds it received
        self.held: dict[int, dict[int, wire.RingPart]] = {}
        self.received: dict[int, set[int]] = {}
        self.sent: dict[int, int] = {}  # per op: the rounds sent
        self.max_frame = len(self.order) * (self.bridge.max_bytes + 4096)
        #: per peer: frame bytes not sent yet (a large part; the socket's buffer was full)
        self.outbox: dict[int, deque[memoryview]] = {peer: deque() for peer in peers}
        #: wakes the thread to watch a peer's socket for room (an outbox filled on the rank's thread)
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.notices = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notices.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.notices.bind(notice_address(daemon_pid, group))
        self.notices.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.notices, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        for sock in peers.values():
            # never blocked in a send: two bridges sending each other a large part at once would
            # each wait for the other to read
            sock.setblocking(False)
            self.selector.register(sock, selectors.EVENT_READ)
        self.watching: set[int] = set()  # the peers whose sockets are watched for room
        self.closing = False
        #: the bridge's state is touched by its thread and, for an op this process published last,
        #: by the process's own thread (``all_posted_here``: no notice, no wake-up of the bridge's thread)
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"commd-bridge-{group}"[:15], daemon=True)
        # A forked child (a DataLoader worker) must not keep the connections open: the other nodes
        # see this bridge gone by its connections closing when this process dies.
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (host := me()) is not None and host.forget())

    def start(self) -> None:
        self.thread.start()

    def all_posted_here(self, seq: int) -> None:
        """This process saw every local rank publish op ``seq``: reduce and send the node's part now."""
        with self.lock:
            self.bridge.local_ready()

    # ---- the bridge's callbacks --------------------------------------------------------
    def _send(self, part: wire.RingPart) -> None:
        """The bridge's part of an op (through the gather, when there is one) or its failure (to
        every other node at once)."""
        if self.rounds and part.error is None:
            self.held.setdefault(part.seq, {})[self.node] = part
            self._advance(part.seq)
            return
        fields = part.to_wire()
        raw = fields.pop("d", None)
        self._frame_to(part.to, s.encode(fields), raw, part.error is None)

    def _frame_to(self, peers: list[int], body: bytes, raw: Any = None, fail_on_error: bool = True) -> None:
        """Send a frame of msgpack ``body`` and ``raw`` bytes to each of ``peers``; what a socket
        does not take now waits in the peer's outbox (the thread sends it as room comes, in order)."""
        data = memoryview(b"" if raw is None else raw).cast("B")
        frame = [memoryview(_FRAME.pack(4 + len(body) + len(data), len(body))), memoryview(body), data]
        for peer in peers:
            sock = self.peers.get(peer)
            if sock is None:
                continue
            queue = self.outbox[peer]
            sent = 0
            if not queue:
                try:
                    sent = sock.sendmsg(frame)
                except BlockingIOError:
                    pass
                except OSError as exc:
                    if fail_on_error:
                        self.bridge.fail("peer_died", self._lost(peer, exc))
                    return
            for piece in frame:  # (what went out is skipped)
                if sent < len(piece):
                    queue.append(piece[sent:])
                sent = max(0, sent - len(piece))
            if queue and threading.current_thread() is not self.thread:
                try:
                    self.wake_w.send(b"w")
                except BlockingIOError:
                    pass  # (it is woken already)

    def _flush(self, peer: int) -> None:
        """Send what ``peer``'s outbox holds, as far as its socket takes it."""
        queue, sock = self.outbox[peer], self.peers[peer]
        while queue:
            try:
                sent = sock.sendmsg(list(queue)[:64])
            except BlockingIOError:
                return
            except OSError as exc:
                queue.clear()
                self.bridge.fail("peer_died", self._lost(peer, exc))
                return
            while sent and queue:
                if sent >= len(queue[0]):
                    sent -= len(queue.popleft())
                else:
                    queue[0], sent = queue[0][sent:], 0

    def _watch_for_room(self) -> None:
        """Watch exactly the sockets with something queued for room to send."""
        for peer, queue in self.outbox.items():
            if bool(queue) != (peer in self.watching) and not self.closing:
                try:
                    self.selector.modify(self.peers[peer],
                                         selectors.EVENT_READ | (selectors.EVENT_WRITE if queue else 0))
                except (KeyError, ValueError):
                    continue  # (its connection closed: no longer watched)
                (self.watching.add if queue else self.watching.discard)(peer)

    # ---- the gather ---------------------------------------------------------------------
    def _advance(self, seq: int) -> None:
        """Send op ``seq``'s next rounds once their parts are here: round r needs this node's part
        and round r - 1 received.  Done with the op once every round went out and came in."""
        held, got = self.held.get(seq), self.received.setdefault(seq, set())
        if held is None or self.node not in held:
            return
        count = self.sent.get(seq, 0)
        while count < self.rounds and (count == 0 or count - 1 in got):
            n = len(self.order)
            parts = [held[self.order[p]].to_wire() for p in gather_sent(n, self.position, count)]
            target = self.order[(self.position + (1 << count)) % n]
            self._frame_to([target], s.encode({"t": "gather", "g": self.group, "s": seq, "r": count, "p": parts}))
            count += 1
        if count == self.rounds and len(got) == self.rounds:
            del self.held[seq], self.received[seq]
            self.sent.pop(seq, None)
        else:
            self.sent[seq] = count

    def _on_gather(self, peer: int, msg: dict[str, Any]) -> None:
        """Round r of an op's gather, from the node 2**r places before this one: exactly the parts
        that node holds for the round, each fed to the bridge."""
        n = len(self.order)
        seq, round_ = s.int_field(msg, "s", 1), s.int_field(msg, "r", 0, self.rounds - 1)
        sender = (self.position - (1 << round_)) % n
        if self.order[sender] != peer:
            raise s.ProtocolError(f"gather round {round_} comes from node {self.order[sender]}, not node {peer}")
        items = s.field(msg, "p", list)
        parts = [wire.RingPart.from_wire(item) if isinstance(item, dict) else None for item in items]
        want = [self.order[p] for p in gather_sent(n, sender, round_)]
        if any(p is None or p.seq != seq or p.group != self.group or p.error is not None for p in parts) or [
                p.node for p in parts if p is not None] != want:
            raise s.ProtocolError(f"gather round {round_} of op {seq} must carry the parts of nodes {want}")
        if seq < self.bridge.next_result:
            return  # (an op this node already failed or finished: nothing to do)
        got = self.received.setdefault(seq, set())
        if round_ in got:
            raise s.ProtocolError(f"gather round {round_} of op {seq} came twice")
        got.add(round_)
        held = self.held.setdefault(seq, {})
        for part in parts:
            assert part is not None
            held[part.node] = part
            self.bridge.on_part(part)
        self._advance(seq)

    def _failed(self, group: str, number: int, code: str, message: str) -> None:
        if self.on_failed is not None:
            try:
                self.on_failed(number, code, message)
            except CommdError as exc:  # the daemon is gone: the ranks' own checks see it
                log.warning("group %s: could not tell the daemon of a failed op: %s", group, exc)

    def _lost(self, peer: int, why: object) -> str:
        first = self.global_ranks[self.bridge.placement.members(peer)[0]]
        return (f"group {self.group!r}: rank {first} on node {peer}, which bridged that node's ranks of the group "
                f"to the others, is gone (it died or left: {why})")

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        next_check = time.monotonic() + CHECK_S
        try:
            while not self.closing:
                events = self.selector.select(CHECK_S)
                with self.lock:
                    for key, mask in events:
                        if key.fileobj is self.notices:
                            self._read_notices()
                        elif key.fileobj is self.wake_r:
                            try:
                                self.wake_r.recv(4096)
                            except BlockingIOError:
                                pass
                        else:
                            peer = self.by_socket[key.fileobj.fileno()]  # type: ignore[union-attr]
                            if mask & selectors.EVENT_WRITE:
                                self._flush(peer)
                            if mask & selectors.EVENT_READ:
                                self._read_peer(key.fileobj)  # type: ignore[arg-type]
                    self._watch_for_room()
                    now = time.monotonic()
                    if now >= next_check and not self.closing:
                        next_check = now + CHECK_S
                        self._check()
        except Exception as exc:  # noqa: BLE001 - the ranks must never wait on a dead thread
            log.exception("group %s: the exchange ring's bridge failed", self.group)
            with self.lock:
                self.bridge.fail("internal", f"group {self.group!r}: the exchange ring's bridge failed: {exc!r}")

    def _read_notices(self) -> None:
        while True:
            try:
                frame, ancillary, _, _ = self.notices.recvmsg(MAX_NOTICE_BYTES + 1,
                                                              socket.CMSG_SPACE(struct.calcsize("3i")))
            except BlockingIOError:
                return
            pid = _sender_pid(ancillary)
            if pid not in self._allowed_pids():
                log.warning("group %s: dropped a bridge notice from pid %s, not a rank of the ring or its daemon",
                            self.group, pid)
                continue
            try:
                msg = read_notice(frame)
            except s.ProtocolError as exc:
                log.warning("group %s: dropped a bridge notice: %s", self.group, exc)
                continue
            if "k" in msg:
                self.bridge.local_ready()
            elif "left" in msg:
                code, why, number = str(msg["code"]), str(msg["left"]), msg.get("n")
                message = left_message(self.group, self._rank_of(pid), code, why)
                self.bridge.fail(code, message, index=0 if number is None else int(number) + 1)  # type: ignore[arg-type]
            else:
                self.bridge.fail("peer_died", str(msg["fail"]))

    def _read_peer(self, sock: socket.socket) -> None:
        """What ``sock``'s peer sent: read into the peer's inbox (no copy per read), then each whole
        frame decoded and handled in order."""
        peer = self.by_socket[sock.fileno()]
        inbox = self.inboxes[peer]
        try:
            with memoryview(inbox.data) as view:
                got = sock.recv_into(view[inbox.filled:])
            error = None
        except BlockingIOError:
            return  # (nothing after all)
        except OSError as exc:
            got, error = 0, exc
        if not got:
            self.selector.unregister(sock)
            self.outbox[peer].clear()
            self.watching.discard(peer)
            if not self.closing:
                self.bridge.fail("peer_died", self._lost(peer, error or "connection closed"), tell=False)
            return
        inbox.filled += got
        messages: list[dict[str, Any]] = []
        start, problem = 0, None
        with memoryview(inbox.data) as view:
            while inbox.filled - start >= 4:
                (length,) = _LENGTH.unpack_from(view, start)
                if not 4 <= length <= self.max_frame:
                    problem = f"a frame of {length} bytes (4 to {self.max_frame})"
                    break
                if inbox.filled - start < 4 + length:
                    break
                (body,) = _LENGTH.unpack_from(view, start + 4)
                try:
                    if body > length - 4:
                        raise s.ProtocolError(f"a frame of {length} bytes with a map of {body}")
                    msg = s.decode(view[start + 8: start + 8 + body], self.max_frame)
                    if length - 4 > body:  # a part's contribution, raw (copied: the inbox is reused)
                        if "d" in msg:
                            raise s.ProtocolError("a part with its contribution both in the map and raw")
                        msg["d"] = bytes(view[start + 8 + body: start + 4 + length])
                    messages.append(msg)
                except s.ProtocolError as exc:
                    problem = str(exc)
                    break
                start += 4 + length
        inbox.keep_from(start, 4 + length if problem is None and inbox.filled - start >= 4 else 0)
        for msg in messages:
            if not self._handle(peer, msg):
                return
        if problem is not None:
            self._bad(peer, problem)

    def _handle(self, peer: int, msg: dict[str, Any]) -> bool:
        """One frame from ``peer``: a round of the gather or a part; False once the ring failed on it."""
        try:
            if msg["t"] == "gather" and self.rounds:
                self._on_gather(peer, msg)
                return True
            part = wire.RingPart.from_wire(msg)
        except (s.ProtocolError, wire.FabricMessageError) as exc:
            self._bad(peer, str(exc))
            return False
        if part.node != peer or part.group != self.group:
            self._bad(peer, f"a part of group {part.group!r} from node {part.node}")
            return False
        self.bridge.on_part(part)
        return True

    def _bad(self, peer: int, what: str) -> None:
        self.bridge.fail("internal", f"group {self.group!r}: the exchange ring's bridge on node {peer} sent {what}")

    def _check(self) -> None:
        """Local ranks or the daemon dead: the op fails everywhere; a part waiting for a local rank's
        daemon op is a divergence (on the daemon this is checked when that op arrives)."""
        bridge = self.bridge
        if bridge.failed is not None:
            return
        for line in range(bridge.me):
            pid = self._line_pid(line)
            if pid and pid != os.getpid() and not pid_alive(pid):
                rank = self.global_ranks[bridge.local_ranks[line]]
                bridge.fail("peer_died", f"rank {rank} (pid {pid}) died")
                return
        if not pid_alive(self.daemon_pid):
            bridge.fail("peer_died", f"the commd daemon of node {self.node} (pid {self.daemon_pid}) died")
            return
        if bridge.parts:
            bridge.check_diverged()

    def _line_pid(self, line: int) -> int:
        """The pid a local rank wrote in its control line of the ring."""
        return int(self.bridge.words[(fr.CONTROL_OFFSET + line * fr.CONTROL_BYTES) // 8 + fr.PID])

    def _allowed_pids(self) -> set[int]:
        return {self._line_pid(line) for line in range(self.bridge.me)} | {self.daemon_pid, os.getpid()}

    def _rank_of(self, pid: int | None) -> int | str:
        for line in range(self.bridge.me):
            if self._line_pid(line) == pid:
                return self.global_ranks[self.bridge.local_ranks[line]]
        return "?"

    def forget(self) -> None:
        """In a forked child: close this process's copies of the sockets (no thread runs here)."""
        self.closing = True
        for sock in (*self.peers.values(), self.notices, self.wake_r, self.wake_w):
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop the thread and close the connections (the other nodes' bridges then see this one gone)."""
        self.closing = True
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(2 * CHECK_S + 1.0)
        for sock in self.peers.values():
            try:
                sock.close()
            except OSError:
                pass
        self.notices.close()
        self.wake_r.close()
        self.wake_w.close()
        self.selector.close()


def _sender_pid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= 12:
            return struct.unpack("3i", data[:12])[0]
    return None


class NoticeSender:
    """A rank's side of its node's bridge host: ``k`` and ``left`` notices, one datagram each."""

    def __init__(self, daemon_pid: int, group: str) -> None:
        self.address = notice_address(daemon_pid, group)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.group = group

    def all_posted(self, seq: int) -> None:
        self._send(host_notice(k=seq))

    def left(self, code: str, why: str, number: int | None) -> None:
        self._send(host_notice(left=why[:1024], code=code, **({} if number is None else {"n": number})))

    def _send(self, notice: bytes) -> None:
        try:
            self.sock.sendto(notice, self.address)
        except OSError as exc:
            raise CommdError(f"group {self.group!r}: the node's exchange-ring bridge is gone ({exc})") from None

    def close(self) -> None:
        self.sock.close()
