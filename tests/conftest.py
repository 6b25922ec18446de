"""Shared fixtures: a tiny config in a temporary run directory, with a per-session feature cache."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from elastic_qa.checkpoint.node_local import ROOT_ENV
from elastic_qa.config import Config, load_config, packaged_config

# A suite started in the background by a non-interactive shell (`nohup make test &`) inherits SIGINT
# ignored, and so would every process a test starts: the tests of Ctrl-C then wait for an exit that never
# comes (seen: both failed under `nohup bash -c 'make test' &`). Handled here, it is back to the default
# in every child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"

# The node-local checkpoint copies (checkpoint/node_local.py) of every job the tests start, the jobs they
# kill included, go here (inherited by subprocesses and torchrun workers), never into /dev/shm.
NODE_LOCAL_ROOT = tempfile.mkdtemp(prefix="elastic-qa-node-local-")
os.environ[ROOT_ENV] = f"{NODE_LOCAL_ROOT}/copies"
atexit.register(shutil.rmtree, NODE_LOCAL_ROOT, True)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One feature cache for the whole session (building it is the slow part of tiny runs)."""
    return tmp_path_factory.mktemp("feature-cache")


def tiny_overrides(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return [f"run.dir={run_dir}", f"data.cache_dir={cache}", "log.console=none", *extra]


def train_tiny(run_dir: Path, cache: Path, *extra: str, timeout: float = 120) -> None:
    """One single-process training run of the tiny config (no torchrun), failing loudly."""
    command = [
        sys.executable,
        "-m",
        "elastic_qa.train",
        "--config",
        "tiny",
        *tiny_overrides(run_dir, cache, *extra),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture
def tiny_config(tmp_path: Path, cache_dir: Path):
    """Factory: the packaged tiny config in tmp_path/run, plus overrides."""

    def make(*overrides: str) -> Config:
        return load_config(packaged_config("tiny"), tiny_overrides(tmp_path / "run", cache_dir, *overrides))

    return make


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """The run directory of one tiny training run with checkpoints at steps 10, 20 and 30 (read only)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train_tiny(run_dir, cache_dir, "train.max_steps=30", "checkpoint.every_steps=10")
    return run_dir


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random transformers QA models with their own fast tokenizers, one per style, built once per
    session: bert (WordPiece, token types), roberta (byte-level BPE, none). Skipped without transformers."""
    pytest.importorskip("transformers")
    from elastic_qa.models import tiny

    root = tmp_path_factory.mktemp("hf-models")
    return {style: tiny.create(root / style, style) for style in tiny.STYLES}
