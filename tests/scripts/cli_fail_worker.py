"""Launched by `commd launch` in tests: rank 1 fails with code 7, rank 0 would block for a minute."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import commd  # noqa: F401  (registers the "commd" backend)


def main() -> int:
    out_dir = sys.argv[1]
    dist.init_process_group("commd", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)
        os._exit(7)
    # Rank 0 blocks in a collective its peer never joins, then in a sleep.
    try:
        dist.all_reduce(torch.ones(4))
    except Exception:
        pass
    time.sleep(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
