"""Ordinary tensors seen again are registered once and reduced in place after; never a stale mapping.

Two in-process clients all-reduce ordinary CPU tensors.  The daemon's counters (``commd status``:
bytes by path, registered segments) show which path each buffer took; every result is compared
with NumPy.
"""

from __future__ import annotations

import gc
import logging
import os
import urllib.request
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import DaemonProcess, wait_until

from commd.client import CommdError, ops
from commd.client.registry import StorageRegistry
from commd.client.segments import register_fd
from commd.client.status import query_status
from commd.memory.arena import REGISTERED, sealed_memfd
from commd.protocol import schema as s
from commd.runtime import ConfigError

pytestmark = pytest.mark.timeout(120)

N = 4096  # float32 elements: 16 KiB, above the inline size


def values(t: torch.Tensor) -> np.ndarray:
    """A copy as NumPy: ``Tensor.numpy()`` on the tensor itself would mark its storage not resizable."""
    return t.detach().clone().numpy()


def all_reduce_checked(clients: list[Any], tensors: list[torch.Tensor], what: str) -> None:
    """All-reduce ``tensors`` (one per client) in place and compare with NumPy."""
    want = np.sum([values(t) for t in tensors], axis=0)
    handles = [ops.all_reduce(c, t, timeout=20) for c, t in zip(clients, tensors, strict=True)]
    for h in handles:
        h.wait(30)
    for rank, t in enumerate(tensors):
        assert np.array_equal(values(t), want), f"{what}: rank {rank} got a wrong all-reduce result"


def in_memfd(t: torch.Tensor) -> bool:
    """The tensor's memory lies in a mapping of one of commd's memfds (/proc/self/maps)."""
    address = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            return len(rest) == 5 and rest[4].startswith("/memfd:commd-")
    return False


def status(daemon: DaemonProcess) -> dict[str, Any]:
    return query_status(daemon.paths)


def client_rows(daemon: DaemonProcess) -> list[dict[str, Any]]:
    return sorted(status(daemon)["clients"], key=lambda c: c["rank"])


@pytest.fixture
def pair(daemon: DaemonProcess, connect: Callable[..., Any]) -> list[Any]:
    return [connect(0, 2), connect(1, 2)]


def fill(tensors: list[torch.Tensor], step: int) -> None:
    for rank, t in enumerate(tensors):
        t.copy_((torch.arange(t.numel(), dtype=t.dtype) * (rank + 1) + step).view_as(t))


def test_second_sighting_registers_then_nothing_is_staged(daemon: DaemonProcess, pair: list[Any]) -> None:
    tensors = [torch.empty(N) for _ in pair]
    fill(tensors, 0)
    all_reduce_checked(pair, tensors, "first sighting")  # referenced by itself alone: maybe a temporary
    first = status(daemon)["bytes_by_path"]
    assert first["staged"] == 2 * N * 4 and first["registered"] == 0, first
    views = [t[100:200] for t in tensors]  # made before the move: must follow it
    for step in range(1, 4):
        fill(tensors, step)
        all_reduce_checked(pair, tensors, f"step {step}")
    after = status(daemon)["bytes_by_path"]
    assert after["staged"] == first["staged"], f"a buffer was staged after its first sighting: {after}"
    assert after["registered"] == 3 * 2 * N * 4, after
    for rank, (t, v) in enumerate(zip(tensors, views, strict=True)):
        assert in_memfd(t), f"rank {rank}'s storage was not moved into shared memory"
        assert v.data_ptr() == t.data_ptr() + 400 and np.array_equal(values(v), values(t)[100:200])
    rows = client_rows(daemon)
    assert [r["registered_segments"] for r in rows] == [1, 1], rows
    assert [r["registered_bytes"] for r in rows] == [N * 4, N * 4], rows


