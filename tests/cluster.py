"""A multi-node commd job for tests: K daemons (one per node) and their workers.

Nodes are either processes on loopback with distinct node names and runtime
dirs (cheap, no privileges) or simulated hosts (network namespaces, see
commd/sim).  Daemons form their fabric through a TCPStore rendezvous or, with
``mpi=True``, under one ``mpiexec`` (the MPI lane then has a real world).
Everything started here is stopped by ``stop()``, which tests call from a
fixture finalizer.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import DAEMON_START_S, POLL_S, Workers, job_paths, new_job

from commd.client.spawn import ping
from commd.runtime import new_secret

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
#: Daemons of simulated hosts under one mpiexec: each its own MPI node, TCP on the host's eth0
#: between them (MPICH would otherwise use shared memory: all hosts share one kernel).
MPI_ACROSS_HOSTS_ENV = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "tcp,self",
                        "UCX_NET_DEVICES": "eth0"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    def __init__(
        self, root: Path, nnodes: int, nproc: int, hosts: Any = None, op_timeout: float = 20.0,
        extra: list[str] | None = None, mpi: bool = False, peer_timeout: float = 5.0,
    ) -> None:
        self.job = new_job()
        self.nnodes, self.nproc = nnodes, nproc
        self.world = nnodes * nproc
        self.hosts = list(hosts.hosts) if hosts is not None else None
        self.names = [h.name for h in self.hosts] if self.hosts else [f"n{i}" for i in range(nnodes)]
        self.ips = [h.ip for h in self.hosts] if self.hosts else ["127.0.0.1"] * nnodes
        self.runtime = [Path(root) / f"node{i}" for i in range(nnodes)]
        for path in self.runtime:
            path.mkdir(parents=True, exist_ok=True)
        self.port = random.randint(20000, 60000) if self.hosts else free_port()
        self.op_timeout = op_timeout
        self.extra = list(extra or []) + ["--peer-timeout", str(peer_timeout)]
        self.mpi = mpi
        self.secret = new_secret()  # a store rendezvous needs it on every node (never in the store)
        self.procs: list[subprocess.Popen] = []
        self.workers: list[Workers] = []

    # ---- daemons ----------------------------------------------------------
    def _daemon_argv(self, i: int) -> list[str]:
        argv = [sys.executable, "-m", "commd", "daemon", "--job", self.job, "--op-timeout", str(self.op_timeout),
                "--node-name", self.names[i], "--advertise", self.ips[i], *self.extra]
        if not self.mpi:
            argv += ["--nnodes", str(self.nnodes), "--node-rank", str(i),
                     "--rendezvous", f"{self.ips[0]}:{self.port}"]
        return argv

    def _env(self, i: int) -> dict[str, str]:
        env = dict(os.environ, COMMD_RUNTIME_DIR=str(self.runtime[i]), COMMD_NODE=self.names[i])
        env["COMMD_SECRET"] = self.secret
        env.pop("COMMD_JOB", None)
        return env

    def start(self) -> Cluster:
        if self.mpi:
            argv = [MPIEXEC]
            if self.hosts:
                for name, value in MPI_ACROSS_HOSTS_ENV.items():
                    argv += ["-genv", name, value]
            for i in range(self.nnodes):
                if i:
                    argv.append(":")
                argv += ["-n", "1", "-env", "COMMD_RUNTIME_DIR", str(self.runtime[i]),
                         "-env", "COMMD_NODE", self.names[i]]
                if self.hosts:
                    argv += ["ip", "netns", "exec", self.hosts[i].netns]
                argv += self._daemon_argv(i)
            log = open(self.runtime[0] / "mpiexec.out", "ab")
            self.procs.append(subprocess.Popen(argv, env=self._env(0), stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=log, start_new_session=True))
            log.close()
        else:
            for i in range(self.nnodes):
                prefix = ["ip", "netns", "exec", self.hosts[i].netns] if self.hosts else []
                log = open(self.runtime[i] / "daemon.out", "ab")
                self.procs.append(subprocess.Popen(prefix + self._daemon_argv(i), env=self._env(i),
                                                   stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                   start_new_session=True))
                log.close()
        deadline = time.monotonic() + DAEMON_START_S * 2
        for i in range(self.nnodes):
            paths = job_paths(self.runtime[i], self.job)
            while not ping(paths, 0.2):
                if any(p.poll() is not None for p in self.procs):
                    raise AssertionError(f"a daemon exited while the fabric formed:\n{self.logs()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"node {i}'s daemon did not answer in time:\n{self.logs()}")
                time.sleep(POLL_S)
        return self

    def paths(self, i: int) -> Any:
        return job_paths(self.runtime[i], self.job)

    def daemon_pid(self, i: int) -> int:
        return self.paths(i).daemon_pid()

    def logs(self, lines: int = 30) -> str:
        out = []
        for i, path in enumerate(self.runtime):
            for name in ("daemon.out", "mpiexec.out"):
                f = path / name
                if f.exists():
                    text = f.read_text(errors="replace").splitlines()[-lines:]
                    out.append(f"--- node {i} {name} ---\n" + "\n".join(text))
        return "\n".join(out)

    # ---- workers ----------------------------------------------------------
    def node_of(self, rank: int) -> int:
        return rank // self.nproc

    def start_workers(self, target: Callable[..., Any], *args: Any) -> list[Workers]:
        env = {"COMMD_TEST_NODES": ",".join(self.names[self.node_of(r)] for r in range(self.world))}
        started = []
        for i in range(self.nnodes):
            ranks = list(range(i * self.nproc, (i + 1) * self.nproc))
            workers = Workers(target, self.world, self.job, self.runtime[i], args, ranks,
                              env=dict(env, COMMD_NODE=self.names[i]),
                              netns=self.hosts[i].netns if self.hosts else None)
            started.append(workers.start())
        self.workers += started
        return started

    def join(self, workers: list[Workers], timeout: float = 90.0) -> dict[int, Any]:
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        for w in workers:
            results.update(w.join(max(1.0, deadline - time.monotonic())))
        return results

    def status(self, i: int) -> dict[str, Any]:
        from commd.cli.status import query_status

        return query_status(self.paths(i), timeout=10.0)

    def stop(self) -> None:
        for workers in self.workers:
            workers.close()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=10)
