"""Rate-limited logging: a misbehaving client must not be able to flood the daemon's log.

Every line goes through a *key* (e.g. the client and the error code).  Each key
may log ``burst`` lines per ``period_s``; further lines in that period are
counted, not written, and one "suppressed K similar messages" line follows when
the period ends (at the key's next message, or from ``flush``, which the
daemon's watchdog calls).  The number of keys tracked is bounded: the stalest
one is summarized and forgotten when the table is full.  So the log grows by at
most ``burst + 1`` lines per key per period, whatever a client sends.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

DEFAULT_BURST = 10
DEFAULT_PERIOD_S = 10.0
DEFAULT_MAX_KEYS = 1024


@dataclass
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0
    level: int = logging.WARNING
    label: str = ""


class RateLimitedLog:
    """``log(level, key, label, msg, *args)``: like ``Logger.log``, at most ``burst`` lines per key per period."""

    def __init__(
        self,
        logger: logging.Logger,
        burst: int = DEFAULT_BURST,
        period_s: float = DEFAULT_PERIOD_S,
        max_keys: int = DEFAULT_MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or period_s <= 0 or max_keys < 1:
            raise ValueError("burst and max_keys must be at least 1 and period_s positive")
        self.logger = logger
        self.burst = burst
        self.period_s = period_s
        self.max_keys = max_keys
        self.clock = clock
        self._windows: collections.OrderedDict[Hashable, _Window] = collections.OrderedDict()
        self.suppressed_total = 0

    def log(self, level: int, key: Hashable, label: str, msg: str, *args: Any, exc_info: bool = False) -> bool:
        """Log unless ``key`` used up its burst in this period; ``label`` names the key in the
        summary line ("protocol errors from client 3").  Returns whether the line was written."""
        now = self.clock()
        window = self._windows.get(key)
        if window is not None and now - window.start >= self.period_s:
            self._summarize(window, now)
            window = None
            del self._windows[key]
        if window is None:
            while len(self._windows) >= self.max_keys:
                _, oldest = self._windows.popitem(last=False)
                self._summarize(oldest, now)
            window = self._windows[key] = _Window(now, level=level, label=label)
        else:
            self._windows.move_to_end(key)
        if window.logged < self.burst:
            window.logged += 1
            self.logger.log(level, msg, *args, exc_info=exc_info)
            return True
        window.suppressed += 1
        window.level = max(window.level, level)
        self.suppressed_total += 1
        return False

    def flush(self) -> None:
        """Write the summary of every period that has ended (the watchdog calls this)."""
        now = self.clock()
        for key, window in list(self._windows.items()):
            if now - window.start >= self.period_s:
                self._summarize(window, now)
                del self._windows[key]

    def _summarize(self, window: _Window, now: float) -> None:
        if window.suppressed:
            self.logger.log(window.level, "suppressed %d similar messages (%s) in the last %.0fs",
                            window.suppressed, window.label, now - window.start)
