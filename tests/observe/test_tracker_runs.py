"""Real MLflow (a local SQLite store, read back with MlflowClient) and W&B (offline) runs.

In the default run: a second start of the same run continues its tracker run and skips the steps it holds.
Marked long (real training, two processes each, a minute on two loaded cores): one tracker run per run
across a SIGKILL and a resume that re-trains steps the killed attempt had already logged, every step in it
once; trackers that raise or hang are dropped and training finishes."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from elastic_qa.config import Config, ConfigError, resolve_config
from elastic_qa.observe.follow import read_events
from elastic_qa.observe.trackers import check_installed
from elastic_qa.observe.trackers.background import BackgroundTracker, TrackerRun
from elastic_qa.observe.trackers.mlflow_run import RUN_TAG, MlflowRun, flat_params
from elastic_qa.observe.trackers.wandb_run import WandbRun, offline_high_water, offline_history
from tests.conftest import tiny_overrides

STEPS = 20
# Checkpoints every 5 steps, saved synchronously (an async save could still be in flight at the kill);
# killed after step 13: the resume is from step 10 and re-trains 11-13, which the killed attempt logged.
COMMON = (
    f"train.max_steps={STEPS}",
    "train.eval_every=5",
    "log.every_steps=1",
    "checkpoint.every_steps=5",
    "checkpoint.async=false",
)
KILLED_AT, RESUMED_FROM = 13, 10


def train(run_dir: Path, cache: Path, *extra: str, module: str = "elastic_qa.train", expect: int = 0) -> None:
    command = [sys.executable, "-m", module, "--config", "tiny", *tiny_overrides(run_dir, cache, *extra)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == expect, result.stderr[-3000:]


def train_killed_then_resumed(run_dir: Path, cache: Path, *extra: str) -> None:
    train(run_dir, cache, *COMMON, *extra, f"debug.kill_at_step={KILLED_AT}", expect=-signal.SIGKILL)
    train(run_dir, cache, *COMMON, *extra)
    assert [e["step"] for e in read_events(run_dir) if e["event"] == "resume"] == [RESUMED_FROM]


def run_uuid(run_dir: Path) -> str:
    return json.loads((run_dir / "checkpoints" / "run.json").read_text())["run"]


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty SQLite tracking store, made once (creating MLflow's tables takes seconds of CPU)."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow") / "empty.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


def mlflow_store(empty_store: Path, db: Path) -> str:
    """A new tracking store at `db`, created before training as a team's store is: MLflow creates its
    tables in many steps, and a worker killed while creating them would leave a store that cannot open."""
    shutil.copyfile(empty_store, db)
    return f"sqlite:///{db}"


def mlflow_runs(db: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("elastic-qa")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


def mlflow_steps(db: Path, run_id: str, metric: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    return sorted(m.step for m in MlflowClient(f"sqlite:///{db}").get_metric_history(run_id, metric))


UUID = "0123456789abcdef0123456789abcdef"


def logged_by(run: TrackerRun, steps: range) -> BackgroundTracker:
    """`run` opened, given `steps` (loss at each, eval_f1 at every fifth) and closed, in its own thread."""
    tracker = BackgroundTracker(run, timeout_s=120)
    for step in steps:
        tracker.log(step, {"loss": 1.0 / step, **({"eval_f1": 0.5} if step % 5 == 0 else {})})
    tracker.close(finished=False)
    assert tracker.dropped is None
    return tracker


def tiny_config(tmp_path: Path, *overrides: str) -> Config:
    return resolve_config("tiny", [f"run.dir={tmp_path / 'run'}", *overrides])


def test_a_second_start_continues_the_mlflow_run_and_skips_the_steps_it_holds(
    tmp_path: Path, empty_store: Path
) -> None:
    db = tmp_path / "mlflow.db"
    cfg = tiny_config(tmp_path, f"log.mlflow.tracking_uri={mlflow_store(empty_store, db)}")
    logged_by(MlflowRun(cfg, UUID), range(1, 8))
    again = logged_by(MlflowRun(cfg, UUID), range(4, 13))  # rolled back to step 3
    assert again.high_water == {"loss": 12, "eval_f1": 10}
    (run,) = mlflow_runs(db)
    assert run.data.tags[RUN_TAG] == UUID and run.info.status == "KILLED"
    assert mlflow_steps(db, run.info.run_id, "loss") == list(range(1, 13))
    assert mlflow_steps(db, run.info.run_id, "eval_f1") == [5, 10]


def test_a_start_after_one_killed_before_its_params_logs_the_params_that_are_missing(
    tmp_path: Path, empty_store: Path
) -> None:
    # The first start created the tagged run, logged one param and was killed there (its tracker thread is
    # behind the training loop: a kill at step 13 of a loaded machine has been seen to land before it).
    from mlflow.tracking import MlflowClient

    db = tmp_path / "mlflow.db"
    uri = mlflow_store(empty_store, db)
    cfg = tiny_config(tmp_path, f"log.mlflow.tracking_uri={uri}", "train.max_steps=9")
    client = MlflowClient(f"sqlite:///{db}")
    run = client.create_run(client.create_experiment("elastic-qa"), tags={RUN_TAG: UUID})
    client.log_param(run.info.run_id, "train.max_steps", "7")  # the killed start's config said 7
    logged_by(MlflowRun(cfg, UUID), range(1, 4))
    (found,) = mlflow_runs(db)
    # None left out, and the one the run held is unchanged.
    assert found.data.params == {**flat_params(cfg.to_dict()), "train.max_steps": "7"}
    assert mlflow_steps(db, found.info.run_id, "loss") == [1, 2, 3]


def test_a_second_start_continues_the_wandb_offline_run_and_skips_the_steps_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_config(tmp_path, "log.wandb.mode=offline", f"log.wandb.dir={tmp_path / 'wandb-files'}")
    logged_by(WandbRun(cfg, UUID), range(1, 8))
    files = tmp_path / "wandb-files" / "wandb"
    assert offline_high_water(files, UUID) == {"loss": 7, "eval_f1": 5}
    # W&B names the folder by the second the attempt started in: date it back, so that the next start
    # (within the same second here, seconds later in a real restart) writes a folder of its own.
    (first,) = files.glob(f"offline-run-*-{UUID}")
    first.rename(files / f"offline-run-20000101_000000-{UUID}")
    logged_by(WandbRun(cfg, UUID), range(4, 13))
    attempts = sorted(files.glob(f"offline-run-*-{UUID}"))
    rows = [row for path in attempts for row in offline_history(path / f"run-{UUID}.wandb")]
    assert len(attempts) == 2
    assert sorted(step for step, keys in rows if "loss" in keys) == list(range(1, 13))
    assert sorted(step for step, keys in rows if "eval_f1" in keys) == [5, 10]


def test_an_mlflow_run_continues_across_a_kill_and_resume_with_every_step_logged_once(
    tmp_path: Path, cache_dir: Path, empty_store: Path
) -> None:
    run_dir, db = tmp_path / "run", tmp_path / "mlflow.db"
    uri = mlflow_store(empty_store, db)
    train_killed_then_resumed(run_dir, cache_dir, "log.trackers=[mlflow]", f"log.mlflow.tracking_uri={uri}")
    (run,) = mlflow_runs(db)
    assert run.data.tags[RUN_TAG] == run_uuid(run_dir)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["train.max_steps"] == str(STEPS)
    for metric in ("loss", "lr", "grad_norm", "world_size"):
        assert mlflow_steps(db, run.info.run_id, metric) == list(range(1, STEPS + 1)), metric
    for metric in ("eval_em", "eval_f1", "eval_loss"):
        assert mlflow_steps(db, run.info.run_id, metric) == [5, 10, 15, 20], metric


@pytest.mark.long
def test_a_wandb_offline_run_keeps_its_id_across_a_kill_and_logs_every_step_once(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    train_killed_then_resumed(run_dir, cache_dir, "log.trackers=[wandb]", "log.wandb.mode=offline")
    uuid = run_uuid(run_dir)
    attempts = sorted((tmp_path / "wandb-files" / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and all(path.name.endswith(f"-{uuid}") for path in attempts)
    # A killed attempt may end before W&B's service wrote its file: what it had not sent for certain then is
    # in the checkpoint's backlog, which the next attempt logs.
    files = [path / f"run-{uuid}.wandb" for path in attempts if (path / f"run-{uuid}.wandb").exists()]
    assert files and files[-1].parent == attempts[-1]
    rows = [row for path in files for row in offline_history(path)]
    assert sorted(step for step, keys in rows if "loss" in keys) == list(range(1, STEPS + 1))
    assert sorted(step for step, keys in rows if "eval_f1" in keys) == [5, 10, 15, 20]


@pytest.mark.long
def test_trackers_that_raise_or_hang_are_dropped_with_one_warning_each_and_training_finishes(
    tmp_path: Path, cache_dir: Path, empty_store: Path
) -> None:
    run_dir, db = tmp_path / "run", tmp_path / "mlflow.db"
    mlflow = ("log.trackers=[mlflow]", f"log.mlflow.tracking_uri={mlflow_store(empty_store, db)}")
    train(run_dir, cache_dir, *COMMON, *mlflow, module="tests.observe.faulty_trackers")
    events = read_events(run_dir)
    dropped = sorted(e["tracker"] for e in events if e["event"] == "tracker_dropped")
    assert dropped == ["hanging", "raising"]
    assert [e["step"] for e in events if e["event"] == "train_done"] == [STEPS]
    (run,) = mlflow_runs(db)  # the healthy tracker beside them got everything
    assert mlflow_steps(db, run.info.run_id, "loss") == list(range(1, STEPS + 1))


OTHER_UID = 65534  # nobody: another user of the machine
# Capabilities that let root write where the owner and mode say no: dropped from the bounding set in the
# child (prctl PR_CAPBSET_DROP), root then meets a folder's mode bits as any user does. The child cannot run
# as another uid here: the interpreter lies under root's private home.
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER = 24, 1, 2, 3


def without_root_override() -> None:
    """preexec_fn: the child (root or not) can write only where owner and mode let it."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER):
        if os.geteuid() == 0 and libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def wandb_unwritable(tmp_path: Path, how: str) -> Path:
    """A folder W&B cannot write in, for a process without root's override (as any user)."""
    if how == "under a regular file":
        (tmp_path / "file").write_text("a regular file, not a directory\n")
        return tmp_path / "file" / "wandb"
    folder = tmp_path / "folder"
    folder.mkdir()
    if "another user's" in how and os.geteuid() != 0:
        pytest.skip("giving a folder to another user takes root")
    if how == "another user's folder":
        os.chown(folder, OTHER_UID, OTHER_UID)  # mode 0755: hers
    elif how == "read-only folder":
        folder.chmod(0o555)
    else:  # W&B's own folder in it is another user's
        (folder / "wandb").mkdir()
        os.chown(folder / "wandb", OTHER_UID, OTHER_UID)
    return folder


