"""A live job holds its run: a trainer started by hand on it is refused (exit 2, one line naming the live
job and how to join it) and fences nothing; once the job is dead, a start resumes its checkpoint. Real
torchrun agents, real processes, real SIGSTOP/SIGKILL."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_qa.chaos.evidence import run_config
from elastic_qa.chaos.job import Job
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.node_local import NodeLocalCopy
from elastic_qa.observe.follow import read_events

pytestmark = pytest.mark.integration

MAX_STEPS = 80
SETTINGS = (
    f"train.max_steps={MAX_STEPS}",
    "train.warmup_steps=2",
    "debug.step_delay=20ms",
    "log.every_steps=1",
    "log.console=none",
    "dist.timeout=600s",  # workers are frozen (SIGSTOP) while the intruder starts: no collective times out
)


def by_hand(run_dir: Path, cache: Path, *extra: str) -> subprocess.Popen:
    """`python -m elastic_qa.train` started by a person: no torchrun variables, so not part of any job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
    command = [sys.executable, "-m", "elastic_qa.train", "--config", "tiny"]
    overrides = [f"run.dir={run_dir}", f"data.cache_dir={cache}", "log.console=none", *extra]
    return subprocess.Popen(
        [*command, *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def test_a_trainer_started_by_hand_on_a_live_run_is_refused_and_the_job_trains_to_the_end(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    job = Job(run_dir, "tiny", [f"data.cache_dir={cache_dir}", *SETTINGS], agents=2)
    job.start()
    try:
        job.wait_for_step(10)  # nothing saved yet: a fenced job would start again from step 0
        workers = [pid for agent in job.live_agents() for pid in job.workers(agent)]
        assert workers
        # Frozen, the job cannot reach its end before the intruder has checked; its processes still run.
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            started = time.time()
            intruder = by_hand(run_dir, cache_dir, f"train.max_steps={MAX_STEPS}")
            _, err = intruder.communicate(timeout=300)
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        code = job.wait(timeout=300)
    finally:
        job.kill_everything()

    assert intruder.returncode == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    run_id = json.loads((run_dir / "launch.json").read_text())["run_id"]
    assert f"is held by a live job: run {run_id} (rank 0 pid " in lines[0], lines[0]
    assert int(re.search(r"rank 0 pid (\d+)", lines[0]).group(1)) in workers  # type: ignore[union-attr]
    assert "since " in lines[0] and f"launch/local.sh join --run-dir {run_dir}" in lines[0]
    assert code == 0
    events = read_events(run_dir)
    assert not [e for e in events if e.get("pid") == intruder.pid]  # it wrote nothing into the live run
    assert not [e for e in events if e["event"] in ("worker_start", "resume") and e["ts"] > started]
    steps = sorted({e["step"] for e in events if e["event"] == "step"})
    assert steps == list(range(1, MAX_STEPS + 1))  # trained once, to the end: no regroup to step 0
    assert not list((run_dir / "checkpoints" / "holders").iterdir())  # done: the hold is released


def test_a_start_after_the_holding_job_was_killed_resumes_its_checkpoint_once_its_node_copy_is_removed(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    store = open_store(str(run_dir / "checkpoints"))
    job = Job(
        run_dir, "tiny", [f"data.cache_dir={cache_dir}", *SETTINGS, "checkpoint.every_steps=10"], agents=1
    )
    job.start()
    try:
        deadline = time.monotonic() + 180
        while not store.list_steps():
            assert job.process is not None and job.process.poll() is None, "the job ended before a checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.05)
    finally:
        job.kill_everything()  # SIGKILL: its hold stays behind, naming processes that no longer run
    assert list((run_dir / "checkpoints" / "holders").glob("*.json"))
    saved = store.list_steps()[-1].step
    # Killed, no worker removed its copy from node memory: remove_node_local_copy does (a benchmark's job
    # ends this way), and leaves the durable checkpoints to the start below.
    copy = NodeLocalCopy.for_run(run_config(run_dir))
    assert copy is not None
    directory = Path(copy.directory)
    assert list(directory.glob("step-*/manifest.json")), "the job's copy in node memory, before the removal"
    job.remove_node_local_copy()
    assert not directory.exists() and not Path(copy.lock_path).exists()
    assert [info.step for info in store.list_steps()][-1] == saved  # durable checkpoints untouched
    job.remove_node_local_copy()  # twice: nothing left to do

    resumed = by_hand(run_dir, cache_dir, f"train.max_steps={saved + 3}")
    _, err = resumed.communicate(timeout=300)

    assert resumed.returncode == 0, err[-3000:]
    mine = [e for e in read_events(run_dir) if e.get("pid") == resumed.pid]
    assert [e["step"] for e in mine if e["event"] == "resume"] == [saved]
    assert any(e["event"] == "run_hold_taken_over" for e in mine)
