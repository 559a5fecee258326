"""all_reduce of sparse COO tensors on the "commd" backend, against Gloo and a dense reference.

Every rank builds everyone's deterministic inputs (random nnz, zero included,
duplicate indices, uncoalesced), all-reduces its own on commd and on a Gloo
group over the same store, and checks the result against the sum of every
rank's ``to_dense()`` and against Gloo's.  Failures (a non-SUM op, a dense
tensor or another shape on some rank) must reach every rank, through wait(),
exception() and the future, while the group keeps working.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_torch_backend import INIT_TIMEOUT, spawn

pytestmark = pytest.mark.timeout(240)

#: (dtype, sparse sizes, dense sizes) of the random cases: 1-D and 2-D sparse, hybrid with dense trailing dims.
CASES = [
    (torch.float32, (50,), ()),
    (torch.float64, (7, 9), ()),
    (torch.int64, (40,), ()),
    (torch.int64, (6, 5), ()),
    (torch.float32, (12,), (3,)),
    (torch.float64, (5, 4), (2, 3)),
]


def _init(rank: int, world: int) -> Any:
    """The commd default group of ``world`` ranks and a Gloo group of the same ranks."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd", timeout=INIT_TIMEOUT)
    return dist.new_group(backend="gloo")


def random_sparse(rank: int, case: int, dtype: torch.dtype, sparse: tuple[int, ...],
                  dense: tuple[int, ...]) -> torch.Tensor:
    """Rank ``rank``'s uncoalesced input of case ``case`` (any rank can rebuild it): rank 1 gives no
    entries in every third case, the others up to 12 with one index repeated."""
    gen = torch.Generator().manual_seed(7919 * case + rank)
    nnz = 0 if rank == 1 and case % 3 == 0 else int(torch.randint(1, 13, (1,), generator=gen))
    indices = torch.stack([torch.randint(0, n, (nnz,), generator=gen) for n in sparse])
    if nnz:
        indices = torch.cat([indices, indices[:, :1]], dim=1)  # a duplicate: summed by the reduction
        nnz += 1
    if dtype.is_floating_point:
        values = torch.randn((nnz, *dense), generator=gen, dtype=torch.float64).to(dtype)
    else:
        values = torch.randint(-1000, 1000, (nnz, *dense), generator=gen).to(dtype)
    tensor = torch.sparse_coo_tensor(indices, values, (*sparse, *dense))
    assert nnz == 0 or not tensor.is_coalesced()
    return tensor


def _check_result(got: torch.Tensor, want_dense: torch.Tensor, gloo: torch.Tensor, what: str) -> None:
    assert got.layout == torch.sparse_coo and got.is_coalesced(), f"{what}: not a coalesced sparse tensor"
    assert got.shape == want_dense.shape and got.dtype == want_dense.dtype, f"{what}: {got.shape} {got.dtype}"
    if got.dtype.is_floating_point:
        torch.testing.assert_close(got.to_dense(), want_dense, msg=lambda m: f"{what} vs dense sum: {m}")
    else:
        assert torch.equal(got.to_dense(), want_dense), f"{what}: differs from the dense sum"
    # same entries as Gloo's (its result is coalesced too): nnz and indices exactly, values closely
    torch.testing.assert_close(got, gloo.coalesce(), msg=lambda m: f"{what} vs Gloo: {m}")


def sums_rank(rank: int, world: int) -> None:
    """Random cases, torch's own DistributedTest cases, async forms: all equal to the references."""
    gloo = _init(rank, world)
    try:
        for case, (dtype, sparse, dense) in enumerate(CASES):
            mine = random_sparse(rank, case, dtype, sparse, dense)
            want = sum(random_sparse(r, case, dtype, sparse, dense).to_dense() for r in range(world))
            over_commd, over_gloo = mine.clone(), mine.clone()
            dist.all_reduce(over_commd)
            dist.all_reduce(over_gloo, group=gloo)
            _check_result(over_commd, want, over_gloo, f"case {case} {dtype} {sparse}+{dense}")

        # torch's test_sparse_all_reduce_sum: the result replaces the input, compared as assertEqual does
        from torch.testing._internal.common_distributed import simple_sparse_reduce_tests

        for i, (inputs, outputs) in enumerate(simple_sparse_reduce_tests(rank, world, num_inputs=1)):
            tensor = inputs[0]
            dist.all_reduce(tensor, dist.ReduceOp.SUM)
            torch.testing.assert_close(tensor, outputs[0], msg=lambda m, i=i: f"torch's sparse case {i}: {m}")

        # no rank has an entry
        empty = torch.sparse_coo_tensor(torch.empty(2, 0, dtype=torch.int64), torch.empty(0, 3), (4, 4, 3))
        dist.all_reduce(empty)
        assert empty.is_coalesced() and empty.values().shape[0] == 0 and empty.shape == (4, 4, 3)

        # a group of one rank: its own tensor, coalesced
        alone = [dist.new_group([r]) for r in range(world)][rank]
        tensor = random_sparse(rank, 1, *CASES[1])
        dist.all_reduce(tensor, group=alone)
        assert tensor.is_coalesced() and torch.equal(tensor.to_dense(), random_sparse(rank, 1, *CASES[1]).to_dense())

        # async: wait(), then the future; the future alone (its callbacks sum the entries)
        dtype, sparse, dense = CASES[4]
        want = sum(random_sparse(r, 4, dtype, sparse, dense).to_dense() for r in range(world))
        tensor = random_sparse(rank, 4, dtype, sparse, dense)
        work = dist.all_reduce(tensor, async_op=True)
        assert work.wait() and work.is_completed() and work.is_success() and work.exception() is None
        assert work.result()[0] is tensor
        assert work.get_future().wait()[0] is tensor
        torch.testing.assert_close(tensor.to_dense(), want, msg=lambda m: f"async wait(): {m}")
        tensor = random_sparse(rank, 4, dtype, sparse, dense)
        value = dist.all_reduce(tensor, async_op=True).get_future().wait()
        assert value[0] is tensor and tensor.is_coalesced()
        torch.testing.assert_close(tensor.to_dense(), want, msg=lambda m: f"async future: {m}")
    finally:
        dist.destroy_process_group()


