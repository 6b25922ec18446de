"""A real finished run, and copies of it to doctor: the evidence the verifier tests start from."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import train_tiny

STEPS = 30


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A real, fault-free single-process run with a ledger: the evidence the tests then doctor."""
    run_dir = tmp_path_factory.mktemp("verified") / "run"
    train_tiny(
        run_dir,
        cache_dir,
        f"train.max_steps={STEPS}",
        "debug.sample_ledger=true",
        "log.every_steps=1",
        "checkpoint.every_steps=10",
        "train.threads=1",
    )
    return run_dir


@pytest.fixture
def copy_of(finished_run: Path, tmp_path: Path):
    def make(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(finished_run, target)
        config = (target / "config.yaml").read_text().replace(str(finished_run), str(target))
        (target / "config.yaml").write_text(config)
        return target

    return make
