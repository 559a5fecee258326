"""Local groups' exchange rings: small all-reduces between the ranks in shared memory.

The ring logic runs here with two in-process clients (one thread per rank), checked
against NumPy; the daemon's side (who gets a ring) through the op socket; and the torch
backend end to end (the ring is used, results, ordering against daemon ops, futures).
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_torch_backend import WORLD, spawn

from commd.client.errors import CommdError, CommTimeoutError, MismatchError, PeerDiedError
from commd.client.fastring import ExchangeRing, RingHandle, RingLeft, available, request_ring
from commd.protocol import fastring as fr
from commd.torch_backend.ring_ops import ring_all_reduce

pytestmark = pytest.mark.skipif(not available(), reason="exchange rings need x86-64 Linux")


def _rings(clients: list[Any], group: str = "world", timeout: float = 10.0) -> list[ExchangeRing]:
    rings = []
    for c in clients:
        region, meta = request_ring(c.paths.ops_socket, c.client_id, c.secret, group, 10.0, c.daemon_pid)
        rings.append(ExchangeRing(region, meta, group, c.rank, c.daemon_pid, timeout))
    return rings


def _per_rank(fn: Callable[[int], Any], n: int = 2, timeout: float = 30.0) -> list[Any]:
    """Run ``fn(rank)`` on one thread per rank; return results (or raised exceptions) by rank."""
    out: list[Any] = [None] * n

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank thread hung"
    return out


_REFERENCE = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
              "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
_CASES = [("float32", "sum"), ("float64", "avg"), ("float16", "max"), ("int32", "product"), ("int64", "min"),
          ("uint8", "bxor"), ("int16", "bor"), ("bool", "band"), ("complex64", "sum")]


def _inputs(rank: int, dtype: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(rank * 7 + n)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if dtype.startswith("complex"):
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    if dtype.startswith(("int", "uint")):
        return rng.integers(1, 50, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def _reference(dtype: str, op: str, n: int, ranks: int = 2) -> np.ndarray:
    xs = [_inputs(r, dtype, n) for r in range(ranks)]
    if op == "avg":
        return (xs[0] + xs[1]) / 2
    if dtype == "bool":
        return {"band": np.logical_and}[op](xs[0], xs[1])
    return _REFERENCE[op](xs[0], xs[1])


def test_ring_all_reduce_matches_numpy_for_every_dtype(daemon: Any, connect: Callable[..., Any]) -> None:
    clients = [connect(r, 2) for r in range(2)]
    rings = _rings(clients)
    # carried in the entry, then in the large slots (one element past a slot, the largest op)
    sizes = [1, 3, 1000, fr.SLOT_BYTES // 8, fr.SLOT_BYTES // 8 + 1, fr.large_bytes(2)]

    def body(r: int) -> list[tuple[str, str, int, np.ndarray]]:
        got = []
        for dtype, op in _CASES:
            for n in sizes:
                n = min(n, fr.large_bytes(2) // np.dtype(dtype).itemsize)
                x = _inputs(r, dtype, n)
                rings[r].all_reduce(x.view(np.uint8), dtype, op, None).wait(10)
                got.append((dtype, op, n, x))
        return got

    results = _per_rank(body)
    for r in range(2):
        assert not isinstance(results[r], BaseException), results[r]
        for dtype, op, n, x in results[r]:
            want = _reference(dtype, op, n)
            if dtype.startswith(("float", "complex")):
                np.testing.assert_allclose(x, want, rtol=1e-3, err_msg=f"{dtype} {op} n={n} rank {r}")
            else:
                np.testing.assert_array_equal(x, want, err_msg=f"{dtype} {op} n={n} rank {r}")
    assert [np.array_equal(a[3], b[3]) for a, b in zip(results[0], results[1], strict=True)] == [True] * len(
        results[0]), "the ranks computed different bits"


def test_more_async_ops_than_ring_entries_complete(daemon: Any, connect: Callable[..., Any]) -> None:
    """Both ranks submit 3 × depth ops before waiting on any, every third one larger than an
    entry (so the large slots are reused too): the ring must not wait on itself."""
    clients = [connect(r, 2) for r in range(2)]
    rings, paths = _rings(clients), clients[0].paths
    count = 3 * fr.DEPTH
    big = fr.SLOT_BYTES // 4 * 3

    def body(r: int) -> list[np.ndarray]:
        xs = [np.full(big if i % 3 == 1 else 4, (r + 1) * (i + 1), np.float32) for i in range(count)]
        handles = [rings[r].all_reduce(x.view(np.uint8), "float32", "sum", None) for x in xs]
        for h in handles:
            h.wait(10)
        return xs

    results = _per_rank(body)
    for r in range(2):
        assert not isinstance(results[r], BaseException), results[r]
        assert [(float(x.min()), float(x.max())) for x in results[r]] == [(3.0 * (i + 1),) * 2 for i in range(count)]
    # ring ops never reach the daemon's scheduler; commd status counts them per ring
    from commd.client.status import query_status

    status = query_status(paths)
    assert status["rings"]["world"] == {"ranks": 2, "ops": count, "posted": [count, count]}
    # ... and so do its text and the Prometheus metrics (taken from the same status document)
    from commd.cli.status import format_status
    from commd.observe.metrics import DaemonCollector

    assert f"exchange rings (all-reduces the ranks of a local group ran without the daemon): world {count}" in \
        format_status(status)
    snapshot = {"status": status, "by_op": {}, "error_replies": {}, "limits_hit": {}}
    family = next(m for m in DaemonCollector(lambda: snapshot).collect() if m.name == "commd_ring_allreduces")
    assert [(s.labels, s.value) for s in family.samples if s.name.endswith("_total")] == [({"group": "world"}, count)]


def test_a_mismatch_fails_every_rank_and_the_ring_goes_on(daemon: Any, connect: Callable[..., Any]) -> None:
    rings = _rings([connect(r, 2) for r in range(2)])

    def body(r: int) -> tuple[str, float]:
        x = np.ones(2 + r, np.float32)
        try:
            rings[r].all_reduce(x.view(np.uint8), "float32", "sum", None).wait(10)
            error = "no error"
        except MismatchError as exc:
            error = str(exc)
        y = np.full(2, r + 1.0, np.float32)
        rings[r].all_reduce(y.view(np.uint8), "float32", "sum", None).wait(10)
        return error, float(y[0])

    for r, (error, after) in enumerate(_per_rank(body)):
        assert "mismatched collective #0 on group 'world': 'count' differs: ranks [0] 2, ranks [1] 3" in error, (
            r, error)
        assert after == 3.0


_TIMED_OUT = (r"allreduce #0 on group 'world' timed out: group ranks \[1\] \(global ranks \[1\]\) did not submit it "
              r"within the op timeout of 0.5s")


def test_a_timed_out_op_fails_on_every_rank_and_later_ops_are_unaffected(
        daemon: Any, connect: Callable[..., Any]) -> None:
    """As on the daemon path: the op times out naming the missing rank, the late rank's op fails on
    arrival with the same words (never combined with a later op of the first rank), and the next
    ops of both ranks meet each other on the ring."""
    rings = _rings([connect(r, 2) for r in range(2)], timeout=0.5)
    x = np.ones(2, np.float32)
    start = time.monotonic()
    handle = rings[0].all_reduce(x.view(np.uint8), "float32", "sum", None)
    with pytest.raises(CommTimeoutError, match=_TIMED_OUT):
        handle.wait()
    assert time.monotonic() - start < 5
    later = rings[0].all_reduce(np.full(2, 100.0, np.float32).view(np.uint8), "float32", "sum", None)
    late = np.full(2, 2.0, np.float32)
    started = time.monotonic()
    with pytest.raises(CommTimeoutError, match=_TIMED_OUT):
        rings[1].all_reduce(late.view(np.uint8), "float32", "sum", None).wait()
    assert time.monotonic() - started < 0.4, "the late op waited instead of failing on arrival"
    assert late.tolist() == [2.0, 2.0] and x.tolist() == [1.0, 1.0]
    y = np.full(2, 200.0, np.float32)
    rings[1].all_reduce(y.view(np.uint8), "float32", "sum", None).wait(5)
    later.wait(5)
    assert y.tolist() == [300.0, 300.0]
    assert rings[0].usable() and rings[1].usable()


def test_a_rank_waiting_with_a_timed_out_op_fails_when_its_peer_withdraws(
        daemon: Any, connect: Callable[..., Any]) -> None:
    """Three ranks: rank 0's op times out (rank 1 missing) while rank 2, with a long timeout, waits
    with it: rank 2 fails too, at once, with rank 0's words, as the daemon fails every waiting rank."""
    rings = _rings([connect(r, 3) for r in range(3)], timeout=60.0)
    rings[0].op_timeout = 0.5
    waiting = rings[2].all_reduce(np.ones(2, np.float32).view(np.uint8), "float32", "sum", None)
    first = rings[0].all_reduce(np.ones(2, np.float32).view(np.uint8), "float32", "sum", None)
    with pytest.raises(CommTimeoutError, match=_TIMED_OUT):
        first.wait()
    with pytest.raises(CommTimeoutError, match=_TIMED_OUT):
        waiting.wait(5)
    with pytest.raises(CommTimeoutError, match=_TIMED_OUT):
        rings[1].all_reduce(np.ones(2, np.float32).view(np.uint8), "float32", "sum", None).wait(5)
    outs = _per_rank(lambda r: rings[r].all_reduce(np.full(3, r + 1.0, np.float32).view(np.uint8), "float32",
                                                   "sum", None).wait(10), n=3)
    assert all(not isinstance(o, BaseException) for o in outs), outs


