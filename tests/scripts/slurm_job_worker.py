"""A rank of a Slurm job in tests/test_deploy.py: all_reduce through the daemon the prolog started.

argv: rank world_size [node,node,...] ; prints one JSON line: {"ok", "sum"} or {"ok": false, "error"}.
The environment is what the TaskProlog exported (COMMD_JOB, COMMD_RUNTIME_DIR, COMMD_NODE).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from commd.client import Client, ops


def main() -> int:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    nodes = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    try:
        client = Client(rank, world, connect_timeout=float(os.environ.get("WORKER_CONNECT_TIMEOUT", "60")),
                        nodes=nodes)
        client.register_group("world", list(range(world)))
        small = torch.full((7,), float(rank + 1))
        large = torch.full((300_000,), float(rank + 1))  # above the inline limit: staged through the arena
        ops.all_reduce(client, small).wait(60)
        ops.all_reduce(client, large).wait(60)
        client.close()
    except Exception as exc:  # the test asserts on the message
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps({"ok": True, "sum": [float(small[0]), float(large[-1])], "uid": os.getuid()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
