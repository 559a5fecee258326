"""commd's collectives in ``torch.profiler``: one ``record_function`` range per op submission; and in
a recorded trace (``record.py``, ``COMMD_RECORD``): one entry per op.

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

from commd.torch_backend import record

PREFIX = "commd:"

F = TypeVar("F", bound=Callable[..., Any])


def profiled(name: str) -> Callable[[F], F]:
    """Decorate a ProcessGroup op method: its submission shows as ``commd:<name>`` in a profile."""
    title = PREFIX + name

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def run(group: Any, *args: Any, **kwargs: Any) -> Any:
            recorder = record.active
            if recorder is not None:
                return recorded(recorder, group, args, kwargs)
            if not torch.autograd._profiler_enabled():
                return method(group, *args, **kwargs)
            with record_function(title):
                return method(group, *args, **kwargs)

        def recorded(recorder: record.Recorder, group: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            mark = recorder.enter()  # (an op that raises was never submitted: nothing to record)
            if not torch.autograd._profiler_enabled():
                work = method(group, *args, **kwargs)
            else:
                with record_function(title):
                    work = method(group, *args, **kwargs)
            recorder.leave(name, group, args, kwargs, mark, work)
            return work

        return run  # type: ignore[return-value]

    return decorate