@pytest.mark.parametrize("verdict", ["withdrawn", "kept"])
def test_a_rank_completing_an_op_waits_for_a_peer_deciding_its_timeout(
        daemon: Any, connect: Callable[..., Any], verdict: str) -> None:
    """The one decision (protocol/fastring.py): rank 0 has marked its entry WITHDRAWING when rank 1's
    input arrives; rank 1 neither completes nor fails the op until rank 0 decides, then follows it."""
    rings = _rings([connect(r, 2) for r in range(2)], timeout=0.5)
    x = np.ones(2, np.float32)
    pending = rings[0].all_reduce(x.view(np.uint8), "float32", "sum", None)
    h = rings[0]._header_at[rings[0].pending[0].seq % rings[0].depth][0]
    words = rings[0]._words
    words[h + fr.STATE] = fr.WITHDRAWING  # as _time_out leaves it between its mark and its verdict
    y = np.full(2, 2.0, np.float32)
    outcome: list[Any] = []

    def late() -> None:
        try:
            rings[1].all_reduce(y.view(np.uint8), "float32", "sum", None).wait(5)
            outcome.append("completed")
        except CommdError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=late, daemon=True)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive() and not outcome, f"rank 1 went on while rank 0 was deciding: {outcome}"
    if verdict == "withdrawn":
        words[h + fr.VERDICT] = 0b10 | 500 << fr.VERDICT_TIMEOUT_SHIFT
    words[h + fr.STATE] = fr.WITHDRAWN if verdict == "withdrawn" else 0
    thread.join(5)
    assert not thread.is_alive()
    if verdict == "withdrawn":
        assert isinstance(outcome[0], CommTimeoutError) and re.search(_TIMED_OUT, str(outcome[0])), outcome
        assert y.tolist() == [2.0, 2.0]
    else:
        assert outcome == ["completed"] and y.tolist() == [3.0, 3.0]
        pending.wait(5)
        assert x.tolist() == [3.0, 3.0]


