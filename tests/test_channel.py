"""The fabric's control channel framing (length-prefixed msgpack on a stream socket)."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from commd.fabric.channel import MAX_FRAME, ChannelClosed, Connection, frame
from commd.protocol import schema as s


def test_messages_survive_being_split_and_batched() -> None:
    a, b = socket.socketpair()
    reader = Connection(a)
    data = frame({"t": "x", "n": 1}) + frame({"t": "y", "blob": b"z" * 70_000})
    b.sendall(data[:3])
    assert reader.recv_blocking(time.monotonic() + 0.05) is None  # half a header: nothing yet
    b.sendall(data[3:])
    first = reader.recv_blocking(time.monotonic() + 5)
    second = reader.recv_blocking(time.monotonic() + 5)
    assert first["t"] == "x" and first["n"] == 1 and second["blob"] == b"z" * 70_000


def test_oversized_frame_and_garbage_close_the_channel() -> None:
    a, b = socket.socketpair()
    reader = Connection(a)
    b.sendall(struct.pack("!I", MAX_FRAME + 1))
    with pytest.raises(ChannelClosed, match="exceeds"):
        reader.recv_blocking(time.monotonic() + 5)
    a, b = socket.socketpair()
    reader = Connection(a)
    b.sendall(struct.pack("!I", 3) + b"\xc1\xc1\xc1")
    with pytest.raises(ChannelClosed, match="bad control message"):
        reader.recv_blocking(time.monotonic() + 5)
    a, b = socket.socketpair()
    reader = Connection(a)
    b.sendall(struct.pack("!I", 5) + s.encode({"t": "x"})[:2])
    b.close()
    with pytest.raises(ChannelClosed, match="closed"):
        reader.recv_blocking(time.monotonic() + 5)
