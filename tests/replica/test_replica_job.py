"""The replica-group mode end to end: a real Lighthouse, one real torchrun job per group, a real SIGKILL.

Holds (elastic_qa/step_holds.py) pin the fault to its step however slow the machine: every group waits
after step 5 until the test has killed group 1's worker, and after step 30 until the restarted group has
asked for a quorum and found itself behind the job. What is asserted is state: the ledger (every step
committed by exactly one quorum whose shares are its global batch), the survivors' steps while group 1 was
down, the heal, and the groups' parameters at the end (bitwise equal).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elastic_qa.config import load_config, packaged_config
from elastic_qa.launcher.processes import kill_trees, python_env
from elastic_qa.observe.follow import read_events
from elastic_qa.replica.shares import read_replica_ledger, verify
from elastic_qa.step_holds import arm, release, release_all

pytest.importorskip("torchft")
pytestmark = pytest.mark.integration

MAX_STEPS = 40


def overrides(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return [
        f"run.dir={run_dir}", f"data.cache_dir={cache}", f"train.max_steps={MAX_STEPS}", "model.dropout=0.0",
        "debug.sample_ledger=true", "log.every_steps=1", "log.console=none", *extra,
    ]  # fmt: skip


def start(run_dir: Path, cache: Path, *extra: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "elastic_qa.replica.launch",
        "--config",
        "tiny",
        *overrides(run_dir, cache, *extra),
    ]
    return subprocess.Popen(command, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_for(
    run_dir: Path, job: subprocess.Popen, what: str, check: Callable[[dict[str, Any]], bool]
) -> dict:
    """The first event of the run's workers that passes `check`, waiting for it (the job must live)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for event in read_events(run_dir):
            if check(event):
                return event
        if job.poll() is not None:
            raise AssertionError(f"the job ended ({job.returncode}) before {what}: {job.stdout.read()!r}")
        time.sleep(0.05)
    raise TimeoutError(f"no {what} in {run_dir}")


def finished(job: subprocess.Popen) -> int:
    try:
        return job.wait(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()


def check_ledger(run_dir: Path, cache: Path) -> None:
    cfg = load_config(packaged_config("tiny"), overrides(run_dir, cache))
    from elastic_qa.models import family_for
    from elastic_qa.prep import prepare

    windows = len(prepare(cfg, family_for(cfg.model)).train)
    verdict = verify(
        read_replica_ledger(run_dir), windows, cfg.train.global_batch_size, cfg.run.seed, MAX_STEPS, 1
    )
    assert verdict.ok, verdict.problems


def final_digests(run_dir: Path) -> dict[int, str]:
    done = [e for e in read_events(run_dir) if e.get("event") == "train_done"]
    return {e["replica_group"]: e["params_sha256"] for e in done}


def test_two_groups_train_every_window_once_and_end_bitwise_equal(tmp_path: Path, cache_dir: Path) -> None:
    run_dir = tmp_path / "run"
    job = start(run_dir, cache_dir)
    assert finished(job) == 0, job.stdout.read() if job.stdout else ""
    check_ledger(run_dir, cache_dir)
    digests = final_digests(run_dir)
    assert set(digests) == {0, 1} and len(set(digests.values())) == 1, digests


def test_a_killed_worker_heals_from_its_peer_and_the_groups_end_bitwise_equal(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir, holds = tmp_path / "run", tmp_path / "holds"
    arm(holds, [5, 30])
    job = start(run_dir, cache_dir, f"debug.hold_dir={holds}")
    try:
        held = wait_for(
            run_dir,
            job,
            "group 1 held at 5",
            lambda e: e.get("event") == "hold" and e.get("replica_group") == 1,
        )
        killed = held["pid"]
        os.kill(killed, signal.SIGKILL)
        release(holds, 5)
        # torchrun restarts group 1's worker. Either it heals from group 0 at once, or (group 0 held at 30
        # meanwhile) it finds itself alone behind the job's step and trains nothing until group 0 is back.
        back = wait_for(
            run_dir, job, "group 1 back",
            lambda e: e.get("event") in ("heal", "quorum_behind")
            and e.get("replica_group") == 1
            and e["pid"] != killed,
        )  # fmt: skip
        if back["event"] == "quorum_behind":
            assert back["step"] == 0 and back["job_step"] == 30
        release(holds, 30)
        heal = wait_for(
            run_dir, job, "group 1 healed",
            lambda e: e.get("event") == "heal" and e.get("replica_group") == 1 and e["pid"] != killed,
        )  # fmt: skip
        assert heal["step"] > 5 and heal["from_step"] == 0
        assert finished(job) == 0
    finally:
        release_all(holds)
        if job.poll() is None:
            job.kill()
    check_ledger(run_dir, cache_dir)
    digests = final_digests(run_dir)
    assert set(digests) == {0, 1} and len(set(digests.values())) == 1, digests


def test_a_lost_group_leaves_the_survivor_training_to_the_end(tmp_path: Path, cache_dir: Path) -> None:
    run_dir, holds = tmp_path / "run", tmp_path / "holds"
    arm(holds, [5])
    job = start(run_dir, cache_dir, f"debug.hold_dir={holds}")
    try:
        wait_for(
            run_dir,
            job,
            "group 1 held at 5",
            lambda e: e.get("event") == "hold" and e.get("replica_group") == 1,
        )
        records = [
            json.loads(line) for line in (run_dir / "agents" / "replicas.jsonl").read_text().splitlines()
        ]
        kill_trees(
            [next(e["pid"] for e in records if e["event"] == "group_started" and e["group"] == 1)]
        )  # its torchrun agent and worker
        release(holds, 5)
        assert finished(job) == 1  # a group failed; the job's work did not
    finally:
        release_all(holds)
        if job.poll() is None:
            job.kill()
    check_ledger(run_dir, cache_dir)
    alone = [e for e in read_events(run_dir) if e.get("event") == "step" and e["step"] > 5]
    assert alone and all(e["participants"] == 1 and e["replica_group"] == 0 for e in alone)
    assert max(e["step"] for e in alone) == MAX_STEPS