def test_a_stale_withdrawal_in_an_entry_being_rewritten_fails_nothing(
        daemon: Any, connect: Callable[..., Any]) -> None:
    """Rank 1 is rewriting an entry whose last op (``depth`` ops ago) it withdrew: its header already
    names this op, its mark is still the old WITHDRAWN, its ``posted`` not yet there.  Rank 0, waiting
    for this op, must not take the old mark for this op's timeout (found by the path-equivalence
    schedules: one rank failed an op the other completed)."""
    rings = _rings([connect(r, 2) for r in range(2)], timeout=30.0)
    x = np.ones(2, np.float32)
    pending = rings[0].all_reduce(x.view(np.uint8), "float32", "sum", None)
    op = rings[0].pending[0]
    h = rings[1]._header_at[op.seq % rings[1].depth][1]
    words = rings[1]._words
    words[h + fr.STATE], words[h + fr.VERDICT] = fr.WITHDRAWN, 0b01 | 500 << fr.VERDICT_TIMEOUT_SHIFT  # the old op's
    words[h + fr.SEQ], words[h + fr.INDEX] = op.seq, op.index  # rewritten so far: posted is not
    with pytest.raises(CommTimeoutError, match="not completed after"):
        pending.wait(0.3)  # the caller's own wait ran out; the op is still pending
    y = np.full(2, 2.0, np.float32)
    rings[1].all_reduce(y.view(np.uint8), "float32", "sum", None).wait(5)
    pending.wait(5)
    assert x.tolist() == y.tolist() == [3.0, 3.0]


