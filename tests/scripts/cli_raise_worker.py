"""Launched by `commd launch` in tests: rank 1 raises; rank 0's next collective then fails too (its peer
died), and it re-raises: the launcher must name rank 1, the first to fail, and its exception."""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import commd  # noqa: F401  (registers the "commd" backend)


def main() -> int:
    dist.init_process_group("commd", timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    dist.barrier()
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(4))  # fails: rank 1 is gone (a follow-on error, raised second)
    return 0


if __name__ == "__main__":
    sys.exit(main())
