"""`elastic-qa node --replicas` refuses, before it starts anything, what cannot work across hosts (exit 2, one
line); a host's group hold refuses a second command for a live group and another job, never the job's other
groups; a host that is not the store host refuses a run.dir, key or checkpoint.dir that is not the store
host's. The job itself runs on namespace hosts in tests/multinode/test_replicas.py."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_qa.exits import UsageError
from elastic_qa.launcher.node import NodeLog
from elastic_qa.liveness import this_process
from elastic_qa.replica import node, worker
from elastic_qa.replica.heal import KEY_ENV
from elastic_qa.replica.node import GroupHold, check_job, main, peer_key, read_job_file, write_job_file
from elastic_qa.session.hold import RunHeldError, RunHold

pytest.importorskip("torchft")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line `elastic-qa node` refuses `argv` with (exit 2)."""
    assert main(list(argv)) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def live(tmp_path: Path):
    """A live process of this host to hold things with (a real pid, a real start time), killed after."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process
    process.kill()
    process.wait()


def test_settings_that_cannot_work_across_hosts_are_refused_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--replicas", "--endpoint", f"127.0.0.1:{free_port()}", "--config", "tiny"]
    run = f"run.dir={tmp_path / 'run'}"
    assert "--replicas needs --group N" in refused(capsys, *base, run)
    assert "numbered 0 .. 1" in refused(capsys, *base, "--group", "2", run)
    assert "--rdzv-backend etcd-v2" in refused(
        capsys, *base, "--group", "0", "--rdzv-backend", "etcd-v2", run
    )
    assert "--nnodes 2" in refused(capsys, *base, "--group", "0", "--nnodes", "2", run)
    assert "replica.nproc_per_group=4" in refused(capsys, *base, "--group", "0", "--nproc-per-node", "4", run)
    assert "the Lighthouse listens at the endpoint" in refused(
        capsys, *base, "--group", "0", run, "replica.lighthouse_port=1"
    )
    assert "every host mounts" in refused(capsys, *base, "--group", "0", "run.dir=s3://bucket/run")
    assert not (tmp_path / "run").exists()  # nothing was created


def test_a_store_host_whose_lighthouse_port_is_taken_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        line = refused(
            capsys, "--replicas", "--group", "0", "--store-host", "--endpoint", f"127.0.0.1:{port}",
            "--config", "tiny", f"run.dir={tmp_path / 'run'}",
        )  # fmt: skip
    assert f"port {port}" in line and "already in use" in line


def test_the_group_hold_refuses_a_second_command_for_a_live_group_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], live: subprocess.Popen
) -> None:
    run_dir = tmp_path / "run"
    checkpoints = str(run_dir / "checkpoints")
    GroupHold(checkpoints, "job", 0, str(run_dir)).acquire([this_process(live.pid).to_dict()])
    GroupHold(checkpoints, "job", 1, str(run_dir)).acquire([this_process(live.pid).to_dict()])
    # Group 1 runs: a second command for it is refused; group 0's command is not refused by group 1.
    line = refused(
        capsys, "--replicas", "--group", "1", "--endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "job",
        "--config", "tiny", f"run.dir={run_dir}",
    )  # fmt: skip
    assert f"group 1 of this job already runs (run job.group-1 (rank 0 pid {live.pid}" in line
    mine = GroupHold(checkpoints, "job", 2, str(run_dir))
    mine.check()
    mine.refuse_running(2)
    # Another job holding these checkpoints refuses the group, and the group's hold refuses it.
    with pytest.raises(RunHeldError, match=r"job\.group-"):
        RunHold(checkpoints, "other", str(run_dir)).acquire([this_process().to_dict()])
    elsewhere = str(tmp_path / "elsewhere")
    RunHold(elsewhere, "another", str(run_dir)).acquire([this_process(live.pid).to_dict()])
    with pytest.raises(RunHeldError, match="run another"):
        GroupHold(elsewhere, "job", 0, str(run_dir)).check()
    # Once the holder is gone, its group is free to take over.
    live.kill()
    live.wait()
    GroupHold(checkpoints, "job", 1, str(run_dir)).refuse_running(1)


def test_a_host_refuses_a_run_dir_key_or_checkpoint_dir_that_is_not_the_store_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    run_dir = tmp_path / "run"
    log = NodeLog(run_dir, "test@127.0.0.1")
    with pytest.raises(UsageError, match=r"run\.dir is not the store host's"):
        read_job_file(run_dir, 0.0, log)
    with pytest.raises(UsageError, match="no heal key"):
        peer_key(run_dir)  # and no key file was made
    assert not (run_dir / "replica" / "heal.key").exists()
    key = bytes(range(32))
    hold = GroupHold(str(run_dir / "checkpoints"), "job", 1, str(run_dir))
    write_job_file(run_dir, "job", 0, key, "127.0.0.1:29510")
    record = read_job_file(run_dir, 0.0, log)
    path = run_dir / "replica" / "job.json"
    with pytest.raises(UsageError, match="names job job, this host's is other"):
        check_job(record, "other", key, hold, path)
    with pytest.raises(UsageError, match="heal key is not the store host's"):
        check_job(record, "job", bytes(32), hold, path)
    with pytest.raises(UsageError, match=r"not the store host's checkpoint\.dir"):
        check_job(record, "job", key, hold, path)
    GroupHold(str(run_dir / "checkpoints"), "job", 0, str(run_dir)).acquire([this_process().to_dict()])
    check_job(record, "job", key, hold, path)
    assert "key" not in path.read_text().replace("key_check", "")  # the key itself is never written


def test_the_node_and_the_worker_name_the_same_variables() -> None:
    assert (node.HEAL_HOST_ENV, node.GROUPS_HERE_ENV) == (worker.HEAL_HOST_ENV, worker.GROUPS_HERE_ENV)
