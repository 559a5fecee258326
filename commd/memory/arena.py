"""Shared-memory segments: created by a client, mapped by the daemon.

A client owns an *arena*: one or more segments, each a file in /dev/shm that
both the client and its node's daemon map.  Tensors allocated in the arena are
zero-copy; everything else is staged through it.  The client unlinks each
segment file right after the daemon has mapped it, so nothing is left in
/dev/shm however either process ends.
"""

from __future__ import annotations

import bisect
import collections
import mmap
import os
import stat
import threading
import weakref
from dataclasses import dataclass

import numpy as np

SHM_DIR = "/dev/shm"
ALIGNMENT = 64


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


@dataclass
class Segment:
    """One mapped shared-memory file."""

    seg_id: int
    name: str
    size: int
    mm: mmap.mmap
    array: np.ndarray  # uint8 view of the whole mapping
    base: int  # virtual address of the mapping in this process

    @classmethod
    def create(cls, seg_id: int, name: str, size: int) -> Segment:
        """Create a fresh segment file (owner-only) and map it."""
        fd = os.open(segment_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls._wrap(seg_id, name, size, mm)

    @classmethod
    def attach(cls, seg_id: int, name: str, size: int, expected_uid: int) -> Segment:
        """Map a segment a client created, after checking owner and size."""
        fd = os.open(segment_path(name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"segment {name!r} is not a regular file")
            if st.st_uid != expected_uid:
                raise ValueError(f"segment {name!r} is owned by uid {st.st_uid}, not {expected_uid}")
            if st.st_size < size:
                raise ValueError(
                    f"segment {name!r} holds {st.st_size} bytes, fewer than the {size} claimed"
                )
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls._wrap(seg_id, name, size, mm)

    @classmethod
    def _wrap(cls, seg_id: int, name: str, size: int, mm: mmap.mmap) -> Segment:
        array = np.frombuffer(mm, dtype=np.uint8, count=size)
        return cls(seg_id, name, size, mm, array, int(array.ctypes.data))

    def unlink(self) -> None:
        try:
            os.unlink(segment_path(self.name))
        except FileNotFoundError:
            pass

    def contains(self, address: int, nbytes: int) -> bool:
        return self.base <= address and address + nbytes <= self.base + self.size


class FreeList:
    """First-fit allocator over one segment with coalescing frees.

    Kept deliberately simple: arenas hold a few large communication buffers,
    not millions of small objects.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0]
        self._lengths: dict[int, int] = {0: size}
        self.used = 0

    def allocate(self, nbytes: int) -> int | None:
        need = _align(max(nbytes, 1))
        for start in self._starts:
            length = self._lengths[start]
            if length >= need:
                self._starts.remove(start)
                del self._lengths[start]
                if length > need:
                    self._insert(start + need, length - need)
                self.used += need
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        length = _align(max(nbytes, 1))
        self.used -= length
        self._insert(start, length)
        self._coalesce(start)

    def _insert(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._lengths[start] = length

    def _coalesce(self, start: int) -> None:
        i = self._starts.index(start)
        if i + 1 < len(self._starts):
            nxt = self._starts[i + 1]
            if start + self._lengths[start] == nxt:
                self._lengths[start] += self._lengths.pop(nxt)
                self._starts.pop(i + 1)
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == start:
                self._lengths[prev] += self._lengths.pop(start)
                self._starts.pop(i)


@dataclass
class Block:
    """A live allocation; ``array`` is a uint8 view that frees the block when collected."""

    segment: Segment
    offset: int
    nbytes: int
    array: np.ndarray


class Arena:
    """A client's arena: segments plus allocators, growing on demand.

    ``on_new_segment`` is called (outside the lock) for every segment created
    after the first, so the client can register it with the daemon before
    the first tensor in it is submitted.
    """

    def __init__(self, prefix: str, segment_bytes: int) -> None:
        self.prefix = prefix
        self.segment_bytes = segment_bytes
        self.segments: list[Segment] = []
        self._free: list[FreeList] = []
        self._lock = threading.Lock()
        # Frees arrive from finalizers, i.e. from the garbage collector, which
        # may run inside allocate() while it holds the lock: they are queued
        # here (deque appends are atomic) and applied under the lock later.
        self._pending_frees: collections.deque[tuple[int, int, int]] = collections.deque()
        self.on_new_segment = None  # type: ignore[var-annotated]

    def new_segment(self, size: int) -> Segment:
        with self._lock:
            seg_id = len(self.segments)
            segment = Segment.create(seg_id, f"{self.prefix}-s{seg_id}", size)
            self.segments.append(segment)
            self._free.append(FreeList(size))
        return segment

    def allocate(self, nbytes: int) -> Block:
        """Allocate ``nbytes`` in some segment, creating one if none has room."""
        with self._lock:
            self._apply_frees()
            for segment, free in zip(self.segments, self._free, strict=True):
                offset = free.allocate(nbytes)
                if offset is not None:
                    return self._block(segment, offset, nbytes)
        segment = self.new_segment(max(self.segment_bytes, _align(nbytes)))
        if self.on_new_segment is not None:
            self.on_new_segment(segment)
        with self._lock:
            offset = self._free[segment.seg_id].allocate(nbytes)
        if offset is None:  # pragma: no cover - the segment was sized for it
            raise MemoryError(f"cannot allocate {nbytes} bytes in a fresh segment")
        return self._block(segment, offset, nbytes)

    def _block(self, segment: Segment, offset: int, nbytes: int) -> Block:
        array = segment.array[offset : offset + max(nbytes, 1)]
        # A fresh view object per block: when the last tensor over it dies the
        # view is collected and the block returns to the free list.
        view = array.view()
        weakref.finalize(view, self._release, segment.seg_id, offset, nbytes)
        return Block(segment, offset, nbytes, view)

    def _release(self, seg_id: int, offset: int, nbytes: int) -> None:
        self._pending_frees.append((seg_id, offset, nbytes))

    def _apply_frees(self) -> None:
        """Return queued blocks to their free lists (caller holds the lock)."""
        while self._pending_frees:
            seg_id, offset, nbytes = self._pending_frees.popleft()
            self._free[seg_id].free(offset, nbytes)

    def locate(self, address: int, nbytes: int) -> tuple[Segment, int] | None:
        """Return (segment, offset) if [address, address+nbytes) lies in the arena."""
        for segment in self.segments:
            if segment.contains(address, nbytes):
                return segment, address - segment.base
        return None

    def bytes_in_use(self) -> int:
        with self._lock:
            self._apply_frees()
            return sum(f.used for f in self._free)

    def total_bytes(self) -> int:
        return sum(s.size for s in self.segments)
