"""The dashboard's state across jobs and deaths: a run directory started again reads as running, and a
worker killed outright reads as killed by its signal, as its torchrun agent saw it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_qa.report.live import LiveRun
from tests.report.runs import CONFIG, T0, line, write_run


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def test_a_run_directory_started_again_reads_as_training_with_an_eta(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", {**CONFIG, "train": {**CONFIG["train"], "max_steps": 200}})
    first = [
        {"event": "job_start", "ts": T0, "run_id": "a", "agents": 2},
        {"event": "agent_started", "ts": T0, "agent": 0, "pid": 10, "is_host": True},
        {"event": "agent_started", "ts": T0, "agent": 1, "pid": 11, "is_host": False},
        {"event": "agent_exit", "ts": T0 + 36, "agent": 0, "pid": 10, "code": 0},
        {"event": "agent_exit", "ts": T0 + 36, "agent": 1, "pid": 11, "code": 0},
        {"event": "job_end", "ts": T0 + 36, "exit_codes": {"0": 0, "1": 0}},
    ]
    again = [
        {"event": "job_start", "ts": T0 + 60, "run_id": "b", "agents": 1},
        {"event": "agent_started", "ts": T0 + 60, "agent": 0, "pid": 20, "is_host": True},
    ]
    (run_dir / "agents").mkdir()
    (run_dir / "agents" / "launch.jsonl").write_text(jsonl(first + again))
    rows = [line("worker_start", 61.0, 0, 3, 1)] + [
        line("step", 61.0 + (step - 100) / 10, 0, 3, 1, step=step, loss=1.0) for step in range(110, 151, 10)
    ]  # 10 steps a second: 50 of 200 left
    (run_dir / "logs" / "rank-000.pid-3000.jsonl").write_text(jsonl(rows))
    run = LiveRun(run_dir)
    run.refresh()
    state = run.state()
    assert (state["status"], state["attempt"], state["step"]) == ("training", 3, 150)
    assert state["eta_s"] == pytest.approx(5.0)
    assert state["agents"] == [{"agent": 0, "pid": 20, "role": "store host", "state": "started"}]


def test_a_start_after_one_that_ended_without_finishing_reads_as_starting_then_training(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "agents").mkdir()
    (run_dir / "config.yaml").write_text(json.dumps({**CONFIG, "train": {"max_steps": 200}}))
    first = [line("worker_start", 0.0, 0, 1, 1)]
    first += [line("step", step / 10, 0, 1, 1, step=step, loss=1.0) for step in range(10, 51, 10)]
    first += [line("stopping", 5.5, 0, 1, 1, step=50, signal="SIGTERM")]
    (run_dir / "logs" / "rank-000.pid-1000.jsonl").write_text(jsonl(first))
    launch = run_dir / "agents" / "launch.jsonl"
    launch.write_text(
        jsonl([
            {"event": "job_start", "ts": T0, "run_id": "a", "agents": 1},
            {"event": "agent_started", "ts": T0, "agent": 0, "pid": 10, "is_host": True},
            {"event": "job_end", "ts": T0 + 6, "exit_codes": {"0": 130}},
        ])
    )  # fmt: skip
    run = LiveRun(run_dir)
    run.refresh()
    assert run.state()["status"] == "ended without finishing"
    with open(launch, "a") as handle:  # `start` again on the same run directory
        handle.write(jsonl([{"event": "job_start", "ts": T0 + 60, "run_id": "b", "agents": 1}]))
    run.refresh()
    assert run.state()["status"] == "starting"
    again = [line("worker_start", 61.0, 0, 2, 1), line("resume", 61.1, 0, 2, 1, step=50)]
    again += [
        line("step", 61.0 + (step - 50) / 10, 0, 2, 1, step=step, loss=1.0) for step in range(60, 101, 10)
    ]
    (run_dir / "logs" / "rank-000.pid-2000.jsonl").write_text(jsonl(again))
    run.refresh()
    state = run.state()
    assert (state["status"], state["attempt"], state["step"]) == ("training", 2, 100)
    assert state["eta_s"] == pytest.approx(10.0)  # 10 steps a second, 100 left


WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    rank, log_dir = int(os.environ["RANK"]), sys.argv[1]
    def say(event, **fields):
        row = {"event": event, "ts": time.time(), "rank": rank, "attempt": 1, "world_size": 2,
               "pid": os.getpid(), "node": "here/0", **fields}
        with open(os.path.join(log_dir, f"rank-{rank:03d}.pid-{os.getpid()}.jsonl"), "a") as log:
            log.write(json.dumps(row) + "\\n")
    say("worker_start")
    say("step", step=1, loss=1.0)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    say("peer_failure", error="Connection closed by peer")  # what the survivor of a kill says
    time.sleep(600)  # until torchrun stops it
    """
)


@pytest.mark.integration
def test_a_worker_killed_outright_reads_as_killed_by_sigkill_as_its_agent_logged_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "agents").mkdir()
    (tmp_path / "worker.py").write_text(WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=0", str(tmp_path / "worker.py"), str(run_dir / "logs")]  # fmt: skip
    with open(run_dir / "agents" / "agent-0.log", "wb") as agent_log:
        subprocess.run(command, stdout=agent_log, stderr=subprocess.STDOUT, timeout=300, check=False)
    run = LiveRun(run_dir)
    run.refresh()
    state = run.state()
    victim = next(m for m in state["members"] if m["rank"] == 1)
    assert victim["state"] == "killed by SIGKILL" and state["status"] == "regrouping"
    texts = [row["text"] for row in state["timeline"]]
    assert f"rank 1 on here (pid {victim['pid']}) killed by SIGKILL" in texts
    assert "rank 0 on here lost a peer: Connection closed by peer" in texts
