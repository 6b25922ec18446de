"""Every command that takes a checkpoint accepts a run directory, its checkpoints directory or one step
directory; a path with nothing in it is bad input, said in one sentence."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.locate import load_checkpoint, resolve_checkpoint_path
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.checkpoint.store import CheckpointError, step_dir_name
from elastic_qa.cli import main as cli_main
from elastic_qa.config import CheckpointConfig
from tests.checkpoint.helpers import Trainee, manifest_fields


def save_steps(directory: Path, *steps: int) -> None:
    checkpointer = Checkpointer(CheckpointConfig(async_=False, keep_last=5), open_store(str(directory)))
    trainee = Trainee()
    for step in steps:
        trainee.step = step
        checkpointer.save(step, trainee.state(), manifest_fields())


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run directory as training leaves it: config.yaml and checkpoints/ with steps 10 and 20."""
    run_dir = tmp_path / "run"
    save_steps(run_dir / "checkpoints", 10, 20)
    (run_dir / "config.yaml").write_text(f"run:\n  dir: {run_dir}\ncheckpoint:\n  dir: ''\n")
    return run_dir


def test_a_run_a_checkpoints_and_a_step_directory_resolve_to_the_same_store(run: Path) -> None:
    checkpoints = str(run / "checkpoints")
    for given in (str(run), str(run) + "/", checkpoints):
        location = resolve_checkpoint_path(given)
        assert location.directory.rstrip("/") == checkpoints and location.step_path is None
    one = resolve_checkpoint_path(f"{checkpoints}/{step_dir_name(10)}")
    assert one.directory == checkpoints and one.step == 10 and one.step_path.endswith(step_dir_name(10))

    assert load_checkpoint(str(run)).step == 20  # the newest valid one
    assert load_checkpoint(f"{checkpoints}/{step_dir_name(10)}").step == 10


def test_a_run_whose_checkpoints_live_elsewhere_is_found_through_its_config(tmp_path: Path) -> None:
    run_dir, elsewhere = tmp_path / "run", tmp_path / "store"
    save_steps(elsewhere, 5)
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(f"checkpoint:\n  dir: {elsewhere}\n")
    assert resolve_checkpoint_path(str(run_dir)).directory == str(elsewhere)


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "no checkpoints here"),
        (lambda p: (p / "checkpoints").mkdir(parents=True), "the run has no checkpoints yet"),
        (lambda p: p.write_text("x"), "is not a directory"),
    ],
    ids=["missing", "empty", "run-without-checkpoints", "file"],
)
def test_a_path_with_no_checkpoint_is_bad_input_in_one_sentence(tmp_path: Path, make, said: str) -> None:
    path = tmp_path / "given"
    make(path)
    with pytest.raises(CheckpointError, match=said):
        resolve_checkpoint_path(str(path))


@pytest.mark.parametrize("form", ["run", "checkpoints", "step"])
def test_ckpt_list_verify_and_show_take_every_form(run: Path, form: str, capsys) -> None:
    path = {"run": run, "checkpoints": run / "checkpoints", "step": run / "checkpoints" / step_dir_name(20)}
    given = str(path[form])

    assert cli_main(["ckpt", "list", given]) == 0
    listed = capsys.readouterr().out
    assert ("10" in listed) == (form != "step") and "20" in listed
    assert cli_main(["ckpt", "verify", given]) == 0
    assert "step 20: ok" in capsys.readouterr().out
    assert cli_main(["ckpt", "show", given]) == 0
    assert "step 20" in capsys.readouterr().out