def test_views_and_autograd_follow_the_move(daemon: DaemonProcess, pair: list[Any]) -> None:
    """A parameter's .grad viewing a bucket (as DDP's gradient_as_bucket_view) sees the reduced values."""
    buckets = [torch.zeros(N) for _ in pair]
    params = [torch.nn.Parameter(torch.ones(N // 2)) for _ in pair]
    for p, b in zip(params, buckets, strict=True):
        p.grad = b[: N // 2].view(N // 2)
    for step in range(3):
        for rank, (p, b) in enumerate(zip(params, buckets, strict=True)):
            b.zero_()
            (p * (rank + 1 + step)).sum().backward()  # accumulates into the bucket view
        all_reduce_checked(pair, buckets, f"step {step}")
        want = sum(r + 1 + step for r in range(len(pair)))
        for p in params:
            assert torch.equal(p.grad, torch.full((N // 2,), float(want))), f"step {step}: grad view is stale"
    assert all(in_memfd(b) for b in buckets)


def test_old_memory_is_released(pair: list[Any]) -> None:
    """Moving a storage frees its old (anonymous) memory: the process holds each tensor once, in the memfd."""
    nbytes = 64 << 20
    before = _anonymous_kib()
    tensors = [torch.ones(nbytes // 4) for _ in pair]
    for _ in range(2):
        all_reduce_checked(pair, tensors, "64 MiB")
    assert all(in_memfd(t) for t in tensors)
    grown = _anonymous_kib() - before
    assert grown < 32 * 1024, f"anonymous memory grew by {grown} KiB: the moved storages' old memory is still held"


def _anonymous_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


def test_freed_storage_is_unregistered_and_a_new_one_never_hits_it(daemon: DaemonProcess, pair: list[Any]) -> None:
    tensors = [torch.empty(N) for _ in pair]
    for step in range(2):
        fill(tensors, step)
        all_reduce_checked(pair, tensors, f"step {step}")
    assert [r["registered_segments"] for r in client_rows(daemon)] == [1, 1]
    del tensors
    gc.collect()
    for step in range(3):  # fresh tensors of the same size: maybe the same addresses, never the old mapping
        fresh = [torch.empty(N) for _ in pair]
        fill(fresh, 10 + step)
        all_reduce_checked(pair, fresh, f"fresh tensors, step {step}")
    # the unregisters went out before the first op after the death; the fresh ones were each seen once
    rows = client_rows(daemon)
    assert [r["registered_segments"] for r in rows] == [0, 0], rows


def test_replaced_memory_is_never_used_through_the_old_mapping(daemon: DaemonProcess, pair: list[Any]) -> None:
    """A registered storage whose memory is replaced (what a resize does) is forgotten at its next use."""
    tensors = [torch.empty(N) for _ in pair]
    for step in range(2):
        fill(tensors, step)
        all_reduce_checked(pair, tensors, f"step {step}")
    for t in tensors:
        replacement = torch.empty(N).untyped_storage()
        t.untyped_storage()._swap_data_ptr_(replacement)  # the user's storage now lives elsewhere
        del replacement
    for step in range(2, 5):
        fill(tensors, step)
        all_reduce_checked(pair, tensors, f"after replacement, step {step}")
    assert [r["registered_segments"] for r in client_rows(daemon)] == [1, 1]  # re-registered once, old one gone


def test_a_registered_storage_cannot_be_resized_and_stays_correct(pair: list[Any]) -> None:
    """The memfd is sealed against shrinking, so torch refuses the resize; results stay right."""
    tensors = [torch.empty(N) for _ in pair]
    for step in range(2):
        fill(tensors, step)
        all_reduce_checked(pair, tensors, f"step {step}")
    with pytest.raises(RuntimeError, match="not resizable"):
        tensors[0].untyped_storage().resize_(0)
    fill(tensors, 7)
    all_reduce_checked(pair, tensors, "after the refused resize")


def test_resized_before_registration_is_registered_with_its_new_memory(daemon: DaemonProcess,
                                                                        pair: list[Any]) -> None:
    tensors = [torch.empty(N) for _ in pair]
    fill(tensors, 0)
    all_reduce_checked(pair, tensors, "first sighting")
    for t in tensors:
        t.untyped_storage().resize_(2 * N * 4)
        t.set_(t.untyped_storage(), 0, (2 * N,))
    for step in range(1, 4):
        fill(tensors, step)
        all_reduce_checked(pair, tensors, f"after resize, step {step}")
    assert [r["registered_bytes"] for r in client_rows(daemon)] == [2 * N * 4, 2 * N * 4]


def test_storage_reused_for_another_tensor(pair: list[Any]) -> None:
    """Different views of one registered storage: each op names its own offset."""
    storages = [torch.empty(3 * N) for _ in pair]
    for step in range(4):
        part = step % 3
        views = [s_[part * N : (part + 1) * N].view(N // 2, 2) for s_ in storages]
        fill(views, step)
        all_reduce_checked(pair, [v.reshape(-1) for v in views], f"part {part}")


def test_fresh_tensors_every_step_stay_staged(daemon: DaemonProcess, pair: list[Any]) -> None:
    for step in range(6):
        fresh = [torch.empty(N) for _ in pair]
        fill(fresh, step)
        all_reduce_checked(pair, fresh, f"step {step}")
        del fresh
    paths = status(daemon)["bytes_by_path"]
    assert paths["registered"] == 0 and paths["staged"] == 6 * 2 * N * 4, paths
    assert [r["registered_segments"] for r in client_rows(daemon)] == [0, 0]


def test_a_completed_staged_op_holds_neither_its_staging_block_nor_the_users_tensor(daemon: DaemonProcess, pair: list[Any]) -> None:
    """A fresh 1 MiB tensor every step, staged: its block is free again once the op completes, though
    the client remembers where pending ops write for hundreds of storages, so the arena never grows
    (100 steps in the first segment, none of it in use between steps), and the tensor itself dies
    when the user drops it."""
    first = [c.arena.total_bytes() for c in pair]
    for step in range(100):
        fresh = [torch.empty(1 << 18) for _ in pair]
        fill(fresh, step)
        all_reduce_checked(pair, fresh, f"step {step}")
        dropped = [weakref.ref(t) for t in fresh]
        del fresh
        in_use = [c.arena.bytes_in_use() for c in pair]
        assert in_use == [0, 0], f"step {step}: {in_use} bytes of staging still held after the ops completed"
        assert [ref() for ref in dropped] == [None, None], f"step {step}: a dropped tensor is still alive"
    assert [c.arena.total_bytes() for c in pair] == first
    assert status(daemon)["bytes_by_path"]["staged"] == 100 * 2 * (1 << 20)


def test_a_flat_buffer_that_other_tensors_view_is_registered_at_its_first_sighting(
        daemon: DaemonProcess, pair: list[Any]) -> None:
    """A DDP bucket: views of it (one per parameter) exist before its first all-reduce; nothing is staged."""
    buckets = [torch.empty(2 * N) for _ in pair]
    views = [[b[: N // 2], b[N // 2 :]] for b in buckets]  # noqa: F841 - alive: the bucket backs them
    for step in range(2):
        fill(buckets, step)
        all_reduce_checked(pair, buckets, f"step {step}")
        paths = status(daemon)["bytes_by_path"]
        assert paths["staged"] == 0 and paths["registered"] == (step + 1) * 2 * 2 * N * 4, paths
    assert all(in_memfd(b) for b in buckets)
    assert [r["registered_segments"] for r in client_rows(daemon)] == [1, 1]


def test_a_flat_buffer_remade_every_step_is_registered_and_dropped_when_it_dies(
        daemon: DaemonProcess, pair: list[Any]) -> None:
    """A fresh viewed buffer per step (flattened gradients): each registered at once, each unregistered after
    its death, so the daemon maps one per client at a time; every result right."""
    for step in range(6):
        flats = [torch.empty(2 * N) for _ in pair]
        views = [f.view(2, N) for f in flats]  # noqa: F841 - alive while the buffer is reduced
        fill(flats, step)
        all_reduce_checked(pair, flats, f"step {step}")
        rows = client_rows(daemon)
        assert [r["registered_segments"] for r in rows] == [1, 1], f"step {step}: {rows}"
        assert [r["registered_bytes"] for r in rows] == [2 * N * 4] * 2, f"step {step}: {rows}"
        del flats, views
    assert status(daemon)["bytes_by_path"]["staged"] == 0


def test_a_temporary_is_staged_below_64_mib_and_registered_from_it(daemon: DaemonProcess, pair: list[Any]) -> None:
    """Seen once, referenced by itself alone: below COMMD_REGISTER_FIRST_BYTES (64 MiB) staging costs less than
    moving it into fresh shared memory; from it, it is moved at once, and unregistered once it dies."""
    for step, count in enumerate((N, 64 * N)):  # 16 KiB and 1 MiB
        fresh = [torch.empty(count) for _ in pair]
        fill(fresh, step)
        all_reduce_checked(pair, fresh, f"{count * 4} bytes")
        assert not any(in_memfd(t) for t in fresh)
    paths = status(daemon)["bytes_by_path"]
    assert paths["registered"] == 0 and paths["staged"] == 2 * (N + 64 * N) * 4, paths
    large = [torch.ones(16 << 20) for _ in pair]  # 64 MiB
    all_reduce_checked(pair, large, "64 MiB")
    assert all(in_memfd(t) for t in large)
    assert status(daemon)["bytes_by_path"]["registered"] == 2 * (64 << 20)
    del large
    small = [torch.ones(N) for _ in pair]
    all_reduce_checked(pair, small, "after the death")  # the unregisters go out before this op
    assert [r["registered_segments"] for r in client_rows(daemon)] == [0, 0]


def test_register_first_bytes_registers_large_temporaries_at_once_and_bounds_their_mappings(
        daemon: DaemonProcess, connect: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """COMMD_REGISTER_FIRST_BYTES: a temporary at least that large is registered at its first sighting, and its
    registration goes when it dies (mapped bytes stay at one tensor over many fresh ones); smaller ones stage."""
    for bad in ("lots", "-1"):
        monkeypatch.setenv("COMMD_REGISTER_FIRST_BYTES", bad)
        with pytest.raises(ConfigError, match="COMMD_REGISTER_FIRST_BYTES"):
            connect(0, 2)
    monkeypatch.setenv("COMMD_REGISTER_FIRST_BYTES", str(2 * N * 4))
    pair = [connect(0, 2), connect(1, 2)]
    for step in range(8):
        large = [torch.empty(2 * N) for _ in pair]
        fill(large, step)
        all_reduce_checked(pair, large, f"large, step {step}")
        assert all(in_memfd(t) for t in large)
        rows = client_rows(daemon)
        assert [r["registered_bytes"] for r in rows] == [2 * N * 4] * 2, f"step {step}: mapped bytes grew: {rows}"
        del large
    small = [torch.empty(N) for _ in pair]
    fill(small, 9)
    all_reduce_checked(pair, small, "small")
    paths = status(daemon)["bytes_by_path"]
    assert paths["registered"] == 8 * 2 * 2 * N * 4 and paths["staged"] == 2 * N * 4, paths


def test_many_persistent_tensors_stay_within_the_client_budget(daemon: DaemonProcess, pair: list[Any]) -> None:
    budget = 3 * N * 4
    for client in pair:
        client._registry.budget = budget  # noqa: SLF001 - a small budget for the test
    tensors = [[torch.empty(N) for _ in pair] for _ in range(8)]
    for step in range(3):
        for i, group in enumerate(tensors):
            fill(group, step + i)
            all_reduce_checked(pair, group, f"tensor {i} step {step}")
            mapped = [r["registered_bytes"] for r in client_rows(daemon)]
            assert max(mapped) <= budget, f"registered bytes {mapped} passed the client budget {budget}"
    assert all(client._registry.registered_bytes <= budget for client in pair)  # noqa: SLF001


def test_daemon_cap_refusal_falls_back_to_staging(start_daemon: Callable[..., DaemonProcess],
                                                  connect: Callable[..., Any],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("COMMD_MAX_REGISTERED_BYTES", str(N * 4 + 100))  # the daemon's cap: one tensor
    daemon = start_daemon().wait_ready()
    monkeypatch.delenv("COMMD_MAX_REGISTERED_BYTES")  # the clients' budget stays large: the daemon refuses
    pair = [connect(0, 2), connect(1, 2)]
    tensors = [[torch.empty(N) for _ in pair] for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="commd.client"):
        for step in range(3):
            for i, group in enumerate(tensors):
                fill(group, step + i)
                all_reduce_checked(pair, group, f"tensor {i} step {step}")
    rows = client_rows(daemon)
    assert [r["registered_segments"] for r in rows] == [1, 1], rows
    assert status(daemon)["limits_hit"].get("max_registered_bytes", 0) >= 2
    refusals = [r for r in caplog.records if "staged instead of registered" in r.getMessage()]
    assert len(refusals) == 2, [r.getMessage() for r in refusals]  # once per client
    assert "COMMD_MAX_REGISTERED_BYTES" in refusals[0].getMessage()


def test_registration_can_be_turned_off(daemon: DaemonProcess, connect: Callable[..., Any],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMMD_REGISTER", "2")
    with pytest.raises(ConfigError, match="COMMD_REGISTER"):
        connect(0, 2)
    monkeypatch.setenv("COMMD_REGISTER", "0")
    pair = [connect(0, 2), connect(1, 2)]
    tensors = [torch.empty(N) for _ in pair]
    for step in range(3):
        fill(tensors, step)
        all_reduce_checked(pair, tensors, f"step {step}")
    assert status(daemon)["bytes_by_path"]["registered"] == 0
    assert not in_memfd(tensors[0])


def test_a_torch_that_cannot_swap_storages_stages_and_says_so(
        daemon: DaemonProcess, connect: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Older torch has no ``_swap_data_ptr_``: registration is off from the start (no memfd mapped in
    the daemon per storage only to fail the move), the ops succeed staged, and the reason is logged once."""
    from commd.client import registry

    monkeypatch.setattr(registry, "storage_swap_supported", lambda: False)
    monkeypatch.setattr(registry, "_unsupported_said", False)
    with caplog.at_level(logging.WARNING, logger="commd.client"):
        pair = [connect(0, 2), connect(1, 2)]
    said = [r for r in caplog.records if "_swap_data_ptr_" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    tensors = [torch.empty(N) for _ in pair]
    for step in range(3):
        fill(tensors, step)
        all_reduce_checked(pair, tensors, f"step {step}")
    assert status(daemon)["bytes_by_path"]["registered"] == 0
    assert [r["registered_segments"] for r in client_rows(daemon)] == [0, 0]


# ---- what the daemon accepts ----------------------------------------------------
def _register(client: Any, daemon: DaemonProcess, fd: int, seg_id: int, size: int = N * 4) -> None:
    register_fd(daemon.paths.ops_socket, client.client_id, client.secret, client.daemon_pid, 10.0,
                seg_id, f"commd-test-{seg_id}", size, fd, REGISTERED)


def test_descriptors_of_the_wrong_kind_are_refused(daemon: DaemonProcess, pair: list[Any], tmp_path: Path) -> None:
    client = pair[0]
    base = s.REGISTERED_SEG_BASE + 1000
    read_end, write_end = os.pipe()
    disk = tmp_path / "file"
    disk.write_bytes(b"\0" * N * 4)
    disk_fd = os.open(disk, os.O_RDWR)
    unsealed = os.memfd_create("commd-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, N * 4)
    os.posix_fallocate(unsealed, 0, N * 4)
    sealed = sealed_memfd("commd-sealed", N * 4, "test")
    try:
        cases = [(read_end, "not a regular file"), (disk_fd, "not a sealable memfd"),
                 (unsealed, "not sealed against shrinking")]
        for i, (fd, why) in enumerate(cases):
            with pytest.raises(CommdError, match=why):
                _register(client, daemon, fd, base + i)
        with pytest.raises(CommdError, match="outside"):  # an arena-range id for a registered storage
            _register(client, daemon, sealed, 5)
    finally:
        for fd in (read_end, write_end, disk_fd, unsealed, sealed):
            os.close(fd)
    tensors = [torch.empty(N) for _ in pair]
    for step in range(3):  # the daemon keeps serving
        fill(tensors, step)
        all_reduce_checked(pair, tensors, f"after refusals, step {step}")


def test_another_users_descriptor_is_refused(daemon: DaemonProcess, pair: list[Any]) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a memfd to another user")
    fd = sealed_memfd("commd-foreign", N * 4, "test")
    try:
        os.fchown(fd, 65534, 65534)
        with pytest.raises(CommdError, match="owned by uid 65534"):
            _register(pair[0], daemon, fd, s.REGISTERED_SEG_BASE + 2000)
    finally:
        os.close(fd)
    tensors = [torch.empty(N) for _ in pair]
    fill(tensors, 1)
    all_reduce_checked(pair, tensors, "after the refusal")


def test_unregister_is_validated(daemon: DaemonProcess, pair: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    """Unknown segment, an arena segment, a segment a pending op uses: clear errors, the daemon serves on."""
    tensors = [torch.empty(N) for _ in pair]
    for step in range(2):
        fill(tensors, step)
        all_reduce_checked(pair, tensors, f"step {step}")
    seg = next(iter(pair[0]._registry._lru))  # noqa: SLF001 - the registered segment's id
    fill(tensors, 5)
    want = values(tensors[0]) + values(tensors[1])
    pending = ops.all_reduce(pair[0], tensors[0], timeout=20)  # rank 1 has not submitted: stays pending
    def refusals() -> list[str]:
        pair[0].pump(0.05)  # the refusals come back on rank 0's op channel
        return [r.getMessage() for r in caplog.records if "unregisters segment" in r.getMessage()]

    with caplog.at_level(logging.ERROR, logger="commd.client"):
        for target in (s.REGISTERED_SEG_BASE + 999_999, 0, seg):
            pair[0]._ops.send(s.encode({"t": s.UNREGISTER, "seg": target}))  # noqa: SLF001
        wait_until(lambda: len(refusals()) >= 3, 20, "three refused unregisters")
        assert not pending.is_completed()
        other = ops.all_reduce(pair[1], tensors[1], timeout=20)  # only now: the op was pending throughout
        pending.wait(30)
        other.wait(30)
    messages = [r.getMessage() for r in caplog.records if "unregisters segment" in r.getMessage()]
    assert "not a registered storage" in messages[0] and "not a registered storage" in messages[1], messages
    assert "pending op" in messages[2], messages
    for t in tensors:
        assert np.array_equal(values(t), want)
    fill(tensors, 9)
    all_reduce_checked(pair, tensors, "after the refused unregisters")  # still registered, still right
    assert status(daemon)["bytes_by_path"]["registered"] > 0


def test_registry_keys_by_storage_object() -> None:
    """Unit check of the registry alone: sightings count per storage, not per address."""
    calls: list[int] = []
    registry = StorageRegistry("commd-unit", lambda seg, name, n, fd: calls.append(seg), budget=1 << 30)
    t = torch.zeros(N)
    assert registry.lookup(t) is None  # first sighting
    found = registry.lookup(t[10:])
    assert found is not None and found[1] == 40 and len(calls) == 1
    assert registry.lookup(t.view(2, -1)) == (found[0], 0)
    other = torch.zeros(N)
    assert registry.lookup(other) is None
    del t
    gc.collect()
    assert registry.due_unregisters(lambda op_id: False) == [found[0]]
    assert registry.registered_bytes == 0
    a = torch.from_numpy(np.zeros(N, dtype=np.float32))  # NumPy's memory: never moved
    assert registry.lookup(a) is None and registry.lookup(a) is None and len(calls) == 1



def test_registry_first_sighting_rules() -> None:
    """Unit check of the registry alone: which first sightings register (no daemon: the fd is only counted)."""
    calls: list[int] = []
    registry = StorageRegistry("commd-unit", lambda seg, name, n, fd: calls.append(n), budget=1 << 30,
                               first_bytes=8 * N * 4)
    assert registry.lookup(torch.zeros(N)) is None  # a temporary: itself alone
    assert registry.lookup(torch.cat([torch.zeros(N), torch.zeros(N)])) is None
    bucket = torch.zeros(2 * N)
    grads = [bucket[:N], bucket[N:]]  # noqa: F841 - views a DDP bucket's parameters hold
    assert registry.lookup(bucket) == (s.REGISTERED_SEG_BASE, 0) and calls == [2 * N * 4]
    shared = torch.zeros(4 * N)
    part = shared[:N]  # viewed, but the op uses a quarter of it: moving it all is not worth it
    assert registry.lookup(part) is None and len(calls) == 1
    assert registry.lookup(torch.zeros(8 * N)) is not None and calls[-1] == 8 * N * 4  # first_bytes
    assert registry.lookup(torch.zeros(8 * N), may_register=False) is None and len(calls) == 2
    assert registry.lookup(torch.from_numpy(np.zeros(8 * N, dtype=np.float32))) is None  # not torch's memory
    assert len(calls) == 2


def test_status_and_metrics_show_the_buffer_paths(start_daemon: Callable[..., DaemonProcess],
                                                  connect: Callable[..., Any]) -> None:
    """`commd status` and the Prometheus metrics show the same counters: after the first step, nothing staged."""
    from cluster import free_port
    from prometheus_client.parser import text_string_to_metric_families

    from commd.cli.status import format_status

    port = free_port()
    daemon = start_daemon(extra=["--metrics-port", str(port)]).wait_ready()
    pair = [connect(0, 2), connect(1, 2)]
    tensors = [torch.empty(N) for _ in pair]
    for step in range(3):
        fill(tensors, step)
        all_reduce_checked(pair, tensors, f"step {step}")
    snapshot = status(daemon)
    text = format_status(snapshot)
    assert "buffers by path: registered 64.0 KiB, arena 0 B, staged 32.0 KiB" in text, text
    assert "1 / 16.0 KiB" in text, text
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
    by_path = {s.labels["path"]: s.value for s in families["commd_buffer_bytes"].samples if s.name.endswith("_total")}
    assert by_path == {path: float(n) for path, n in snapshot["bytes_by_path"].items()}, by_path
    assert families["commd_registered_segments"].samples[0].value == 2
    assert families["commd_registered_bytes"].samples[0].value == 2 * N * 4


def test_a_staged_tensor_stays_resizable(pair: list[Any]) -> None:
    """Staging must not mark the user's storage as not resizable (FSDP frees its buffers with resize_(0))."""
    tensors = [torch.empty(N) for _ in pair]
    fill(tensors, 0)
    all_reduce_checked(pair, tensors, "staged")
    for t in tensors:
        t.untyped_storage().resize_(0)  # raised "Trying to resize storage that is not resizable" before
        assert t.untyped_storage().nbytes() == 0


# ---- DDP through the torch backend ------------------------------------------------
DDP_STEPS = 6


def _buffer_paths() -> dict[str, int]:
    """The job's daemon's bytes by path (the one job in this test's runtime directory)."""
    from commd.runtime import JobPaths

    (directory,) = Path(os.environ["COMMD_RUNTIME_DIR"]).glob("*/daemon.pid")
    return query_status(JobPaths(directory.parent.name, directory.parent))["bytes_by_path"]


def _ddp_rank(rank: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # this small model's buckets (~20 KiB) would take the group's exchange ring, which never
    # registers anything; registration is what is under test, so they go through the daemon
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), COMMD_LOCAL_RING="0")
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)  # several buckets, each above 4 KiB
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        data = torch.Generator().manual_seed(rank)
        marks = []
        for _ in range(DDP_STEPS):
            x = torch.randn(16, 64, generator=data)
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            opt.step()
            dist.barrier()
            marks.append(_buffer_paths())
            dist.barrier()
        print(f"rank {rank}: bytes by path after each step: {marks}")
        # DDP rebuilds its buckets once, after the first step; the rebuilt buckets are viewed by the
        # parameters' gradient views before their first all-reduce: registered from the second step on
        assert marks[-1]["staged"] == marks[0]["staged"], f"a bucket was staged after step 1: {marks}"
        assert marks[-1]["registered"] > marks[1]["registered"] > marks[0]["registered"], marks
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        both = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(both, flat)
        assert torch.equal(both[0], both[1]), "DDP replicas diverged"
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two torch ranks and an auto-started daemon: 15-50 s on a shared 2-core machine
def test_ddp_buckets_are_zero_copy_from_the_second_step(backend_env: Path) -> None:
    from test_torch_backend import spawn

    spawn(_ddp_rank, ())


def test_any_op_names_a_registered_storage_but_only_in_place_buffers_get_registered(
        daemon: DaemonProcess, pair: list[Any]) -> None:
    tensors = [torch.empty(N) for _ in pair]
    for step in range(2):
        fill(tensors, step)
        all_reduce_checked(pair, tensors, f"step {step}")
    before = status(daemon)["bytes_by_path"]
    outputs = [torch.empty(2 * N) for _ in pair]
    for _ in range(2):  # an all-gather's output, seen twice, stays staged; its registered input is named
        handles = [ops.all_gather(c, o, t, timeout=20) for c, o, t in zip(pair, outputs, tensors, strict=True)]
        for h in handles:
            h.wait(30)
        want = np.concatenate([values(t) for t in tensors])
        assert all(np.array_equal(values(o), want) for o in outputs)
    after = status(daemon)["bytes_by_path"]
    assert after["registered"] - before["registered"] == 2 * 2 * N * 4, (before, after)
    assert after["staged"] - before["staged"] == 2 * 2 * 2 * N * 4, (before, after)
    assert not any(in_memfd(o) for o in outputs)


@pytest.mark.parametrize("marker", [2, 0, True, "1"])
def test_the_staged_marker_is_validated(marker: Any) -> None:
    from commd.scheduler.agreement import parse_submission

    msg = {"v": s.PROTOCOL_VERSION, "t": s.OP, "id": 1, "kind": "allreduce", "group": "world", "seq": 0,
           "dtype": "float32", "count": 4, "buf": {"seg": 0, "off": 0, "n": 16, "st": marker}}
    with pytest.raises(s.ProtocolError, match="'st'"):
        parse_submission(msg, 1, 0, 2, 30.0)
    msg["buf"]["st"] = 1
    assert parse_submission(msg, 1, 0, 2, 30.0).buffers["buf"].staged