def _outcomes(make: Any, op: Any = dist.ReduceOp.SUM) -> dict[str, str | None]:
    """The error one failing all_reduce gives through each API: raised at the call, by wait(), by the
    future's wait(), and exception() after wait() (three runs of the same op)."""
    seen: dict[str, str | None] = {}
    for api in ("wait", "future", "exception"):
        try:
            work = dist.all_reduce(make(), op, async_op=True)
        except Exception as exc:
            seen["call"] = f"{type(exc).__name__}: {exc}"
            continue
        try:
            if api == "future":
                work.get_future().wait()
            else:
                work.wait()
            seen[api] = None
        except Exception as exc:
            seen[api] = f"{type(exc).__name__}: {exc}"
        if api == "exception":
            error = work.exception()
            seen[api] = None if error is None else f"{type(error).__name__}: {error}"
            assert not work.is_success()
    return seen


def _assert_everywhere(seen: dict[str, str | None], want: str, what: str) -> None:
    for api in ("wait", "future", "exception"):
        assert seen.get(api) is not None, f"{what}: no error through {api}(): {seen}"
        assert want in seen[api], f"{what}: {api}() gave {seen[api]!r}, wanted {want!r}"  # type: ignore[operator]


def errors_rank(rank: int, world: int) -> None:
    """Every invalid sparse all_reduce fails on every rank with a clear error; the group goes on."""
    _init(rank, world)
    try:
        def sparse(size: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.sparse_coo_tensor([[0, 2]], torch.tensor([1, 2], dtype=dtype), (size,))

        # another size on one rank
        seen = _outcomes(lambda: sparse(4 + (rank == 1)))
        _assert_everywhere(seen, "MismatchError: sparse all_reduce: the ranks' sparse tensors differ", "sizes")
        assert "rank 1: torch.float32 of size [5]" in seen["wait"], seen  # type: ignore[operator]
        # another dtype on one rank
        seen = _outcomes(lambda: sparse(dtype=torch.float64 if rank == 0 else torch.float32))
        _assert_everywhere(seen, "rank 0: torch.float64 of size [4]", "dtypes")
        # another number of sparse dimensions (same number of dimensions)
        seen = _outcomes(lambda: sparse(4).to_dense().reshape(2, 2).to_sparse(1 + rank))
        _assert_everywhere(seen, "with 2 sparse dimension(s)", "sparse dims")

        # MAX everywhere: refused at the call on every rank (as on Gloo)
        seen = _outcomes(sparse, dist.ReduceOp.MAX)
        assert seen == {"call": "ValueError: all_reduce: only ReduceOp.SUM is supported for sparse tensors "
                                "(as on Gloo), got MAX"}, seen
        # AVG on rank 0 only: refused there at the call, rank 1 learns it through its work
        seen = _outcomes(sparse, dist.ReduceOp.AVG if rank == 0 else dist.ReduceOp.SUM)
        if rank == 0:
            assert set(seen) == {"call"} and "got AVG" in seen["call"], seen  # type: ignore[operator]
        else:
            _assert_everywhere(seen, "MismatchError: sparse all_reduce: rank 0: only ReduceOp.SUM", "AVG on rank 0")
        # a CSR tensor on rank 1: refused there, rank 0 told
        seen = _outcomes(lambda: sparse().to_dense().reshape(2, 2).to_sparse_csr() if rank == 1
                         else sparse().to_dense().reshape(2, 2).to_sparse())
        if rank == 1:
            assert set(seen) == {"call"} and "only sparse COO tensors" in seen["call"], seen  # type: ignore[operator]
        else:
            _assert_everywhere(seen, "rank 1: only sparse COO tensors", "CSR on rank 1")

        # a dense tensor on rank 0, a sparse one on rank 1 (large and small dense: daemon and ring paths)
        for n in (4, 100_000):
            seen = _outcomes(lambda n=n: torch.ones(n) if rank == 0 else sparse(n))
            _assert_everywhere(seen, "MismatchError", f"dense {n} on rank 0")
            if rank == 1:
                assert "sparse all_reduce: the ranks could not exchange" in seen["wait"], seen  # type: ignore[operator]

        # sparse tensors in all_reduce_coalesced: refused at the call
        try:
            dist.all_reduce_coalesced([sparse(), sparse()])
            raise AssertionError("all_reduce_coalesced took sparse tensors")
        except ValueError as exc:
            assert "dense tensors only" in str(exc), exc

        # the group still works, sparse and dense
        good = sparse()
        dist.all_reduce(good)
        assert torch.equal(good.to_dense(), world * torch.tensor([1.0, 0.0, 2.0, 0.0])), good
        dense = torch.full((10,), float(rank + 1))
        dist.all_reduce(dense)
        assert torch.equal(dense, torch.full((10,), float(sum(range(1, world + 1)))))
    finally:
        dist.destroy_process_group()


def _ddp_train(rank: int, group: Any, steps: int = 4) -> tuple[list[torch.Tensor], bool]:
    """SGD steps of an EmbeddingBag(sparse=True) + Linear DDP model; every rank starts from other weights.
    Returns the parameters and whether the embedding's gradient was sparse."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(10 + rank)  # DDP broadcasts rank 0's initial weights
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(30, 8, mode="sum", sparse=True), torch.nn.Linear(8, 2))
    ddp = DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    sparse_grad = True
    for _ in range(steps):
        words, target = torch.randint(0, 30, (6, 5), generator=data), torch.randn(6, 2, generator=data)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(words), target).backward()
        sparse_grad = sparse_grad and model[0].weight.grad.is_sparse
        opt.step()
    return [p.detach().clone() for p in model.parameters()], sparse_grad


def ddp_rank(rank: int, world: int) -> None:
    """DDP with sparse embedding gradients trains the same on commd as on Gloo; replicas agree."""
    gloo = _init(rank, world)
    try:
        over_commd, sparse_commd = _ddp_train(rank, dist.group.WORLD)
        over_gloo, sparse_gloo = _ddp_train(rank, gloo)
        assert sparse_commd and sparse_gloo, "the embedding's gradients were not sparse"
        for i, (c, g) in enumerate(zip(over_commd, over_gloo, strict=True)):
            torch.testing.assert_close(c, g, msg=lambda m, i=i: f"DDP parameter {i}, commd vs Gloo: {m}")
        flat = torch.cat([p.reshape(-1) for p in over_commd])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat, group=gloo)
        assert all(torch.equal(everyone[0], e) for e in everyone), "DDP replicas diverged"
        assert not torch.equal(over_commd[0], _initial_embedding()), "the embedding did not train"
    finally:
        dist.destroy_process_group()


def _initial_embedding() -> torch.Tensor:
    """Rank 0's initial embedding weights, which DDP broadcast to every rank."""
    torch.manual_seed(10)
    return torch.nn.EmbeddingBag(30, 8, mode="sum", sparse=True).weight.detach()


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sparse_all_reduce_matches_dense_sum_and_gloo(backend_env: Any, world: int) -> None:
    spawn(sums_rank, (world,), nprocs=world)


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
def test_invalid_sparse_all_reduce_fails_every_rank(backend_env: Any) -> None:
    spawn(errors_rank, (2,), nprocs=2)


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
def test_ddp_with_sparse_embedding_gradients_matches_gloo(backend_env: Any) -> None:
    spawn(ddp_rank, (2,), nprocs=2)


def cuda_rank(rank: int, world: int) -> None:
    """Sparse CUDA tensors (torch's test_sparse_all_reduce_sum_cuda): the sum stays on the GPU."""
    _init(rank, world)
    try:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        for case, (dtype, sparse, dense) in enumerate(CASES):
            tensor = random_sparse(rank, case, dtype, sparse, dense).to(device)
            want = sum(random_sparse(r, case, dtype, sparse, dense).to_dense() for r in range(world))
            dist.all_reduce(tensor)
            assert tensor.device == device and tensor.is_coalesced(), f"case {case}: {tensor.device}"
            torch.testing.assert_close(tensor.to_dense().cpu(), want, msg=lambda m, c=case: f"CUDA case {c}: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sparse_cuda_all_reduce_matches_dense_sum(backend_env: Any) -> None:
    spawn(cuda_rank, (2,), nprocs=2)
