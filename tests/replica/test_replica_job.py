"""The replica-group mode end to end: a real Lighthouse, one real torchrun job per group, real SIGKILLs.

Holds (elastic_qa/step_holds.py) pin each fault to its step however slow the machine: every group waits
after the fault's step until the test has killed its victim, and the survivor a few steps later until the
restarted group is back. What is asserted is state: the ledger (every step committed by exactly one quorum
whose shares are its global batch), the survivors' steps while a group was down, the heals, and the groups'
parameters at the end (bitwise equal). The whole-job faults (killed, stopped, no quorum) are in
test_faults.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_qa.checkpoint.payload import MODEL_FILE
from elastic_qa.config import load_config, packaged_config
from elastic_qa.launcher.processes import kill_trees, python_env
from elastic_qa.models import family_for
from elastic_qa.observe.follow import read_events
from elastic_qa.prep import prepare
from elastic_qa.replica.shares import Verdict, read_replica_ledger, verify
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


def started_again(
    run_dir: Path, job: subprocess.Popen, group: int, before: Collection[int], rank: int | None = None
) -> dict:
    """The `train_start` of a worker of `group` (of group rank `rank`, when given) that is none of `before`:
    the group started again after a kill."""
    return wait_for(
        run_dir, job, f"group {group}{'' if rank is None else f' rank {rank}'} started again",
        lambda e: e.get("event") == "train_start" and e.get("replica_group") == group
        and e["pid"] not in before and rank in (None, e.get("rank")),
    )  # fmt: skip


def held(run_dir: Path, job: Any, step: int, groups: tuple[int, ...] = (0, 1)) -> None:
    """Wait until every group of `groups` is held after `step` (elastic_qa/step_holds.py)."""
    for group in groups:
        wait_for(
            run_dir, job, f"group {group} held at {step}",
            lambda e, g=group: e.get("event") == "hold" and e.get("replica_group") == g and e["step"] == step,
        )  # fmt: skip


def finished(job: subprocess.Popen) -> int:
    try:
        return job.wait(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()


def ledger_verdict(run_dir: Path, cache: Path, steps: int = MAX_STEPS, workers: int = 1) -> Verdict:
    cfg = load_config(packaged_config("tiny"), overrides(run_dir, cache))
    windows = len(prepare(cfg, family_for(cfg.model)).train)
    rows = read_replica_ledger(run_dir)
    return verify(rows, windows, cfg.train.global_batch_size, cfg.run.seed, steps, workers)


def check_ledger(run_dir: Path, cache: Path, workers: int = 1) -> None:
    verdict = ledger_verdict(run_dir, cache, workers=workers)
    assert verdict.ok, verdict.problems


def final_digests(run_dir: Path) -> dict[int, str]:
    done = [e for e in read_events(run_dir) if e.get("event") == "train_done"]
    return {e["replica_group"]: e["params_sha256"] for e in done}


def step_losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(run_dir) if e.get("event") == "step"}


def final_parameters(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / f"step-{step:08d}" / MODEL_FILE
    return torch.load(path, weights_only=True, map_location="cpu")


def test_a_run_with_kills_stays_within_1e_4_of_the_fault_free_run_at_200_steps(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Group 1 lost after step 50 (its torchrun agent and worker killed: the survivor trains on alone, the
    launcher starts the group again and it heals from the survivor), group 0's worker killed after step 120
    (torchrun restarts it; it heals from its peer): each step's global batch is the same windows whoever
    trains it, so the model differs from a fault-free run's only by the order of the float sums (one
    participant or two; one worker per group or two). The faulted run trains every window once and ends with
    its groups bitwise equal.

    The fault-free run is one of 2 groups of 2 workers (DDP inside each group): every window once over the 4
    workers, the groups end bitwise equal, and each step line's loss is the whole global batch's, as with
    one worker per group (the faulted run before its first fault: the same weights at step 1, so the same
    loss but for the order of the float sums). These were 4 tests of 6 jobs; every job start costs seconds
    of CPU."""
    steps, holds = 200, tmp_path / "holds"
    clean = start(tmp_path / "clean", cache_dir, f"train.max_steps={steps}", "replica.nproc_per_group=2")
    assert finished(clean) == 0, clean.stdout.read() if clean.stdout else ""
    verdict = ledger_verdict(tmp_path / "clean", cache_dir, steps=steps, workers=2)
    assert verdict.ok, verdict.problems
    events = read_events(tmp_path / "clean")
    done = [e for e in events if e.get("event") == "train_done"]
    assert len(done) == 4 and len({e["params_sha256"] for e in done}) == 1, done
    # Every worker flushes denormals on each of its threads (train.flush_denormals, on by default).
    assert [e["flush_denormals"] for e in events if e.get("event") == "worker_start"] == [True] * 4

    arm(holds, [50, 53, 120, 122])
    run_dir = tmp_path / "faulted"
    job = start(run_dir, cache_dir, f"train.max_steps={steps}", f"debug.hold_dir={holds}")
    try:
        worker = wait_for(
            run_dir, job, "group 1 held at 50",
            lambda e: e.get("event") == "hold" and e["step"] == 50 and e.get("replica_group") == 1,
        )["pid"]  # fmt: skip
        lost = group_pid(run_dir, 1)
        kill_trees([lost])  # its torchrun agent and worker: a lost node
        release(holds, 50)
        wait_for(
            run_dir, job, "group 0 trained alone",
            lambda e: e.get("event") == "step" and e["step"] == 53 and e["participants"] == 1,
        )  # fmt: skip
        started_again(run_dir, job, 1, {worker})
        release(holds, 53)
        victim = wait_for(
            run_dir, job, "group 0 held at 120",
            lambda e: e.get("event") == "hold" and e["step"] == 120 and e.get("replica_group") == 0,
        )["pid"]  # fmt: skip
        os.kill(victim, signal.SIGKILL)
        release(holds, 120)
        # The survivor is held 2 steps later until the killed worker is back (torchrun restarts it; if the
        # survivor is held by then, the restarted worker's quorum waits for it: the Lighthouse forms none of
        # the restarted group alone while its peer is alive), which then heals from it.
        started_again(run_dir, job, 0, {victim})
        release(holds, 122)
        assert finished(job) == 0
    finally:
        release_all(holds)
        if job.poll() is None:
            job.kill()
    assert ledger_verdict(run_dir, cache_dir, steps=steps).ok
    events = read_events(run_dir)
    healed = {e["replica_group"] for e in events if e.get("event") == "heal" and e["step"] > 0}
    assert healed == {0, 1}
    assert [e for e in events if e.get("event") == "heal" and e["replica_group"] == 1 and e["step"] > 50]
    heal = next(
        e for e in events if e.get("event") == "heal" and e["replica_group"] == 0 and e["pid"] != victim
    )
    # The restarted worker held no state, and healed from the survivor's state at or after the kill's step
    # (a warm worker is back in time for the survivor's next quorum: the state of step 120 itself).
    assert heal["step"] >= 120 and heal["from_step"] == 0, heal
    records = [json.loads(line) for line in (run_dir / "agents" / "replicas.jsonl").read_text().splitlines()]
    started = [e["pid"] for e in records if e["event"] == "group_started" and e["group"] == 1]
    assert len(started) == 2 and started[0] == lost
    # One lineage per quorum: a healed group adopts the one its quorum's rank 0 claimed for the heal step, and
    # claims none of its own when it is rank 0 of that quorum's next step (group 0, healed second, is).
    claims = [e["quorum"] for e in events if e.get("event") == "lineage" and "quorum" in e]
    assert len(claims) == len(set(claims)), claims
    digests = final_digests(run_dir)
    assert set(digests) == {0, 1} and len(set(digests.values())) == 1, digests
    faulted, reference = final_parameters(run_dir, steps), final_parameters(tmp_path / "clean", steps)
    assert faulted.keys() == reference.keys()
    worst = max(
        float(
            (faulted[name].float() - reference[name].float()).norm()
            / reference[name].float().norm().clamp_min(1e-12)
        )
        for name in reference
    )
    print(f"largest relative parameter difference at step {steps}: {worst:.3e}")
    assert worst < 1e-4

    assert step_losses(tmp_path / "clean")[1] == pytest.approx(step_losses(run_dir)[1], rel=1e-5)


