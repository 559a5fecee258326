"""Async handles for submitted ops: wait with a timeout, poll, or use a torch Future.

A handle is on the latency-critical path of every op, so it is kept lean:
no lock or event of its own unless a second thread actually blocks on it
(one lock shared by all handles guards that rare hand-over).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from commd.client.errors import CommdError, CommTimeoutError

_STATE_LOCK = threading.Lock()


class Handle:
    """Completion of one op; completed by whichever thread receives its reply."""

    __slots__ = (
        "client", "op_id", "kind", "group", "deadline", "_done", "_event", "_error", "_finish",
        "_result", "_future", "_keep", "src", "__weakref__",
    )

    def __init__(
        self,
        client: Any,
        op_id: int,
        kind: str,
        group: str,
        deadline: float,
        finish: Callable[[dict[str, Any]], None] | None = None,
        result: Any = None,
        keep: Any = None,
    ) -> None:
        self.client = client  # pumps replies while we wait (see Client.wait_for)
        self.op_id = op_id
        self.kind = kind
        self.group = group
        self.deadline = deadline
        self._done = False
        self._event: threading.Event | None = None
        self._error: CommdError | None = None
        self._finish = finish
        self._result = result
        self._future: torch.futures.Future | None = None
        self._keep = keep  # staging buffers that must outlive the op
        self.src: int | None = None

    @property
    def description(self) -> str:
        return f"{self.kind} on group '{self.group}' (rank {self.client.rank})"

    # ---- completion (called by the Client that received the op's reply) ----
    def complete(self, reply: dict[str, Any]) -> None:
        """The op succeeded: copy the result out (``finish``) and wake every waiter.

        Done or failed, the handle lets go of its staging buffers (``keep``, and the copy-out that
        reads them): a completed handle can outlive its op by far (``PendingWrites`` holds hundreds),
        and each staging block it kept would make the arena grow by fresh segments."""
        finish, self._finish = self._finish, None
        try:
            if finish is not None:
                finish(reply)
        except Exception as exc:  # a failed copy-out is the op's failure
            self.fail(CommdError(f"{self.description}: copying the result out failed: {exc}"))
            return
        self.src = reply.get("src")
        self._keep = None
        self._settle(None)

    def fail(self, error: CommdError) -> None:
        """The op failed with ``error``: wake every waiter, who raises it."""
        self._finish = None
        self._keep = None
        self._settle(error)

    def _settle(self, error: CommdError | None) -> None:
        with _STATE_LOCK:
            if self._done:
                return
            self._error = error
            self._done = True
            event, future = self._event, self._future
        if event is not None:
            event.set()
        if future is not None:
            if error is None:
                future.set_result(self._result)
            else:
                future.set_exception(error)

    def block(self, timeout: float) -> None:
        """Sleep until completed by another thread, at most ``timeout`` seconds."""
        with _STATE_LOCK:
            if self._done:
                return
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        event.wait(timeout)

    # ---- user side ----------------------------------------------------
    def is_completed(self) -> bool:
        return self._done

    def exception(self) -> CommdError | None:
        return self._error if self._done else None

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; raise the op's error, or CommTimeoutError after ``timeout`` s."""
        if not self._done:
            self.client.wait_for(self, None if timeout is None else max(0.0, timeout))
            if not self._done:
                raise CommTimeoutError(f"{self.description} not completed after {timeout:.3f}s")
        if self._error is not None:
            raise self._error
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with the op's result (or its error)."""
        self.client.start_receiver()
        with _STATE_LOCK:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._done:
                    if self._error is not None:
                        self._future.set_exception(self._error)
                    else:
                        self._future.set_result(self._result)
            return self._future
