"""A real launcher stopped by real signals: Ctrl-C exits 130, SIGTERM 143, each after saving, each
printing the saved step and the command that resumes the job; that command resumes from that step."""

from __future__ import annotations

import json
import shlex
import signal
import sys
from pathlib import Path

import pytest

from elastic_qa.chaos.job import Job
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.launcher.terminal import DEFAULT_PROG
from elastic_qa.observe.follow import read_events

pytestmark = pytest.mark.integration

# One agent of one worker: the fastest real job; the step delay leaves time to send the signal mid-run.
SETTINGS = (
    "train.max_steps=2000",
    "train.warmup_steps=2",
    "debug.step_delay=20ms",
    "log.every_steps=1",
    "log.console=plain",
)


def stop_with(job: Job, signum: int, at_step: int) -> tuple[int, str]:
    job.wait_for_step(at_step)
    assert job.process is not None
    job.process.send_signal(signum)
    try:
        code = job.wait(timeout=90)
    finally:
        job.kill_everything()
    return code, (job.run_dir / "chaos" / "launcher.log").read_text()


def printed_resume_command(output: str) -> list[str]:
    line = next(line for line in output.splitlines() if "resume with: " in line)
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[: len(DEFAULT_PROG.split())] == DEFAULT_PROG.split()
    return command[len(DEFAULT_PROG.split()) :]


