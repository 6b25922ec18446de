"""A short chaos scenario on real torchrun agents: one fault of every kind, then the verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

FAULTS = [
    "kill-worker@step=20",
    "join-node@step=35",
    "term-node@step=50",
    "freeze-worker@step=65,for=2s",
    "kill-during-save@step=75",
    "corrupt-checkpoint@step=90",
    "storage-errors@step=100,for=3s",
    "kill-node@step=110",
]


def test_a_scenario_with_every_fault_kind_passes_verification(tmp_path: Path, cache_dir: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "chaos",
        "run",
        "--run-dir",
        str(run_dir),
        "--agents",
        "2",
        "--max",
        "3",
        "--reference-cache",
        str(tmp_path / "references"),
        "--timeout",
        "400",
        *[arg for fault in FAULTS for arg in ("--fault", fault)],
        f"data.cache_dir={cache_dir}",
        "train.max_steps=150",
        "debug.step_delay=50ms",
        "checkpoint.interval=2s",
        "debug.save_delay=100ms",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    assert report["ok"]
    assert [row["fault"] for row in report["faults"]] == [f.split("@")[0] for f in FAULTS]
    assert all(row["verdict"] == "ok" for row in report["faults"])
    assert (run_dir / "chaos" / "report.html").stat().st_size > 1000
