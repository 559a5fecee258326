"""A storage seen again is exported once and cached until it dies.

The one idea behind both zero-copy paths for tensors the user allocated:

- CUDA tensors (``cuda_ipc.py``): a storage's IPC handle is exported the first time an op uses
  it, under an export id that later ops name; the daemon (``commd/daemon/cuda.py``) opens it once
  and closes it when the client says the storage died.
- ordinary CPU tensors (here): the client moves the storage into a sealed memfd in place — the
  same kind of memory as an arena segment (``memory.arena.sealed_memfd``) —, swaps it under the
  user's storage (every view of it follows: DDP's gradient views into a bucket included), and
  registers that memfd with the daemon as a segment of kind ``registered``.  From then on an op
  names it as ``{seg, off, n}``: the daemon reduces in place, no copy in, no copy out.

When: moving costs one copy, but fresh shared memory (reserving and faulting its pages, the
daemon's mapping, the unregister when it dies) costs more than staging's two copies below about
64 MiB (``benchmarks/first_sighting.py``): a temporary, seen once, is staged.  So a storage is
registered at its second sighting — or at its first when other tensors view it
(``backs_other_tensors``: a flat buffer such as a DDP bucket, whose views are made when it is
built; DDP rebuilds its buckets after the first step, and the rebuilt ones are zero-copy from the
second step on) or when the op's tensor holds at least ``COMMD_REGISTER_FIRST_BYTES`` (64 MiB).

No stale mapping is ever used: an entry is keyed by the storage object itself (torch keeps one
Python object per storage, so a new storage at a recycled address is a different key), it is
checked against the storage's address and size on every lookup (a storage whose memory was
replaced is forgotten), and a finalizer notices the storage's death.  A forgotten registration is
unregistered on the op channel after the ops that used it (``due_unregisters``).

Bounds: the client keeps at most ``budget`` registered bytes and ``MAX_REGISTRATIONS`` storages
(least recently used ones are dropped first; a dropped storage is staged from then on, so nothing
thrashes); the daemon has its own cap (``COMMD_MAX_REGISTERED_BYTES``), and a refusal there makes
the client stage instead (logged once).

Only buffers of in-place ops (all-reduce, broadcast, reduce) get registered (any op may then name a
registered storage), and only storages
torch allocated itself (resizable, not shared, not pinned): a registered storage lives in a memfd
that cannot shrink — the daemon's guarantee against SIGBUS —, so torch refuses to resize it, and
FSDP resizes its all-gather buffers.  ``COMMD_REGISTER=0`` turns registration off.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from commd.memory.arena import SegmentError, sealed_memfd
from commd.protocol import schema as s
from commd.runtime import env_bytes, env_int

log = logging.getLogger("commd.client")

#: Registered storages one client keeps (the daemon's default COMMD_MAX_SEGMENTS is 1024, arena included).
MAX_REGISTRATIONS = 512
#: ``COMMD_REGISTER_FIRST_BYTES``'s default: from about this size, moving a temporary into fresh shared memory
#: costs no more than staging it (``benchmarks/first_sighting.py``: 16 MiB 1.06-1.26x staging's time, 32 MiB
#: 1.3x, 64 MiB 0.36-0.94x, on a loaded 2-core machine).
DEFAULT_FIRST_BYTES = 64 << 20
#: ``COMMD_REGISTER_FIRST_BYTES``'s largest value: no storage is registered at first sighting by size alone.
NEVER_BY_SIZE = 1 << 62
#: A storage the registry will not register (evicted, refused, or not torch's own memory).
NEVER = -1
#: ``Registration.last_use`` between a lookup and ``mark_used``: an op is being submitted with it.
IN_FLIGHT = -1


def storage_swap_supported() -> bool:
    """Whether this torch can move a storage's memory in place (``UntypedStorage._swap_data_ptr_``, torch 2.13)."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def registration_enabled() -> bool:
    """``COMMD_REGISTER`` (0 or 1, default 1), validated; off, said once, on a torch that cannot swap storages.

    Without the swap every registration would map a memfd in the daemon and then fail to move
    the storage into it: one wasted round trip per storage, and nothing registered.
    """
    if not env_int("COMMD_REGISTER", 1, 0, 1):
        return False
    if not storage_swap_supported():
        global _unsupported_said
        if not _unsupported_said:
            _unsupported_said = True
            log.warning("torch %s cannot move a tensor's storage into shared memory in place "
                        "(UntypedStorage._swap_data_ptr_, torch >= 2.13): ordinary tensors are copied "
                        "through the arena", torch.__version__)
        return False
    return True


_unsupported_said = False


