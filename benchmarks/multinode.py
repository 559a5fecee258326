"""Multi-node all_reduce benchmark: commd's lanes against Gloo and MPI across simulated hosts.

Two simulated hosts (network namespaces on one bridge, commd.sim) with two
ranks each, 4 ranks in all, in two link settings in one run:

  shaped     tc: 10 Gbit/s per host and direction (tbf) and 0.1 ms one-way delay;
  unshaped   the bare veth/bridge path (bounded only by the CPU copying bytes).

In each setting, float32 all_reduce (sum) from --min-bytes to --max-bytes through:

  commd-tcp   commd client library on arena tensors (zero-copy), lane="tcp",
  commd-gloo  ... lane="gloo"   (both: daemons formed by TCPStore rendezvous),
  commd-mpi   ... lane="mpi"    (daemons started under one mpiexec, MPMD);
  torch-commd torch.distributed backend "commd" on ordinary tensors (torch.empty), the user's
              path: `commd launch --nnodes 2 --node-rank i --master host0:PORT --nproc-per-node 2`
              in each host starts and forms the daemons, the ranks call dist.all_reduce;
  torch-commd-daemon  the same with COMMD_LOCAL_RING=0: every op through the daemon's op
              channel (not in the default --paths);
  torch-commd-rank-bridge  the same with COMMD_RING_BRIDGE=rank: the small all-reduces'
              exchange ring bridged by each node's first rank instead of the daemons (not in
              the default --paths);
  gloo        torch.distributed Gloo directly across the 4 ranks (GLOO_SOCKET_IFNAME=eth0);
  mpi         mpi4py Allreduce directly across the 4 ranks under mpiexec, each rank in its
              host's namespace; MPICH is told which ranks share a host (see MPI_DIRECT_ENV),
              so ranks on one host use shared memory and ranks on different hosts TCP over
              the veth links — checked with the eth0 byte counters, reported per path —
              and uses its multi-leader all-reduce composition (MPI_TUNED_ENV);
  mpi-auto    the same with MPICH's automatic composition (shown; ratios use "mpi");

plus the link bound (TCP throughput host0 -> host1, alone and both ways at
once, and the 8-byte round trip, measured by a small Python sender/receiver
in the same run) and, on the unshaped hosts, the scheduling overhead of
commd's fabric (bursts of async 8-byte all-reduces, the daemons' own
counters read through ``query_status``).

Per size and path: median over the timed iterations of the slowest rank's
time, algbw = S/t, busbw = algbw * 2(n-1)/n with n = 4, the ratios of commd
(best lane, each lane, each torch path) to Gloo and MPI, and the targets
(>= 1 MiB: commd >= 1.5x Gloo direct and >= 1x MPI direct, torch-commd >= 1x
MPI direct; unshaped: torch-commd's 1 KiB median <= 250 us; scheduling <= 50 us
per op).

    python benchmarks/multinode.py                  # both settings, 1 KiB..256 MiB (~5-8 min on 2 cores)
    python benchmarks/multinode.py --quick          # smoke test, 1-2 minutes
    python benchmarks/multinode.py --json out.json --links shaped --paths commd-tcp,gloo
    python benchmarks/multinode.py --links unshaped --paths torch-commd,torch-commd-daemon,mpi --max-bytes 64K
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from allreduce import human, message_sizes, parse_size  # noqa: E402  (the single-node benchmark's helpers)

WORKER = HERE / "_multinode_worker.py"
PY = sys.executable
COMMD_PATHS = ("commd-tcp", "commd-gloo", "commd-mpi")
#: The user's path: torch.distributed "commd" on ordinary tensors under `commd launch`, with the
#: exchange ring (default) and with COMMD_LOCAL_RING=0 (every op through the daemon's op channel).
TORCH_PATH, TORCH_DAEMON_PATH = "torch-commd", "torch-commd-daemon"
TORCH_RANK_BRIDGE_PATH = "torch-commd-rank-bridge"
TORCH_PATHS = (TORCH_PATH, TORCH_DAEMON_PATH, TORCH_RANK_BRIDGE_PATH)
DIRECT_PATHS = ("gloo", "mpi")
#: MPI with MPICH's own choice of all-reduce composition (shown, not used for the ratios).
MPI_AUTO = "mpi-auto"
PATHS = COMMD_PATHS + TORCH_PATHS + DIRECT_PATHS + (MPI_AUTO,)
#: Run when --paths is not given: every path but the torch comparisons of the daemon's part.
DEFAULT_PATHS = tuple(p for p in PATHS if p not in (TORCH_DAEMON_PATH, TORCH_RANK_BRIDGE_PATH))
LINKS = ("shaped", "unshaped")
NHOSTS = 2
ELEMENT = 4
#: Issue targets.
TARGET_MIN_BYTES = 1 << 20
TARGET_VS_GLOO = 1.5
TARGET_VS_MPI = 1.0
TARGET_SCHED_US = 50.0
#: The torch path's small-op target, on the unshaped hosts.
TARGET_TORCH_LATENCY_BYTES = 1 << 10
TARGET_TORCH_LATENCY_US = 250.0

#: MPI directly: MPICH sees every rank on one hostname and would use shared memory
#: between all of them (also between namespaces: /dev/shm is shared) — measured, the
#: hosts' eth0 counters stay at 0.  These settings make it behave as on 2 real nodes:
#: NUM_CLIQUES/CLIQUES_BY_BLOCK split the ranks into 2 "nodes" of consecutive ranks
#: (ranks 0,1 on host0 and 2,3 on host1, as mpiexec places them), which use MPICH's
#: shared memory inside a node; between nodes the UCX netmod may only use TCP on the
#: namespace's eth0 (UCX's own shared-memory transports would otherwise bypass the link).
MPI_DIRECT_ENV = {
    "MPIR_CVAR_NUM_CLIQUES": str(NHOSTS),
    "MPIR_CVAR_CLIQUES_BY_BLOCK": "1",
    "MPIR_CVAR_CH4_NETMOD": "ucx",
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": "eth0",
}
#: The "mpi" row also picks MPICH's multi-leader composition (inter-node + intra-node) for
#: MPI_Allreduce: measured here 2.5-2.7x faster from 1 MiB than MPICH's automatic choice
#: (the "mpi-auto" row), same link bytes.  The faster MPI is the fairer baseline.  Its
#: shared-memory region per leader is otherwise sized by the first call (our first call
#: is a 4-byte agreement: every large all-reduce then crawled, ~10x slower); 4 MiB is
#: MPICH's maximum.
MPI_TUNED_ENV = {"MPIR_CVAR_ALLREDUCE_COMPOSITION": "4", "MPIR_CVAR_ALLREDUCE_SHM_PER_LEADER": str(4 << 20)}
#: commd's MPI lane: one daemon per host, each its own MPI "node", TCP on eth0 between them.
MPI_LANE_ENV = {
    "MPIR_CVAR_NOLOCAL": "1",
    "MPIR_CVAR_CH4_NETMOD": "ucx",
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": "eth0",
}

DAEMON_START_S = 120.0
KILL_GRACE_S = 5.0
STATUS_LINE = "  [{}] {}"


# ---- processes ---------------------------------------------------------------------
class Procs:
    """Every process this run started, each in its own session so a kill takes its children too."""

    def __init__(self) -> None:
        self.live: list[subprocess.Popen[Any]] = []

    def start(self, argv: list[str], env: dict[str, str], log: Path, stdout_pipe: bool = False) -> subprocess.Popen[Any]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if stdout_pipe else out, stderr=out, start_new_session=True,
            )
        self.live.append(proc)
        return proc

    def stop(self, procs: list[subprocess.Popen[Any]] | None = None) -> None:
        """SIGTERM each process group, SIGKILL what is left after a grace period; always reaps."""
        targets = list(self.live if procs is None else procs)
        for proc in targets:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_S
        for proc in targets:
            try:
                proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in targets:
            _signal_group(proc, signal.SIGKILL)  # also children left behind by a leader that exited
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                print(f"warning: process {proc.pid} survived SIGKILL", file=sys.stderr)
            if proc.stdout is not None:
                proc.stdout.close()
            if proc in self.live:
                self.live.remove(proc)


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_all(procs: list[subprocess.Popen[Any]], timeout: float, what: str) -> None:
    """Wait for every process to exit 0; raise naming the first failure or the timeout."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for proc in list(pending):
            code = proc.poll()
            if code is None:
                continue
            pending.remove(proc)
            if code != 0:
                argv = [str(a) for a in proc.args]
                raise RuntimeError(f"{what}: process {proc.pid} ({Path(argv[0]).name} ... {' '.join(argv[-2:])}) "
                                   f"exited with code {code}")
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{what}: timed out after {timeout:.0f}s, still running: "
                               f"{[p.pid for p in pending]}")
        time.sleep(0.05)


