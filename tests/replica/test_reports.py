"""Trackers, evaluation, keep_best and early stopping in the replica-group mode, with the writer group killed
mid-run: a real Lighthouse, real torchrun jobs, a real MLflow store (SQLite, read back with MlflowClient), a
real SIGKILL.

The writer (the quorum's rank 0 group, group 0) sends its first batch of tracker records and then, with
`log.tracker_send_every=1h`, nothing until it closes its runs: it dies holding steps 6-15 (and the evaluation
of step 10) unsent. Group 1 writes meanwhile, the restarted group 0 heals from it and becomes the writer
again (group 1 hands its tracker runs over). What must come out: every step and every evaluation in the
one MLflow run once; the `eval` lines every train.eval_every steps; the best checkpoint, committed by the
killed group before it died, still kept and named at the end by the final checkpoint, which the healed
group writes; and the early stop at step 40 of a run of 60 steps, which needs the count of evaluations
without improvement that the healed group's best tracker received in the heal (2, from steps 20 and 30).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.best import best_of
from elastic_qa.observe.follow import read_events
from elastic_qa.observe.trackers.mlflow_run import RUN_TAG
from elastic_qa.step_holds import arm, release, release_all
from tests.observe.test_tracker_runs import empty_store, mlflow_runs, mlflow_store
from tests.replica.test_replica_job import MAX_STEPS, check_ledger, final_digests, finished, start, wait_for

pytest.importorskip("torchft")
pytest.importorskip("mlflow")
pytestmark = pytest.mark.integration
__all__ = ["empty_store"]  # the fixture, used by name

EVERY = 10  # train.eval_every
# A high learning rate: the tiny model's F1 peaks at step 10 and falls after it (keep-best.md's example),
# so the best checkpoint is one the writer committed before it was killed at step 15, and the run stops
# early after three evaluations without improvement, at step 40 of 60.
BEST = 10


def history(db: Path, metric: str) -> list:
    """The one MLflow run's values of `metric`, in step order."""
    from mlflow.tracking import MlflowClient

    runs = mlflow_runs(db)
    if not runs:
        return []
    (run,) = runs
    return sorted(
        MlflowClient(f"sqlite:///{db}").get_metric_history(run.info.run_id, metric), key=lambda m: m.step
    )


def test_the_writer_group_killed_leaves_every_step_in_mlflow_once_and_keeps_the_best(
    tmp_path: Path, cache_dir: Path, empty_store: Path
) -> None:
    run_dir, holds, db = tmp_path / "run", tmp_path / "holds", tmp_path / "mlflow.db"
    arm(holds, [5, 15, 30])
    job = start(
        run_dir, cache_dir, f"debug.hold_dir={holds}", "log.trackers=[mlflow]",
        f"log.mlflow.tracking_uri={mlflow_store(empty_store, db)}", "log.tracker_send_every=1h",
        f"train.eval_every={EVERY}", "train.lr=1e-2", "checkpoint.keep_best=f1", "checkpoint.keep_last=1",
        "train.max_steps=60", "checkpoint.early_stop_patience=3",
    )  # fmt: skip
    try:
        wait_for(run_dir, job, "group 0 held at 5", lambda e: e.get("event") == "hold" and e["step"] == 5)
        deadline = time.monotonic() + 120
        while not history(db, "loss"):  # the writer's first batch: what it queued while its run opened
            assert time.monotonic() < deadline and job.poll() is None, "the writer sent nothing"
            time.sleep(0.2)
        release(holds, 5)
        held = wait_for(
            run_dir, job, "group 0 held at 15",
            lambda e: e.get("event") == "hold" and e.get("replica_group") == 0 and e["step"] == 15,
        )  # fmt: skip
        wait_for(
            run_dir, job, "the best of step 10 committed",
            lambda e: e.get("event") == "checkpoint_committed" and e["step"] == BEST
            and e["reason"] == "best",
        )  # fmt: skip
        sent_before = [m.step for m in history(db, "loss")]
        assert sent_before and sent_before[-1] <= 5, sent_before  # 6-15 (and step 10's scores) unsent
        killed = held["pid"]
        os.kill(killed, signal.SIGKILL)
        release(holds, 15)
        wait_for(
            run_dir, job, "group 0 back",
            lambda e: e.get("event") in ("heal", "train_start") and e.get("replica_group") == 0
            and e["pid"] != killed,
        )  # fmt: skip
        release(holds, 30)
        assert finished(job) == 0
    finally:
        release_all(holds)
        if job.poll() is None:
            job.kill()
    check_ledger(run_dir, cache_dir)
    digests = final_digests(run_dir)
    assert set(digests) == {0, 1} and len(set(digests.values())) == 1, digests

    events = read_events(run_dir)
    steps = [e for e in events if e.get("event") == "step"]
    assert sorted(e["step"] for e in steps) == list(range(1, MAX_STEPS + 1))
    assert {e["replica_group"] for e in steps if e["step"] > 15} == {0, 1}  # the writer changed twice
    evals = {e["step"]: e for e in events if e.get("event") == "eval"}
    assert sorted(e["step"] for e in events if e.get("event") == "eval") == [10, 20, 30, 40]
    (early,) = [e for e in events if e.get("event") == "early_stop"]
    assert early["step"] == MAX_STEPS and early["best_step"] == BEST and early["replica_group"] == 0
    assert early["evaluations_without_improvement"] == 3

    # MLflow: one run, finished, every step and every evaluation once, the scores of the eval lines.
    (run,) = mlflow_runs(db)
    assert run.info.status == "FINISHED"
    for metric in ("loss", "lr", "grad_norm", "samples_per_s", "world_size"):
        assert [m.step for m in history(db, metric)] == list(range(1, MAX_STEPS + 1)), metric
    scores = history(db, "eval_f1")
    assert [m.step for m in scores] == [10, 20, 30, 40]
    assert all(round(m.value, 4) == evals[m.step]["f1"] for m in scores)
    by_step = {m.step: m.value for m in history(db, "loss")}
    assert all(round(by_step[e["step"]], 6) == round(e["loss"], 6) for e in steps)

    # keep_best: the best evaluation's checkpoint, committed by the killed writer, kept beside keep_last=1
    # and named by the final checkpoint, which the healed group 0 wrote.
    assert max(evals, key=lambda step: (evals[step]["f1"], -step)) == BEST
    store = open_store(str(run_dir / "checkpoints"))
    assert [info.step for info in store.list_steps()] == [BEST, MAX_STEPS]
    final = store.read_manifest(store.path(f"step-{MAX_STEPS:08d}"))
    assert best_of(final) == {"metric": "f1", "value": best_of(final)["value"], "step": BEST}
    kept = store.verify(store.path(f"step-{BEST:08d}"))
    assert kept.ok and kept.manifest is not None
    assert round(kept.manifest["eval"]["f1"], 4) == evals[BEST]["f1"]
    (writer,) = [e for e in events if e.get("event") == "checkpoint_committed" and e["step"] == MAX_STEPS]
    assert writer["replica_group"] == 0 and writer["pid"] != killed
    run_uuid = json.loads((run_dir / "checkpoints" / "run.json").read_text())["run"]
    assert final["run"] == run_uuid == run.data.tags[RUN_TAG]  # the healed writer's manifests too
