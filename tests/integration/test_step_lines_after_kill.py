"""Every committed step once in the step lines and in MLflow when a worker is SIGKILLed under torchrun.

A step's line waits for the next control all-reduce for its loss sums; a worker killed meanwhile leaves
the last steps' lines on their way, while the survivors' emergency checkpoint commits those steps. The
kill here comes from outside at no chosen moment (the job saves and evaluates only at its end, and no debug
setting pauses it, which would write each line before its pause): whenever it lands, the step the
survivors completed last has its line on the way. The job trains on in a new group, loses rank 1 then
rank 0 so, and is stopped; every step up to the stop's committed one is in rank 0's `step` events once
and in MLflow once.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from elastic_qa.chaos.job import Job
from elastic_qa.observe.follow import read_events
from tests.integration.test_elastic import finish, run_job
from tests.observe.test_tracker_runs import empty_store, mlflow_runs, mlflow_steps, mlflow_store

pytestmark = pytest.mark.integration
__all__ = ["empty_store"]  # the fixture, used by name

NO_END = (
    "train.max_steps=100000",  # stopped by the test: it cannot end before the kill lands
    "checkpoint.every_steps=0",  # no save (a save writes every line first) before the stop's
)


def trained_in(job: Job, attempt: int, step: int, timeout: float = 120) -> None:
    """Wait until `attempt` has logged step `step`."""
    deadline = time.monotonic() + timeout
    while job.attempt_steps.get(attempt, 0) < step:
        assert job.process is not None and job.process.poll() is None, "the job ended"
        assert time.monotonic() < deadline, f"attempt {attempt} did not reach step {step} in {timeout} s"
        job.progress()
        time.sleep(0.05)


def test_killed_workers_leave_every_committed_step_once_in_the_step_lines_and_in_mlflow(
    tmp_path: Path, cache_dir: Path, empty_store: Path
) -> None:
    # One job, two kills (these were two runs of one test, each a job of its own): rank 1 killed in the
    # first group, then rank 0 in the group that resumed; each regroup must leave every line once.
    run_dir, db = tmp_path / "run", tmp_path / "mlflow.db"
    uri = mlflow_store(empty_store, db)
    job = run_job(run_dir, cache_dir, *NO_END, "log.trackers=[mlflow]", f"log.mlflow.tracking_uri={uri}")
    killed = {1: 1, 2: 0}  # attempt -> the rank killed in it
    try:
        for attempt, rank in killed.items():
            if attempt == 1:
                job.wait_for_step(3)
            else:  # a few steps into the resumed group, as into the first
                [resumed] = {e["step"] for e in read_events(run_dir) if e["event"] == "resume"}
                trained_in(job, attempt, resumed + 3)
            [victim] = {
                e["pid"]
                for e in read_events(run_dir)
                if e["event"] == "step" and e["rank"] == rank and e["attempt"] == attempt
            }
            os.kill(victim, signal.SIGKILL)
            assert job.wait_for_new_attempt(after=attempt), "the job ended instead of regrouping"
        assert job.process is not None
        job.process.send_signal(signal.SIGTERM)  # the launcher stops every agent; rank 0 commits the step
        assert finish(job) == 128 + signal.SIGTERM
    finally:
        job.kill_everything()

    events = read_events(run_dir)
    emergencies = [e["step"] for e in events if e["event"] == "emergency_checkpoint"]
    assert len(emergencies) == 2
    assert {e["step"] for e in events if e["event"] == "resume"} == set(emergencies)
    [stopped] = [
        e["step"] for e in events if e["event"] == "checkpoint_committed" and e["reason"] == "sigterm"
    ]
    lines = [e for e in events if e["event"] == "step" and e["rank"] == 0]
    assert sorted(e["step"] for e in lines) == list(range(1, stopped + 1))
    recovered = [e for e in lines if e.get("recovered")]
    assert {(e["attempt"], e["world_size"]) for e in recovered} == {(1, 2), (2, 2)}
    for (attempt, rank), emergency in zip(killed.items(), emergencies, strict=True):
        # The lines that were on their way end at the emergency's step, written for the attempt that
        # trained them.
        theirs = [e for e in recovered if e["attempt"] == attempt]
        assert theirs and theirs[-1]["step"] == emergency
        # A line still waiting for its sums has the survivor's share of the loss; one the survivor had
        # written from the last sums (rank 0 killed before writing its own) the whole batch's.
        assert all(e.get("loss_ranks", [1 - rank]) == [1 - rank] for e in theirs)

    (run,) = mlflow_runs(db)
    for metric in ("loss", "lr", "world_size"):
        assert mlflow_steps(db, run.info.run_id, metric) == list(range(1, stopped + 1)), metric