def _tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def mpiexec_path(args: argparse.Namespace) -> str:
    found = args.mpiexec or shutil.which("mpiexec", path=str(Path(PY).parent)) or shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found (next to this python or on PATH); use --mpiexec")
    return found


def base_env(host: Any, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment, the simulated host's (node name, runtime dir), no inherited commd job/secret."""
    env = dict(os.environ)
    for key in ("COMMD_SECRET", "COMMD_JOB"):
        env.pop(key, None)
    env.update(host.env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def random_port() -> int:
    """A port in a fresh namespace: nothing else listens there, so any one is free."""
    return random.randint(20000, 60000)


# ---- link bound -------------------------------------------------------------------
def measure_link(sim: Any, args: argparse.Namespace, work: Path, procs: Procs, tag: str) -> dict[str, Any]:
    """TCP host0 -> host1 alone, both directions at once, and the 8-byte round trip."""
    h0, h1 = sim.hosts[0], sim.hosts[1]
    log = work / f"{tag}-link.log"
    port = random_port()
    limit = 4 * args.link_seconds + 60
    servers = [
        procs.start(h1.argv([PY, str(WORKER), "link-server", port, 3, limit]), base_env(h1), log, stdout_pipe=True),
        procs.start(h0.argv([PY, str(WORKER), "link-server", port, 1, limit]), base_env(h0), log, stdout_pipe=True),
    ]
    try:
        for server in servers:
            ready, _, _ = select.select([server.stdout], [], [], 60)
            if not ready or server.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"link server did not start within 60s:\n{_tail(log)}")

        def client(src: Any, dst: Any, mode: str, amount: float, name: str) -> tuple[subprocess.Popen[Any], Path]:
            out = work / f"{tag}-link-{name}.json"
            argv = src.argv([PY, str(WORKER), "link-client", dst.ip, port, mode, amount, out])
            return procs.start(argv, base_env(src), log), out

        result: dict[str, Any] = {}
        proc, out = client(h0, h1, "sink", args.link_seconds, "uni")
        wait_all([proc], args.link_seconds + 60, "link test host0->host1")
        result["one_way"] = json.loads(out.read_text())
        a, out_a = client(h0, h1, "sink", args.link_seconds, "bidir01")
        b, out_b = client(h1, h0, "sink", args.link_seconds, "bidir10")
        wait_all([a, b], args.link_seconds + 60, "link test both ways")
        result["both_ways"] = [json.loads(out_a.read_text()), json.loads(out_b.read_text())]
        proc, out = client(h0, h1, "ping", args.link_pings, "ping")
        wait_all([proc], 120, "link round-trip test")
        result["ping"] = json.loads(out.read_text())
        wait_all(servers, 30, "link servers")
    finally:
        procs.stop(servers)
    one_way = result["one_way"]["gbit_s"]
    per_direction = min(r["gbit_s"] for r in result["both_ways"])
    result["one_way_gbit_s"] = one_way
    result["both_ways_gbit_s_per_direction"] = per_direction
    # An all-reduce of 4 ranks on 2 hosts: whatever the algorithm, each host must send
    # its half of the sum's inputs and receive the other half's result, S bytes each
    # way (2(N-1)/N * S for N = 2 hosts), over its one link, while the other host does
    # the same: t >= S / B with B the per-direction rate with both directions busy.
    bound = per_direction * 1e9 / 8
    result["bound_algbw_gbps"] = bound / 1e9
    result["bound_busbw_gbps"] = bound / 1e9 * busbw_factor(args.world)
    return result


def busbw_factor(n: int) -> float:
    return 2 * (n - 1) / n


# ---- commd fabrics ------------------------------------------------------------------
def start_fabric(sim: Any, job: str, use_mpi: bool, args: argparse.Namespace, procs: Procs, log: Path,
                 mpi_env: dict[str, str]) -> list[subprocess.Popen[Any]]:
    """One daemon per simulated host, formed into one fabric; returns once every daemon answers."""
    from commd.client.spawn import ping
    from commd.runtime import JobPaths, new_secret

    hosts = sim.hosts
    port = random_port()

    def argv(i: int) -> list[str]:
        h = hosts[i]
        out = [PY, "-m", "commd", "daemon", "--job", job, "--op-timeout", str(args.op_timeout),
               "--node-name", h.name, "--advertise", h.ip, "--peer-timeout", "30"]
        if not use_mpi:
            out += ["--nnodes", str(len(hosts)), "--node-rank", str(i), "--rendezvous", f"{hosts[0].ip}:{port}"]
        return out

    started = []
    secret = {"COMMD_SECRET": new_secret()}  # a store rendezvous needs it on every node
    if use_mpi:
        cmd = [mpiexec_path(args)]
        for i, h in enumerate(hosts):
            if i:
                cmd.append(":")
            cmd += ["-n", "1"]
            for key, value in h.env.items():
                cmd += ["-env", key, value]
            cmd += h.argv(argv(i))
        started.append(procs.start(cmd, base_env(hosts[0], mpi_env), log))
    else:
        for i, h in enumerate(hosts):
            started.append(procs.start(h.argv(argv(i)), base_env(h, secret), log))
    deadline = time.monotonic() + DAEMON_START_S
    for h in hosts:
        paths = JobPaths(job, h.runtime_dir / job)
        while not ping(paths, 0.2):
            if any(p.poll() is not None for p in started):
                raise RuntimeError(f"a daemon exited while the fabric formed:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{h.name}'s daemon did not answer within {DAEMON_START_S:.0f}s:\n{_tail(log)}")
            time.sleep(0.1)
    return started


def worker_cfg(args: argparse.Namespace, sim: Any, work: Path, name: str, **extra: Any) -> Path:
    cfg = {
        "world": args.world, "nproc": args.nproc, "sizes": args.sizes, "warmup": args.warmup,
        "time_per_size_s": args.time_per_size, "min_iters": args.min_iters, "max_iters": args.max_iters,
        "op_timeout": args.op_timeout, "connect_timeout": DAEMON_START_S,
        "nodes": [sim.hosts[r // args.nproc].name for r in range(args.world)],
        "out": str(work / f"{name}-r{{rank}}.json"),
    }
    cfg.update(extra)
    path = work / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def start_rank_workers(sim: Any, args: argparse.Namespace, mode: str, cfg: Path, procs: Procs, log: Path,
                       extra_env: dict[str, str] | None = None) -> list[subprocess.Popen[Any]]:
    """One worker per rank, ranks placed host by host (ranks 0..nproc-1 on host0, ...)."""
    out = []
    for rank in range(args.world):
        host = sim.hosts[rank // args.nproc]
        out.append(procs.start(host.argv([PY, str(WORKER), mode, cfg, rank]), base_env(host, extra_env), log))
    return out


def collect(cfg_path: Path, world: int) -> list[dict[str, Any]]:
    cfg = json.loads(cfg_path.read_text())
    per_rank = []
    for rank in range(world):
        path = Path(cfg["out"].format(rank=rank))
        if not path.exists():
            raise RuntimeError(f"rank {rank} wrote no results ({path})")
        per_rank.append(json.loads(path.read_text()))
    return per_rank


def run_commd(sim: Any, args: argparse.Namespace, work: Path, procs: Procs, tag: str, lanes: list[str],
              use_mpi: bool, sched: dict[str, int] | None) -> dict[str, Any]:
    """A fresh fabric for a fresh job, one sweep per lane in the same worker processes."""
    name = f"{tag}-commd-{'mpi' if use_mpi else 'store'}"
    log = work / f"{name}.log"
    job = f"mnb-{uuid.uuid4().hex[:8]}"
    started_at = time.monotonic()
    daemons: list[subprocess.Popen[Any]] = []
    workers: list[subprocess.Popen[Any]] = []
    try:
        daemons = start_fabric(sim, job, use_mpi, args, procs, log, args.mpi_lane_env)
        cfg = worker_cfg(args, sim, work, name, job=job, lanes=lanes, sched=sched,
                         arena_bytes=max(args.sizes) + (4 << 20),
                         local_probe_bytes=min(args.sizes) if lanes else 0,
                         local_probe_warmup=args.warmup * 4, local_probe_iters=args.max_iters)
        workers = start_rank_workers(sim, args, "commd", cfg, procs, log)
        wait_all(workers, args.timeout, f"commd workers ({', '.join(lanes)})")
        per_rank = collect(cfg, args.world)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}\n--- log tail ---\n{_tail(log)}"}
    finally:
        procs.stop(workers)
        procs.stop(daemons)
    out: dict[str, Any] = {"wall_s": round(time.monotonic() - started_at, 1), "lanes": {}}
    for lane in lanes:
        out["lanes"][lane] = [{"rank": r["rank"], "host": r["host"], "results": r["lanes"][lane]} for r in per_rank]
    if all("local" in r for r in per_rank):
        slowest = [max(ts) for ts in zip(*(r["local"]["times"] for r in per_rank), strict=True)]
        out["local"] = {"bytes": per_rank[0]["local"]["bytes"], "latency_us": statistics.median(slowest) * 1e6,
                        "iters": len(slowest)}
    if sched:
        out["sched"] = [{"rank": r["rank"], "host": r["host"], "bursts": r["sched"]} for r in per_rank]
    return out


def run_gloo(sim: Any, args: argparse.Namespace, work: Path, procs: Procs, tag: str) -> dict[str, Any]:
    name = f"{tag}-gloo"
    log = work / f"{name}.log"
    started_at = time.monotonic()
    workers: list[subprocess.Popen[Any]] = []
    try:
        cfg = worker_cfg(args, sim, work, name, master=f"{sim.hosts[0].ip}:{random_port()}")
        workers = start_rank_workers(sim, args, "gloo", cfg, procs, log, {"GLOO_SOCKET_IFNAME": "eth0"})
        wait_all(workers, args.timeout, "gloo workers")
        per_rank = collect(cfg, args.world)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}\n--- log tail ---\n{_tail(log)}"}
    finally:
        procs.stop(workers)
    return {"wall_s": round(time.monotonic() - started_at, 1), "per_rank": per_rank}


def run_torch(sim: Any, args: argparse.Namespace, work: Path, procs: Procs, tag: str, path: str) -> dict[str, Any]:
    """``commd launch --nnodes 2 --node-rank i --master host0:PORT --nproc-per-node 2`` in each host, as a
    user starts a job: the launchers start and form the daemons, the ranks find them through COMMD_JOB."""
    from commd.runtime import new_secret

    name = f"{tag}-{path}"
    log = work / f"{name}.log"
    started_at = time.monotonic()
    launchers: list[subprocess.Popen[Any]] = []
    try:
        cfg = worker_cfg(args, sim, work, name, torch_warmup_s=args.torch_warmup)
        env = {"COMMD_SECRET": new_secret()}  # the same job secret on every node, as the README asks
        if path == TORCH_DAEMON_PATH:
            env["COMMD_LOCAL_RING"] = "0"
        if path == TORCH_RANK_BRIDGE_PATH:
            env["COMMD_RING_BRIDGE"] = "rank"
        master = f"{sim.hosts[0].ip}:{random_port()}"
        for i, host in enumerate(sim.hosts):
            argv = [PY, "-m", "commd", "launch", "--nnodes", str(NHOSTS), "--node-rank", str(i), "--master", master,
                    "--nproc-per-node", str(args.nproc), "--node-name", host.name,
                    "--op-timeout", str(args.op_timeout), str(WORKER), "torch", str(cfg)]
            launchers.append(procs.start(host.argv(argv), base_env(host, env), log))
        wait_all(launchers, args.timeout, f"commd launch ({path})")
        per_rank = collect(cfg, args.world)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}\n--- log tail ---\n{_tail(log)}"}
    finally:
        procs.stop(launchers)
    return {"wall_s": round(time.monotonic() - started_at, 1), "per_rank": per_rank}


def run_mpi(sim: Any, args: argparse.Namespace, work: Path, procs: Procs, tag: str,
            env: dict[str, str], name: str) -> dict[str, Any]:
    """The 4 ranks under one mpiexec (MPMD: nproc ranks per host namespace), MPICH settings in ``env``."""
    name = f"{tag}-{name}"
    log = work / f"{name}.log"
    started_at = time.monotonic()
    launched: list[subprocess.Popen[Any]] = []
    try:
        cfg = worker_cfg(args, sim, work, name)
        cmd = [mpiexec_path(args)]
        for i, h in enumerate(sim.hosts):
            if i:
                cmd.append(":")
            cmd += ["-n", str(args.nproc)] + h.argv([PY, str(WORKER), "mpi", cfg])
        launched = [procs.start(cmd, base_env(sim.hosts[0], env), log)]
        wait_all(launched, args.timeout, "mpiexec (MPI direct)")
        per_rank = collect(cfg, args.world)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}\n--- log tail ---\n{_tail(log)}"}
    finally:
        procs.stop(launched)
    return {"wall_s": round(time.monotonic() - started_at, 1), "per_rank": per_rank}


