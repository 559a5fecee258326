"""Processes of the multi-node benchmark (started by benchmarks/multinode.py inside simulated hosts).

Usage::

    python _multinode_worker.py commd CONFIG.json RANK   # commd client library, arena tensors, lane hints
    python _multinode_worker.py gloo  CONFIG.json RANK   # torch.distributed Gloo across every rank
    commd launch ... _multinode_worker.py torch CONFIG.json  # torch.distributed "commd", rank from RANK
    mpiexec ... python _multinode_worker.py mpi CONFIG.json   # mpi4py Allreduce, rank from COMM_WORLD
    python _multinode_worker.py link-server PORT CONNS TIMEOUT   # TCP sink / echo for the link bound
    python _multinode_worker.py link-client IP PORT sink|ping SECONDS|COUNT OUT.json

Every all-reduce path runs the same measurement loop (``measure``) so the
rows are comparable: per size one checked all-reduce, one timed warm-up,
then the ranks agree (an all-reduce of ``max``) on the warm-up time, which
sets the number of extra warm-ups and timed iterations from the time budget
per size — all ranks must run the same count, and a machine whose speed
varies tenfold with load needs a measured estimate rather than a fixed one.
Each rank records the byte counters of its namespace's eth0 around the timed
loop, so the report can show how many bytes really crossed the link.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ELEMENT = 4  # float32
LINK_CHUNK = 4 << 20


# ---- shared ------------------------------------------------------------------
def link_counters(dev: str = "eth0") -> dict[str, int] | None:
    """Bytes sent/received on ``dev`` of this process's network namespace (None if absent)."""
    base = Path("/sys/class/net") / dev / "statistics"
    try:
        return {"rx": int((base / "rx_bytes").read_text()), "tx": int((base / "tx_bytes").read_text())}
    except OSError:
        return None


