"""Real torchrun agents on this host, real process kills: the job survives and loses nothing.

Each test asserts on state: the sample ledger (each sample exactly once per epoch, no step missing), the
steps lost per restart (from the `resume` events), and the final parameters against a fault-free run.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from elastic_qa.chaos.evidence import (
    attempts,
    check_checkpoints,
    check_ledger,
    final_parameters,
    parameter_difference,
    run_config,
)
from elastic_qa.chaos.job import Job
from elastic_qa.chaos.judge import steps_lost
from elastic_qa.dist import usable_cores
from elastic_qa.launcher.local import COLD_WORKERS_ENV
from elastic_qa.launcher.processes import alive
from elastic_qa.models import family_for
from elastic_qa.observe.follow import read_events
from elastic_qa.prep import prepare
from elastic_qa.step_holds import arm, release

pytestmark = pytest.mark.integration

MAX_STEPS = 60
# Dropout off so the trajectory does not depend on the world size (per-rank dropout masks would).
COMMON = (
    f"train.max_steps={MAX_STEPS}",
    "model.dropout=0.0",
    "debug.sample_ledger=true",
    "log.every_steps=1",
    "log.console=none",
    "checkpoint.every_steps=20",
)


def run_job(run_dir: Path, cache: Path, *extra: str, agents: int = 2, **kwargs) -> Job:
    job = Job(run_dir, "tiny", [f"data.cache_dir={cache}", *COMMON, *extra], agents=agents, **kwargs)
    job.start()
    return job


def held_at(run_dir: Path, step: int) -> tuple[str, Path]:
    """(the override, the hold directory) that hold the job after `step` until `release(dir, step)`
    (elastic_qa/step_holds.py): what a test does there cannot race the job, however slow the machine."""
    hold_dir = run_dir.parent / f"{run_dir.name}-holds"
    arm(hold_dir, [step])
    return f"debug.hold_dir={hold_dir}", hold_dir


def join_while_held(job: Job, hold_dir: Path, step: int) -> None:
    """Add an agent while the job is held after `step`; release it once the joiner is admitted (a newer
    group trained a step): the job cannot end before the world has grown."""
    job.wait_for_step(step)
    before = job.attempt
    job.join()
    assert job.wait_for_new_attempt(after=before), "the job ended before the joining agent was admitted"
    release(hold_dir, step)


def finish(job: Job, timeout: float = 150) -> int:
    try:
        return job.wait(timeout)
    finally:
        job.kill_everything()


def world_sizes(events: list[dict]) -> list[int]:
    sizes = []
    for event in events:
        if event.get("event") == "worker_start" and event.get("rank") == 0:
            sizes.append(event["world_size"])
    return sizes


def assert_nothing_lost(
    run_dir: Path,
    reference: dict,
    max_lost: int,
    restarts: int,
    bitwise: bool = False,
    max_steps: int = MAX_STEPS,
) -> dict:
    """Exactly-once, every checkpoint valid, exactly `restarts` regroups each losing at most `max_lost` steps,
    and the final parameters of the fault-free run."""
    cfg = run_config(run_dir)
    num_samples = len(prepare(cfg, family_for(cfg.model)).train)
    ledger = check_ledger(run_dir, cfg, num_samples)
    assert ledger.ok, ledger.problems
    assert ledger.steps == max_steps
    assert check_checkpoints(cfg) == []
    events = read_events(run_dir)
    runs = attempts(events)
    regroups = [{"attempt": run["attempt"], "lost": steps_lost(runs, run)} for run in runs[1:]]
    assert len(regroups) == restarts, regroups
    assert all(r["lost"] <= max_lost for r in regroups), regroups
    step, params = final_parameters(cfg)
    assert step == max_steps
    diff = parameter_difference(params, reference)
    if bitwise:
        assert diff["bitwise_equal"], diff
    assert diff["relative"] < 1e-4, diff
    return {"restarts": regroups, "diff": diff, "events": events}


def checked_final_parameters(run_dir: Path, steps: int) -> dict[str, torch.Tensor]:
    """The final parameters of a finished run, once its ledger shows every sample once and its newest
    checkpoint is the last step."""
    cfg = run_config(run_dir)
    ledger = check_ledger(run_dir, cfg, len(prepare(cfg, family_for(cfg.model)).train))
    assert ledger.ok, ledger.problems
    step, params = final_parameters(cfg)
    assert step == steps
    return params


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict:
    """A fault-free run at world size 2: the parameters every faulted run must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference")
    job = run_job(run_dir, cache_dir)
    assert finish(job) == 0
    return checked_final_parameters(run_dir, MAX_STEPS)


