"""`elastic-qa report RUN_DIR`: one self-contained page with the run's charts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from elastic_qa.observe.report import line_chart
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


def _axis_labels(svg: str) -> list[str]:
    return re.findall(r'text-anchor="end">([^<]+)</text>', svg)


def test_a_flat_series_gets_distinct_axis_labels_and_counts_start_at_zero() -> None:
    flat = line_chart("loss", [("loss", [(1.0, 0.5), (2.0, 0.5)], "#000")], "step")
    y_labels = _axis_labels(flat)[:3]  # bottom, middle, top
    assert len(set(y_labels)) == 3, y_labels
    world = line_chart("world", [("world", [(0.0, 2.0), (9.0, 2.0)], "#000")], "s", step_lines=True)
    assert _axis_labels(world)[:3] == ["0", "1", "2"]


def test_a_rank_absent_for_a_while_is_not_drawn_across_the_gap_and_one_point_shows() -> None:
    points = [(float(step), 1.0) for step in [*range(1, 11), *range(50, 61)]]
    chart = line_chart("loss", [("rank 1", points, "#000")], "step")
    assert chart.count("<polyline") == 2
    single = line_chart("eval", [("EM", [(100.0, 0.7)], "#000")], "step")
    assert single.count("<circle") == 1
