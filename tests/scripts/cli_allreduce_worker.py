"""Launched by `commd launch` in tests: all_reduce through the commd backend and check the sum."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import commd  # registers the "commd" backend


def main() -> int:
    out_dir = sys.argv[1]
    dist.init_process_group("commd", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = world * (world + 1) / 2
    small = torch.full((7,), float(rank + 1))
    large = torch.full((300_000,), float(rank + 1))  # above the inline limit: goes through the arena
    dist.all_reduce(small)
    dist.all_reduce(large)
    ok = bool(torch.all(small == expected)) and bool(torch.all(large == expected))
    lane_ops = None
    if len(sys.argv) > 2:  # a second group whose ops ask for one lane (pg_options)
        group = dist.new_group(list(range(world)), pg_options=commd.Options(lane=sys.argv[2]))
        again = torch.full((1000,), float(rank + 1))
        dist.all_reduce(again, group=group)
        ok = ok and bool(torch.all(again == expected))
        from commd.cli.status import query_status
        from commd.torch_backend.process_group import current_client

        fabric = query_status(current_client().paths)["fabric"]
        lane_ops = fabric["lane_ops"] if fabric else None
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "GROUP_RANK", "COMMD_JOB", "COMMD_SECRET"]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"ok": ok, "sum": float(small[0]), "env": {k: os.environ.get(k) for k in keys},
                   "lane_ops": lane_ops}, f)
    dist.destroy_process_group()
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
