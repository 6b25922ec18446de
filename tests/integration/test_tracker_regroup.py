"""An MLflow run across real torchrun regroups: rank 0 SIGKILLed (the group restarts from a checkpoint and
re-trains steps the dead rank 0 had logged), and an agent joining (the group stops and regroups at a larger
world). One MLflow run, every step in it once, its world_size series showing the regroup."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_qa.observe.follow import read_events
from tests.integration.test_elastic import (
    MAX_STEPS,
    finish,
    held_at,
    join_while_held,
    mlflow_series,
    run_job,
    world_sizes,
)
from tests.observe.test_tracker_runs import empty_store, mlflow_runs, mlflow_store

pytestmark = pytest.mark.integration
__all__ = ["empty_store"]  # the fixture, used by name


@pytest.mark.long  # a regroup's MLflow run in the default run: the join and leave in test_elastic.py
def test_rank_0_killed_under_torchrun_continues_the_mlflow_run_with_every_step_once(
    tmp_path: Path, cache_dir: Path, empty_store: Path
) -> None:
    run_dir, db = tmp_path / "run", tmp_path / "mlflow.db"
    uri = mlflow_store(empty_store, db)
    job = run_job(
        run_dir,
        cache_dir,
        "log.trackers=[mlflow]",
        f"log.mlflow.tracking_uri={uri}",
        "debug.kill_at_step=25",
        "debug.kill_rank=0",
    )
    assert finish(job) == 0
    series = mlflow_series(db)
    assert series["loss"] == series["world_size"] == list(range(1, MAX_STEPS + 1))


# Long: the same join with the same MLflow checks, three more regroups and the sample ledger on top, is
# test_a_node_lost_an_orphaned_worker_a_join_and_a_sigterm_regroup_the_job_without_losing_a_step
# (test_elastic.py).
@pytest.mark.long
def test_an_agent_joining_continues_the_mlflow_run_with_every_step_once(
    tmp_path: Path, cache_dir: Path, empty_store: Path
) -> None:
    run_dir, db = tmp_path / "run", tmp_path / "mlflow.db"
    hold, hold_dir = held_at(run_dir, 10)
    uri = mlflow_store(empty_store, db)
    job = run_job(
        run_dir, cache_dir, hold, "log.trackers=[mlflow]", f"log.mlflow.tracking_uri={uri}", agents=1
    )
    join_while_held(job, hold_dir, 10)
    assert finish(job) == 0
    assert world_sizes(read_events(run_dir)) == [1, 2]
    series = mlflow_series(db)
    assert series["loss"] == series["world_size"] == list(range(1, MAX_STEPS + 1))
    from mlflow.tracking import MlflowClient

    (run,) = mlflow_runs(db)
    sizes = {
        int(m.value)
        for m in MlflowClient(f"sqlite:///{db}").get_metric_history(run.info.run_id, "world_size")
    }
    assert sizes == {1, 2}