def _write_json(path: str, value: Any) -> None:
    """Atomically: the orchestrator never reads half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def _fill(buf: Any, value: float) -> None:
    """Fill a torch tensor or a numpy array."""
    if hasattr(buf, "fill_"):
        buf.fill_(value)
    else:
        buf.fill(value)


def process_cost(daemon_pid: int | None = None) -> dict[str, float]:
    """CPU seconds and context switches so far: this rank's (``getrusage``) and, when given, its host's
    daemon's (``/proc``: every thread's, voluntary and involuntary switches)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    cost = {"rank_cpu_s": usage.ru_utime + usage.ru_stime, "rank_csw": float(usage.ru_nvcsw + usage.ru_nivcsw)}
    if daemon_pid is not None:
        try:
            fields = Path(f"/proc/{daemon_pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks = os.sysconf("SC_CLK_TCK")
            cost["daemon_cpu_s"] = (int(fields[11]) + int(fields[12])) / ticks
            switches = 0
            for task in Path(f"/proc/{daemon_pid}/task").iterdir():
                for line in (task / "status").read_text().splitlines():
                    if line.endswith("ctxt_switches:") or "ctxt_switches:" in line:
                        switches += int(line.split(":")[1])
            cost["daemon_csw"] = float(switches)
        except (OSError, ValueError, IndexError):
            pass
    return cost


def measure(
    cfg: dict[str, Any], rank: int, world: int, make: Callable[[int], Any],
    reduce_fn: Callable[[Any], None], agree_max: Callable[[float], float], barrier: Callable[[], None],
    what: str, after_size: Callable[[], Any] | None = None, counters: Callable[[], Any] | None = None,
    daemon_pid: int | None = None,
) -> list[dict[str, Any]]:
    """Time ``reduce_fn`` on tensors of each size; iteration counts from the per-size time budget.

    ``after_size`` (optional) is called after each size's timed loop; what it
    returns is kept with that size (commd: the daemon's fabric counters).
    ``counters`` (optional) is read just before and just after the timed loop,
    kept as ``counters: {"before", "after"}`` (the torch path: which of its ops
    reached the daemons).
    """
    results = []
    want = world * (world + 1) / 2
    for nbytes in cfg["sizes"]:
        buf = make(nbytes // ELEMENT)
        _fill(buf, rank + 1)
        barrier()
        reduce_fn(buf)  # the check, and the first use of any connection
        if not bool((buf == want).all()):
            raise SystemExit(f"{what}: wrong all_reduce result on rank {rank} at {nbytes} B: "
                             f"{buf[:4].tolist()} != {want}")
        _fill(buf, 0)  # zeros stay zeros over many in-place sums
        t0 = time.perf_counter()
        reduce_fn(buf)
        first = agree_max(time.perf_counter() - t0)
        budget = cfg["time_per_size_s"]
        extra_warmup = _clamp(int(0.25 * budget / max(first, 1e-9)), 0, cfg["warmup"] - 1)
        iters = _clamp(int(budget / max(first, 1e-9)), cfg["min_iters"], cfg["max_iters"])
        for _ in range(extra_warmup):
            reduce_fn(buf)
        barrier()
        seen = counters() if counters is not None else None
        before = link_counters()
        cost_before = process_cost(daemon_pid)
        times = []
        clock = time.perf_counter
        for _ in range(iters):
            t0 = clock()
            reduce_fn(buf)
            times.append(clock() - t0)
        cost_after = process_cost(daemon_pid)
        after = link_counters()
        link = {k: after[k] - before[k] for k in after} if before and after else None
        row = {"bytes": nbytes, "times": times, "warmup": 1 + extra_warmup, "link": link,
               "cost": {k: cost_after[k] - cost_before[k] for k in cost_after if k in cost_before}}
        if counters is not None:
            row["counters"] = {"before": seen, "after": counters()}
        if after_size is not None:
            row["after"] = after_size()
        results.append(row)
        del buf
    return results


def _daemon_pid(paths: Any) -> int | None:
    from commd.client.status import query_status

    return query_status(paths, timeout=20.0).get("pid")


def _measure_torch(cfg: dict[str, Any], rank: int, world: int, what: str,
                   counters: Callable[[], dict[str, Any]] | None = None,
                   daemon_pid: int | None = None) -> list[dict[str, Any]]:
    """``measure`` through the initialised torch.distributed default group (commd or Gloo)."""
    import torch
    import torch.distributed as dist

    scalar = torch.zeros(1)

    def agree(value: float) -> float:
        scalar[0] = value
        dist.all_reduce(scalar, op=dist.ReduceOp.MAX)
        return float(scalar[0])

    return measure(cfg, rank, world, make=lambda count: torch.empty(count, dtype=torch.float32),
                   reduce_fn=lambda t: dist.all_reduce(t), agree_max=agree, barrier=dist.barrier, what=what,
                   counters=counters, daemon_pid=daemon_pid)


def _finish(cfg: dict[str, Any], rank: int, value: dict[str, Any]) -> None:
    value.update(rank=rank, pid=os.getpid(), host=os.environ.get("COMMD_NODE"))
    _write_json(cfg["out"].format(rank=rank), value)


# ---- commd ---------------------------------------------------------------------
def run_commd(cfg: dict[str, Any], rank: int) -> None:
    """The commd client library on arena tensors, one sweep per lane hint; then the scheduling bursts."""
    import torch

    from commd.client import Client, ops
    from commd.client.spawn import ping
    from commd.runtime import JobPaths

    world, nproc = cfg["world"], cfg["nproc"]
    paths = JobPaths.for_job(cfg["job"])
    deadline = time.monotonic() + cfg["connect_timeout"]
    while not ping(paths, 0.2):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: the daemon of job {cfg['job']} did not answer within "
                             f"{cfg['connect_timeout']:.0f}s ({paths.directory})")
        time.sleep(0.1)
    client = Client(rank, world, local_rank=rank % nproc, job=cfg["job"], arena_bytes=cfg["arena_bytes"],
                    op_timeout=cfg["op_timeout"], nodes=cfg["nodes"])
    timeout = cfg["op_timeout"]
    local_first = rank % nproc == 0
    out: dict[str, Any] = {"lanes": {}}
    try:
        client.register_group("world", list(range(world)))
        scalar = client.empty(1, torch.float32)

        for lane in cfg["lanes"]:
            def agree(value: float, lane: str = lane) -> float:
                scalar[0] = value
                ops.all_reduce(client, scalar, "max", lane=lane).wait(timeout)
                return float(scalar[0])

            out["lanes"][lane] = measure(
                cfg, rank, world,
                make=lambda count: client.empty(count, torch.float32),
                reduce_fn=lambda t, lane=lane: ops.all_reduce(client, t, lane=lane).wait(timeout),
                agree_max=agree,
                barrier=lambda lane=lane: ops.barrier(client, lane=lane).wait(timeout),
                what=f"commd lane {lane}",
                after_size=(lambda: _fabric_snapshot(paths)) if local_first else None,
                daemon_pid=_daemon_pid(paths) if local_first else None,
            )
        if cfg.get("local_probe_bytes"):
            out["local"] = _local_latency(cfg, client, rank)
        if cfg.get("sched"):
            out["sched"] = _sched_bursts(cfg, client, rank, paths)
    finally:
        client.close()
    _finish(cfg, rank, out)


def _local_latency(cfg: dict[str, Any], client: Any, rank: int) -> dict[str, Any]:
    """The same all-reduce among this host's ranks only (no fabric, no lane): the daemon's local cost.

    Set beside the cross-host latency of the same size it shows how much of a
    small op's time the fabric (negotiation, lane thread, link) adds.
    """
    import torch

    from commd.client import ops

    nproc, timeout = cfg["nproc"], cfg["op_timeout"]
    node = rank // nproc
    group = f"host{node}"
    client.register_group(group, list(range(node * nproc, (node + 1) * nproc)))
    t = client.empty(cfg["local_probe_bytes"] // ELEMENT, torch.float32)
    t.zero_()
    for _ in range(cfg["local_probe_warmup"]):
        ops.all_reduce(client, t, group=group).wait(timeout)
    ops.barrier(client, group=group).wait(timeout)
    times = []
    for _ in range(cfg["local_probe_iters"]):
        t0 = time.perf_counter()
        ops.all_reduce(client, t, group=group).wait(timeout)
        times.append(time.perf_counter() - t0)
    return {"bytes": cfg["local_probe_bytes"], "group": group, "times": times}


def _fabric_snapshot(paths: Any) -> dict[str, Any]:
    from commd.client.status import query_status

    fabric = query_status(paths, timeout=20.0).get("fabric") or {}
    keys = ("node", "reported", "fast_path", "scheduling_us_per_op", "coordinator_us_per_report",
            "negotiation_us_median", "lane_ops", "coordinator")
    return {k: fabric.get(k) for k in keys}


def _sched_bursts(cfg: dict[str, Any], client: Any, rank: int, paths: Any) -> list[dict[str, Any]]:
    """Bursts of async 8-byte all-reduces (handles kept, waited at the end); status after each.

    Burst 0 warms the negotiation cache; the report uses the differences
    between consecutive status snapshots, so the sweep before does not count.
    """
    import torch

    from commd.client import ops

    sched = cfg["sched"]
    n, timeout = sched["n"], cfg["op_timeout"]
    local_first = rank % cfg["nproc"] == 0
    t = client.empty(2, torch.float32)  # 8 bytes
    t.zero_()
    ops.barrier(client).wait(timeout)
    rows = [{"burst": -1, "status": _fabric_snapshot(paths) if local_first else None}]
    ops.barrier(client).wait(timeout)
    for burst in range(sched["reps"] + 1):
        ops.barrier(client).wait(timeout)
        t0 = time.perf_counter()
        handles = [ops.all_reduce(client, t) for _ in range(n)]
        t1 = time.perf_counter()
        for handle in handles:
            handle.wait(timeout)
        t2 = time.perf_counter()
        ops.barrier(client).wait(timeout)
        status = _fabric_snapshot(paths) if local_first else None
        rows.append({"burst": burst, "n": n, "issue_s": t1 - t0, "total_s": t2 - t0, "status": status})
        del handles
    return rows


# ---- torch.distributed "commd" (under commd launch) ---------------------------
def run_torch(cfg: dict[str, Any]) -> None:
    """``init_process_group("commd")`` on ordinary tensors, as a user's script under ``commd launch`` does.

    The launcher started this host's daemon and gave us RANK/WORLD_SIZE/MASTER_*
    and COMMD_JOB; nothing here names the daemon.  First a few seconds of small
    all-reduces (the daemons import torch in the background after they start,
    which would land in the first sizes' times), then the common sweep.
    """
    import torch
    import torch.distributed as dist

    from commd.runtime import JobPaths

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != cfg["world"]:
        raise SystemExit(f"commd launch started {world} ranks, the benchmark wants {cfg['world']}")
    dist.init_process_group("commd", timeout=timedelta(seconds=cfg["op_timeout"]))
    paths = JobPaths.for_job(os.environ["COMMD_JOB"])
    local_first = int(os.environ["LOCAL_RANK"]) == 0
    try:
        warmed = _torch_warmup(dist, torch, rank, cfg["torch_warmup_s"])
        results = _measure_torch(cfg, rank, world, "torch commd",
                                 (lambda: _daemon_counters(paths)) if local_first else None,
                                 _daemon_pid(paths) if local_first else None)
    finally:
        dist.destroy_process_group()
    _finish(cfg, rank, {"results": results, "warmup_ops": warmed,
                        "local_ring": os.environ.get("COMMD_LOCAL_RING", "1") != "0"})


def _torch_warmup(dist: Any, torch: Any, rank: int, seconds: float) -> int:
    """1 KiB sums until any rank has spent ``seconds`` (element 0 carries "I am done", so all stop together)."""
    t = torch.zeros(256)
    want = dist.get_world_size() * (dist.get_world_size() + 1) / 2
    count = 0
    start = time.monotonic()
    while True:
        t.zero_()
        t[0] = 1.0 if time.monotonic() - start >= seconds else 0.0
        t[1] = rank + 1
        dist.all_reduce(t)
        count += 1
        if float(t[1]) != want:
            raise SystemExit(f"torch commd warm-up: wrong all_reduce result on rank {rank}: {float(t[1])} != {want}")
        if float(t[0]) > 0:
            return count


def _daemon_counters(paths: Any) -> dict[str, Any]:
    """This host's daemon: fabric reports (ops that crossed the hosts through the fabric) and exchange-ring ops."""
    from commd.client.status import query_status

    status = query_status(paths, timeout=20.0)
    fabric = status.get("fabric") or {}
    rings = status.get("rings") or {}
    return {"reported": fabric.get("reported"), "ring_ops": sum(int(r.get("ops", 0)) for r in rings.values())}


# ---- gloo ----------------------------------------------------------------------
def run_gloo(cfg: dict[str, Any], rank: int) -> None:
    """torch.distributed Gloo across every rank (GLOO_SOCKET_IFNAME picks the namespace's eth0)."""
    import torch.distributed as dist

    world = cfg["world"]
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['master']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg["op_timeout"]))
    try:
        results = _measure_torch(cfg, rank, world, "gloo")
    finally:
        dist.destroy_process_group()
    _finish(cfg, rank, {"results": results})


