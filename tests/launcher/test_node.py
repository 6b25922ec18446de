"""`elastic-qa node` without a network: its arguments, the torchrun command it builds, its exit codes."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_qa.exits import UsageError
from elastic_qa.launcher import LOOPBACK_FILE, ON_LOOPBACK
from elastic_qa.launcher.netplan import Endpoint, NetworkPlan, parse_endpoint
from elastic_qa.launcher.node import (
    STOP_GRACE_IDLE_S,
    build_parser,
    default_rdzv_id,
    finish,
    parse_nnodes,
    rendezvous_conf,
    torchrun_command,
    wait_for_agent,
    wait_for_store,
    watch_for_crash_loop,
)
from elastic_qa.launcher.processes import alive, descendants, kill_trees, python_env


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
    # Warm workers: the agent's forkserver imports the preload; each worker runs the loopback file.
    preload = "elastic_qa.launcher.warm_start"
    warm = torchrun_command(args, plan, "job", [preload])
    assert warm[1:5] == ["-m", ON_LOOPBACK, f"--preload={preload}", "torch.distributed.run"]
    assert "--start-method=forkserver" in warm and "-m" not in warm[5:]
    assert warm[-6:] == ["--run-path", str(LOOPBACK_FILE), "elastic_qa.train", "--config", "tiny", "a.b=1"]


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


# ---- the real command: bounded waits, one line for what cannot work ---------------------------------


def node_command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "elastic_qa.launcher.node", *argv]


def wait_for_line(path: Path, text: str, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert process.poll() is None, (
            f"exited {process.returncode} before {text!r}: {path.read_text()[-2000:]}"
        )
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s: {path.read_text()[-2000:]}"
        time.sleep(0.2)


def ignore_sigint() -> None:
    """As for a command started in the background from a script (`cmd &`): SIGINT ignored, inherited."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.integration
def test_ctrl_c_ends_a_store_host_waiting_for_a_peer_that_never_comes_and_its_agent(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Its torchrun agent inherits SIGINT ignored, so forwarding SIGINT left it waiting out its join
    timeout (600 s) and the node with it. 30 s bounds a hang; it is no timing goal."""
    out = tmp_path / "node.err"
    command = node_command(
        f"--endpoint=127.0.0.1:{closed_port()}", "--store-host", "--nnodes=2", "--config=tiny",
        f"run.dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", "log.console=none",
    )  # fmt: skip
    with open(out, "wb") as handle:
        node = subprocess.Popen(
            command, stdout=handle, stderr=handle, env=python_env(), preexec_fn=ignore_sigint
        )
    try:
        wait_for_line(out, '"waiting_for_peers"', node)
        tree = [node.pid, *descendants(node.pid)]
        assert len(tree) >= 2, "the node has started its torchrun agent"
        node.send_signal(signal.SIGINT)
        code = node.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in tree if alive(pid)] == []
    finally:
        kill_trees([node.pid])
    assert code == 128 + signal.SIGINT, out.read_text()[-2000:]


def test_a_loopback_endpoint_nobody_serves_needs_store_host_here(tmp_path: Path) -> None:
    """Only this host can reach a loopback endpoint: without --store-host and nothing serving it, no
    agent would ever host the store (the agent retried for minutes and died in a C++ frame dump)."""
    port = closed_port()
    result = subprocess.run(
        node_command(f"--endpoint=127.0.0.1:{port}", "--nnodes=1", "--config=tiny", f"run.dir={tmp_path}/r"),
        capture_output=True, text=True, env=python_env(), timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert f"127.0.0.1:{port}" in line and "only reachable from this host" in line
    assert "add --store-host" in line
    assert not (tmp_path / "r").exists()


def test_a_second_store_host_on_a_port_already_served_is_one_line_exit_2(tmp_path: Path) -> None:
    with socket.socket() as served:
        served.bind(("127.0.0.1", 0))
        served.listen()
        port = served.getsockname()[1]
        result = subprocess.run(
            node_command(
                f"--endpoint=127.0.0.1:{port}", "--store-host", "--nnodes=1", "--config=tiny",
                f"run.dir={tmp_path}/run",
            ),
            capture_output=True, text=True, env=python_env(), timeout=60,
        )  # fmt: skip
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert f"port {port}" in line and "already in use" in line and "another c10d store or job" in line
    assert not (tmp_path / "run").exists()


def test_a_peer_waits_for_the_store_a_bounded_time_and_says_what_it_waits_for() -> None:
    log = Log()
    endpoint = Endpoint("127.0.0.1", closed_port())
    assert wait_for_store(endpoint, 1.0, [], log) is False
    assert log == [{"event": "waiting_for_store", "endpoint": str(endpoint), "timeout_s": 1.0}]
    assert wait_for_store(endpoint, 600.0, [signal.SIGINT], Log()) is False  # a stop ends the wait
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        served = Endpoint("127.0.0.1", listening.getsockname()[1])
        assert wait_for_store(served, 1.0, [], Log()) is True


def test_an_agent_that_outlives_a_stop_is_killed_with_its_tree_after_a_bounded_grace() -> None:
    """A torchrun blocked in a store call (or ignoring the signal) must not keep the node waiting: with
    no worker under it, it is killed once STOP_GRACE_IDLE_S has passed."""
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    log = Log()
    try:
        code = wait_for_agent(agent, [signal.SIGINT], log)
    finally:
        kill_trees([agent.pid])
    assert code == -signal.SIGKILL
    assert [e["event"] for e in log] == ["stopping", "agent_killed"]
    assert log[0]["training"] is False and log[0]["grace_s"] == STOP_GRACE_IDLE_S
