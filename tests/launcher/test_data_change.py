"""Resuming on training data with another number of windows: refused before any agent starts, and by the
worker itself when started without the launcher, with nothing of the checkpoint changed."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_overrides, train_tiny

pytestmark = pytest.mark.integration

OTHER_DATA = "data.synthetic.train_examples=1500"


def digest_tree(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture
def trained_run(tmp_path: Path, cache_dir: Path) -> Path:
    run_dir = tmp_path / "run"
    train_tiny(run_dir, cache_dir, "train.max_steps=10", "checkpoint.every_steps=10")
    return run_dir


def test_the_launcher_refuses_other_data_before_any_agent_starts(trained_run: Path, cache_dir: Path) -> None:
    before = digest_tree(trained_run / "checkpoints")
    overrides = tiny_overrides(trained_run, cache_dir, "train.max_steps=20", OTHER_DATA)
    result = subprocess.run(
        [str(REPO / "launch" / "local.sh"), "start", "--agents", "1", "--config", "tiny", *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("elastic-qa:")]
    assert len(lines) == 1, result.stderr
    assert "training windows" in lines[0] and "data.synthetic.train_examples: 2000 -> 1500" in lines[0]
    assert "Traceback" not in result.stderr
    assert not (trained_run / "agents" / "launch.jsonl").exists()  # no agent was started
    assert digest_tree(trained_run / "checkpoints") == before


def test_the_worker_refuses_other_data_with_exit_2_and_changes_nothing(
    trained_run: Path, cache_dir: Path
) -> None:
    before = digest_tree(trained_run / "checkpoints")
    command = [sys.executable, "-m", "elastic_qa.train", "--config", "tiny"]
    overrides = tiny_overrides(trained_run, cache_dir, "train.max_steps=20", OTHER_DATA)
    result = subprocess.run([*command, *overrides], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "1500" in result.stderr or "samples" in result.stderr
    assert digest_tree(trained_run / "checkpoints") == before