# ---- mpi -----------------------------------------------------------------------
def run_mpi(cfg: dict[str, Any]) -> None:
    """mpi4py Allreduce(IN_PLACE) on numpy buffers; locality as the launcher's env made MPICH see it."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if world != cfg["world"]:
        raise SystemExit(f"mpiexec started {world} ranks, the benchmark wants {cfg['world']}")
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)

    def agree(value: float) -> float:
        return float(comm.allreduce(value, op=MPI.MAX))

    results = measure(cfg, rank, world, make=lambda count: np.empty(count, dtype=np.float32),
                      reduce_fn=lambda b: comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM), agree_max=agree,
                      barrier=comm.Barrier, what="mpi")
    _finish(cfg, rank, {
        "results": results, "library": MPI.Get_library_version().splitlines()[0],
        "shared_memory_group_size": shared.Get_size(),
    })
    shared.Free()


# ---- link bound -----------------------------------------------------------------
def _serve(conn: socket.socket) -> None:
    """One connection: b"S" = sink (reply: bytes and seconds from first byte to EOF), b"P" = 8-byte echo."""
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = conn.recv(1)
        if mode == b"S":
            buf = bytearray(LINK_CHUNK)
            view = memoryview(buf)
            total, first = 0, None
            while True:
                got = conn.recv_into(view)
                if not got:
                    break
                if first is None:
                    first = time.perf_counter()
                total += got
            elapsed = time.perf_counter() - first if first is not None else 0.0
            conn.sendall(json.dumps({"bytes": total, "seconds": elapsed}).encode() + b"\n")
        elif mode == b"P":
            while True:
                data = conn.recv(8)
                if not data:
                    break
                while len(data) < 8:
                    more = conn.recv(8 - len(data))
                    if not more:
                        return
                    data += more
                conn.sendall(data)


def link_server(port: int, conns: int, timeout: float) -> None:
    """Serve ``conns`` connections (each on its own thread), then exit; give up after ``timeout``."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(conns)
    srv.settimeout(timeout)
    print("ready", flush=True)
    threads = []
    deadline = time.monotonic() + timeout
    for _ in range(conns):
        conn, _addr = srv.accept()
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        thread = threading.Thread(target=_serve, args=(conn,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(max(0.1, deadline - time.monotonic()))
    srv.close()


def link_client(ip: str, port: int, mode: str, amount: float, out: str) -> None:
    """``sink``: send for ``amount`` seconds, report the receiver's rate; ``ping``: ``amount`` 8-byte round trips."""
    with socket.create_connection((ip, port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if mode == "sink":
            sock.sendall(b"S")
            payload = memoryview(bytearray(LINK_CHUNK))
            sent = 0
            end = time.perf_counter() + amount
            while time.perf_counter() < end:
                sock.sendall(payload)
                sent += len(payload)
            sock.shutdown(socket.SHUT_WR)
            reply = json.loads(sock.makefile().readline())
            value = {"mode": "sink", "sent": sent, "received": reply["bytes"], "seconds": reply["seconds"],
                     "gbit_s": reply["bytes"] * 8 / reply["seconds"] / 1e9 if reply["seconds"] else None}
        else:
            sock.sendall(b"P")
            rtts = []
            msg = b"12345678"
            for _ in range(int(amount)):
                t0 = time.perf_counter()
                sock.sendall(msg)
                got = b""
                while len(got) < 8:
                    more = sock.recv(8 - len(got))
                    if not more:
                        raise SystemExit("link ping: the server closed the connection")
                    got += more
                rtts.append(time.perf_counter() - t0)
            sock.shutdown(socket.SHUT_WR)
            value = {"mode": "ping", "count": len(rtts), "rtt_median_us": statistics.median(rtts) * 1e6,
                     "rtt_p10_us": sorted(rtts)[len(rtts) // 10] * 1e6}
    _write_json(out, value)


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode in ("commd", "gloo", "mpi", "torch"):
        with open(argv[1]) as f:
            cfg = json.load(f)
        if mode == "commd":
            run_commd(cfg, int(argv[2]))
        elif mode == "gloo":
            run_gloo(cfg, int(argv[2]))
        elif mode == "torch":
            run_torch(cfg)
        else:
            run_mpi(cfg)
    elif mode == "link-server":
        link_server(int(argv[1]), int(argv[2]), float(argv[3]))
    elif mode == "link-client":
        link_client(argv[1], int(argv[2]), argv[3], float(argv[4]), argv[5])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
