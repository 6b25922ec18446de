"""What a local job exposes: its listening sockets stay on loopback, and run.private keeps files private.

The socket test starts a real two-agent job with the project's launcher and, while it trains, reads the
listening TCP sockets of every process of the job from /proc (passive: nothing connects anywhere).
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from elastic_qa.chaos.job import Job
from elastic_qa.launcher.loopback import LoopbackTCPStore
from elastic_qa.launcher.processes import children
from elastic_qa.step_holds import arm
from tests.conftest import tiny_overrides

LOOPBACK = {"127.0.0.1", "::1"}
TCP_LISTEN = "0A"
needs_proc = pytest.mark.skipif(
    not Path("/proc/self/net/tcp").exists(), reason="reads sockets from Linux /proc"
)


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        kids = [kid for parent in frontier for kid in children(parent)]
        found += kids
        frontier = kids
    return found


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # exited meanwhile
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def decode_address(hex_address: str) -> str:
    """/proc/net/tcp{,6} print each 32-bit word of the address as a native-endian integer."""
    raw = bytes.fromhex(hex_address)
    words = [raw[i : i + 4] for i in range(0, len(raw), 4)]
    if sys.byteorder == "little":
        words = [word[::-1] for word in words]
    packed = b"".join(words)
    return socket.inet_ntop(socket.AF_INET if len(packed) == 4 else socket.AF_INET6, packed)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket that process `pid` holds open in the LISTEN state."""
    inodes = socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == TCP_LISTEN and inode in inodes:
                address, port = local.rsplit(":", 1)
                found.append((decode_address(address), int(port, 16)))
    return found


@needs_proc
def test_a_store_server_asked_for_on_127_0_0_1_listens_there_only_and_serves_its_clients() -> None:
    server = LoopbackTCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
    # A second server on the same port in this process: torch's multi-tenancy shares the first one.
    tenant = LoopbackTCPStore("127.0.0.1", server.port, is_master=True, multi_tenant=True)
    client = TCPStore("127.0.0.1", server.port, is_master=False)
    client.set("key", "value")
    assert server.get("key") == b"value" and tenant.get("key") == b"value"
    on_its_port = [address for address, port in listening_sockets(os.getpid()) if port == server.port]
    assert on_its_port == ["127.0.0.1"]  # torch alone would listen on "::", every interface


@pytest.mark.integration
@needs_proc
def test_every_socket_a_two_agent_local_job_listens_on_is_bound_to_loopback(
    tmp_path: Path, cache_dir: Path
) -> None:
    # Held after step 3 (never released: killed below), so the processes are listed while they all run,
    # however slow the machine (400 steps at full speed used to race the listing).
    arm(tmp_path / "holds", [3])
    job = Job(
        tmp_path / "run",
        "tiny",
        [
            f"data.cache_dir={cache_dir}",
            "train.max_steps=400",
            "log.every_steps=1",
            "log.console=none",
            f"debug.hold_dir={tmp_path / 'holds'}",
        ],
        agents=2,
    )
    job.start()
    try:
        job.wait_for_step(3, timeout=90)  # both ranks trained a step: every store and gloo pair is up
        assert job.process is not None
        processes = [job.process.pid, *descendants(job.process.pid)]
        agents = job.live_agents()
        workers = [pid for agent in agents for pid in job.workers(agent)]
        assert len(agents) == 2 and len(workers) == 2, (agents, workers)
        listening = {pid: listening_sockets(pid) for pid in processes}
    finally:
        job.kill_everything()
    # The c10d store of the is_host agent, rank 0's worker store, and every worker's gloo listener.
    host_agent = next(agent["pid"] for agent in job.agents() if agent["is_host"])
    assert listening[host_agent], "the store host agent listens on nothing: the test saw no store"
    assert all(listening[pid] for pid in workers), "a worker has no gloo listener: the test saw nothing"
    exposed = {pid: [s for s in sockets if s[0] not in LOOPBACK] for pid, sockets in listening.items()}
    assert not any(exposed.values()), f"listening beyond loopback: {exposed}"


def modes_under(run_dir: Path) -> dict[str, int]:
    """Permission bits of the run dir and of everything in it, by path relative to it."""
    modes = {".": stat.S_IMODE(run_dir.stat().st_mode)}
    for path in run_dir.rglob("*"):
        modes[str(path.relative_to(run_dir))] = stat.S_IMODE(path.lstat().st_mode)
    return modes


def train_with_umask(run_dir: Path, cache: Path, *extra: str) -> dict[str, int]:
    """One tiny single-process run under umask 022 that saves a checkpoint; the modes it left behind."""
    command = [
        sys.executable,
        "-m",
        "elastic_qa.train",
        "--config",
        "tiny",
        *tiny_overrides(run_dir, cache, "train.max_steps=4", "checkpoint.every_steps=2", *extra),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, umask=0o022)
    assert result.returncode == 0, result.stderr[-3000:]
    modes = modes_under(run_dir)
    kinds = {path.split("/")[0] for path in modes}
    assert {"config.yaml", "logs", "checkpoints"} <= kinds, sorted(modes)
    return modes


def test_a_private_run_leaves_no_file_or_directory_readable_by_group_or_others(
    tmp_path: Path, cache_dir: Path
) -> None:
    modes = train_with_umask(tmp_path / "run", cache_dir, "run.private=true")
    open_to_others = {path: oct(mode) for path, mode in modes.items() if mode & 0o077}
    assert not open_to_others


def test_a_run_that_is_not_private_follows_the_umask(tmp_path: Path, cache_dir: Path) -> None:
    run_dir = tmp_path / "run"
    modes = train_with_umask(run_dir, cache_dir)  # run.private is false by default
    for path, mode in modes.items():
        expected = 0o755 if (run_dir / path).is_dir() else 0o644
        assert mode == expected, (path, oct(mode))


@pytest.mark.integration
def test_the_launcher_creates_a_private_runs_directory_and_agent_logs_owner_only(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "elastic_qa.launcher.local",
        "start",
        "--agents",
        "1",
        "--min",
        "1",
        "--max",
        "1",
        "--config",
        "tiny",
        *tiny_overrides(run_dir, cache_dir, "train.max_steps=2", "run.private=true"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, umask=0o022)
    assert result.returncode == 0, result.stderr[-3000:]
    modes = modes_under(run_dir)
    assert {"launch.json", "agents/agent-0.log", "agents/launch.jsonl"} <= set(modes), sorted(modes)
    open_to_others = {path: oct(mode) for path, mode in modes.items() if mode & 0o077}
    assert not open_to_others
