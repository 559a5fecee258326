"""Sleeping and waking on a word of shared memory between processes (Linux futex), and a fence.

Exchange rings (``protocol/fastring.py``) are read and written by the ranks of a group
and, for groups that span nodes, by their daemon: both sides sleep on a peer's 32-bit
"bell" word and wake its sleepers after bumping it.  x86-64 Linux only: the rings rely
on its total store order, which ``available()`` checks together with the syscall.
"""

from __future__ import annotations

import ctypes
import platform

_FUTEX_SYSCALL = {"x86_64": 202}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall


def available() -> bool:
    """Whether this machine has both the futex syscall and a total-store-order CPU (x86-64)."""
    return platform.machine() in _FUTEX_SYSCALL


def futex_wait(address: ctypes.c_void_p, expected: int, timeout_s: float) -> None:
    """Sleep while the u32 at ``address`` equals ``expected`` (or until woken / ``timeout_s``)."""
    spec = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _syscall(_FUTEX_SYSCALL["x86_64"], address, _FUTEX_WAIT, ctypes.c_uint32(expected), ctypes.byref(spec), None, 0)


def futex_wake(address: ctypes.c_void_p) -> None:
    """Wake every thread (of any process) asleep on the u32 at ``address``."""
    _syscall(_FUTEX_SYSCALL["x86_64"], address, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


class Fence:
    """A full memory barrier (a locked instruction: an uncontended spin lock taken and released).

    x86 may let a load overtake an earlier store; the sleep/wake handshake (a waiter
    announces it sleeps, then reads the bell; a poster bumps the bell, then reads who
    sleeps) needs each side's store seen before its load, or both could miss the other.
    One per thread-safe user (its caller's lock keeps the word uncontended).
    """

    def __init__(self) -> None:
        self._word = ctypes.c_int(0)
        self._ref = ctypes.byref(self._word)
        if _libc.pthread_spin_init(self._ref, 0) != 0:
            raise OSError("pthread_spin_init failed")
        self._lock, self._unlock = _libc.pthread_spin_trylock, _libc.pthread_spin_unlock

    def __call__(self) -> None:
        if self._lock(self._ref) == 0:  # only this fence's locked caller uses the word: always free
            self._unlock(self._ref)