# ---- analysis ----------------------------------------------------------------------
def summarize(per_rank: list[dict[str, Any]], world: int) -> dict[int, dict[str, Any]]:
    """Per size: median over iterations of the slowest rank's time; link bytes per iteration per host."""
    factor = busbw_factor(world)
    rows: dict[int, dict[str, Any]] = {}
    first_of_host: dict[str, dict[str, Any]] = {}
    for r in per_rank:
        first_of_host.setdefault(r.get("host") or str(r["rank"]), r)
    for i, first in enumerate(per_rank[0]["results"]):
        size = first["bytes"]
        slowest = [max(ts) for ts in zip(*(r["results"][i]["times"] for r in per_rank), strict=True)]
        t = statistics.median(slowest)
        ordered = sorted(slowest)
        algbw = size / t / 1e9
        link_rx = [r["results"][i]["link"]["rx"] / len(slowest) for r in first_of_host.values()
                   if r["results"][i].get("link")]
        fabric_after = [r["results"][i]["after"] for r in first_of_host.values() if r["results"][i].get("after")]
        rows[size] = {
            "latency_us": t * 1e6,
            "p10_us": ordered[len(ordered) // 10] * 1e6,
            "p90_us": ordered[(len(ordered) * 9) // 10] * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * factor,
            "iters": len(slowest),
            "warmup": first.get("warmup"),
            "link_rx_bytes_per_iter_per_host": link_rx,
            "link_rx_per_S": (statistics.mean(link_rx) / size) if link_rx else None,
        }
        if fabric_after:
            rows[size]["fabric_after"] = fabric_after
        counted = [r["results"][i]["counters"] for r in per_rank if r["results"][i].get("counters")]
        if counted:
            rows[size]["daemon_per_op"] = _daemon_per_op(counted, len(slowest))
        costs = [r["results"][i]["cost"] for r in per_rank if r["results"][i].get("cost")]
        if costs:
            rows[size]["cost"] = _cost_per_op(costs, len(slowest))
    return rows


def _cost_per_op(costs: list[dict[str, float]], iters: int) -> dict[str, float]:
    """CPU time per op summed over every process of the job (ranks and daemons), and context switches
    per op per process: figures that do not depend on how many cores run the job."""
    processes = len(costs) + sum(1 for c in costs if "daemon_cpu_s" in c)
    cpu = sum(c.get("rank_cpu_s", 0.0) + c.get("daemon_cpu_s", 0.0) for c in costs)
    daemons = sum(c.get("daemon_cpu_s", 0.0) for c in costs)
    switches = sum(c.get("rank_csw", 0.0) + c.get("daemon_csw", 0.0) for c in costs)
    return {"cpu_us_per_op": cpu / iters * 1e6, "daemon_cpu_us_per_op": daemons / iters * 1e6,
            "csw_per_op_per_process": switches / iters / processes, "processes": processes}


def _daemon_per_op(counted: list[dict[str, Any]], iters: int) -> dict[str, Any]:
    """Per timed op, over the hosts' daemons: fabric reports (max per daemon) and exchange-ring ops (sum)."""
    def delta(key: str) -> list[int]:
        return [c["after"][key] - c["before"][key] for c in counted
                if c["before"].get(key) is not None and c["after"].get(key) is not None]

    reported, ring = delta("reported"), delta("ring_ops")
    return {"fabric_reports": max(reported) / iters if reported else None,
            "ring_ops": sum(ring) / iters if ring else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def analyse(results: dict[str, dict[int, dict[str, Any]]], sizes: list[int]) -> dict[int, dict[str, Any]]:
    """busbw ratios of the best commd lane and of each lane to Gloo and MPI direct."""
    table: dict[int, dict[str, Any]] = {}
    for size in sizes:
        row: dict[str, Any] = {}
        lanes = {p: results[p][size] for p in COMMD_PATHS if size in results.get(p, {})}
        if lanes:
            best = max(lanes, key=lambda p: lanes[p]["busbw_gbps"])
            row["best"] = best
            candidates = {"best": lanes[best], **lanes}
            for name, mine in candidates.items():
                for other in DIRECT_PATHS:
                    theirs = results.get(other, {}).get(size)
                    if theirs:
                        row[f"{name}/{other}"] = _ratio(mine["busbw_gbps"], theirs["busbw_gbps"])
        for path in TORCH_PATHS:
            mine = results.get(path, {}).get(size)
            for other in DIRECT_PATHS:
                theirs = results.get(other, {}).get(size)
                if mine and theirs:
                    row[f"{path}/{other}"] = _ratio(mine["busbw_gbps"], theirs["busbw_gbps"])
        table[size] = row
    return table


def check_targets(ratios: dict[int, dict[str, Any]], results: dict[str, dict[int, dict[str, Any]]],
                  setting: str) -> list[dict[str, Any]]:
    checks = []
    for other, want in (("gloo", TARGET_VS_GLOO), ("mpi", TARGET_VS_MPI)):
        for size, row in ratios.items():
            value = row.get(f"best/{other}")
            if size < TARGET_MIN_BYTES or value is None:
                continue
            checks.append({"target": f"{human(size)}: best commd lane ({row['best']}) busbw >= {want:g}x {other} "
                                     "direct", "size": size, "vs": other, "want": want, "value": round(value, 3),
                           "met": value >= want})
    small = results.get(TORCH_PATH, {}).get(TARGET_TORCH_LATENCY_BYTES)
    if setting == "unshaped" and small:
        value = small["latency_us"]
        checks.append({"target": f"{human(TARGET_TORCH_LATENCY_BYTES)} {TORCH_PATH} median <= "
                                 f"{TARGET_TORCH_LATENCY_US:g} us", "size": TARGET_TORCH_LATENCY_BYTES,
                       "vs": "latency_us", "want": TARGET_TORCH_LATENCY_US, "value": round(value, 1),
                       "met": value <= TARGET_TORCH_LATENCY_US})
    for size, row in ratios.items():
        value = row.get(f"{TORCH_PATH}/mpi")
        if size < TARGET_MIN_BYTES or value is None:
            continue
        checks.append({"target": f"{human(size)}: {TORCH_PATH} busbw >= {TARGET_VS_MPI:g}x mpi direct", "size": size,
                       "vs": "mpi", "want": TARGET_VS_MPI, "value": round(value, 3), "met": value >= TARGET_VS_MPI})
    return checks


def sched_analysis(rows: list[dict[str, Any]], nnodes: int, nproc: int) -> dict[str, Any]:
    """Steady state of the bursts from the differences between consecutive status snapshots.

    Cumulative figures: ``scheduling_us_per_op`` = negotiate + release CPU time
    on that node / ops it released (released == reported once every op has
    completed, which the barrier after each burst guarantees);
    ``coordinator_us_per_report`` = the coordinator's CPU time / reports it got
    from all nodes.  Differences between snapshots isolate each burst.
    """
    per_rank = {r["rank"]: r["bursts"] for r in rows}
    ranks = sorted(per_rank)
    nodes = {node: per_rank[node * nproc] for node in range(nnodes)}
    n_bursts = len(per_rank[ranks[0]])
    bursts = []
    for b in range(1, n_bursts):  # entry 0 is the snapshot before burst 0
        entry = per_rank[ranks[0]][b]
        n = entry["n"]
        per_op = max(per_rank[r][b]["total_s"] for r in ranks) / n * 1e6
        issue = max(per_rank[r][b]["issue_s"] for r in ranks) / n * 1e6
        row: dict[str, Any] = {"burst": entry["burst"], "n": n, "per_op_us": per_op, "issue_per_op_us": issue,
                               "nodes": {}}
        total_reports = [0, 0]
        for node, snaps in nodes.items():
            before, after = snaps[b - 1]["status"], snaps[b]["status"]
            d_rep = after["reported"] - before["reported"]
            d_fast = after["fast_path"] - before["fast_path"]
            sched_total = [(s["scheduling_us_per_op"] or 0.0) * s["reported"] for s in (before, after)]
            row["nodes"][node] = {
                "reported": d_rep, "fast_path_fraction": d_fast / d_rep if d_rep else None,
                "scheduling_us_per_op": (sched_total[1] - sched_total[0]) / d_rep if d_rep else None,
                "negotiation_us_median": after.get("negotiation_us_median"),
                "lane_ops": after.get("lane_ops"),
            }
            total_reports[0] += before["reported"]
            total_reports[1] += after["reported"]
        coord_before = (nodes[0][b - 1]["status"]["coordinator_us_per_report"] or 0.0) * total_reports[0]
        coord_after = (nodes[0][b]["status"]["coordinator_us_per_report"] or 0.0) * total_reports[1]
        d_reports = total_reports[1] - total_reports[0]
        row["coordinator_us_per_report"] = (coord_after - coord_before) / d_reports if d_reports else None
        per_report = row["coordinator_us_per_report"] or 0.0
        # The compared figure: the fabric's scheduling time per op on the busiest node's event
        # loop — its own negotiate+release, plus (node 0) one report per node to coordinate.
        row["overhead_us_per_op"] = max(
            (v["scheduling_us_per_op"] or 0.0) + (per_report * nnodes if node == 0 else 0.0)
            for node, v in row["nodes"].items()
        )
        bursts.append(row)
    steady = bursts[1:] or bursts
    final = {node: snaps[-1]["status"] for node, snaps in nodes.items()}

    def med(key: str) -> float | None:
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    fast = [v["fast_path_fraction"] for r in steady for v in r["nodes"].values() if v["fast_path_fraction"] is not None]
    sched = [v["scheduling_us_per_op"] for r in steady for v in r["nodes"].values()
             if v["scheduling_us_per_op"] is not None]
    return {
        "bursts": bursts,
        "steady_bursts": [r["burst"] for r in steady],
        "per_op_us": med("per_op_us"),
        "issue_per_op_us": med("issue_per_op_us"),
        "scheduling_us_per_op_max_node": max(sched) if sched else None,
        "coordinator_us_per_report": med("coordinator_us_per_report"),
        "fast_path_fraction_min": min(fast) if fast else None,
        "overhead_us_per_op": med("overhead_us_per_op"),
        "final_status": final,
    }


# ---- output -----------------------------------------------------------------------
def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "bw":
        return format(value, ".3f") if value >= 0.01 else format(value, ".2e")
    return format(value, spec)


def print_setting(name: str, data: dict[str, Any], paths: list[str], sizes: list[int], world: int) -> None:
    link = data.get("link") or {}
    results, ratios = data["results"], data["ratios"]
    w = 11
    print(f"\n=== {name}: {data['description']} ===")
    if link.get("one_way_gbit_s"):
        print(f"link (Python TCP, same run): host0->host1 {link['one_way_gbit_s']:.2f} Gbit/s alone, "
              f"{link['both_ways_gbit_s_per_direction']:.2f} Gbit/s per direction with both directions busy; "
              f"8-byte round trip {link['ping']['rtt_median_us']:.0f} us (median)")
        print(f"bound for 4 ranks on 2 hosts: each host must send S and receive S over its link, so "
              f"t >= S/B: algbw <= {link['bound_algbw_gbps']:.3f} GB/s, busbw <= {link['bound_busbw_gbps']:.3f} GB/s"
              + (f" (nominal {data['nominal_gbit']:g} Gbit/s: algbw <= {data['nominal_gbit'] / 8:.3f}, "
                 f"busbw <= {data['nominal_gbit'] / 8 * busbw_factor(world):.3f})" if data.get("nominal_gbit") else ""))
    elif data.get("link_error"):
        print(f"link test FAILED: {data['link_error']}")
    cw = {p: max(w, len(p) + 2) for p in paths}  # column width per path
    print("\nlatency (us): median over iterations of the slowest rank; 'iters' = timed iterations per path")
    print(f"{'size':>9} " + "".join(f"{p:>{cw[p]}}" for p in paths) + "   iters")
    for size in sizes:
        line = f"{human(size):>9} "
        line += "".join(f"{_fmt(results.get(p, {}).get(size, {}).get('latency_us'), '.1f'):>{cw[p]}}" for p in paths)
        iters = "/".join(str(results.get(p, {}).get(size, {}).get("iters", "-")) for p in paths)
        print(f"{line}   {iters}")
    print("\nbusbw (GB/s) = S/t * 2(n-1)/n, n = 4   [bound: from the measured link, see above]")
    print(f"{'size':>9} {'bound':>{w}}" + "".join(f"{p:>{cw[p]}}" for p in paths))
    bound = link.get("bound_busbw_gbps")
    for size in sizes:
        line = f"{human(size):>9} {_fmt(bound, 'bw'):>{w}}"
        line += "".join(f"{_fmt(results.get(p, {}).get(size, {}).get('busbw_gbps'), 'bw'):>{cw[p]}}" for p in paths)
        print(line)
    print("\nCPU per op (us) summed over every process of the job (ranks and daemons; in brackets the daemons'), "
          "and context switches per op per process")
    print(f"{'size':>9} " + "".join(f"{p:>{cw[p] + 12}}" for p in paths))
    for size in sizes:
        line = f"{human(size):>9} "
        for p in paths:
            cost = results.get(p, {}).get(size, {}).get("cost")
            cell = (f"{cost['cpu_us_per_op']:.0f} [{cost['daemon_cpu_us_per_op']:.0f}] "
                    f"{cost['csw_per_op_per_process']:.1f}") if cost else "-"
            line += f"{cell:>{cw[p] + 12}}"
        print(line)
    lane_paths = [p for p in COMMD_PATHS if p in paths]
    others = [p for p in DIRECT_PATHS if p in paths]
    if lane_paths and others:
        cols = [("best", o) for o in others] + [(p, o) for p in lane_paths for o in others]
        print("\ncommd / direct: busbw ratio (> 1: commd faster); 'best' = the fastest commd lane at that size")
        heads = [f"{a.removeprefix('commd-')}/{b}" for a, b in cols]
        print(f"{'size':>9} {'best lane':>11}" + "".join(f"{h:>{w}}" for h in heads))
        for size in sizes:
            row = ratios.get(size, {})
            line = f"{human(size):>9} {row.get('best', '-'):>11}"
            line += "".join(f"{_fmt(row.get(f'{a}/{b}'), '.2f'):>{w}}" for a, b in cols)
            print(line)
    torch_paths = [p for p in TORCH_PATHS if p in paths]
    if torch_paths and others:
        cols = [(p, o) for p in torch_paths for o in others]
        heads = [f"{a}/{b}" for a, b in cols]
        print("\ntorch.distributed commd (ordinary tensors) / direct: busbw ratio (> 1: commd faster)")
        print(f"{'size':>9}" + "".join(f"{h:>{len(h) + 2}}" for h in heads))
        for size in sizes:
            row = ratios.get(size, {})
            print(f"{human(size):>9}" + "".join(f"{_fmt(row.get(h), '.2f'):>{len(h) + 2}}" for h in heads))
    big = max(sizes)
    print(f"\nbytes received per host per iteration on eth0 at {human(big)} (in units of S; "
          "the minimum for 2 hosts is 1.0):")
    print("  " + ", ".join(f"{p} {_fmt(results.get(p, {}).get(big, {}).get('link_rx_per_S'), '.2f')}"
                           for p in paths))
    for path, info in (data.get("mpi_info") or {}).items():
        print(f"  {path}: MPICH {info}")
    local = data.get("commd_local")
    first_lane = next((p for p in ("commd-tcp", "commd-gloo") if p in results), None)
    if local and first_lane:
        size = local["bytes"]
        cross = results[first_lane].get(size, {})
        neg = [a.get("negotiation_us_median") for a in cross.get("fabric_after", []) if a]
        print(f"\ncommd at {human(size)}: {first_lane} across the hosts {_fmt(cross.get('latency_us'), '.0f')} us; "
              f"the same all-reduce among one host's 2 ranks (no fabric) {local['latency_us']:.0f} us; "
              "fabric negotiation (ready -> release) median per daemon "
              + "/".join(_fmt(v, ".0f") for v in neg) + " us")
    _print_torch_small(results, paths, min(sizes))
    for path, error in data["errors"].items():
        print(f"\n{path} FAILED: {error}")
    if data["targets"]:
        print(f"\ntargets (bandwidth from {human(TARGET_MIN_BYTES)}; {TORCH_PATH} latency on the unshaped hosts)")
        for check in data["targets"]:
            print(STATUS_LINE.format("met" if check["met"] else "NOT met", f"{check['target']}: {check['value']:.2f}"))
    print(f"\n(load average before/after this setting: {data['load_before']} / {data['load_after']}; "
          f"wall time per run: " + ", ".join(f"{k} {v}s" for k, v in data["wall_s"].items()) + ")")


def _print_torch_small(results: dict[str, dict[int, dict[str, Any]]], paths: list[str], size: int) -> None:
    """The user's path at the smallest size beside the direct peers, and where its ops went."""
    torch_paths = [p for p in TORCH_PATHS if size in results.get(p, {})]
    if not torch_paths:
        return
    parts = []
    for path in torch_paths:
        row = results[path][size]
        per_op = row.get("daemon_per_op") or {}
        parts.append(f"{path} {row['latency_us']:.0f} us (per op: {_fmt(per_op.get('fabric_reports'), '.2f')} "
                     f"fabric reports per daemon, {_fmt(per_op.get('ring_ops'), '.2f')} exchange-ring ops)")
    peers = [f"{p} {results[p][size]['latency_us']:.0f} us" for p in (*DIRECT_PATHS, MPI_AUTO)
             if p in paths and size in results.get(p, {})]
    print(f"\ncommd at {human(size)} through torch.distributed (ordinary tensors, commd launch): "
          + "; ".join(parts) + ("; direct: " + ", ".join(peers) if peers else ""))


def print_sched(sched: dict[str, Any], n: int) -> None:
    print(f"\n=== scheduling overhead (unshaped hosts, commd, default lane): bursts of {n} async 8-byte "
          "all_reduces per rank, handles waited at the end ===")
    print(f"{'burst':>6} {'per op':>9} {'issue/op':>9} {'node':>5} {'reports':>8} {'fast path':>10} "
          f"{'sched us/op':>12} {'coord us/report':>16} {'compared us/op':>15}")
    for row in sched["bursts"]:
        for j, (node, v) in enumerate(sorted(row["nodes"].items())):
            first = j == 0
            print(f"{row['burst'] if first else '':>6} {_fmt(row['per_op_us'], '.1f') if first else '':>9} "
                  f"{_fmt(row['issue_per_op_us'], '.1f') if first else '':>9} {node:>5} {v['reported']:>8} "
                  f"{_fmt(v['fast_path_fraction'] and v['fast_path_fraction'] * 100, '.1f') + '%':>10} "
                  f"{_fmt(v['scheduling_us_per_op'], '.1f'):>12} "
                  f"{_fmt(row['coordinator_us_per_report'], '.1f') if first else '':>16} "
                  f"{_fmt(row['overhead_us_per_op'], '.1f') if first else '':>15}")
    print(f"(burst 0 warms the negotiation cache; steady state = bursts {sched['steady_bursts']}; us = microseconds; "
          "per op = slowest rank's burst time / N, issue/op = time to submit the N ops)")
    print("daemons' cumulative status at the end: " + "; ".join(
        f"node {node}: scheduling_us_per_op {s.get('scheduling_us_per_op')}, coordinator_us_per_report "
        f"{s.get('coordinator_us_per_report')}, fast_path {s.get('fast_path')}/{s.get('reported')}, "
        f"negotiation_us_median {s.get('negotiation_us_median')}" for node, s in sched["final_status"].items()))
    value = sched["overhead_us_per_op"]
    print("compared with the target: the fabric's scheduling time per op on the busiest daemon = its "
          "scheduling_us_per_op (negotiate + release) + on node 0 coordinator_us_per_report x 2 reports per op, "
          "per-burst differences of the status counters, median over the steady bursts (the daemons count the "
          "CPU time of their event-loop thread in these sections; the op's own execution is excluded)")
    met = value is not None and value <= TARGET_SCHED_US
    print(STATUS_LINE.format("met" if met else "NOT met",
                             f"steady-state scheduling overhead {_fmt(value, '.1f')} us/op <= {TARGET_SCHED_US:g} us "
                             f"(fast path on >= {_fmt((sched['fast_path_fraction_min'] or 0) * 100, '.1f')}% "
                             "of reports)"))
    e2e = sched["per_op_us"]
    print(f"  (for reference, not the compared number: end-to-end {_fmt(e2e, '.1f')} us per op in a burst — "
          f"{'within' if e2e is not None and e2e <= TARGET_SCHED_US else 'above'} 50 us; it includes local "
          "matching, the lane's 8-byte exchange between the hosts and the replies)")


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _commit() -> str | None:
    """The checked-out commit (read-only git call), so a JSON report says what it measured."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _str_keys(table: dict[Any, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in table.items()}


# ---- one link setting ------------------------------------------------------------------
@contextmanager
def simulated_hosts(args: argparse.Namespace, setting: str) -> Iterator[Any]:
    """Up for the body, always down afterwards (namespaces, links, their processes, runtime dirs)."""
    from commd.sim.hosts import SimulatedHosts

    shaped = setting == "shaped"
    sim = SimulatedHosts(NHOSTS, delay_ms=args.delay_ms if shaped else None, rate=args.rate if shaped else None,
                         prefix=args.prefix)
    sim.up()
    try:
        yield sim
    finally:
        try:
            sim.down()
        except Exception as exc:  # report, keep cleaning up the rest
            print(f"warning: removing the simulated hosts failed: {exc}", file=sys.stderr)


def run_setting(setting: str, args: argparse.Namespace, work: Path, procs: Procs) -> dict[str, Any]:
    paths = args.paths
    data: dict[str, Any] = {"results": {}, "raw": {}, "errors": {}, "wall_s": {}, "load_before": _loadavg()}
    with simulated_hosts(args, setting) as sim:
        shaped = setting == "shaped"
        backend = sim.delay_backend
        data["description"] = (
            f"tc {args.rate} per host and direction + {args.delay_ms:g} ms one-way delay (delay: {backend})"
            if shaped else "bare veth + bridge, no shaping")
        data["delay_backend"] = backend
        if shaped:
            from commd.sim.hosts import parse_rate

            data["nominal_gbit"] = parse_rate(args.rate) / 1e9
        data["hosts"] = [{"name": h.name, "ip": h.ip, "netns": h.netns} for h in sim.hosts]
        tag = setting
        print(f"[{setting}] measuring the link ...", file=sys.stderr, flush=True)
        try:
            data["link"] = measure_link(sim, args, work, procs, tag)
        except Exception as exc:
            data["link"] = None
            data["link_error"] = f"{type(exc).__name__}: {exc}"
        lanes = [p.removeprefix("commd-") for p in paths if p in ("commd-tcp", "commd-gloo")]
        want_sched = args.burst > 0 and setting == "unshaped"
        if lanes or want_sched:
            print(f"[{setting}] commd lanes {lanes} (TCPStore fabric) ...", file=sys.stderr, flush=True)
            sched = {"n": args.burst, "reps": args.bursts} if want_sched else None
            out = run_commd(sim, args, work, procs, tag, lanes, use_mpi=False, sched=sched)
            _take_commd(out, data, lanes, args.world)
            if out.get("local"):
                data["commd_local"] = out["local"]
            if sched and "sched" in out:
                try:
                    data["sched"] = sched_analysis(out["sched"], NHOSTS, args.nproc)
                    data["sched_raw"] = out["sched"]
                except (KeyError, TypeError, ZeroDivisionError) as exc:
                    data["errors"]["sched"] = f"cannot analyse the bursts: {type(exc).__name__}: {exc}"
        if "commd-mpi" in paths:
            print(f"[{setting}] commd lane mpi (fabric under mpiexec) ...", file=sys.stderr, flush=True)
            out = run_commd(sim, args, work, procs, tag, ["mpi"], use_mpi=True, sched=None)
            _take_commd(out, data, ["mpi"], args.world)
        for path in (*TORCH_PATHS, "gloo", "mpi", MPI_AUTO):
            if path not in paths:
                continue
            print(f"[{setting}] {path} {'(commd launch)' if path in TORCH_PATHS else 'direct'} ...",
                  file=sys.stderr, flush=True)
            if path in TORCH_PATHS:
                out = run_torch(sim, args, work, procs, tag, path)
            elif path == "gloo":
                out = run_gloo(sim, args, work, procs, tag)
            else:
                env = args.mpi_direct_env if path == "mpi" else args.mpi_auto_env
                out = run_mpi(sim, args, work, procs, tag, env, path)
            if "error" in out:
                data["errors"][path] = out["error"]
                continue
            data["wall_s"][path] = out["wall_s"]
            data["raw"][path] = out["per_rank"]
            data["results"][path] = summarize(out["per_rank"], args.world)
            if path in ("mpi", MPI_AUTO):
                first = out["per_rank"][0]
                data.setdefault("mpi_info", {})[path] = (
                    f"{first.get('library').split(':')[-1].strip()}, MPI_COMM_TYPE_SHARED group size "
                    f"{first.get('shared_memory_group_size')} (ranks MPICH treats as one node), "
                    + (" ".join(f"{k}={v}" for k, v in (args.mpi_direct_env if path == "mpi"
                                                         else args.mpi_auto_env).items()) or "MPICH defaults"))
    data["load_after"] = _loadavg()
    data["ratios"] = analyse(data["results"], args.sizes)
    data["targets"] = check_targets(data["ratios"], data["results"], setting)
    return data


def _take_commd(out: dict[str, Any], data: dict[str, Any], lanes: list[str], world: int) -> None:
    if "error" in out:
        for lane in lanes:
            data["errors"][f"commd-{lane}"] = out["error"]
        return
    data["wall_s"]["commd-" + "+".join(lanes)] = out["wall_s"]
    for lane in lanes:
        data["raw"][f"commd-{lane}"] = out["lanes"][lane]
        data["results"][f"commd-{lane}"] = summarize(out["lanes"][lane], world)


# ---- main ---------------------------------------------------------------------------
def _on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: processes and hosts are removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-bytes", type=parse_size, default=1 << 10, help="smallest message (default 1K)")
    parser.add_argument("--max-bytes", type=parse_size, default=256 << 20, help="largest message (default 256M)")
    parser.add_argument("--factor", type=int, default=4, help="sizes are max-bytes / factor^k, plus min-bytes "
                                                              "(default 4)")
    parser.add_argument("--links", default=",".join(LINKS), help=f"comma-separated subset of {','.join(LINKS)}")
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                        help=f"comma-separated subset of {','.join(PATHS)} (default: all but {TORCH_DAEMON_PATH})")
    parser.add_argument("--rate", default="10gbit", help="shaped link rate per host and direction (default 10gbit)")
    parser.add_argument("--delay-ms", type=float, default=0.1, help="shaped one-way delay (default 0.1 ms)")
    parser.add_argument("--time-per-size", type=float, default=2.0,
                        help="seconds of timed iterations per size and path (default 2.0)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up iterations at most (default 5)")
    parser.add_argument("--torch-warmup", type=float, default=3.5,
                        help="seconds of 1 KiB all-reduces before the torch paths' first size (default 3.5; the "
                             "daemons import torch in the background after they start)")
    parser.add_argument("--min-iters", type=int, default=5, help="timed iterations at least (default 5)")
    parser.add_argument("--max-iters", type=int, default=200, help="timed iterations at most (default 200)")
    parser.add_argument("--burst", type=int, default=2000, help="async 8-byte all_reduces per burst (default "
                                                                "2000; 0 skips the scheduling measurement)")
    parser.add_argument("--bursts", type=int, default=4, help="measured bursts after the warm-up burst (default 4)")
    parser.add_argument("--link-seconds", type=float, default=2.0, help="seconds per TCP throughput test")
    parser.add_argument("--link-pings", type=int, default=2000, help="8-byte round trips for the link latency")
    parser.add_argument("--op-timeout", type=float, default=120.0, help="seconds one collective may take")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds allowed per run of workers")
    parser.add_argument("--mpiexec", help="mpiexec to use (default: the one next to this python, else PATH)")
    parser.add_argument("--mpi-locality", choices=("hosts", "mpich-default"), default="hosts",
                        help="hosts: MPI sees 2 nodes and crosses them over TCP on eth0 (default); "
                             "mpich-default: MPICH's own choice (shared memory between the namespaces)")
    parser.add_argument("--prefix", default="mnbench", help="name prefix of the simulated hosts (default mnbench)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 KiB, 1 MiB, 16 MiB, short budgets (1-2 minutes)")
    parser.add_argument("--json", metavar="FILE", help="write every number (and raw times) to FILE")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory (worker logs and files)")
    args = parser.parse_args(argv)

    args.links = [s.strip() for s in args.links.split(",") if s.strip()]
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if set(args.links) - set(LINKS) or not args.links:
        parser.error(f"--links: choose from {LINKS}")
    if set(args.paths) - set(PATHS) or not args.paths:
        parser.error(f"--paths: choose from {PATHS}")
    if args.min_bytes < ELEMENT or args.min_bytes > args.max_bytes:
        parser.error("need 4 <= --min-bytes <= --max-bytes")
    if args.factor < 2:
        parser.error("--factor must be at least 2")
    if not 0 <= args.torch_warmup <= 600:
        parser.error("--torch-warmup must lie in [0, 600] seconds")
    if args.quick:
        args.sizes = sorted({s for s in (1 << 10, 1 << 20, 16 << 20) if args.min_bytes <= s <= args.max_bytes}
                            or {args.min_bytes})
        args.time_per_size = min(args.time_per_size, 0.25)
        args.warmup, args.min_iters, args.max_iters = min(args.warmup, 2), min(args.min_iters, 2), 30
        args.burst, args.bursts = min(args.burst, 300), min(args.bursts, 2)
        args.link_seconds, args.link_pings = min(args.link_seconds, 0.5), min(args.link_pings, 300)
        args.timeout = min(args.timeout, 120.0)
    else:
        args.sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
    args.nproc = 2
    args.world = NHOSTS * args.nproc
    local = args.mpi_locality == "hosts"
    args.mpi_direct_env = {**MPI_DIRECT_ENV, **MPI_TUNED_ENV} if local else {}
    args.mpi_auto_env = dict(MPI_DIRECT_ENV) if local else {}
    args.mpi_lane_env = dict(MPI_LANE_ENV) if local else {}

    from commd.sim.hosts import cleanup_stale, netns_unavailable, shaping_unavailable

    reason = netns_unavailable() or ("shaped" in args.links and shaping_unavailable(args.delay_ms, args.rate))
    if reason:
        print(f"cannot simulate hosts here: {reason}", file=sys.stderr)
        return 2
    cleanup_stale(args.prefix)  # leftovers of an earlier run of this benchmark that was killed

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    started = time.monotonic()
    load_before = _loadavg()
    work = Path(tempfile.mkdtemp(prefix="commd-mnbench-"))
    procs = Procs()
    settings: dict[str, dict[str, Any]] = {}
    try:
        for setting in args.links:
            settings[setting] = run_setting(setting, args, work, procs)
    except (KeyboardInterrupt, SystemExit):
        print("interrupted: stopping every process and removing the simulated hosts", file=sys.stderr)
        raise
    finally:
        procs.stop()
        if args.keep:
            print(f"worker files and logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\nall_reduce float32 sum, {args.world} ranks = {NHOSTS} simulated hosts x {args.nproc} ranks; "
          "median over timed iterations of the slowest rank's time")
    for setting, data in settings.items():
        print_setting(setting, data, args.paths, args.sizes, args.world)
    sched = next((d["sched"] for d in settings.values() if d.get("sched")), None)
    if sched:
        print_sched(sched, args.burst)
    all_checks = [c for d in settings.values() for c in d["targets"]]
    if all_checks:
        print("\nsummary of the targets: " + ", ".join(
            f"{name} {sum(c['met'] for c in d['targets'])}/{len(d['targets'])} met"
            for name, d in settings.items() if d["targets"]))
    load_after = _loadavg()
    wall = time.monotonic() - started
    print(f"\n(load average before/after the run: {load_before} / {load_after} on {os.cpu_count()} cpus; "
          f"wall time {wall:.0f}s)")
    errors = {f"{name}/{path}": e for name, d in settings.items() for path, e in d["errors"].items()}
    if args.json:
        report = {
            "world": args.world, "hosts": NHOSTS, "ranks_per_host": args.nproc, "sizes": args.sizes,
            "paths": args.paths, "links": args.links,
            "settings_args": {k: v for k, v in vars(args).items() if isinstance(v, int | float | str | list | dict)
                              or v is None},
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                     "kernel": platform.release(), "loadavg_before": load_before, "loadavg_after": load_after,
                     "commit": _commit()},
            "targets": {"min_bytes": TARGET_MIN_BYTES, "vs_gloo": TARGET_VS_GLOO, "vs_mpi": TARGET_VS_MPI,
                        "sched_us": TARGET_SCHED_US, "torch_latency_bytes": TARGET_TORCH_LATENCY_BYTES,
                        "torch_latency_us": TARGET_TORCH_LATENCY_US},
            "settings": {},
            "errors": errors,
            "wall_s": wall,
        }
        for name, data in settings.items():
            out = dict(data)
            out["results"] = {p: _str_keys(r) for p, r in data["results"].items()}
            out["ratios"] = _str_keys(data["ratios"])
            report["settings"][name] = out
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