def group_pid(run_dir: Path, group: int) -> int:
    """The pid of group `group`'s torchrun agent, as the launcher recorded it."""
    records = [json.loads(line) for line in (run_dir / "agents" / "replicas.jsonl").read_text().splitlines()]
    return next(e["pid"] for e in records if e["event"] == "group_started" and e["group"] == group)


# make test-long only: in tests/replica/test_faults.py,
# test_a_killed_lighthouse_quorum_ids_given_again_a_stalled_replica_and_a_kill_during_a_heal checks the same
# (no group holds a state: one restores the newest checkpoint in a new lineage, the other heals from it, every
# window once, nothing before that checkpoint trained again).
@pytest.mark.long
def test_groups_that_all_lost_their_state_resume_from_the_durable_checkpoint(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Both groups held after step 10 (checkpoints every 5 steps); group 0's torchrun agent and worker are
    killed (the launcher starts it again) and group 1's worker is killed (torchrun restarts it): no group
    holds a state. They must not train the job again from step 0: with every group in the quorum, one
    restores the checkpoint of step 10 in a new lineage, the other heals from it, and they train the job
    to its end, every window once."""
    run_dir, holds = tmp_path / "run", tmp_path / "holds"
    arm(holds, [10])
    job = start(
        run_dir, cache_dir, f"debug.hold_dir={holds}", "checkpoint.every_steps=5", "replica.quorum_timeout=3s"
    )
    try:
        held = {
            group: wait_for(
                run_dir,
                job,
                f"group {group} held at 10",
                lambda e, g=group: e.get("event") == "hold" and e.get("replica_group") == g,
            )
            for group in (0, 1)
        }
        wait_for(
            run_dir, job, "the checkpoint of step 10",
            lambda e: e.get("event") == "checkpoint_committed" and e.get("step") == 10,
        )  # fmt: skip
        kill_trees([group_pid(run_dir, 0)])  # started again by the launcher, with no state
        os.kill(held[1]["pid"], signal.SIGKILL)
        release_all(holds)
        assert finished(job) == 0
    finally:
        release_all(holds)
        if job.poll() is None:
            job.kill()
    events = read_events(run_dir)
    old = pids_before(held)
    restored = [e for e in events if e.get("event") == "lineage" and e["pid"] not in old]
    assert len(restored) == 1 and restored[0]["restored"] and restored[0]["step"] == 10, restored
    assert next(e for e in events if e.get("event") == "resume" and e["pid"] not in old)["step"] == 10
    again = [e["step"] for e in events if e.get("event") == "step" and e["pid"] not in old]
    assert again and min(again) == 11 and max(again) == MAX_STEPS
    verdict = ledger_verdict(run_dir, cache_dir)
    assert verdict.ok, verdict.problems
    assert len(verdict.lineages) == 2 and verdict.discarded == 0  # step 10 was durable: nothing lost


def pids_before(held: dict[int, dict]) -> set[int]:
    return {event["pid"] for event in held.values()}


@pytest.mark.parametrize(
    ("setting", "named"),
    [("log.tensorboard=true", "log.tensorboard=true"), ("log.trackers=[tensorboard]", "log.trackers")],
)
def test_a_setting_the_mode_cannot_honour_is_refused_before_anything_starts(
    tmp_path: Path, setting: str, named: str
) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "elastic_qa.replica.launch",
        "--config",
        "tiny",
        f"run.dir={run_dir}",
        setting,
    ]
    result = subprocess.run(command, env=python_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "replica-group mode" in lines[0], lines
    assert not run_dir.exists()