def test_a_dead_rank_fails_the_waiting_op_before_its_timeout(daemon: Any, connect: Callable[..., Any]) -> None:
    rings = _rings([connect(r, 2) for r in range(2)], timeout=60.0)
    gone = subprocess.Popen(["true"])
    gone.wait(10)
    rings[1].control[rings[1].me, fr.PID] = gone.pid  # rank 1's process, as its ring shows it, has exited
    start = time.monotonic()
    handle = rings[0].all_reduce(np.ones(2, np.float32).view(np.uint8), "float32", "sum", None)
    with pytest.raises(PeerDiedError, match=rf"group rank 1 \(pid {gone.pid}\) died"):
        handle.wait()
    assert time.monotonic() - start < 10
    # An op that reaches the left ring (its caller's ``usable()`` ran before the failure was seen)
    # takes no number: the torch backend sends it down the daemon path, as the other ranks' ops.
    numbers = rings[0].group_ops
    with pytest.raises(RingLeft, match=f"the exchange ring was left .*pid {gone.pid}"):
        rings[0].all_reduce(np.ones(2, np.float32).view(np.uint8), "float32", "sum", None)
    assert rings[0].group_ops == numbers and not rings[0].usable()
    rings[0].usable = lambda: True  # the failure comes between the backend's look and its post
    assert ring_all_reduce(_IdleClient(), rings[0], torch.ones(2), "sum", None, None) is None  # the daemon path


class _IdleClient:
    """What ``ring_all_reduce`` asks of the client before it posts: nothing pending."""

    def wait_group_idle(self, group: str) -> None:
        pass

    def wait_writes_to(self, tensor: Any) -> None:
        pass


def test_close_fails_pending_ops_and_stops_the_progress_thread(daemon: Any, connect: Callable[..., Any]) -> None:
    """A progress thread left running at interpreter exit is stopped inside torch's C++ calls, which
    aborts the process: ``close`` must return only once the thread has left."""
    rings = _rings([connect(r, 2) for r in range(2)])
    pending = rings[0].all_reduce(np.ones(2, np.float32).view(np.uint8), "float32", "sum", None)  # rank 1 never joins
    rings[0].start_receiver()
    thread = next(t for t in threading.enumerate() if t.name == "commd-ring")
    rings[0].close()
    assert not thread.is_alive(), "the ring's progress thread outlived close()"
    with pytest.raises(CommdError, match="commd client is closed"):
        pending.wait(1)


