"""Per-op cost of the trace: small synchronous all-reduces with tracing off and on, interleaved.

One daemon, 2 ranks on this host (client library).  Each run is ``--ops``
all-reduces of ``--count`` float32 (an arena tensor, waited one by one); runs
alternate trace off / trace on (``commd trace start``/``stop`` on the same
daemon), ``--repeats`` each, and the median per-op time of each setting is
reported.  ``--modes off`` measures without the trace control message, so the
same script can time an older commd for the "free when off" comparison.

    python benchmarks/trace_overhead.py --ops 2000 --repeats 7
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any


def rank_main(rank: int, job: str, conn: Any, ops_per_run: int, count: int) -> None:
    import torch

    from commd.client import Client, ops

    client = Client(rank, 2, job=job, connect_timeout=60.0)
    client.register_group("world", [0, 1])
    t = client.empty(count, torch.float32)
    t.fill_(1.0)
    while True:
        command = conn.recv()
        if command is None:
            break
        started = time.perf_counter()
        for _ in range(ops_per_run):
            ops.all_reduce(client, t).wait(60)
        conn.send(time.perf_counter() - started)
    client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=2000, help="all-reduces per run")
    parser.add_argument("--count", type=int, default=64, help="float32 elements per all-reduce")
    parser.add_argument("--repeats", type=int, default=7, help="runs per setting")
    parser.add_argument("--modes", default="off,on", help="settings to interleave: off, on")
    args = parser.parse_args()
    modes = args.modes.split(",")
    runtime = Path(tempfile.mkdtemp(prefix="commd-trace-bench-"))
    os.environ["COMMD_RUNTIME_DIR"] = str(runtime)
    job = f"bench{uuid.uuid4().hex[:8]}"
    from commd.client.spawn import ping
    from commd.runtime import JobPaths

    paths = JobPaths(job, runtime / job)
    daemon = subprocess.Popen([sys.executable, "-m", "commd", "daemon", "--job", job],
                              stdout=subprocess.DEVNULL, stderr=open(runtime / "daemon.err", "wb"))
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    try:
        deadline = time.monotonic() + 60
        while ping(paths, 0.2) != daemon.pid:
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise SystemExit(f"the daemon did not start; see {runtime / 'daemon.err'}")
            time.sleep(0.05)
        for rank in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(rank, job, child, args.ops, args.count), daemon=True)
            proc.start()
            pipes.append(parent)
            procs.append(proc)

        def one_run() -> float:
            for pipe in pipes:
                pipe.send("run")
            return max(pipe.recv() for pipe in pipes) / args.ops * 1e6

        one_run()  # warm-up
        results: dict[str, list[float]] = {mode: [] for mode in modes}
        for repeat in range(args.repeats):
            for mode in modes:
                if mode == "on":
                    from commd.client.status import send_trace_control

                    send_trace_control(paths, "start", str(runtime / f"trace{repeat}.json"))
                results[mode].append(one_run())
                if mode == "on":
                    send_trace_control(paths, "stop", None)
        for mode in modes:
            runs = ", ".join(f"{x:.1f}" for x in results[mode])
            print(f"trace {mode:3}: median {statistics.median(results[mode]):7.1f} us/op  (runs: {runs})")
        if "off" in results and "on" in results:
            off, on = statistics.median(results["off"]), statistics.median(results["on"])
            print(f"tracing adds {on - off:+.1f} us/op ({(on / off - 1) * 100:+.1f}%)")
    finally:
        for pipe in pipes:
            pipe.send(None)
        for proc in procs:
            proc.join(timeout=20)
        daemon.terminate()
        daemon.wait(timeout=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
