"""Short real training runs (python -m elastic_qa.train, one process) and byte-for-byte snapshots of what
they leave, for the tests of which run a checkpoint directory belongs to."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import tiny_overrides

EVERY = "checkpoint.every_steps=10"


def train(run_dir: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    overrides = tiny_overrides(run_dir, cache, "train.threads=1", EVERY, *extra)
    command = [sys.executable, "-m", "elastic_qa.train", "--config", "tiny", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def trained_ok(run_dir: Path, cache: Path, *extra: str) -> None:
    result = train(run_dir, cache, *extra)
    assert result.returncode == 0, result.stderr[-3000:]


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root`: a file's sha256 and mode, a directory, a link's target."""
    entries = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            entries[key] = f"link {os.readlink(path)}"
        elif path.is_dir():
            entries[key] = "dir"
        else:
            entries[key] = f"{hashlib.sha256(path.read_bytes()).hexdigest()} {path.stat().st_mode:o}"
    return entries
