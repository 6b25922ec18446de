"""A training job of `elastic-qa node` commands on the namespace hosts of a Cluster, and its etcd server."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from elastic_qa.launcher.processes import python_env
from elastic_qa.observe.follow import read_events
from tests.multinode.cluster import ETCD_INDEX, Cluster

MAX_STEPS = 30
# Tiny and fast: one thread per worker (three workers share two cores), dropout off, the ledger on.
OVERRIDES = (
    f"train.max_steps={MAX_STEPS}",
    "train.threads=1",
    "model.dropout=0.0",
    "debug.sample_ledger=true",
    "debug.step_delay=50ms",
    "log.every_steps=1",
    "log.console=none",
    "checkpoint.every_steps=10",
)
C10D_PORT = 29400
ETCD_PORT = 2379


def etcd_unavailable() -> str | None:
    if not shutil.which("etcd"):
        return "etcd is not installed (Debian: apt-get install etcd-server)"
    try:
        import etcd  # noqa: F401
    except ImportError:
        return "python-etcd is not installed (pip install 'elastic-qa[etcd]')"
    return None


def start_etcd(cluster: Cluster, data_dir: Path) -> subprocess.Popen:
    """etcd 3.4 with the v2 API on its own host (10.91.0.100), off the training hosts; waits until ready."""
    address = cluster.address(ETCD_INDEX)
    log = data_dir.parent / "etcd.log"
    process = cluster.spawn(
        ETCD_INDEX,
        [
            "etcd",
            "--name=eq",
            f"--data-dir={data_dir}",
            "--enable-v2",
            f"--listen-client-urls=http://{address}:{ETCD_PORT}",
            f"--advertise-client-urls=http://{address}:{ETCD_PORT}",
            f"--listen-peer-urls=http://{address}:2380",
            f"--initial-advertise-peer-urls=http://{address}:2380",
            f"--initial-cluster=eq=http://{address}:2380",
        ],
        log,
        python_env(),
    )
    deadline = time.monotonic() + 30
    while "ready to serve client requests" not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"etcd did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    return process


def start_nodes(
    cluster: Cluster,
    run_dir: Path,
    cache: Path,
    backend: str = "c10d",
    *extra: str,
    hosts: range | list[int] | None = None,
) -> dict[int, subprocess.Popen]:
    """`elastic-qa node` on `hosts` (default: every host); with c10d host 0 is the store host and the
    endpoint, and the job allows up to cluster.hosts hosts."""
    endpoint = (
        f"{cluster.address(0)}:{C10D_PORT}"
        if backend == "c10d"
        else f"{cluster.address(ETCD_INDEX)}:{ETCD_PORT}"
    )
    nodes = {}
    for index in range(cluster.hosts) if hosts is None else hosts:
        argv = [
            sys.executable,
            "-m",
            "elastic_qa.launcher.node",
            f"--endpoint={endpoint}",
            f"--nnodes=1:{cluster.hosts}",
            f"--rdzv-backend={backend}",
            "--config=tiny",
            *(["--store-host"] if backend == "c10d" and index == 0 else []),
            f"run.dir={run_dir}",
            f"data.cache_dir={cache}",
            *OVERRIDES,
            *extra,
        ]
        nodes[index] = cluster.spawn(index, argv, run_dir / "hosts" / f"host-{index}.out", python_env())
    return nodes


def newest_step(run_dir: Path, world_size: int | None = None) -> int:
    """The newest step trained (by a group of `world_size`, when given)."""
    steps = [e for e in read_events(run_dir) if e.get("event") == "step"]
    return max((e["step"] for e in steps if world_size in (None, e.get("world_size"))), default=0)


def wait_for_step(
    run_dir: Path,
    step: int,
    nodes: dict[int, subprocess.Popen],
    timeout: float = 120,
    world_size: int | None = None,
) -> None:
    """Until a group (of `world_size`, when given: hosts that start together may first form a smaller
    one, when the last of them reach the rendezvous after its last call) has trained `step`."""
    deadline = time.monotonic() + timeout
    while newest_step(run_dir, world_size) < step:
        if time.monotonic() > deadline:
            newest = newest_step(run_dir, world_size)
            raise TimeoutError(f"step {step}, world {world_size}: not reached in {timeout} s ({newest})")
        if all(node.poll() is not None for node in nodes.values()):
            raise RuntimeError(f"every node exited before step {step}: {codes(nodes)}")
        time.sleep(0.1)


def wait_all(nodes: dict[int, subprocess.Popen], timeout: float = 180) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    for node in nodes.values():
        node.wait(timeout=max(1.0, deadline - time.monotonic()))
    return codes(nodes)


def codes(nodes: dict[int, subprocess.Popen]) -> dict[int, int | None]:
    return {index: node.poll() for index, node in nodes.items()}
