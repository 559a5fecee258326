"""Async handles for submitted ops: wait with a timeout, poll, or use a torch Future."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from commd.client.errors import CommdError, CommTimeoutError


class Handle:
    """Completion of one op.  Thread-safe; completed by the client's receiver thread."""

    __slots__ = (
        "client", "op_id", "description", "deadline", "_event", "_error", "_finish", "_result",
        "_future", "_lock", "_keep", "src",
    )

    def __init__(
        self,
        client: Any,
        op_id: int,
        description: str,
        deadline: float,
        finish: Callable[[dict[str, Any]], None] | None = None,
        result: Any = None,
        keep: Any = None,
    ) -> None:
        self.client = client  # pumps replies while we wait (see Client.wait_for)
        self.op_id = op_id
        self.description = description
        self.deadline = deadline
        self._event = threading.Event()
        self._error: CommdError | None = None
        self._finish = finish
        self._result = result
        self._future: torch.futures.Future | None = None
        self._lock = threading.Lock()
        self._keep = keep  # staging buffers that must outlive the op
        self.src: int | None = None

    # ---- completion (receiver thread) --------------------------------
    def _complete(self, reply: dict[str, Any]) -> None:
        try:
            if self._finish is not None:
                self._finish(reply)
        except Exception as exc:  # a failed copy-out is the op's failure
            self._fail(CommdError(f"{self.description}: copying the result out failed: {exc}"))
            return
        self.src = reply.get("src")
        self._keep = None
        with self._lock:
            self._event.set()
            future = self._future
        if future is not None:
            future.set_result(self._result)

    def _fail(self, error: CommdError) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._error = error
            self._keep = None
            self._event.set()
            future = self._future
        if future is not None:
            future.set_exception(error)

    # ---- user side ----------------------------------------------------
    def is_completed(self) -> bool:
        return self._event.is_set()

    def exception(self) -> CommdError | None:
        return self._error if self._event.is_set() else None

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; raise the op's error, or CommTimeoutError after ``timeout`` s."""
        if not self._event.is_set():
            self.client.wait_for(self, None if timeout is None else max(0.0, timeout))
            if not self._event.is_set():
                raise CommTimeoutError(f"{self.description} not completed after {timeout:.3f}s")
        if self._error is not None:
            raise self._error
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with the op's result (or its error)."""
        self.client.start_receiver()
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._event.is_set():
                    if self._error is not None:
                        self._future.set_exception(self._error)
                    else:
                        self._future.set_result(self._result)
            return self._future

    def remaining(self) -> float:
        return self.deadline - time.monotonic()
