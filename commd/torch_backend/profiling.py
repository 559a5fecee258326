"""commd's collectives in ``torch.profiler``: one ``record_function`` range per op submission.

Named as Gloo's are (``gloo:all_reduce`` → ``commd:all_reduce``), so a
profile reads the same whatever the backend.  A ``record_function`` costs
microseconds even with no profiler running, so the range is only opened while
one is (one flag test otherwise).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.profiler import record_function

PREFIX = "commd:"

F = TypeVar("F", bound=Callable[..., Any])


def profiled(name: str) -> Callable[[F], F]:
    """Decorate a ProcessGroup op method: its submission shows as ``commd:<name>`` in a profile."""
    title = PREFIX + name

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.autograd._profiler_enabled():
                return method(*args, **kwargs)
            with record_function(title):
                return method(*args, **kwargs)

        return run  # type: ignore[return-value]

    return decorate
