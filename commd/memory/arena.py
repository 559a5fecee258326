"""Shared-memory segments: created by a client, mapped by the daemon.

A client owns an *arena*: one or more segments that both the client and its
node's daemon map.  Tensors allocated in the arena are zero-copy; everything
else is staged through it.

A segment is a memfd (no name in any file system, so nothing is left behind
however either process ends), its pages reserved when it is created (running
out of memory is an error then, never a SIGBUS later) and sealed against
shrinking and growing.  The client passes the file descriptor itself to the
daemon (SCM_RIGHTS on the op socket); the daemon checks the seal and the size
before mapping, so no client can shrink a segment under the daemon's reads.
"""

from __future__ import annotations

import bisect
import collections
import errno
import fcntl
import mmap
import os
import stat
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from commd.memory.budget import SOURCE, shared_memory_budget

ALIGNMENT = 64
#: Seals every segment carries: its size can never change once mapped.
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


HUGETLBFS_MAGIC = 0x958458F6


def _file_system_type(fd: int) -> int | None:
    """fstatfs(fd).f_type (None if it cannot be read): Python's os has no fstatfs."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
        if libc.fstatfs(fd, buf) != 0:
            return None
        return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    except (OSError, AttributeError):
        return None


class SegmentError(MemoryError):
    """A segment cannot be created or accepted; the text says why, where from and how much.

    Raised in the process whose arena cannot grow (a new ``Client``, ``commd.empty``, a staged tensor): its
    pages are reserved up front, so running out of shared memory is this error, never a SIGBUS later."""


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def human_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def reserve(fd: int, size: int, what: str) -> None:
    """Allocate every page of ``fd`` now, so no later access can fault for lack of memory."""
    budget = shared_memory_budget()
    if size > budget.free:
        raise SegmentError(
            f"cannot reserve {human_bytes(size)} of {SOURCE} for {what}: only "
            f"{human_bytes(budget.free)} free ({budget.limited_by}); lower COMMD_ARENA_BYTES "
            "or the size of the tensors staged through the arena"
        )
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        raise SegmentError(
            f"cannot reserve {human_bytes(size)} of {SOURCE} for {what}: {os.strerror(exc.errno)} "
            f"({human_bytes(budget.free)} looked free: {budget.limited_by})"
        ) from None


def sealed_memfd(name: str, size: int, what: str) -> int:
    """A memfd of ``size`` bytes, every page reserved, sealed against shrinking and growing.

    The one way every segment's memory is made, arena or registered storage
    (``commd/client/registry.py``): the daemon accepts nothing else.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        reserve(fd, size, what)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: What a segment holds: an arena (the client allocates in it) or one registered torch storage.
ARENA = "arena"
REGISTERED = "registered"


@dataclass
class Segment:
    """One mapped shared-memory segment; ``fd`` stays open until the daemon holds its own.

    ``kind`` is ``ARENA`` or ``REGISTERED`` (a client's ordinary tensor storage moved into
    a memfd once it was seen again): both are the same sealed memfd, checked and mapped alike.
    """

    seg_id: int
    name: str
    size: int
    mm: mmap.mmap
    array: np.ndarray  # uint8 view of the whole mapping
    base: int  # virtual address of the mapping in this process
    fd: int | None = None
    kind: str = ARENA

    @classmethod
    def create(cls, seg_id: int, name: str, size: int) -> Segment:
        """A fresh memfd of ``size`` bytes, pages reserved, sealed against resizing, mapped."""
        fd = sealed_memfd(name, size, f"arena segment {name!r}")
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        segment = cls._wrap(seg_id, name, size, mm)
        segment.fd = fd
        return segment

    @classmethod
    def from_fd(cls, seg_id: int, name: str, size: int, fd: int, expected_uid: int, kind: str = ARENA) -> Segment:
        """Map a segment a client passed as ``fd``, after checking kind, owner, seals and size.

        Never trusts the client: a file that could shrink would turn the
        daemon's next read of it into a SIGBUS that kills the whole node's job.
        The caller keeps ownership of ``fd`` (the mapping does not need it).
        """
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"segment {name!r}: the descriptor is not a regular file")
        if st.st_uid != expected_uid:
            raise ValueError(f"segment {name!r} is owned by uid {st.st_uid}, not {expected_uid}")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise ValueError(f"segment {name!r} is not a sealable memfd (create it with memfd_create "
                             "and MFD_ALLOW_SEALING)") from None
        if seals & fcntl.F_SEAL_SHRINK == 0:
            raise ValueError(f"segment {name!r} is not sealed against shrinking (F_SEAL_SHRINK)")
        if st.st_size < size:
            raise ValueError(f"segment {name!r} holds {st.st_size} bytes, fewer than the {size} claimed")
        if _file_system_type(fd) == HUGETLBFS_MAGIC:
            # a huge page the pool cannot supply on a later fault (after a hole punch) is a SIGBUS
            raise ValueError(f"segment {name!r} is a huge-page memfd; only ordinary shared memory is accepted")
        if st.st_blocks * 512 < size:
            raise ValueError(f"segment {name!r}: only {st.st_blocks * 512} of its {size} bytes are reserved "
                             "(allocate its pages with posix_fallocate before passing it)")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        segment = cls._wrap(seg_id, name, size, mm)
        segment.kind = kind
        return segment

    @classmethod
    def _wrap(cls, seg_id: int, name: str, size: int, mm: mmap.mmap) -> Segment:
        array = np.frombuffer(mm, dtype=np.uint8, count=size)
        return cls(seg_id, name, size, mm, array, int(array.ctypes.data))

    def close_fd(self) -> None:
        """Drop the descriptor (the mapping stays): once the daemon has its own, ours is not needed."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

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
            try:
                self.on_new_segment(segment)
            except BaseException:
                self._discard(segment)
                raise
        with self._lock:
            offset = self._free[segment.seg_id].allocate(nbytes)
        if offset is None:  # pragma: no cover - the segment was sized for it
            raise MemoryError(f"cannot allocate {nbytes} bytes in a fresh segment")
        return self._block(segment, offset, nbytes)

    def _discard(self, segment: Segment) -> None:
        """Forget a segment the daemon did not accept: nothing may be allocated in it."""
        with self._lock:
            segment.close_fd()
            if self.segments and self.segments[-1] is segment:
                self.segments.pop()
                self._free.pop()
            else:  # a later segment exists: keep the ids dense, leave this one empty
                self._free[segment.seg_id] = FreeList(0)

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
