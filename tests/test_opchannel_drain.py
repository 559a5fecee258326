"""The op channel is read a turn's worth at a time (daemon/opchannel.py): a rank that submits as
fast as it is answered cannot keep the event loop from its timers and its other channels."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from commd.daemon.opchannel import DRAIN_TURN_MESSAGES, OpListener


def _one_turn(loop: asyncio.AbstractEventLoop) -> None:
    """One pass of the loop: poll once without waiting, run what is ready, stop."""
    loop.call_soon(loop.stop)
    loop.run_forever()


def test_a_flooded_channel_is_read_a_turn_at_a_time_and_every_message_arrives(tmp_path: Path) -> None:
    loop = asyncio.new_event_loop()
    got: list[bytes] = []
    listener = OpListener(tmp_path / "ops.sock", loop, lambda channel, frame, fds: got.append(frame),
                          lambda channel: None)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        client.connect(str(tmp_path / "ops.sock"))
        _one_turn(loop)  # accepted
        sent = [f"message {i}".encode() for i in range(3 * DRAIN_TURN_MESSAGES + 5)]
        for frame in sent:
            client.send(frame)
        timers: list[int] = []
        for turn in range(1, 10):
            loop.call_soon(timers.append, turn)  # what the loop's other work would run
            _one_turn(loop)
            assert len(got) <= turn * DRAIN_TURN_MESSAGES, (turn, len(got))
            if len(got) == len(sent):
                break
        assert got == sent
        assert timers == list(range(1, turn + 1))  # the other work ran between the turns
        assert turn == 4, turn  # 3 full turns and the rest
    finally:
        client.close()
        listener.close()
        loop.close()
