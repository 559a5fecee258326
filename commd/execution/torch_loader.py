"""The daemon's torch, imported on first need.

Importing torch costs about 2 s of CPU.  A single-node daemon must answer its
first client at once, and one that only runs small ops (NumPy kernels) or
answers ``commd status`` never needs torch at all.  Everything in the daemon
that runs torch kernels gets them through ``torch_module()`` or
``executor()``: torch is imported once, whichever thread asks first (the
event loop, a worker thread, or the warm-up thread started when the first
client connects), and the daemon's kernel thread count is applied before any
kernel runs.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType

from commd.observe.gcpauses import freeze_heap

log = logging.getLogger("commd.daemon")

_lock = threading.Lock()
_threads = 1
_warm_up_allowed = True
_torch: ModuleType | None = None
_warm_up: threading.Thread | None = None


def configure(threads: int, warm_up_allowed: bool = True) -> None:
    """The intra-op thread count torch gets when it is loaded (applied at once if it already is), and
    whether ``warm_up`` may load torch before an op needs it ($COMMD_TORCH_WARMUP)."""
    global _threads, _warm_up_allowed
    with _lock:
        _threads = threads
        _warm_up_allowed = warm_up_allowed
        if _torch is not None:
            _torch.set_num_threads(threads)


def torch_module() -> ModuleType:
    """torch, imported and configured on the first call (thread-safe)."""
    global _torch
    loaded = _torch
    if loaded is not None:
        return loaded
    with _lock:
        if _torch is None:
            import torch

            torch.set_num_threads(_threads)
            # torch's ~170,000 objects live as long as the daemon: out of the collector's full walks
            freeze_heap()
            _torch = torch
        return _torch


def loaded() -> bool:
    """Whether torch has been loaded here."""
    return _torch is not None


def executor() -> ModuleType:
    """``commd.execution.local`` (torch kernels for every op kind), loaded on first use."""
    torch_module()
    from commd.execution import local as module

    return module


def warm_up_later(delay_s: float) -> None:
    """``warm_up`` after ``delay_s`` seconds (or earlier, if something calls ``warm_up`` first).

    A daemon started ahead of its ranks (``commd launch``, a job prologue) loads torch while the
    ranks import theirs, instead of after they connect; the delay keeps the import (whose native
    library loads while holding the GIL) away from the daemon's first answers.
    """
    timer = threading.Timer(delay_s, warm_up)
    timer.daemon = True
    timer.start()


def warm_up() -> None:
    """Load the torch executor on a background thread, once, so that the first large op does not wait.

    A failure is logged here and raised again, with its reason, by the first op that needs torch.
    Nothing happens when warming up is switched off: torch then loads when an op first needs it.
    """
    global _warm_up
    with _lock:
        if _warm_up is not None or _torch is not None or not _warm_up_allowed:
            return
        _warm_up = threading.Thread(target=_load_quietly, name="commd-torch-warm-up", daemon=True)
        _warm_up.start()


def _load_quietly() -> None:
    try:
        executor()
    except Exception:
        log.exception("loading torch in the background failed; ops that need torch will fail")