def test_two_agents_train_to_the_end_and_report_em(
    tmp_path: Path, cache_dir: Path, reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reference fixture already ran two agents to the end, warm (the default); check what a user sees
    # on a fresh run, with each worker a new interpreter: the launcher's other way to start workers.
    monkeypatch.setenv(COLD_WORKERS_ENV, "1")
    job = run_job(tmp_path / "run", cache_dir, "train.max_steps=10", "log.console=plain")
    assert finish(job) == 0
    events = read_events(tmp_path / "run")
    assert world_sizes(events) == [2]
    done = [e for e in events if e["event"] == "train_done" and e["rank"] == 0]
    assert done and done[0]["step"] == 10 and 0.0 <= done[0]["em"] <= 1.0
    assert "EM" in (tmp_path / "run" / "chaos" / "launcher.log").read_text()
    # Each agent's torchrun has a local world of one, yet the two ranks share this host's cores.
    starts = [e for e in events if e["event"] == "worker_start"]
    assert len(starts) == 2 and {e["threads"] for e in starts} == {max(1, usable_cores() // 2)}
    assert [e["warm"] for e in events if e["event"] == "startup"] == [False, False]


def test_bf16_autocast_and_bf16_gradient_compression_train_under_torchrun(
    tmp_path: Path, cache_dir: Path
) -> None:
    job = run_job(
        tmp_path / "run", cache_dir, "train.max_steps=10", "train.precision=bf16", "dist.comm_hook=bf16"
    )
    assert finish(job) == 0
    steps = [e for e in read_events(tmp_path / "run") if e["event"] == "step"]
    assert steps and all(math.isfinite(e["loss"]) for e in steps)


def test_kill_worker_resumes_from_emergency_checkpoint_and_sees_each_sample_once(
    tmp_path: Path, cache_dir: Path, reference: dict
) -> None:
    run_dir = tmp_path / "run"
    job = run_job(run_dir, cache_dir, "debug.kill_at_step=25", "debug.kill_rank=1")
    assert finish(job) == 0
    result = assert_nothing_lost(run_dir, reference, max_lost=1, restarts=1, bitwise=True)
    emergency = [e for e in result["events"] if e["event"] == "emergency_checkpoint"]
    assert emergency and emergency[0]["step"] == 25
    assert world_sizes(result["events"]) == [2, 2]
    # Every worker, the restarted group's too, was a fork of its agent's forkserver (warm workers).
    startups = [e for e in result["events"] if e["event"] == "startup"]
    assert {e["restart_count"] for e in startups} == {0, 1} and all(e["warm"] for e in startups)


def test_node_loss_with_three_agents_regroups_at_two(
    tmp_path: Path, cache_dir: Path, reference: dict
) -> None:
    run_dir = tmp_path / "run"
    hold, hold_dir = held_at(run_dir, 15)
    # Loader workers prefetch ahead: the checkpointed cursor must still be the last completed step's.
    job = run_job(run_dir, cache_dir, hold, "data.num_workers=1", agents=3)
    job.wait_for_step(15)
    victim = next(a for a in job.live_agents() if not a["is_host"])
    workers = job.workers(victim)
    for pid in [victim["pid"], *workers]:  # the node is gone: agent and worker at once
        os.kill(pid, signal.SIGKILL)
    release(hold_dir, 15)
    assert finish(job) == 0
    result = assert_nothing_lost(run_dir, reference, max_lost=1, restarts=1)
    assert world_sizes(result["events"]) == [3, 2]


def test_agent_joining_grows_the_world_without_losing_a_step(
    tmp_path: Path, cache_dir: Path, reference: dict
) -> None:
    run_dir = tmp_path / "run"
    hold, hold_dir = held_at(run_dir, 10)
    job = run_job(run_dir, cache_dir, hold, agents=1)
    join_while_held(job, hold_dir, 10)
    assert finish(job) == 0
    result = assert_nothing_lost(run_dir, reference, max_lost=0, restarts=1)
    assert world_sizes(result["events"]) == [1, 2]


def test_sigterm_of_an_agent_saves_and_the_rest_continue(
    tmp_path: Path, cache_dir: Path, reference: dict
) -> None:
    run_dir = tmp_path / "run"
    hold, hold_dir = held_at(run_dir, 15)
    job = run_job(run_dir, cache_dir, hold, agents=2)
    job.wait_for_step(15)
    victim = next(a for a in job.live_agents() if not a["is_host"])
    os.kill(victim["pid"], signal.SIGTERM)
    release(hold_dir, 15)
    assert finish(job) == 0
    result = assert_nothing_lost(run_dir, reference, max_lost=0, restarts=1)
    assert world_sizes(result["events"]) == [2, 1]
    commits = [e for e in result["events"] if e["event"] == "checkpoint_committed"]
    assert any(e["reason"] == "sigterm" for e in commits)


def test_a_checkpoint_of_another_model_shape_is_refused_with_exit_2_before_any_agent_starts(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    job = run_job(run_dir, cache_dir, "train.max_steps=5")
    assert finish(job) == 0
    config_before = (run_dir / "config.yaml").read_text()
    agents_before = json.loads((run_dir / "launch.json").read_text())["agents"]
    job = Job(
        run_dir, "tiny", [f"data.cache_dir={cache_dir}", *COMMON, "train.max_steps=10", "model.d_model=64"]
    )
    job.start()  # the model changed shape: refused up front, not after a crash loop of restarts
    assert finish(job, timeout=60) == 2
    said = (run_dir / "chaos" / "launcher.log").read_text()
    assert "model.d_model: 32 -> 64" in said and "cannot be resumed" in said
    assert json.loads((run_dir / "launch.json").read_text())["agents"] == agents_before  # none started
    assert len([e for e in read_events(run_dir) if e["event"] == "worker_start"]) == 2  # the first job's
    assert (run_dir / "config.yaml").read_text() == config_before  # the good run's config is kept
    assert (run_dir / "checkpoints" / "step-00000005" / "manifest.json").exists()


def test_a_worker_whose_agent_died_stops_the_group_saves_and_leaves_within_the_grace(
    tmp_path: Path, cache_dir: Path, reference: dict
) -> None:
    run_dir = tmp_path / "run"
    job = run_job(run_dir, cache_dir, "debug.step_delay=100ms", agents=2)
    at_kill = job.wait_for_step(10)
    victim = next(a for a in job.live_agents() if not a["is_host"])
    (orphan,) = job.workers(victim)
    os.kill(victim["pid"], signal.SIGKILL)  # the agent alone: its worker is orphaned
    killed = time.monotonic()
    while alive(orphan) and time.monotonic() - killed < 60:
        time.sleep(0.05)
    orphan_left_s = time.monotonic() - killed
    assert finish(job) == 0
    result = assert_nothing_lost(run_dir, reference, max_lost=0, restarts=1)
    events = result["events"]
    assert any(e["event"] == "agent_lost" and e["pid"] == orphan for e in events)
    # The orphan's stop reached the whole group: rank 0 committed the stop's step, no emergency was needed.
    stops = [e for e in events if e["event"] == "checkpoint_committed" and e["reason"] == "sigterm"]
    assert stops and stops[0]["step"] >= at_kill
    # Seen within one check interval, then stopped and saved, or a hard exit when the grace ran out; plus
    # a second for scheduling on a loaded box.
    dist = run_config(run_dir).dist
    bound = dist.agent_check_interval.total_seconds() + dist.agent_lost_grace.total_seconds() + 1.0
    assert orphan_left_s <= bound