def test_the_daemon_gives_rings_only_to_members_of_local_groups(
    daemon: Any, connect: Callable[..., Any]
) -> None:
    clients = [connect(r, 3) for r in range(3)]
    clients[0].register_group("solo", [0])
    clients[1].register_group("pair", [1, 2])
    c = clients[0]
    with pytest.raises(CommdError, match="authentication failed"):
        request_ring(c.paths.ops_socket, c.client_id, "wrong", "world", 10.0, c.daemon_pid)
    with pytest.raises(CommdError, match="has not registered group 'pair'"):
        request_ring(c.paths.ops_socket, c.client_id, c.secret, "pair", 10.0, c.daemon_pid)
    with pytest.raises(CommdError, match="no exchange ring"):
        request_ring(c.paths.ops_socket, c.client_id, c.secret, "solo", 10.0, c.daemon_pid)
    # one region per group, the same for every member; the daemon keeps serving ops
    r0, _ = request_ring(c.paths.ops_socket, c.client_id, c.secret, "world", 10.0, c.daemon_pid)
    r1, meta = request_ring(c.paths.ops_socket, clients[1].client_id, c.secret, "world", 10.0, c.daemon_pid)
    r0.array[fr.CONTROL_OFFSET] = 42
    assert r1.array[fr.CONTROL_OFFSET] == 42 and meta["rank"] == 1 and meta["nranks"] == 3
    from commd.client import ops

    tensors = [torch.ones(3) for _ in clients]
    handles = [ops.all_reduce(client, t) for client, t in zip(clients, tensors, strict=True)]
    for h in handles:
        h.wait(10)
    assert [t.tolist() for t in tensors] == [[3.0] * 3] * 3


