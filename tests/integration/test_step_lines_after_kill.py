"""Every committed step once in the step lines and in MLflow when a worker is SIGKILLed under torchrun.

A step's line waits for the next control all-reduce for its loss sums; a worker killed meanwhile leaves
the last steps' lines on their way, while the survivors' emergency checkpoint commits those steps. The
kill here comes from outside at no chosen moment (the job saves and evaluates only at its end, and no debug
setting pauses it, which would write each line before its pause): whenever it lands, the step the
survivors completed last has its line on the way. The job then trains on in a new group and is stopped;
every step up to the stop's committed one is in rank 0's `step` events once and in MLflow once.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from elastic_qa.observe.follow import read_events
from tests.integration.test_elastic import finish, run_job
from tests.observe.test_tracker_runs import empty_store, mlflow_runs, mlflow_steps, mlflow_store

pytestmark = pytest.mark.integration
__all__ = ["empty_store"]  # the fixture, used by name

NO_END = (
    "train.max_steps=100000",  # stopped by the test: it cannot end before the kill lands
    "checkpoint.every_steps=0",  # no save (a save writes every line first) before the stop's
)


@pytest.mark.parametrize("killed_rank", [1, 0])
def test_a_killed_worker_leaves_every_committed_step_once_in_the_step_lines_and_in_mlflow(
    tmp_path: Path, cache_dir: Path, empty_store: Path, killed_rank: int
) -> None:
    run_dir, db = tmp_path / "run", tmp_path / "mlflow.db"
    uri = mlflow_store(empty_store, db)
    job = run_job(run_dir, cache_dir, *NO_END, "log.trackers=[mlflow]", f"log.mlflow.tracking_uri={uri}")
    try:
        job.wait_for_step(3)
        [victim] = {
            e["pid"] for e in read_events(run_dir) if e["event"] == "step" and e["rank"] == killed_rank
        }
        os.kill(victim, signal.SIGKILL)
        assert job.wait_for_new_attempt(after=1), "the job ended instead of regrouping"
        assert job.process is not None
        job.process.send_signal(signal.SIGTERM)  # the launcher stops every agent; rank 0 commits the step
        assert finish(job) == 128 + signal.SIGTERM
    finally:
        job.kill_everything()

    events = read_events(run_dir)
    [emergency] = [e["step"] for e in events if e["event"] == "emergency_checkpoint"]
    assert {e["step"] for e in events if e["event"] == "resume"} == {emergency}
    [stopped] = [
        e["step"] for e in events if e["event"] == "checkpoint_committed" and e["reason"] == "sigterm"
    ]
    lines = [e for e in events if e["event"] == "step" and e["rank"] == 0]
    assert sorted(e["step"] for e in lines) == list(range(1, stopped + 1))
    # The lines that were on their way end at the emergency's step, written for the attempt that trained them.
    recovered = [e for e in lines if e.get("recovered")]
    assert recovered and recovered[-1]["step"] == emergency
    assert {(e["attempt"], e["world_size"]) for e in recovered} == {(1, 2)}
    # A line still waiting for its sums has the survivor's share of the loss; one the survivor had written
    # from the last sums (rank 0 killed before writing its own) the whole batch's.
    assert all(e.get("loss_ranks", [1 - killed_rank]) == [1 - killed_rank] for e in recovered)

    (run,) = mlflow_runs(db)
    for metric in ("loss", "lr", "world_size"):
        assert mlflow_steps(db, run.info.run_id, metric) == list(range(1, stopped + 1)), metric