def first_sighting_bytes() -> int:
    """``COMMD_REGISTER_FIRST_BYTES``: an in-place op's storage this large is registered at its first sighting.

    Below it, moving a temporary into fresh shared memory costs more than staging it (its pages
    reserved and faulted, the daemon's mapping, the unregister when it dies), so a storage seen
    once stays staged unless other tensors view it.
    """
    return env_bytes("COMMD_REGISTER_FIRST_BYTES", DEFAULT_FIRST_BYTES, 0, NEVER_BY_SIZE)


def default_budget() -> int:
    """``COMMD_MAX_REGISTERED_BYTES`` when set (the daemon's cap too), else half the machine's memory."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - Linux has both
        physical = 1 << 40
    return env_bytes("COMMD_MAX_REGISTERED_BYTES", physical // 2, 0, 1 << 50)


@dataclass
class Registration:
    seg_id: int
    address: int  # the storage's data pointer once moved into the memfd
    nbytes: int
    finalizer: weakref.finalize
    last_use: int = 0  # the id of the latest op that named it (0: none)


#: Passes a registered storage's memfd to the daemon: (seg_id, name, nbytes, fd); raises on refusal.
RegisterFd = Callable[[int, str, int, int], None]


class StorageRegistry:
    """Per-client cache: torch storage -> its registered segment (thread-safe)."""

    def __init__(self, prefix: str, register_fd: RegisterFd, budget: int, max_count: int = MAX_REGISTRATIONS,
                 first_bytes: int | None = None) -> None:
        self.prefix = prefix
        self.budget = budget
        self.max_count = max_count
        self.first_bytes = first_sighting_bytes() if first_bytes is None else first_bytes
        self._register_fd = register_fd
        self._ids = itertools.count(s.REGISTERED_SEG_BASE)
        self._lock = threading.Lock()
        self._seen: weakref.WeakKeyDictionary[torch.UntypedStorage, int] = weakref.WeakKeyDictionary()
        self._entries: weakref.WeakKeyDictionary[torch.UntypedStorage, Registration] = weakref.WeakKeyDictionary()
        self._lru: collections.OrderedDict[int, Registration] = collections.OrderedDict()
        self.registered_bytes = 0
        # Finalizers run wherever the garbage collector does (maybe inside lookup): they only queue.
        self._died: collections.deque[int] = collections.deque()
        self._retired: list[tuple[int, int]] = []  # (segment id, id of the last op that used it)
        self._refusal_logged = False
        self._daemon_full = False  # the daemon refused one: register only what fits without evicting

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, tensor: torch.Tensor, may_register: bool = True) -> tuple[int, int] | None:
        """(segment id, byte offset) of a contiguous CPU tensor's registered storage, or None: stage it.

        With ``may_register``, counts sightings: a storage's second sighting registers it.
        """
        storage = tensor.untyped_storage()
        with self._lock:
            self._apply_deaths()
            entry = self._entries.get(storage)
            if entry is not None:
                if entry.address == storage.data_ptr() and entry.nbytes == storage.nbytes():
                    self._lru.move_to_end(entry.seg_id)
                    entry.last_use = IN_FLIGHT
                    return entry.seg_id, tensor.data_ptr() - entry.address
                # its memory was replaced (resize, swap): forget the mapping, count afresh
                del self._entries[storage]
                self._retire(entry)
                self._seen[storage] = 1
                return None
            seen = self._seen.get(storage, 0)
            if seen == NEVER or not may_register:
                return None
            if seen == 0:
                if not _torch_owned(storage):
                    self._seen[storage] = NEVER
                    return None
                if not self._register_at_first_sighting(tensor, storage):
                    self._seen[storage] = 1
                    return None
            entry = self._register(storage)
            if entry is None:
                self._seen[storage] = NEVER
                return None
            entry.last_use = IN_FLIGHT
            return entry.seg_id, tensor.data_ptr() - entry.address

    def mark_used(self, seg_id: int, op_id: int) -> None:
        """Op ``op_id`` names ``seg_id`` (0: its submission failed): an unregister waits until it is answered."""
        with self._lock:
            entry = self._lru.get(seg_id)
            if entry is not None:
                entry.last_use = op_id
            # forgotten by another thread between the lookup and now: its unregister waits for this op
            self._retired = [(seg, op_id if seg == seg_id and last == IN_FLIGHT else last)
                             for seg, last in self._retired]

    def due_unregisters(self, pending: Callable[[int], bool]) -> list[int]:
        """Segments to unregister now: forgotten, and the last op that used them is no longer ``pending``."""
        with self._lock:
            self._apply_deaths()
            if not self._retired:
                return []
            keep = [(seg, last) for seg, last in self._retired if last == IN_FLIGHT or pending(last)]
            due = [seg for seg, last in self._retired if not (last == IN_FLIGHT or pending(last))]
            self._retired = keep
            return due

    # ---- internals (caller holds the lock) ----------------------------------
    def _register_at_first_sighting(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> bool:
        """A flat buffer that other tensors view, or a storage of at least ``first_bytes``.

        Either way the op uses at least half of the storage (moving it copies all of it).
        """
        nbytes = tensor.numel() * tensor.element_size()
        if 2 * nbytes < storage.nbytes():
            return False
        return nbytes >= self.first_bytes or backs_other_tensors(storage)

    def _register(self, storage: torch.UntypedStorage) -> Registration | None:
        nbytes = storage.nbytes()
        if nbytes > self.budget or (self._daemon_full and self.registered_bytes + nbytes > self.budget):
            return None
        while self._lru and (self.registered_bytes + nbytes > self.budget or len(self._lru) >= self.max_count):
            self._evict_oldest()
        seg_id = next(self._ids)
        if seg_id > s.MAX_SEGMENT_ID:  # pragma: no cover - two billion registrations
            return None
        name = f"{self.prefix}-g{seg_id - s.REGISTERED_SEG_BASE}"
        try:
            fd = sealed_memfd(name, nbytes, f"registered tensor storage {name!r}")
        except (SegmentError, OSError) as exc:
            self._refused(f"cannot create its shared memory: {exc}")
            return None
        try:
            try:
                self._register_fd(seg_id, name, nbytes, fd)
            except Exception as exc:  # the daemon's refusal (its cap), or it is gone: stage
                self._refused(str(exc))
                self.budget = min(self.budget, self.registered_bytes)  # ask no more than it took
                self._daemon_full = True
                return None
            try:
                # Mapped here, the mapping owned by the storage (unmapped when it dies); no descriptor kept.
                mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                moved = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()
                del mapping
                ctypes.memmove(moved.data_ptr(), storage.data_ptr(), nbytes)
                storage._swap_data_ptr_(moved)  # the user's storage now lives in the memfd
            except Exception as exc:
                self._retired.append((seg_id, 0))
                self._refused(f"cannot move it into shared memory: {exc}")
                return None
            del moved  # now holds the old memory: freed here
        finally:
            os.close(fd)
        address = storage.data_ptr()
        finalizer = weakref.finalize(storage, self._died.append, seg_id)
        entry = Registration(seg_id, address, nbytes, finalizer)
        self._entries[storage] = entry
        self._lru[seg_id] = entry
        self.registered_bytes += nbytes
        return entry

    def _evict_oldest(self) -> None:
        """Drop the least recently used registration; its storage is staged from now on."""
        seg_id, entry = next(iter(self._lru.items()))
        owner = entry.finalizer.peek()
        self._retire(entry)
        if owner is not None:
            storage = owner[0]  # peek() returns (obj, func, args, kwargs)
            self._entries.pop(storage, None)
            self._seen[storage] = NEVER

    def _retire(self, entry: Registration) -> None:
        entry.finalizer.detach()
        if self._lru.pop(entry.seg_id, None) is not None:
            self.registered_bytes -= entry.nbytes
        self._retired.append((entry.seg_id, entry.last_use))

    def _apply_deaths(self) -> None:
        while self._died:
            seg_id = self._died.popleft()
            entry = self._lru.pop(seg_id, None)
            if entry is not None:
                self.registered_bytes -= entry.nbytes
            self._retired.append((seg_id, 0))  # its last op kept it alive, so that op is done

    def _refused(self, why: str) -> None:
        if not self._refusal_logged:
            self._refusal_logged = True
            log.warning("commd: a tensor is staged instead of registered (%s); further refusals are not logged",
                        why)


def backs_other_tensors(storage: torch.UntypedStorage) -> bool:
    """More tensors than the op's own share this storage: a flat buffer others view, kept across steps.

    DDP's gradient buckets (one view per parameter, made when the buckets are built, also at the
    rebuild after the first step), FSDP's flat parameters, optimizers' flattened state: each is
    all-reduced only once per step, so its first sighting decides a whole step's copies.  A
    temporary (``torch.cat``, ``clone``, a fresh result) is referenced by itself alone.  Counted on
    the storage: the op's tensor and the ``storage`` object the caller holds are two references.
    """
    return _storage_use_count is not None and _storage_use_count(storage._cdata) > 2


_storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _torch_owned(storage: torch.UntypedStorage) -> bool:
    """Memory torch allocated itself: only that may be moved (not NumPy's, not shared, not pinned)."""
    if storage.device.type != "cpu" or not storage.resizable() or storage.is_shared():
        return False
    # pinned memory needs CUDA: without it initialized nothing is pinned (and asking would initialize it)
    return not (torch.cuda.is_initialized() and storage.is_pinned())