# ---- the torch backend, end to end ----------------------------------------------------
def ring_rank_main(rank: int) -> None:
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd", init_method="env://", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))
    try:
        x = torch.tensor([rank + 1.0, 2.0 * rank])
        work = dist.all_reduce(x, async_op=True)
        assert isinstance(work.handles[0], RingHandle), "a tiny all-reduce did not take the ring"
        work.wait()
        assert x.tolist() == [3.0, 2.0]
        # non-contiguous; an entry's worth and one more; the largest ring op, and one element more
        # goes through the daemon
        y = torch.arange(12, dtype=torch.float64).reshape(3, 4).t() * (rank + 1)
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        assert torch.equal(y, torch.arange(12, dtype=torch.float64).reshape(3, 4).t() * 2)
        largest = fr.large_bytes(WORLD) // 4
        for n in (fr.SLOT_BYTES // 4, fr.SLOT_BYTES // 4 + 1, largest, largest + 1):
            z = torch.full((n,), float(rank + 1))
            w = dist.all_reduce(z, async_op=True)
            assert isinstance(w.handles[0], RingHandle) == (n <= largest)
            w.wait()
            assert bool((z == 3).all())
        # program order with a daemon op on the same tensor: the broadcast sees the reduced value
        v = torch.full((8,), float(rank + 1))
        dist.all_reduce(v, async_op=True)
        dist.broadcast(v, src=1)
        assert v.tolist() == [3.0] * 8
        # ... and on a zero-copy tensor (the arena: the daemon writes it in place when the op runs):
        # the ring reads it only after the pending broadcast wrote it, and a broadcast after a
        # pending ring op sees the reduced value
        a = commd.empty((16,), torch.float32)
        a.fill_(rank + 1.0)
        if rank == 1:
            time.sleep(0.3)  # rank 0's broadcast is surely still pending when it reaches the all-reduce
        dist.broadcast(a, src=1, async_op=True)
        dist.all_reduce(a)
        assert a.tolist() == [4.0] * 16, a.tolist()
        a.fill_(rank + 1.0)
        w = dist.all_reduce(a, async_op=True)
        dist.broadcast(a, src=0)
        w.wait()
        assert a.tolist() == [3.0] * 16, a.tolist()
        # futures complete without anyone waiting on the work
        f = torch.full((4,), float(rank + 1))
        fut = dist.all_reduce(f, async_op=True).get_future()
        assert fut.wait()[0].tolist() == [3.0] * 4
        # a mismatch fails both ranks; the group goes on
        try:
            dist.all_reduce(torch.ones(2 + rank))
            raise AssertionError("a count mismatch went unnoticed")
        except MismatchError as exc:
            assert "'count' differs" in str(exc)
        # ... and through get_future() (what DDP waits on), on every rank
        fut = dist.all_reduce(torch.ones(3 + rank), async_op=True).get_future()
        failure = None
        try:
            fut.wait()
        except Exception as exc:  # torch reports a failed future as an error carrying the commd message
            failure = str(exc)
        assert failure is not None and "'count' differs" in failure, f"rank {rank}: {failure!r}"
        u = torch.tensor([rank * 10.0])
        dist.all_reduce(u)
        assert u.item() == 10.0
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_torch_backend_takes_the_ring_for_small_all_reduces(backend_env: Any) -> None:
    spawn(ring_rank_main, ())


def exit_without_destroy_rank_main(rank: int, out_dir: str) -> None:
    """Futures on the ring (DDP's path), then the process ends without destroy_process_group: its exit
    hooks run as at interpreter exit, then the threads still alive are written down."""
    import atexit
    import os

    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd", init_method="env://", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))
    x = torch.full((4,), float(rank + 1))
    work = dist.all_reduce(x, async_op=True)
    assert isinstance(work.handles[0], RingHandle), "a tiny all-reduce did not take the ring"
    assert work.get_future().wait()[0].tolist() == [3.0] * 4
    assert "commd-ring" in [t.name for t in threading.enumerate()], "the future did not start the ring's thread"
    dist.barrier()
    atexit._run_exitfuncs()  # what the interpreter runs before it stops the daemon threads
    Path(out_dir, f"threads{rank}").write_text(
        " ".join(sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())))
    os._exit(0)


@pytest.mark.timeout(120)
def test_ranks_that_exit_without_destroying_the_group_leave_no_ring_thread(backend_env: Any, tmp_path: Path) -> None:
    """commd closes the rings at exit (joining their threads) before Python stops daemon threads."""
    spawn(exit_without_destroy_rank_main, (str(tmp_path),))
    for rank in range(WORLD):
        alive = (tmp_path / f"threads{rank}").read_text().split()
        assert "commd-ring" not in alive, f"rank {rank}: threads alive at exit: {alive}"


def fallback_rank_main(rank: int) -> None:
    """Rank 1 cannot use a ring (COMMD_LOCAL_RING=0): both ranks must then keep the daemon path."""
    import os

    import commd  # noqa: F401 - registers the backend

    if rank == 1:
        os.environ["COMMD_LOCAL_RING"] = "0"
    dist.init_process_group("commd", init_method="env://", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))
    try:
        x = torch.tensor([rank + 1.0])
        work = dist.all_reduce(x, async_op=True)
        assert not isinstance(work.handles[0], RingHandle), f"rank {rank} took a ring its peer does not have"
        work.wait()
        assert x.item() == 3.0
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_rank_without_a_ring_keeps_the_whole_group_on_the_daemon_path(backend_env: Any) -> None:
    spawn(fallback_rank_main, ())


