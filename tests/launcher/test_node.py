"""`elastic-qa node` without a network: its arguments, the torchrun command it builds, its exit codes."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from elastic_qa.exits import UsageError
from elastic_qa.launcher.netplan import Endpoint, NetworkPlan, parse_endpoint
from elastic_qa.launcher.node import (
    build_parser,
    default_rdzv_id,
    finish,
    parse_nnodes,
    rendezvous_conf,
    torchrun_command,
    watch_for_crash_loop,
)


def test_endpoints_parse_with_and_without_a_port_and_in_brackets_for_ipv6() -> None:
    assert parse_endpoint("10.0.0.1:29400", 1) == Endpoint("10.0.0.1", 29400)
    assert parse_endpoint("host0", 29400) == Endpoint("host0", 29400)
    assert parse_endpoint("[fd00::1]:2379", 1) == Endpoint("fd00::1", 2379)
    assert str(Endpoint("fd00::1", 2379)) == "[fd00::1]:2379"
    for bad in ("host0:http", ":29400", "host0:70000"):
        with pytest.raises(UsageError):
            parse_endpoint(bad, 29400)


def test_nnodes_is_a_count_or_a_range_of_at_least_one() -> None:
    assert parse_nnodes("3") == (3, 3)
    assert parse_nnodes("1:4") == (1, 4)
    for bad in ("0:2", "4:1", "a:b"):
        with pytest.raises(UsageError):
            parse_nnodes(bad)


def test_every_host_derives_the_same_job_id_from_the_same_run_dir() -> None:
    assert default_rdzv_id("/shared/runs/a") == default_rdzv_id("/shared/runs/a")
    assert default_rdzv_id("/shared/runs/a") != default_rdzv_id("/shared/runs/b")


def test_the_store_host_is_a_flag_and_etcd_gets_no_c10d_settings() -> None:
    assert "is_host=1" in rendezvous_conf("c10d", True)
    assert "is_host=0" in rendezvous_conf("c10d", False)
    assert "is_host" not in rendezvous_conf("etcd-v2", False)
    assert "keep_alive" not in rendezvous_conf("etcd-v2", False)


def test_torchrun_gets_the_planned_local_address_and_the_overrides() -> None:
    args = build_parser().parse_args(
        ["--endpoint", "10.0.0.1:29400", "--nnodes", "1:3", "--store-host", "--config", "tiny", "a.b=1"]
    )
    plan = NetworkPlan("10.0.0.1", "10.0.0.1", "eth0", {}, ())
    command = torchrun_command(args, plan, "job")
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert "--local_addr=10.0.0.1" in command and "--rdzv_id=job" in command
    assert "--rdzv_endpoint=10.0.0.1:29400" in command
    assert command[-4:] == ["elastic_qa.train", "--config", "tiny", "a.b=1"]


class Log(list):
    def __call__(self, event: str, **fields) -> None:
        self.append({"event": event, **fields})


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


def args_for(backend: str = "c10d", store_host: bool = False) -> argparse.Namespace:
    return argparse.Namespace(rdzv_backend=backend, store_host=store_host)


def test_a_sigterm_that_stopped_the_agent_exits_143_and_a_finished_job_exits_0(tmp_path: Path) -> None:
    endpoint = Endpoint("127.0.0.1", closed_port())
    assert finish(args_for(), endpoint, tmp_path, 1, [signal.SIGTERM], {}, Log()) == 143
    assert finish(args_for(), endpoint, tmp_path, 0, [signal.SIGTERM], {}, Log()) == 0


def test_a_crash_loop_of_bad_input_exits_2_and_of_anything_else_1(tmp_path: Path) -> None:
    endpoint = Endpoint("127.0.0.1", closed_port())
    bad = {"error": "does not fit", "bad_input": True}
    assert finish(args_for(), endpoint, tmp_path, 1, [], bad, Log()) == 2
    assert finish(args_for(), endpoint, tmp_path, 1, [], {**bad, "bad_input": False}, Log()) == 1


def test_a_failed_agent_whose_store_endpoint_no_longer_answers_says_the_store_host_is_gone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = Log()
    gone = Endpoint("127.0.0.1", closed_port())
    assert finish(args_for(), gone, tmp_path, 1, [], {}, log) == 1
    assert log[-1]["store_host_gone"] is True
    assert "store host 127.0.0.1" in capsys.readouterr().err
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        alive = Endpoint("127.0.0.1", listening.getsockname()[1])
        assert finish(args_for(), alive, tmp_path, 1, [], {}, log) == 1
    assert log[-1]["store_host_gone"] is False
    # The store host itself, and etcd (no store host), never blame the store.
    assert finish(args_for(store_host=True), gone, tmp_path, 1, [], {}, log) == 1
    assert finish(args_for("etcd-v2"), gone, tmp_path, 1, [], {}, log) == 1
    assert log[-1]["store_host_gone"] is False


def three_failed_processes(run_dir: Path) -> None:
    """Three worker processes, one after the other (ts 11-13), each failing with the same bad input."""
    logs = run_dir / "logs"
    logs.mkdir()
    for pid in (11, 12, 13):
        line = {"event": "bad_input", "error": "checkpoint does not fit", "pid": pid, "ts": float(pid)}
        (logs / f"rank-000.trainer@10.0.0.2.pid-{pid}.jsonl").write_text(json.dumps(line) + "\n")


def test_the_same_error_at_three_attempts_without_a_step_stops_this_hosts_agent(tmp_path: Path) -> None:
    three_failed_processes(tmp_path)
    agent = subprocess.Popen(["sleep", "30"])  # stands in for torchrun: only its SIGTERM is looked at
    crash: dict = {}
    log = Log()
    try:
        watch_for_crash_loop(tmp_path, agent, crash, log)
        assert agent.wait(timeout=10) == -signal.SIGTERM
    finally:
        agent.kill()
    assert crash == {"error": "checkpoint does not fit", "bad_input": True}
    assert log[-1]["event"] == "crash_loop"
    endpoint = Endpoint("127.0.0.1", closed_port())
    assert finish(args_for(), endpoint, tmp_path, 1, [], crash, log) == 2


def test_errors_logged_before_this_run_started_do_not_make_a_crash_loop(tmp_path: Path) -> None:
    three_failed_processes(tmp_path)  # an earlier run of this run directory, since fixed
    agent = subprocess.Popen(["sleep", "2.5"])
    crash: dict = {}
    try:
        watch_for_crash_loop(tmp_path, agent, crash, Log(), since=20.0)
    finally:
        agent.kill()
    assert crash == {} and agent.wait() == 0