def test_ctrl_c_exits_130_and_sigterm_143_after_saving_and_the_printed_command_resumes(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    store = open_store(str(run_dir / "checkpoints"))
    job = Job(run_dir, "tiny", [f"data.cache_dir={cache_dir}", *SETTINGS], agents=1, max_nodes=1)
    job.start()
    code, output = stop_with(job, signal.SIGINT, at_step=4)  # past the warm-up

    assert code == 130
    saved = store.list_steps()[-1].step
    assert f"stopped by SIGINT: saved step {saved}; resume with: " in output
    assert '"event"' not in output  # the launcher's JSON records are in its log file, not on the terminal

    # The printed command, run again with a longer horizon (SIGTERM this time), resumes from the saved step.
    command = printed_resume_command(output)
    assert command[0] == "start" and f"run.dir={run_dir}" in command
    command.append("train.max_steps=3000")
    resumed = Job(run_dir, "tiny", [], agents=1, max_nodes=1)
    resumed.start = lambda: _start_exactly(resumed, command)  # type: ignore[method-assign]
    resumed.start()
    code, output = stop_with(resumed, signal.SIGTERM, at_step=saved + 2)

    assert code == 143
    assert f"resuming from step {saved}" in output
    assert f"stopped by SIGTERM: saved step {store.list_steps()[-1].step}; resume with: " in output
    events = read_events(run_dir)
    assert [e["step"] for e in events if e["event"] == "resume"] == [saved]
    (changed,) = [e for e in events if e["event"] == "config_changed"]
    assert [(c["key"], c["old"], c["new"]) for c in changed["changes"]] == [("train.max_steps", 2000, 3000)]
    assert (
        "config changed since the checkpoint: train.max_steps 2000 -> 3000: the learning rate keeps" in output
    )
    lr = {e["step"]: e["lr"] for e in events if e["event"] == "step"}
    assert lr[saved + 1] <= lr[saved]  # the new horizon does not lift the learning rate back up


def _start_exactly(job: Job, command: list[str]) -> None:
    """Job.start, but with the launcher arguments exactly as printed (not rebuilt from Job's fields)."""
    import subprocess
    import time

    from elastic_qa.launcher.processes import python_env

    out = open(job.run_dir / "chaos" / "launcher.log", "wb")  # noqa: SIM115 - lives with the job
    launch = job.run_dir / "launch.json"
    before = launch.stat().st_mtime_ns
    job.process = subprocess.Popen(
        [sys.executable, "-m", "elastic_qa.launcher.local", *command],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=python_env(),
    )
    deadline = time.monotonic() + 60
    while launch.stat().st_mtime_ns == before and time.monotonic() < deadline:
        time.sleep(0.05)


def launcher(job: Job, command: str) -> str:
    """`join`, `leave` or `stop` for the job: its one line of output (exit 0)."""
    import subprocess

    from elastic_qa.launcher.processes import python_env

    result = subprocess.run(
        [sys.executable, "-m", "elastic_qa.launcher.local", command, "--run-dir", str(job.run_dir)],
        capture_output=True, text=True, env=python_env(), timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.strip().splitlines()
    return line


def wait_until(condition, what: str, timeout: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.2)


def first_step_at_world(job: Job, world: int, timeout: float = 180) -> int:
    """Wait for rank 0 to log a step at this world size: the regroup is done."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [
            e["step"] for e in read_events(job.run_dir) if e["event"] == "step" and e["world_size"] == world
        ]
        if steps:
            return steps[0]
        assert job.process is not None and job.process.poll() is None, "the launcher exited"
        time.sleep(0.2)
    raise AssertionError(f"no step at world size {world} within {timeout} s")


def test_join_and_leave_say_what_they_did_and_a_requested_stop_that_saved_exits_0(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    store = open_store(str(run_dir / "checkpoints"))
    job = Job(run_dir, "tiny", [f"data.cache_dir={cache_dir}", *SETTINGS], agents=1, max_nodes=2)
    job.start()
    try:
        job.wait_for_step(3)
        joined = launcher(job, "join")
        assert joined.startswith("joined: agent 1 (pid ") and "the job regroups at 2 agents" in joined
        first_step_at_world(job, 2)
        left = launcher(job, "leave")
        assert left.startswith("leaving: agent 1 (pid ") and "the job regroups at 1 agent (1 worker" in left
        job.wait_for_step(first_step_at_world(job, 1) + 2)
        wait_until(lambda: len(job.live_agents()) == 1, "the agent that left exits")
        assert launcher(job, "stop").startswith("stopping: SIGTERM to 1 agent (pid ")
        code = job.wait(timeout=90)
    finally:
        job.kill_everything()
    output = (run_dir / "chaos" / "launcher.log").read_text()
    assert code == 0, output[
        -3000:
    ]  # it was 1: "the job ended before its last step (agents stopped or failed"
    saved = store.list_steps()[-1].step
    stopping = [e for e in read_events(run_dir) if e["event"] == "stopping" and e["rank"] == 0]
    assert saved == stopping[-1]["step"]
    # `leave` signalled rank 1 only: rank 0 names that stop too (it said "(None)").
    assert all(isinstance(e["signal"], str) for e in stopping), stopping
    assert "(None)" not in output
    assert f"stopped by `stop` and saved, resumable: saved step {saved}; resume with: " in output


def test_ctrl_c_in_a_terminal_stops_two_agents_without_aborting_either(
    tmp_path: Path, cache_dir: Path
) -> None:
    # As a terminal does: the launcher (launch/local.sh, exec'ed) leads the foreground process group, and
    # Ctrl-C is SIGINT to that group. Each agent must exit as torchrun does on a stop, never by SIGABRT
    # (its rendezvous keep-alive torn down in C++: elastic_qa/launcher/loopback.py).
    import os
    import subprocess

    from elastic_qa.launcher.processes import python_env

    run_dir = tmp_path / "run"
    job = Job(run_dir, "tiny", [f"data.cache_dir={cache_dir}", *SETTINGS], agents=2)
    (run_dir / "chaos").mkdir(parents=True)
    script = Path(__file__).resolve().parents[2] / "launch" / "local.sh"
    with open(run_dir / "chaos" / "launcher.log", "wb") as out:
        job.process = subprocess.Popen(
            [str(script), "start", "--agents", "2", "--config", "tiny", *job.overrides],
            stdout=out, stderr=subprocess.STDOUT, env=python_env(), start_new_session=True,
        )  # fmt: skip
    try:
        job.wait_for_step(4)
        os.killpg(job.process.pid, signal.SIGINT)
        assert job.wait(timeout=90) == 130
    finally:
        job.kill_everything()
    actions = [json.loads(line) for line in (run_dir / "agents" / "launch.jsonl").read_text().splitlines()]
    exits = [e for e in actions if e["event"] == "agent_exit"]
    assert len(exits) == 2 and all(e["code"] >= 0 for e in exits), exits
    for log in sorted((run_dir / "agents").glob("agent-*.log")):
        said = log.read_text(errors="replace")
        assert "terminate called" not in said and "Fatal Python error" not in said, said[-3000:]
    assert any(
        e["event"] == "checkpoint_committed" and e["reason"] == "sigterm" for e in read_events(run_dir)
    )