def diverge_rank_main(rank: int) -> None:
    """The ranks disagree on which path an op takes (rank 0's all-reduce fits the ring, rank 1's
    is one element larger; or rank 0 all-reduces while rank 1 broadcasts): both ranks get a
    MismatchError at once, long before the op's timeout, through wait() and through
    get_future() (what DDP waits on), and the group goes on, right.  Each case on a fresh group
    (the first disagreement makes a group leave its ring)."""
    import commd  # noqa: F401 - registers the backend

    timeout = 60.0
    dist.init_process_group("commd", init_method="env://", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=timeout))
    try:
        largest = fr.large_bytes(WORLD) // 4
        for case in ("size", "kind", "size, future"):
            group = dist.new_group([0, 1])
            probe = torch.ones(2)
            work = dist.all_reduce(probe, group=group, async_op=True)
            assert isinstance(work.handles[0], RingHandle), "the fresh group has no ring"
            work.wait()
            x = torch.ones(largest + (0 if case == "kind" else rank))
            started = time.monotonic()
            try:
                if case == "kind" and rank == 1:
                    dist.broadcast(x, src=0, group=group)
                elif case == "size, future":
                    dist.all_reduce(x, group=group, async_op=True).get_future().wait()
                else:
                    dist.all_reduce(x, group=group)
                raise AssertionError(f"rank {rank}: a ring/daemon disagreement ({case}) went unnoticed")
            except Exception as exc:  # a failed future surfaces as torch's error carrying commd's message
                if case != "size, future" and not isinstance(exc, MismatchError):
                    raise
                elapsed = time.monotonic() - started
                assert elapsed < timeout / 4, f"rank {rank}: the mismatch took {elapsed:.1f}s to surface"
                assert "mismatched collective" in str(exc), f"rank {rank} ({case}): {exc}"
            # the group goes on (through the daemon: the ring was left), with right results
            for n in (3, largest):
                y = torch.full((n,), float(rank + 1))
                work = dist.all_reduce(y, group=group, async_op=True)
                assert not isinstance(work.handles[0], RingHandle), "the ring was used after it was left"
                work.wait()
                assert bool((y == 3).all()), f"rank {rank}: wrong result after the mismatch"
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_ring_or_daemon_get_a_mismatch_at_once(backend_env: Any) -> None:
    spawn(diverge_rank_main, ())


