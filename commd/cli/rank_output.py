"""Worker output with each line prefixed by its rank, as torchrun's ``--tee`` shows it.

``commd launch`` gives every worker pipes for stdout and stderr; one thread
per pipe copies whole lines to the launcher's own stream, prefixed with
``[rankN]:`` and written under one lock, so lines of different ranks never
interleave mid-line and each rank's lines keep their order.  A line the worker
prefixed itself (torch prefixes a distributed worker's traceback the same way) is
not prefixed twice.
"""

from __future__ import annotations

import threading
from typing import BinaryIO, TextIO

#: How long the launcher waits, after the workers exit, for their pipes to drain.  A
#: worker's own child can hold a pipe open forever; its output is then left behind.
DRAIN_TIMEOUT_S = 5.0

_write_lock = threading.Lock()


def prefix(rank: int) -> bytes:
    return f"[rank{rank}]:".encode()


class RankOutput:
    """Copies one worker pipe to ``sink`` line by line, each line prefixed with the rank."""

    def __init__(self, rank: int, pipe: BinaryIO, sink: TextIO) -> None:
        self._prefix = prefix(rank)
        self._pipe = pipe
        self._sink = sink
        #: the last line the worker wrote that was not blank (its exception, when it raised one)
        self.last_line = ""
        self._thread = threading.Thread(target=self._pump, name=f"commd-launch-out-{rank}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for line in iter(self._pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"  # the worker's last line had no newline: keep ours separate
                text = line.removeprefix(self._prefix).strip()
                if text:
                    self.last_line = text.decode(errors="replace")
                with _write_lock:
                    try:
                        self._write(line if line.startswith(self._prefix) else self._prefix + line)
                    except (OSError, ValueError):  # our own stream is gone (closed pipe): keep draining
                        pass
        finally:
            self._pipe.close()

    def _write(self, data: bytes) -> None:
        """Bytes as they came where the sink has a byte layer; else decoded (a captured stream)."""
        buffer = getattr(self._sink, "buffer", None)
        self._sink.flush()
        if buffer is not None:
            buffer.write(data)
            buffer.flush()
        else:
            self._sink.write(data.decode(errors="replace"))
            self._sink.flush()

    def join(self, timeout: float) -> bool:
        """Wait for the pipe to reach its end; False if it did not within ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
