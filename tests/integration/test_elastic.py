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
from tests.observe.test_tracker_runs import empty_store, mlflow_runs, mlflow_steps, mlflow_store

pytestmark = pytest.mark.integration
__all__ = ["empty_store"]  # the fixture, used by name

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


def held_at(run_dir: Path, *steps: int) -> tuple[str, Path]:
    """(the override, the hold directory) that hold the job after each of `steps` until
    `release(dir, step)` (elastic_qa/step_holds.py): what a test does there cannot race the job, however
    slow the machine."""
    hold_dir = run_dir.parent / f"{run_dir.name}-holds"
    arm(hold_dir, list(steps))
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


def test_two_agents_train_in_bf16_to_the_end_report_em_and_refuse_a_checkpoint_of_another_shape(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One fresh 2-agent job makes three checks that each used to start a job of their own: what a user
    # sees at the end, bf16 under torchrun, and the refusal of its checkpoint by a model of another shape.
    # The reference fixture runs two warm agents to the end (the default); here each worker is a new
    # interpreter: the launcher's other way to start workers.
    monkeypatch.setenv(COLD_WORKERS_ENV, "1")
    run_dir = tmp_path / "run"
    settings = ["train.max_steps=10", "log.console=plain", "train.precision=bf16", "dist.comm_hook=bf16"]
    job = run_job(run_dir, cache_dir, *settings)
    assert finish(job) == 0
    events = read_events(run_dir)
    assert world_sizes(events) == [2]
    done = [e for e in events if e["event"] == "train_done" and e["rank"] == 0]
    assert done and done[0]["step"] == 10 and 0.0 <= done[0]["em"] <= 1.0
    assert "EM" in (run_dir / "chaos" / "launcher.log").read_text()
    # Each agent's torchrun has a local world of one, yet the two ranks share this host's cores.
    starts = [e for e in events if e["event"] == "worker_start"]
    assert len(starts) == 2 and {e["threads"] for e in starts} == {max(1, usable_cores() // 2)}
    assert {e["flush_denormals"] for e in starts} == {True}  # on every thread of each (train.flush_denormals)
    assert [e["warm"] for e in events if e["event"] == "startup"] == [False, False]
    # bf16 autocast and bf16 gradient compression trained.
    steps = [e for e in events if e["event"] == "step"]
    assert steps and all(math.isfinite(e["loss"]) for e in steps)

    config_before = (run_dir / "config.yaml").read_text()
    agents_before = json.loads((run_dir / "launch.json").read_text())["agents"]
    longer = [*settings, "train.max_steps=20", "model.d_model=64"]
    job = Job(run_dir, "tiny", [f"data.cache_dir={cache_dir}", *COMMON, *longer])
    job.start()  # the model changed shape: refused up front, not after a crash loop of restarts
    assert finish(job, timeout=60) == 2
    said = (run_dir / "chaos" / "launcher.log").read_text()
    assert "model.d_model: 32 -> 64" in said and "cannot be resumed" in said
    assert json.loads((run_dir / "launch.json").read_text())["agents"] == agents_before  # none started
    assert len([e for e in read_events(run_dir) if e["event"] == "worker_start"]) == 2  # the first job's
    assert (run_dir / "config.yaml").read_text() == config_before  # the good run's config is kept
    assert (run_dir / "checkpoints" / "step-00000010" / "manifest.json").exists()


def mlflow_series(db: Path) -> dict[str, list[int]]:
    """The steps of the one finished MLflow run in `db` at which it has a loss and a world size."""
    (run,) = mlflow_runs(db)
    assert run.info.status == "FINISHED"
    return {metric: mlflow_steps(db, run.info.run_id, metric) for metric in ("loss", "world_size")}


def test_a_node_lost_an_orphaned_worker_a_join_and_a_sigterm_regroup_the_job_without_losing_a_step(
    tmp_path: Path, cache_dir: Path, reference: dict, empty_store: Path
) -> None:
    # One job for what were five tests, each a job of its own: a node lost (agent and worker at once) with
    # three agents regroups at two; a worker whose agent died stops that group, saves and leaves within the
    # grace; an agent joining grows the world again without losing a step; its SIGTERM saves and the rest
    # continue; and across the four regroups one MLflow run gets every step once
    # (tests/integration/test_tracker_regroup.py kept the join alone, long).
    run_dir, db = tmp_path / "run", tmp_path / "mlflow.db"
    hold, hold_dir = held_at(run_dir, 12, 24, 36, 48)
    uri = mlflow_store(empty_store, db)
    trackers = ("log.trackers=[mlflow]", f"log.mlflow.tracking_uri={uri}")
    # Loader workers prefetch ahead: the checkpointed cursor must still be the last completed step's. The
    # step delay keeps the job training while the orphan's watchdog looks (the hold at 24 is released at
    # once: a held rank 0 would keep the orphan's stop from reaching the group).
    job = run_job(
        run_dir, cache_dir, hold, *trackers, "data.num_workers=1", "debug.step_delay=100ms", agents=3
    )
    job.wait_for_step(12)
    victim = next(a for a in job.live_agents() if not a["is_host"])
    workers = job.workers(victim)
    for pid in [victim["pid"], *workers]:  # the node is gone: agent and worker at once
        os.kill(pid, signal.SIGKILL)
    release(hold_dir, 12)

    at_kill = job.wait_for_step(24)
    victim = next(a for a in job.live_agents() if not a["is_host"])
    (orphan,) = job.workers(victim)
    os.kill(victim["pid"], signal.SIGKILL)  # the agent alone: its worker is orphaned
    killed = time.monotonic()
    release(hold_dir, 24)
    while alive(orphan) and time.monotonic() - killed < 60:
        time.sleep(0.05)
    orphan_left_s = time.monotonic() - killed

    join_while_held(job, hold_dir, 36)
    job.wait_for_step(48)
    victim = next(a for a in job.live_agents() if not a["is_host"])  # the agent that joined
    os.kill(victim["pid"], signal.SIGTERM)
    release(hold_dir, 48)
    assert finish(job) == 0

    result = assert_nothing_lost(run_dir, reference, max_lost=1, restarts=4)
    assert world_sizes(result["events"]) == [3, 2, 1, 2, 1]
    # Only the node's loss may cost a step: the orphan's stop, the join and the SIGTERM each saved theirs.
    assert [r["lost"] for r in result["restarts"][1:]] == [0, 0, 0], result["restarts"]
    events = result["events"]
    assert any(e["event"] == "agent_lost" and e["pid"] == orphan for e in events)
    # The orphan's stop reached the whole group: rank 0 committed the stop's step, no emergency was needed.
    stops = [e for e in events if e["event"] == "checkpoint_committed" and e["reason"] == "sigterm"]
    assert any(at_kill <= e["step"] < 36 for e in stops), stops
    assert any(e["step"] >= 48 for e in stops), stops  # the SIGTERMed agent's group saved
    # Seen within one check interval, then stopped and saved, or a hard exit when the grace ran out; plus
    # a second for scheduling on a loaded box.
    dist = run_config(run_dir).dist
    bound = dist.agent_check_interval.total_seconds() + dist.agent_lost_grace.total_seconds() + 1.0
    assert orphan_left_s <= bound
    series = mlflow_series(db)
    assert series["loss"] == series["world_size"] == list(range(1, MAX_STEPS + 1))
    from mlflow.tracking import MlflowClient

    (run,) = mlflow_runs(db)
    history = MlflowClient(f"sqlite:///{db}").get_metric_history(run.info.run_id, "world_size")
    assert {int(m.value) for m in history} == {1, 2, 3}
