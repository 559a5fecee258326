"""The threads that run ready ops: one per key, program order per group, small ops inline.

Both the node's single-node ops (one key, ``LOCAL_KEY``) and the fabric member's
released multi-node ops (one key per lane, see ``worker_key``) run here, so the
rules live in one place:

* one thread per key runs its ops in the order they were submitted;
* an op waits for the previous op of its group to finish, whichever key ran it
  (program order, as on a CUDA stream);
* a small op (``INLINE_BYTES``) runs right on the event loop when its key is idle
  and its group's previous op is done: same order, two thread wake-ups saved;
* lanes that must never run at the same time on one device share one key
  (``worker_key``).

Completions of queued ops come back to the event loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

#: Ops at most this large may run inline on the event loop when their key is idle.
INLINE_BYTES = 64 * 1024

#: The key of the node's own single-node ops.
LOCAL_KEY = "local"

#: Lanes that share one device and must never run concurrently (NCCL's user guide:
#: NCCL and CUDA-aware MPI on the same GPU can deadlock).  Ops on these lanes that
#: touch a GPU go to one shared thread, so they run one at a time in global order.
EXCLUSIVE_GPU_LANES = frozenset({"nccl", "mpi"})

#: ``job(inline)``: runs the op (``inline``: on the event loop) and returns its result.
Job = Callable[[bool], Any]
#: ``done(result)``: called on the event loop with the job's result.
Done = Callable[[Any], None]


def worker_key(lane: str, on_gpu: bool) -> str:
    """The worker thread an inter-node op runs on: the exclusion rule in one place."""
    if on_gpu and lane in EXCLUSIVE_GPU_LANES:
        return "gpu-exclusive"
    return lane


class WorkerPool:
    """Worker threads keyed by name, started on first use, all completing on one event loop."""

    def __init__(self, after_queued: Callable[[], None] | None = None) -> None:
        #: Called on the loop after the ``done`` of every op that ran on a thread.
        self._after_queued = after_queued
        self.loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._busy: dict[str, int] = {}  # key -> ops handed to its thread and not yet done (loop only)
        self._group_tail: dict[str, threading.Event] = {}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def busy(self) -> int:
        """Ops queued or running on threads, over every key."""
        return sum(self._busy.values())

    def key_busy(self, key: str) -> bool:
        """True if an op is queued or running on ``key``'s thread."""
        return bool(self._busy.get(key))

    def group_done(self, group: str) -> bool:
        """True if every op submitted for ``group`` has finished."""
        tail = self._group_tail.get(group)
        return tail is None or tail.is_set()

    def submit(self, key: str, group: str | None, nbytes: int, job: Job, done: Done,
               may_inline: bool = True, inline_bytes: int = INLINE_BYTES) -> Callable[[], None] | None:
        """Queue ``job`` on ``key``'s thread, or return it (with ``done``) to be run now on the loop.

        ``group``: ops of one group run in submission order across keys (None: no ordering
        beyond the key's own).  ``may_inline``: the caller's own conditions for running
        inline (e.g. no GPU, no import to wait for); size (at most ``inline_bytes``) and
        idleness are checked here.
        """
        if group is not None:
            prev = self._group_tail.get(group)
            finished: threading.Event | None = threading.Event()
            self._group_tail[group] = finished
        else:
            prev = finished = None
        if may_inline and nbytes <= inline_bytes and not self._busy.get(key) and (prev is None or prev.is_set()):
            def run_now() -> None:
                result = job(True)
                if finished is not None:
                    finished.set()
                done(result)

            return run_now
        self._busy[key] = self._busy.get(key, 0) + 1

        def finish(result: Any) -> None:
            self._busy[key] -= 1
            done(result)
            if self._after_queued is not None:
                self._after_queued()

        self._queue(key).put((prev, finished, job, finish))
        return None

    def close(self, timeout: float) -> None:
        """Stop every thread after the ops already queued; wait up to ``timeout`` for each."""
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join(timeout=timeout)

    def _queue(self, key: str) -> queue.SimpleQueue:
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = queue.SimpleQueue()
            thread = threading.Thread(target=self._main, args=(q,), name=f"commd-worker-{key}", daemon=True)
            self._threads.append(thread)
            thread.start()
        return q

    def _main(self, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            prev, finished, job, finish = item
            if prev is not None:
                prev.wait()  # the group's previous op (earlier in program order) finishes first
            result = job(False)
            if finished is not None:
                finished.set()
            try:
                self.loop.call_soon_threadsafe(finish, result)
            except RuntimeError:  # loop already closed
                return
