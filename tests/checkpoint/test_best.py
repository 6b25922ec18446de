"""The best checkpoint: which evaluation is the best, when evaluations stop improving, and the rotation
that never prunes the best and replaces it only once a better one is committed and verified."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from elastic_qa import ckpt as inspect
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.best import BestTracker, best_of, best_record
from elastic_qa.checkpoint.locate import load_best_checkpoint
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.checkpoint.store import CheckpointError
from elastic_qa.cli import main as cli_main
from elastic_qa.config import CheckpointConfig, ConfigError, load_config, packaged_config
from tests.checkpoint.helpers import Trainee, manifest_fields


def scores(f1: float, em: float = 0.0) -> dict[str, float]:
    return {"em": em, "f1": f1, "loss": 1.0}


def tracker(**overrides) -> BestTracker:
    return BestTracker(CheckpointConfig(keep_best="f1", **overrides))


def test_a_new_best_is_a_score_above_every_earlier_one() -> None:
    best = tracker()

    found = [best.observe(step, scores(f1)) for step, f1 in [(10, 0.2), (20, 0.1), (30, 0.2), (40, 0.3)]]

    assert found == [True, False, False, True]  # a tie keeps the earlier checkpoint
    assert (best.value, best.step) == (0.3, 40)


def test_the_metric_is_the_one_keep_best_names() -> None:
    best = BestTracker(CheckpointConfig(keep_best="em"))
    best.observe(10, scores(f1=0.9, em=0.1))
    assert best.observe(20, scores(f1=0.1, em=0.2))
    assert (best.value, best.step) == (0.2, 20)


def test_early_stop_comes_after_patience_evaluations_without_improvement_by_more_than_min_delta() -> None:
    best = tracker(early_stop_patience=2, early_stop_min_delta=0.05)
    best.observe(10, scores(0.50))
    best.observe(20, scores(0.52))  # a new best, but not by more than min_delta: counts against patience
    assert best.step == 20 and best.stale_evals == 1 and not best.exhausted
    best.observe(30, scores(0.60))  # improves on the best (0.52) by more than 0.05: the count starts over
    assert best.stale_evals == 0
    best.observe(40, scores(0.40))
    assert not best.exhausted
    best.observe(50, scores(0.61))
    assert best.exhausted and best.step == 50


def test_without_keep_best_only_the_last_evaluation_is_tracked() -> None:
    best = BestTracker(CheckpointConfig())
    assert not best.observe(10, scores(0.5))
    assert best.manifest_fields(10) == {"eval": {"step": 10, "em": 0.0, "f1": 0.5}}
    assert best.manifest_fields(11) == {}
    assert not best.exhausted


def test_the_manifest_names_the_best_and_carries_the_scores_only_of_the_step_evaluated() -> None:
    best = tracker()
    best.observe(10, scores(0.4, 0.3))
    best.observe(20, scores(0.2, 0.1))

    assert best.manifest_fields(20) == {
        "eval": {"step": 20, "em": 0.1, "f1": 0.2},
        "best": {"metric": "f1", "value": 0.4, "step": 10},
    }
    assert "eval" not in best.manifest_fields(21)  # trained on since: not the state that was scored
    assert best_of(best.manifest_fields(21)) == {"metric": "f1", "value": 0.4, "step": 10}


def test_the_tracker_survives_a_weights_only_round_trip() -> None:
    best = tracker(early_stop_patience=3)
    for step, f1 in [(10, 0.4), (20, 0.3)]:
        best.observe(step, scores(f1))
    buffer = io.BytesIO()
    torch.save(best.state_dict(), buffer)

    restored = tracker(early_stop_patience=3)
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))

    assert restored.state_dict() == best.state_dict()
    assert restored.scores_at(20) == {"em": 0.0, "f1": 0.3, "loss": 1.0}


def test_a_best_of_another_metric_starts_over_and_a_checkpoint_without_one_loads() -> None:
    best = tracker()
    best.observe(10, scores(0.4))
    other = BestTracker(CheckpointConfig(keep_best="em"))
    other.load_state_dict(best.state_dict())
    assert other.value is None and other.step is None
    other.load_state_dict(None)  # trainer.pt written before the tracker existed
    assert other.value is None


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["checkpoint.early_stop_patience=2"], "early_stop_patience=2"),  # without keep_best: no metric
        (["checkpoint.keep_best=f1", "checkpoint.early_stop_patience=-1"], "early_stop_patience=-1"),
        (["checkpoint.keep_best=f1", "checkpoint.early_stop_min_delta=1.5"], "early_stop_min_delta=1.5"),
        (["checkpoint.keep_best=loss"], "keep_best"),
    ],
)
def test_bad_keep_best_settings_are_refused_naming_the_field(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=f"checkpoint.{named}"):
        load_config(packaged_config("tiny"), overrides)


# ---- the rotation ----------------------------------------------------------------------------------


class Saves:
    """Synchronous saves of a small state, each with the manifest fields the trainer's tracker writes."""

    def __init__(self, root: Path, keep_last: int, attempt: int = 1) -> None:
        self.store = open_store(str(root))
        self.failing = False
        self.checkpointer = Checkpointer(
            CheckpointConfig(async_=False, keep_last=keep_last, keep_best="f1"),
            self.store,
            before_file=self._before_file,
        )
        self.trainee = Trainee()
        self.attempt = attempt

    def _before_file(self, name: str) -> None:
        if self.failing:
            raise OSError(28, "No space left on device")

    def save(self, step: int, best: int, evaluated: float | None = None) -> None:
        self.trainee.step = step
        fields = {
            **manifest_fields(attempt=self.attempt),
            "best": {"metric": "f1", "value": 0.5, "step": best},
            **({"eval": {"step": step, "em": evaluated, "f1": evaluated}} if evaluated is not None else {}),
        }
        self.checkpointer.save(step, self.trainee.state(), fields)

    def steps(self) -> list[int]:
        return [info.step for info in self.store.list_steps()]


