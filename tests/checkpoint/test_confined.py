"""The checkpoint directory's own subdirectories (checkpoint/confined.py): attempts/, holders/ and rejected/
are used only as real directories inside it. One that links elsewhere gets nothing written or removed
there: a start (the trainer's, the launcher's) is refused with one line and exit 2, and each writer refuses
again at its write."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.fencing import Fence
from elastic_qa.checkpoint.store import CheckpointError, step_dir_name
from elastic_qa.launcher.processes import python_env
from tests.checkpoint.helpers import manifest_fields, small_files
from tests.checkpoint.runs import snapshot, train


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """Another directory with files of its own: a note, another run's attempt claim."""
    place = tmp_path / "elsewhere"
    place.mkdir()
    (place / "keep.json").write_text('{"mine": true}')
    (place / "attempt-00000009.0123456789abcdef.json").write_text('{"attempt": 9}')
    return place


def test_an_attempts_directory_that_links_elsewhere_gets_no_claim(tmp_path: Path, elsewhere: Path) -> None:
    store = open_store(str(tmp_path / "checkpoints"))
    Path(store.root).mkdir()
    Path(store.path("attempts")).symlink_to(elsewhere)
    before = snapshot(elsewhere)
    with pytest.raises(CheckpointError, match="attempts is a symbolic link"):
        Fence(store).register(world_size=1)
    assert snapshot(elsewhere) == before


def test_a_rejected_directory_that_links_elsewhere_receives_no_quarantined_step(
    tmp_path: Path, elsewhere: Path
) -> None:
    store = open_store(str(tmp_path / "checkpoints"))
    path = store.commit(4, small_files(4), manifest_fields())
    Path(store.path("rejected")).symlink_to(elsewhere)
    before = snapshot(elsewhere)
    with pytest.raises(CheckpointError, match="rejected is a symbolic link"):
        store.quarantine(path, "damaged")
    assert snapshot(elsewhere) == before
    assert store.verify(store.path(step_dir_name(4))).ok  # left where it was


def test_a_store_without_links_quarantines_as_before(tmp_path: Path) -> None:
    for url in (str(tmp_path / "checkpoints"), f"memory://{tmp_path.name}/checkpoints"):
        store = open_store(url)
        target = store.quarantine(store.commit(4, small_files(4), manifest_fields()), "damaged")
        assert target.startswith(store.path("rejected", "step-00000004."))
        assert store.list_steps() == []


@pytest.mark.parametrize("name", ["attempts", "holders", "rejected"])
def test_a_start_whose_checkpoint_subdirectory_links_elsewhere_is_refused_with_exit_2_and_changes_nothing(
    tmp_path: Path, cache_dir: Path, elsewhere: Path, name: str
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / name).symlink_to(elsewhere)
    before, checkpoints = snapshot(elsewhere), snapshot(run_dir / "checkpoints")
    result = train(run_dir, cache_dir, "train.max_steps=8")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"checkpoints/{name} is a symbolic link to {elsewhere}" in lines[0], lines
    assert snapshot(elsewhere) == before and snapshot(run_dir / "checkpoints") == checkpoints
    assert json.loads((elsewhere / "keep.json").read_text()) == {"mine": True}


def test_a_launcher_start_whose_holders_directory_links_elsewhere_is_refused_before_any_agent(
    tmp_path: Path, cache_dir: Path, elsewhere: Path
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "holders").symlink_to(elsewhere)
    before = snapshot(elsewhere)
    start = [sys.executable, "-m", "elastic_qa.launcher.local", "start", "--agents", "1", "--config", "tiny"]
    overrides = [f"run.dir={run_dir}", f"data.cache_dir={cache_dir}", "train.max_steps=8", "log.console=none"]
    result = subprocess.run(
        [*start, *overrides], capture_output=True, text=True, env=python_env(), timeout=300
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "checkpoints/holders is a symbolic link to" in lines[0], lines
    assert not (run_dir / "launch.json").exists() and not (run_dir / "agents").exists()
    assert snapshot(elsewhere) == before
