"""`elastic-qa report RUN_DIR`: one self-contained page with the run's charts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import train_tiny


def test_report_renders_a_run_into_one_self_contained_page(tmp_path: Path, cache_dir: Path) -> None:
    train_tiny(tmp_path, cache_dir, "train.max_steps=20", "train.eval_every=10")
    result = subprocess.run(
        [sys.executable, "-m", "elastic_qa.cli", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    page = Path(result.stdout.strip()).read_text()
    for title in ("Loss per rank", "Gradient norm", "Learning rate", "Samples/s", "World size", "Evaluation"):
        assert title in page
    assert (
        page.count("<svg") >= 6
        and "<script" not in page
        and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    )


def test_report_of_a_directory_without_logs_fails_with_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elastic_qa.cli", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "logs" in result.stderr