def test_the_rotation_never_prunes_the_best_even_with_keep_last_1(tmp_path: Path) -> None:
    saves = Saves(tmp_path / "ckpt", keep_last=1)
    saves.save(10, best=10, evaluated=0.5)
    for step in (20, 30, 40):
        saves.save(step, best=10)

    assert saves.steps() == [10, 40]
    assert best_record(saves.store) == {"metric": "f1", "value": 0.5, "step": 10}


def test_the_old_best_goes_only_once_the_new_one_is_committed(tmp_path: Path) -> None:
    saves = Saves(tmp_path / "ckpt", keep_last=1)
    saves.save(10, best=10, evaluated=0.5)
    saves.save(20, best=10)

    saves.failing = True  # the new best's save fails (a crash between evaluation and commit leaves the same)
    saves.save(30, best=30, evaluated=0.6)
    assert saves.steps() == [10, 20]
    assert best_record(saves.store)["step"] == 10  # an uncommitted checkpoint is never named the best

    saves.failing = False
    saves.save(30, best=30, evaluated=0.6)
    assert saves.steps() == [30]


def test_a_best_whose_save_failed_is_never_named_and_the_standing_best_stays(tmp_path: Path) -> None:
    saves = Saves(tmp_path / "ckpt", keep_last=1)
    saves.save(10, best=10, evaluated=0.5)
    saves.failing = True  # a storage error: the new best of step 20 is never committed, training goes on
    saves.save(20, best=20, evaluated=0.6)
    saves.failing = False

    saves.save(30, best=20)  # the tracker still names 20: the manifest names the best that stands

    assert saves.steps() == [10, 30]
    assert best_record(saves.store)["step"] == 10
    saves.save(40, best=40, evaluated=0.7)
    assert saves.steps() == [40]


def test_a_restart_keeps_the_best_its_checkpoints_name(tmp_path: Path) -> None:
    first = Saves(tmp_path / "ckpt", keep_last=2)
    first.save(10, best=10, evaluated=0.5)
    for step in (20, 30):
        first.save(step, best=10)

    restarted = Saves(tmp_path / "ckpt", keep_last=2, attempt=2)  # resumed from 30: its state names 10
    for step in (40, 50):
        restarted.save(step, best=10)

    assert restarted.steps() == [10, 40, 50]
    assert load_best_checkpoint(str(tmp_path / "ckpt")).step == 10


def test_ckpt_list_marks_the_best_with_its_score(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    saves = Saves(tmp_path / "ckpt", keep_last=3)
    saves.save(10, best=10, evaluated=0.5)
    saves.save(20, best=10, evaluated=0.25)

    assert inspect.cmd_list(saves.store.root) == 0

    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    header, *rows = lines[[row[:1] for row in lines].index(["step"]) :]  # after the log lines, if shown
    by_step = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    assert by_step["10"]["best"] == "f1=0.5000" and by_step["10"]["f1"] == "0.5000"
    assert by_step["20"]["best"] == "-" and by_step["20"]["f1"] == "0.2500"


def test_export_best_of_a_run_without_one_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    store = open_store(str(tmp_path / "ckpt"))
    Checkpointer(CheckpointConfig(async_=False), store).save(10, Trainee().state(), manifest_fields())

    with pytest.raises(CheckpointError, match="no best checkpoint"):
        load_best_checkpoint(store.root)
    assert cli_main(["export", store.root, "--out", str(tmp_path / "out"), "--best"]) == 2
    assert "no best checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
