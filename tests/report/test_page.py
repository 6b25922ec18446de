"""`elastic-qa report RUN_DIR`: one self-contained page that opens with a summary, then readable charts."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from elastic_qa.observe.follow import read_events
from elastic_qa.report.charts import Series, line_chart
from elastic_qa.report.page import render_report
from elastic_qa.report.summary import read_config, run_summary
from tests.report.runs import CONFIG, IDLE, line, write_run

SVG = "{http://www.w3.org/2000/svg}"


def charts(page: str) -> dict[str, ET.Element]:
    """Each chart of a page as parsed SVG, by its title."""
    found = {}
    for svg in re.findall(r"<svg.*?</svg>", page, flags=re.DOTALL):
        root = ET.fromstring(svg)
        found[root.find(f"{SVG}title").text] = root
    return found


def polylines(svg: ET.Element) -> list[list[tuple[float, float]]]:
    lines = svg.iter(f"{SVG}polyline")
    return [[tuple(map(float, xy.split(","))) for xy in p.get("points").split()] for p in lines]


def y_labels(svg: ET.Element) -> list[str]:
    return [t.text for t in svg.iter(f"{SVG}text") if t.get("class") == "y-tick"]


def test_report_renders_a_real_run_into_one_self_contained_page(trained: Path, tmp_path: Path) -> None:
    """The session's finished tiny run (tests/conftest.py, read only: the page is written elsewhere), not a
    training start of its own."""
    out = tmp_path / "report.html"
    result = subprocess.run(
        [sys.executable, "-m", "elastic_qa.cli", "report", str(trained), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert Path(result.stdout.strip()) == out
    page = out.read_text()
    assert ">30 of 30<" in page and "finished" in page
    titles = " ".join(charts(page))
    expected = ("Loss per rank", "Gradient norm", "Learning rate", "Throughput", "World size", "Evaluation")
    for title in expected:
        assert title in titles, title
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_report_of_a_directory_without_logs_fails_with_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elastic_qa.cli", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "logs" in result.stderr


def test_the_summary_gives_scores_steps_wall_time_world_sizes_restarts_checkpoints_and_config(
    tmp_path: Path,
) -> None:
    run_dir = write_run(tmp_path / "run")
    facts = run_summary(read_events(run_dir), read_config(run_dir))
    assert facts["result"] == {"em": 0.625, "f1": 0.75, "loss": 0.5, "step": 100} and facts["result_is_final"]
    assert (facts["step"], facts["max_steps"], facts["finished"]) == (100, 100, True)
    assert facts["wall_s"] == 35.0 and facts["world_sizes"] == [2, 3]
    assert (facts["attempts"], facts["restarts"], facts["idle_s"]) == (2, 1, IDLE[1] - IDLE[0])
    assert (facts["checkpoints"], facts["last_checkpoint"]) == (2, 100)
    assert ("model", "native (d_model 32, n_layers 1, n_heads 2)") in facts["config"]
    page = render_report(run_dir).read_text()
    summary = page[: page.index("<svg")]
    for shown in ("62.5 / 75.0", ">100 of 100<", ">35.0 s<", "2 → 3", "last at step 100"):
        assert shown in summary, shown
    assert "no worker ran for 10.0 s" in summary
    assert "max-width:800px" not in page


def test_the_world_size_line_breaks_where_no_worker_ran_and_the_gap_is_shaded(tmp_path: Path) -> None:
    world = next(svg for title, svg in charts(render_report(write_run(tmp_path / "run")).read_text()).items()
                 if title.startswith("World size"))  # fmt: skip
    (gap,) = [r for r in world.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    start, end = float(gap.get("x")), float(gap.get("x")) + float(gap.get("width"))
    assert "no worker: 10.0 s" in gap.find(f"{SVG}title").text
    lines = polylines(world)
    assert len(lines) == 2  # one level per attempt
    assert all(max(x for x, _ in ln) <= start + 0.1 or min(x for x, _ in ln) >= end - 0.1 for ln in lines)
    assert y_labels(world) == ["0", "1", "2", "3", "4"]  # whole workers, with room above the largest


def test_a_rank_absent_for_a_while_is_not_drawn_across_the_gap_and_one_point_shows() -> None:
    points = [(float(step), 1.0 + step) for step in [*range(1, 11), *range(50, 61)]]
    svg = line_chart("loss", [Series("r", points, "#000")], "s", "y")
    chart = ET.fromstring(re.search(r"<svg.*</svg>", svg)[0])
    assert len(polylines(chart)) == 2
    single = line_chart("eval", [Series("EM", [(100.0, 0.7)], "#000")], "step", "EM")
    assert single.count("<circle") == 1


def test_a_flat_series_or_a_single_evaluation_is_drawn_on_a_padded_axis() -> None:
    def axis_labels(chart: str) -> tuple[list[str], list[str]]:
        svg = ET.fromstring(re.search(r"<svg.*</svg>", chart)[0])
        xs = [t.text for t in svg.iter(f"{SVG}text") if t.get("class") == "x-tick"]
        return xs, y_labels(svg)

    xs, ys = axis_labels(line_chart("eval", [Series("EM", [(60.0, 0.7)], "#000")], "step", "EM"))
    assert 4 <= len(xs) <= 8 and "60" in xs and xs[0] != "59.5" and 4 <= len(ys) <= 8 and "0.7" in ys
    _, ys = axis_labels(line_chart("lr", [Series("lr", [(1.0, 3e-4), (2.0, 3e-4)], "#000")], "step", "lr"))
    assert "300µ" in ys and len(set(ys)) == len(ys) >= 4


def test_charts_scale_to_the_page_width_and_log_axes_say_so(tmp_path: Path) -> None:
    page = render_report(write_run(tmp_path / "run")).read_text()
    found = charts(page)
    assert all(svg.get("width") == "100%" and svg.get("viewBox") for svg in found.values())
    loss = next(svg for title, svg in found.items() if title.startswith("Loss"))
    assert "loss (log scale)" in [t.text for t in loss.iter(f"{SVG}text")]
    assert set(y_labels(loss)) <= {"0.1", "0.2", "0.5", "1", "2", "5", "10"}


def test_text_from_the_run_is_escaped_and_cannot_inject_markup(tmp_path: Path) -> None:
    config = {**CONFIG, "data": {"source": "<img src=x onerror=alert(1)>.json"}}
    crash = [line("worker_crash", 9.0, 1, 1, 2, error="<script>alert(2)</script>")]
    run_dir = write_run(tmp_path / "<script>alert(1)</script>", config, **{"rank-001.pid-1001.jsonl": crash})
    page = render_report(run_dir).read_text()
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)" in page and "&lt;img src=x" in page