def test_three_ranks_reduce_in_rank_order_in_entries_and_large_slots(daemon: Any, connect: Callable[..., Any]) -> None:
    """An odd group: the largest op is 8 MiB / 3 (a page multiple); every rank computes the same
    bits as NumPy adding the inputs in group-rank order, in the entries and in the large slots."""
    clients = [connect(r, 3) for r in range(3)]
    rings = _rings(clients)
    largest = fr.large_bytes(3) // 8
    assert rings[0].max_bytes == fr.large_bytes(3) and fr.large_bytes(3) % 4096 == 0
    sizes = [5, fr.SLOT_BYTES // 8, fr.SLOT_BYTES // 8 + 1, largest]

    def body(r: int) -> list[np.ndarray]:
        got = []
        for n in sizes:
            for op in ("sum", "avg"):
                x = _inputs(r, "float64", n)
                rings[r].all_reduce(x.view(np.uint8), "float64", op, None).wait(20)
                got.append(x)
        return got

    results = _per_rank(body, n=3)
    for r in range(3):
        assert not isinstance(results[r], BaseException), results[r]
    i = 0
    for n in sizes:
        xs = [_inputs(r, "float64", n) for r in range(3)]
        total = (xs[0] + xs[1]) + xs[2]
        for want in (total, total / 3):
            for r in range(3):
                np.testing.assert_array_equal(results[r][i], want, err_msg=f"n={n} rank {r}")
            i += 1


def test_a_peer_that_sent_the_place_to_the_daemon_fails_the_ring_op_at_once(
        daemon: Any, connect: Callable[..., Any]) -> None:
    """The ring side of a disagreement, alone: rank 1 counts a daemon collective, rank 0 posts a
    ring op at that place: a MismatchError in moments (the op's timeout is 60 s), the daemon told
    the op's shape, both ranks leave the ring; a failing notification changes none of it."""
    clients = [connect(r, 2) for r in range(2)]
    for failing in (False, True):
        group = f"pair{int(failing)}"
        for c in clients:
            c.register_group(group, [0, 1])
        rings = _rings(clients, group=group, timeout=60.0)
        told: list[tuple[str, str, int]] = []

        def tell(dtype: str, op: str, count: int, failing: bool = failing,
                 told: list[tuple[str, str, int]] = told) -> None:
            told.append((dtype, op, count))
            if failing:
                raise RuntimeError("the daemon could not be told")

        rings[0].on_diverged = tell
        rings[1].note_daemon_op()
        x = np.ones(5, np.float32)
        started = time.monotonic()
        with pytest.raises(MismatchError, match=r"group ranks \[1\] a collective that goes through the daemon"):
            rings[0].all_reduce(x.view(np.uint8), "float32", "sum", None).wait(30)
        assert time.monotonic() - started < 10
        assert told == [("float32", "sum", 5)]
        assert not rings[0].usable() and not rings[1].usable()
        assert x.tolist() == [1.0] * 5  # the failed op left the input as it was


def traced_rank_main(rank: int, out_dir: str) -> None:
    """``commd trace start`` on a running job whose all-reduces take the ring: every op between start
    and stop is in the trace (lane ``ring``, numbered as the daemon numbers its own), none before; a
    ring op's failure (a mismatch) has its line in the daemon's log."""
    import json
    import subprocess
    import sys

    import commd  # noqa: F401 - registers the backend
    from commd.torch_backend.process_group import current_client

    dist.init_process_group("commd", init_method="env://", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))
    try:
        job = current_client().paths.job
        trace = Path(out_dir, "live.json")

        def cli(*argv: str) -> None:
            out = subprocess.run([sys.executable, "-m", "commd", "trace", *argv, "--job", job],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr

        for _ in range(3):  # untraced
            dist.all_reduce(torch.ones(4))
        dist.barrier()  # #3
        if rank == 0:
            cli("start", str(trace))
        dist.barrier()  # #4
        works = [dist.all_reduce(torch.full((16,), float(i)), async_op=True) for i in range(5)]  # #5..#9
        assert all(isinstance(w.handles[0], RingHandle) for w in works)
        for w in works:
            w.wait()
        try:
            dist.all_reduce(torch.ones(2 + rank))  # #10: a mismatch, on the ring
        except MismatchError:
            pass
        dist.barrier()  # #11: the ring ops' records reach the daemon before it (one op channel)
        if rank == 0:
            cli("stop")
            events = json.loads(trace.read_text())
            ops = sorted((e["args"]["seq"], e["args"]["kind"], e["args"]["lane"], "error" in e["args"])
                         for e in events if e.get("ph") == "b" and "args" in e)
            Path(out_dir, "ops.json").write_text(json.dumps(ops))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_trace_started_on_a_running_job_records_its_ring_ops(backend_env: Any, tmp_path: Path) -> None:
    import json

    spawn(traced_rank_main, (str(tmp_path),))
    ops = json.loads((tmp_path / "ops.json").read_text())
    ring = [op for op in ops if op[2] == "ring"]
    assert [op[0] for op in ring] == [5, 6, 7, 8, 9, 10] and all(op[1] == "allreduce" for op in ring), ops
    assert [op[3] for op in ring] == [False] * 5 + [True], ring  # the mismatch is traced with its error
    assert [op[0] for op in ops if op[2] != "ring"] == [4, 11], ops  # the barriers after the start
    log = next(backend_env.glob("*/daemon.log")).read_text()
    lines = [line for line in log.splitlines() if "op failed (mismatch)" in line]
    assert len(lines) == 1 and "allreduce #10 on group" in lines[0] and "ranks [0, 1]" in lines[0], lines
