"""`elastic-qa ckpt list | verify | show` on a checkpoint directory with good and corrupted checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elastic_qa import ckpt as inspect
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.checkpoint.payload import MODEL_FILE
from elastic_qa.checkpoint.store import CheckpointStore, step_dir_name
from elastic_qa.cli import main as cli_main
from elastic_qa.config import CheckpointConfig
from tests.checkpoint.helpers import (
    Trainee,
    crafted_tensor_file,
    file_path,
    flip_byte,
    manifest_fields,
    small_files,
)

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "elastic_qa.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


@pytest.fixture
def checkpoints(tmp_path: Path) -> CheckpointStore:
    """Steps 10, 20 and 30, with step 20's model.pt damaged (one flipped byte)."""
    store = open_store(str(tmp_path / "ckpt"))
    ckpt = Checkpointer(CheckpointConfig(async_=False, keep_last=5), store)
    trainee = Trainee()
    for step in (10, 20, 30):
        trainee.train(1)
        trainee.step = step
        ckpt.save(step, trainee.state(), manifest_fields(epoch=step // 10, world_size=2))
    flip_byte(store, file_path(store, 20, MODEL_FILE))
    return store


def test_ckpt_verify_list_and_show_from_the_command_line(checkpoints: CheckpointStore) -> None:
    root = checkpoints.root
    # Each run imports torch (seconds): start the three independent ones together.
    verify, listing, show = (
        cli("ckpt", "verify", root),
        cli("ckpt", "list", root),
        cli("ckpt", "show", f"{root}/{step_dir_name(30)}"),
    )

    code, out, err = finish(verify)
    assert code == 1, out + err
    lines = {line.split(":")[0]: line for line in out.splitlines()}
    assert lines["step 10"].endswith("ok") and lines["step 30"].endswith("ok")
    assert "BAD" in lines["step 20"] and "model.pt" in lines["step 20"] and "sha256" in lines["step 20"]

    code, out, err = finish(listing)
    assert code == 0, err
    header, *rows = [line.split() for line in out.splitlines()]
    assert header == ["step", "epoch", "world", "size", "age", "f1", "em", "best", "verified"]
    by_step = {row[0]: row for row in rows}
    assert set(by_step) == {"10", "20", "30"}
    assert by_step["10"][8] == "yes" and by_step["30"][8] == "yes"
    assert by_step["20"][8] == "NO:" and "sha256" in " ".join(by_step["20"][9:])
    assert by_step["30"][5:8] == ["-", "-", "-"]  # never evaluated, no keep_best
    assert by_step["30"][1:3] == ["3", "2"]  # epoch, world size

    code, out, err = finish(show)
    assert code == 0, err
    assert "step 30" in out and "epoch 1" in out and "world size at save 2" in out
    for name in ("model.pt", "optimizer.pt", "trainer.pt"):
        assert name in out

    checkpoints.remove(checkpoints.path(step_dir_name(20)))
    code, out, err = finish(cli("ckpt", "verify", root))
    assert code == 0, out + err
    assert [line.split(":")[0] for line in out.splitlines()] == ["step 10", "step 30"]


def test_verify_loads_every_file_so_a_crafted_pickle_is_bad_even_with_a_matching_sha256(
    tmp_path: Path, capsys
) -> None:
    store = open_store(str(tmp_path / "ckpt"))
    marker = tmp_path / "pwned"
    store.commit(5, {**small_files(5), MODEL_FILE: crafted_tensor_file(str(marker))}, manifest_fields())

    assert inspect.cmd_verify(store.root) == 1

    out = capsys.readouterr().out
    assert out.startswith("step 5: BAD") and "model.pt" in out
    assert not marker.exists()


def test_verify_reports_a_step_directory_without_a_manifest(tmp_path: Path, capsys) -> None:
    store = open_store(str(tmp_path / "ckpt"))
    store.commit(5, small_files(5), manifest_fields())
    (tmp_path / "ckpt" / step_dir_name(6)).mkdir()

    assert inspect.cmd_verify(store.root) == 1
    assert "step 6: BAD: manifest.json missing" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["list", "verify", "show"])
def test_a_directory_with_no_checkpoints_is_bad_input_said_in_one_sentence(
    tmp_path: Path, capsys, command: str
) -> None:
    assert cli_main(["ckpt", command, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no checkpoints" in err and len(err.strip().splitlines()) == 1


def test_show_of_a_damaged_checkpoint_fails_with_exit_code_2(checkpoints: CheckpointStore, capsys) -> None:
    assert cli_main(["ckpt", "show", checkpoints.path(step_dir_name(20))]) == 2
    assert "sha256" in capsys.readouterr().err