UNWRITABLE = [
    "another user's folder",
    "read-only folder",
    "its wandb folder another user's",
    "under a regular file",
]


@pytest.mark.parametrize("how", UNWRITABLE)
def test_training_refuses_an_unwritable_wandb_dir_in_one_line_and_never_writes_to_the_temp_dir(
    tmp_path: Path, cache_dir: Path, how: str
) -> None:
    shared = tmp_path / "system-temp"  # W&B's fallback, the system's temporary directory, made private
    shared.mkdir()
    folder = wandb_unwritable(tmp_path, how)
    extra = ("log.trackers=[wandb]", "log.wandb.mode=offline", f"log.wandb.dir={folder}", "train.max_steps=2")
    command = [sys.executable, "-m", "elastic_qa.train", "--config", "tiny"]
    command += tiny_overrides(tmp_path / "run", cache_dir, *extra)
    env = {**os.environ, "TMPDIR": str(shared), "WANDB_SILENT": "true"}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=180, env=env, preexec_fn=without_root_override
    )
    assert result.returncode == 2, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("elastic-qa:")]
    assert len(said) == 1 and f"log.wandb.dir={folder}: W&B cannot write there" in said[0], result.stderr
    assert not (shared / "wandb").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before training started


def test_a_wandb_dir_from_wandb_dir_that_cannot_be_written_is_refused_naming_wandb_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = wandb_unwritable(tmp_path, "under a regular file")
    monkeypatch.setenv("WANDB_DIR", str(folder))
    with pytest.raises(ConfigError, match=rf"^WANDB_DIR={folder}: W&B cannot write there \({tmp_path}/file "):
        check_installed(tiny_config(tmp_path, "log.trackers=[wandb]"))


def test_a_wandb_dir_that_cannot_be_written_when_the_tracker_opens_drops_it_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder was fine at the start, but not where and when rank 0 opens the tracker (a new rank 0
    after a regroup, on another node): dropped with its warning, never written to the temp dir."""
    shared = tmp_path / "system-temp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))  # where W&B would go instead
    monkeypatch.setenv("WANDB_SILENT", "true")
    folder = wandb_unwritable(tmp_path, "under a regular file")
    cfg = tiny_config(tmp_path, "log.trackers=[wandb]", "log.wandb.mode=offline", f"log.wandb.dir={folder}")
    tracker = BackgroundTracker(WandbRun(cfg, UUID), timeout_s=120)
    tracker.close(finished=False)
    assert (
        tracker.dropped is not None and f"log.wandb.dir={folder}: W&B cannot write there" in tracker.dropped
    )
    assert not (shared / "wandb").exists()
