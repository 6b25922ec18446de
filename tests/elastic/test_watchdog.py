"""The agent watchdog: it watches only a worker that a torchrun agent started, and a worker whose agent
died saves what it can and leaves (exit 76) within dist.agent_lost_grace, instead of dying unsaved.

The worker runs for real, under a shell that plays its parent; the test's helper process is a subreaper
(PR_SET_CHILD_SUBREAPER), so the orphaned worker is re-parented to it and its exit code can be read.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.config import load_config
from elastic_qa.elastic.signals import StopRequest
from elastic_qa.elastic.watchdog import AgentWatchdog
from elastic_qa.exits import EXIT_AGENT_LOST
from elastic_qa.observe.follow import read_events
from tests.conftest import REPO, tiny_overrides

# Runs `command` in the background of `sh` (its parent: a shell run by hand, or a stand-in for the torchrun
# agent) and SIGKILLs that shell once the worker has logged step `kill_at_step`. Prints the worker's exit
# code (None if it was gone before its parent), the seconds from its parent's end to its exit, and the step
# logged when the parent was killed.
ORPHANAGE = """
import ctypes, json, os, subprocess, sys, time
from elastic_qa.observe.follow import read_events

assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
run_dir, out, kill_at_step, command = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
parent = subprocess.Popen(
    ["sh", "-c", '"$@" >"$OUT" 2>&1 & echo $!; wait', "sh", *command],
    stdout=subprocess.PIPE,
    text=True,
    env={**os.environ, "OUT": out},
)
worker = int(parent.stdout.readline())
step = 0
while step < kill_at_step and os.path.exists(f"/proc/{worker}"):
    step = max([e["step"] for e in read_events(run_dir) if e.get("event") == "step"], default=0)
    time.sleep(0.05)
parent.kill()
parent.wait()
ended = time.monotonic()
try:
    exit_code = os.waitstatus_to_exitcode(os.waitpid(worker, 0)[1])
except ChildProcessError:  # it ended before its parent did
    exit_code = None
print(json.dumps({"exit": exit_code, "seconds": time.monotonic() - ended, "step": step}))
"""

# Thread wake-ups, os._exit and waitpid on a loaded 2-core box, on top of interval + grace.
SLACK_S = 1.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def without_torchrun() -> dict[str, str]:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    return {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_") and k not in names}


def as_torchrun_worker() -> dict[str, str]:
    """The environment a torchrun agent gives its only worker (a process group of one)."""
    return {
        **without_torchrun(),
        "TORCHELASTIC_RUN_ID": "watchdog-test",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }


def run_orphaned(run_dir: Path, cache: Path, env: dict[str, str], kill_at_step: int, *extra: str) -> dict:
    worker = [
        sys.executable,
        "-m",
        "elastic_qa.train",
        "--config",
        "tiny",
        *tiny_overrides(run_dir, cache, "log.every_steps=1", "debug.step_delay=100ms", *extra),
    ]
    out = run_dir.parent / "worker.out"
    result = subprocess.run(
        [sys.executable, "-c", ORPHANAGE, str(run_dir), str(out), str(kill_at_step), *worker],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    outcome["output"] = out.read_text()[-2000:] if out.exists() else ""
    return outcome


def committed_steps(run_dir: Path) -> list[int]:
    store = open_store(str(run_dir / "checkpoints"))
    return [info.step for info in store.list_steps() if store.verify(info.path).ok]


def grace_bound_s(run_dir: Path, save_in_flight: bool = False) -> float:
    """How long after its agent's death the worker may still be there: from the config it ran with (a save
    still in flight when the grace ends may take up to checkpoint.emergency_retry_for more)."""
    cfg = load_config(run_dir / "config.yaml")
    save = cfg.checkpoint.emergency_retry_for.total_seconds() if save_in_flight else 0.0
    watch = cfg.dist.agent_check_interval.total_seconds() + cfg.dist.agent_lost_grace.total_seconds()
    return watch + save + SLACK_S


def test_a_single_process_run_outlives_the_shell_that_started_it(tmp_path: Path, cache_dir: Path) -> None:
    # `nohup train ... &` and a shell that exits, `setsid`, a closed SSH session: the parent goes while the
    # run trains, and there is no agent to lose.
    run_dir = tmp_path / "run"
    outcome = run_orphaned(
        run_dir, cache_dir, without_torchrun(), 3, "train.max_steps=15", "dist.agent_check_interval=50ms"
    )
    assert outcome["exit"] == 0, outcome["output"]
    assert committed_steps(run_dir) == [15]
    events = [e["event"] for e in read_events(run_dir)]
    assert "train_done" in events and "agent_lost" not in events


def test_a_worker_whose_agent_died_saves_its_last_step_and_exits_76(tmp_path: Path, cache_dir: Path) -> None:
    run_dir = tmp_path / "run"
    outcome = run_orphaned(
        run_dir,
        cache_dir,
        as_torchrun_worker(),
        3,
        "train.max_steps=300",
        "dist.agent_check_interval=100ms",
    )
    saved = committed_steps(run_dir)  # the step the stop finished: not an exit that saved nothing
    assert len(saved) == 1 and outcome["step"] <= saved[0] < 300, saved
    assert outcome["exit"] == EXIT_AGENT_LOST, outcome["output"]
    assert outcome["seconds"] <= grace_bound_s(run_dir)


def test_a_worker_whose_agent_died_and_whose_save_hangs_leaves_after_the_grace_and_the_save_bound(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    outcome = run_orphaned(
        run_dir,
        cache_dir,
        as_torchrun_worker(),
        3,
        "train.max_steps=300",
        "dist.agent_check_interval=100ms",
        "dist.agent_lost_grace=1s",
        "debug.save_delay=60s",  # the stop's save never finishes
        "checkpoint.emergency_retry_for=1s",  # how long past the grace a save in flight may keep it
    )
    assert outcome["exit"] == EXIT_AGENT_LOST, outcome["output"]
    assert outcome["seconds"] <= grace_bound_s(run_dir, save_in_flight=True)


def test_only_a_process_started_by_a_torchrun_agent_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(None).dist
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    alone = AgentWatchdog(config.agent_check_interval, config.agent_lost_grace, StopRequest())
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    worker = AgentWatchdog(config.agent_check_interval, config.agent_lost_grace, StopRequest())
    assert not alone.active and worker.active and worker.parent == os.getppid()
