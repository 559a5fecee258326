"""The ways a multi-node fabric starts, end to end (nodes are loopback processes here):

* `commd launch --nnodes 2 --node-rank i --master ADDR:PORT` on each node;
* torchrun-style env:// ranks that auto-start their node's daemon;
* `mpiexec -n 2 commd daemon` (the MPI lane gets a real world);
* `commd daemon --nnodes/--node-rank/--rendezvous` started ahead, and refusals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import fabric_workers as fw
import pytest
from cluster import MPIEXEC, Cluster, free_port

from commd.runtime import new_secret

SCRIPTS = Path(__file__).parent / "scripts"


def _env(runtime: Path, node: str) -> dict[str, str]:
    env = dict(os.environ, COMMD_RUNTIME_DIR=str(runtime), COMMD_NODE=node)
    for key in ("COMMD_JOB", "COMMD_SECRET", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    return env


def _communicate_all(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    """Every process's output; whatever still runs at the end (a failed wait) is killed."""
    try:
        return [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def _results(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_launch_on_two_nodes(tmp_path: Path) -> None:
    """Node 0's launcher reads the job secret from COMMD_SECRET_FILE, node 1's from COMMD_SECRET."""
    port = free_port()
    secret = new_secret()
    secret_file = tmp_path / "job.secret"
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    procs = []
    for i in range(2):
        runtime = tmp_path / f"node{i}"
        runtime.mkdir()
        env = _env(runtime, f"n{i}")
        env.update({"COMMD_SECRET_FILE": str(secret_file)} if i == 0 else {"COMMD_SECRET": secret})
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "commd", "launch", "--nnodes", "2", "--node-rank", str(i),
             "--master", f"127.0.0.1:{port}", "--nproc-per-node", "2",
             str(SCRIPTS / "cli_allreduce_worker.py"), str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    outputs = _communicate_all(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    results = _results(tmp_path, 4)
    assert all(r["ok"] and r["sum"] == 10.0 for r in results), results
    assert [r["env"]["RANK"] for r in results] == ["0", "1", "2", "3"]
    assert [r["env"]["GROUP_RANK"] for r in results] == ["0", "0", "1", "1"]
    assert len({r["env"]["COMMD_JOB"] for r in results}) == 1


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
def test_torchrun_style_ranks_auto_start_their_node_daemons(tmp_path: Path) -> None:
    port = free_port()
    secret = new_secret()  # the daemons' shared secret: every rank's environment has it, the store never
    procs = []
    for rank in range(4):
        node = rank // 2
        runtime = tmp_path / f"node{node}"
        runtime.mkdir(exist_ok=True)
        env = _env(runtime, f"n{node}")
        env.update(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), COMMD_SECRET=secret)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPTS / "cli_allreduce_worker.py"), str(tmp_path), "gloo"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = _communicate_all(procs)
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(outputs)
    results = _results(tmp_path, 4)
    assert all(r["ok"] and r["sum"] == 10.0 for r in results)
    # the group made with pg_options=commd.Options(lane="gloo") ran on the gloo lane
    assert all(r["lane_ops"]["gloo"]["ops"] >= 1 for r in results), results


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
@pytest.mark.skipif(not Path(MPIEXEC).exists(), reason="mpiexec (the mpich wheel) is not installed")
def test_mpiexec_daemons_run_every_op_on_the_mpi_lane(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, 2, 2, mpi=True)
    try:
        cluster.start()
        assert cluster.status(0)["fabric"]["lanes"] == ["gloo", "mpi", "tcp"]
        results = cluster.join(cluster.start_workers(fw.every_op, ["mpi"], [5, 70_000]), timeout=240)
        assert set(results.values()) == {"ok"}
        assert cluster.status(1)["fabric"]["lane_ops"]["mpi"]["ops"] > 0
    finally:
        cluster.stop()
        print(cluster.logs())


def test_daemon_refuses_bad_fabric_arguments(tmp_path: Path) -> None:
    env = _env(tmp_path, "n0")
    cases = [
        (["--nnodes", "2"], "--rendezvous"),
        (["--nnodes", "2", "--node-rank", "2", "--rendezvous", "127.0.0.1:1234"], "--node-rank 2"),
        (["--nnodes", "2", "--node-rank", "0", "--rendezvous", "nowhere"], "HOST:PORT"),
        (["--node-name", "bad name!"], "node name"),
        (["--nnodes", "2", "--node-rank", "0", "--rendezvous", "127.0.0.1:1234", "--advertise", "x.y"], "IPv4"),
    ]
    for extra, needle in cases:
        proc = subprocess.run([sys.executable, "-m", "commd", "daemon", "--job", "bad", *extra], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and needle in proc.stderr, (extra, proc.stderr)


@pytest.mark.extended
def test_node_with_wrong_secret_is_refused(tmp_path: Path) -> None:
    """Both nodes were given a secret by the cluster, but they differ: the coordinator refuses node 1."""
    port = free_port()
    procs = []
    for i, secret in enumerate(["s" * 32, "t" * 32]):
        env = _env(tmp_path / f"n{i}", f"n{i}")
        env["COMMD_SECRET"] = secret
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "commd", "daemon", "--job", "sec", "--nnodes", "2", "--node-rank", str(i),
             "--rendezvous", f"127.0.0.1:{port}", "--rendezvous-timeout", "6"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    started = time.monotonic()
    try:
        out1 = procs[1].communicate(timeout=120)[0]
        out0 = procs[0].communicate(timeout=120)[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert time.monotonic() - started < 110
    assert procs[1].returncode == 1 and procs[0].returncode == 1, out0 + out1
    assert "wrong job secret" in out1 or "authentication" in out1, out1
    assert "never joined" in out0 or "wrong job secret" in out0, out0
