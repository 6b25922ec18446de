"""Render a run into one self-contained HTML page (inline SVG, no scripts, no network).

Charts: loss per rank (and a reference run's, when given), gradient norm per rank, learning rate,
samples/s, world size over time with restarts, checkpoint commits and fault markers, eval EM/F1.
`elastic-qa report RUN_DIR` and the chaos verifier both use this renderer.
"""

from __future__ import annotations

import html
import itertools
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_qa.observe.follow import read_events

_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
Series = tuple[str, list[tuple[float, float]], str]  # label, points, colour


def _scale(values: Sequence[float], low: float, high: float) -> tuple[float, float, float]:
    """The data range to draw (widened when flat) and pixels per unit: (lo, hi, scale)."""
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    return lo, hi, (high - low) / (hi - lo)


def _runs(points: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """Sorted points cut where x jumps by more than 5x the usual spacing (a rank absent for a while):
    a line across the gap would draw values that were never measured."""
    gaps = sorted(b[0] - a[0] for a, b in itertools.pairwise(points))
    if len(gaps) < 2:
        return [points]
    limit = 5 * max(gaps[len(gaps) // 2], 1e-12)
    runs = [[points[0]]]
    for previous, point in itertools.pairwise(points):
        if point[0] - previous[0] > limit:
            runs.append([])
        runs[-1].append(point)
    return runs


def line_chart(
    title: str,
    series: list[Series],
    x_label: str,
    markers: Sequence[tuple[float, str, str]] = (),
    log_y: bool = False,
    step_lines: bool = False,
    width: int = 760,
    height: int = 220,
) -> str:
    """An SVG line chart; markers are vertical lines (x, label, colour)."""
    import math

    left, right, top, bottom = 60, width - 10, 24, height - 34
    points = [p for _, pts, _ in series for p in pts]
    if not points:
        return f"<h3>{html.escape(title)}</h3><p>(no data)</p>"
    ys = [math.log10(max(y, 1e-12)) if log_y else y for _, y in points]
    xs = [x for x, _ in points] + [m[0] for m in markers]
    if step_lines:  # counts (world size): draw from zero so a flat line reads as a level, not noise
        ys = [*ys, 0.0]
    x0, x_max, xk = _scale(xs, left, right)
    y0, y_max, yk = _scale(ys, 0, bottom - top)

    def px(x: float) -> float:
        return left + (x - x0) * xk

    def py(y: float) -> float:
        value = math.log10(max(y, 1e-12)) if log_y else y
        return bottom - (value - y0) * yk

    parts = [
        f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" '
        f'font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="14" font-weight="bold">{html.escape(title)}</text>',
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#999"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#999"/>',
    ]
    for frac in (0.0, 0.5, 1.0):
        value = y0 + frac * (y_max - y0)
        label = f"{10**value:.3g}" if log_y else f"{value:.4g}"
        parts.append(
            f'<text x="{left - 4}" y="{bottom - frac * (bottom - top) + 4:.1f}" '
            f'text-anchor="end">{label}</text>'
        )
    for frac, anchor in ((0.0, "start"), (0.5, "middle"), (1.0, "end")):
        value = x0 + frac * (x_max - x0)
        parts.append(
            f'<text x="{left + frac * (right - left):.1f}" y="{bottom + 14}" '
            f'text-anchor="{anchor}">{value:.4g}</text>'
        )
    parts.append(
        f'<text x="{(left + right) / 2}" y="{height - 4}" text-anchor="middle">{html.escape(x_label)}</text>'
    )
    for x, label, colour in markers:
        parts.append(
            f'<line x1="{px(x):.1f}" y1="{top}" x2="{px(x):.1f}" y2="{bottom}" stroke="{colour}" '
            f'stroke-dasharray="3,3"><title>{html.escape(label)}</title></line>'
        )
    for index, (label, pts, colour) in enumerate(series):
        if not pts:
            continue
        pts = sorted(pts)
        if step_lines:
            path = []
            for (xa, ya), (xb, _) in zip(pts, [*pts[1:], pts[-1]], strict=True):
                path += [(xa, ya), (xb, ya)]
            pts = path
        for run in [pts] if step_lines else _runs(pts):
            coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run)
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.4" points="{coords}">'
                f"<title>{html.escape(label)}</title></polyline>"
            )
        if len(pts) <= 30:  # few points (evaluations): dots, so that a single one shows
            parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in pts]
        parts.append(
            f'<text x="{right - 4}" y="{top + 12 * (index + 1)}" text-anchor="end" '
            f'fill="{colour}">{html.escape(label)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _per_rank(events: list[dict], event: str, field: str, x: str = "step") -> dict[int, list]:
    series: dict[int, list] = defaultdict(list)
    for row in events:
        if row.get("event") == event and field in row:
            series[row.get("rank", 0)].append((row[x], row[field]))
    return series


def render_report(
    run_dir: Path,
    out: Path | None = None,
    reference_dir: Path | None = None,
    faults: Sequence[dict[str, Any]] = (),
    summary_html: str = "",
) -> Path:
    run_dir = Path(run_dir)
    events = read_events(run_dir)
    if not events:
        raise FileNotFoundError(f"{run_dir}/logs holds no log lines")
    t0 = events[0]["ts"]
    sections = [f"<h1>elastic_qa run {html.escape(str(run_dir))}</h1>", summary_html]

    losses = _per_rank(events, "step", "rank_loss")
    global_loss = [(r["step"], r["loss"]) for r in events if r.get("event") == "step" and r.get("rank") == 0]
    series: list[Series] = [
        (f"rank {rank} loss", pts, _COLOURS[rank % len(_COLOURS)]) for rank, pts in sorted(losses.items())
    ]
    series.append(("global loss (rank 0)", global_loss, "#000"))
    if reference_dir is not None:
        reference = [
            (r["step"], r["loss"])
            for r in read_events(Path(reference_dir))
            if r.get("event") == "step" and r.get("rank") == 0
        ]
        series.append(("reference run", reference, "#aaa"))
    sections.append(
        line_chart("Loss per rank (ranks are renumbered at each restart)", series, "step", log_y=True)
    )

    norms = _per_rank(events, "step", "grad_norm")
    sections.append(
        line_chart(
            "Gradient norm per rank (of the all-reduced gradient: ranks agree unless one diverged)",
            [(f"rank {rank}", pts, _COLOURS[rank % len(_COLOURS)]) for rank, pts in sorted(norms.items())],
            "step",
            log_y=True,
        )
    )
    sections.append(
        line_chart(
            "Learning rate",
            [
                (
                    "lr",
                    [(r["step"], r["lr"]) for r in events if r.get("event") == "step" and r.get("rank") == 0],
                    _COLOURS[0],
                )
            ],
            "step",
        )
    )
    sections.append(
        line_chart(
            "Samples/s (global)",
            [
                (
                    "samples/s",
                    [
                        (r["ts"] - t0, r["samples_per_s"])
                        for r in events
                        if r.get("event") == "step" and r.get("rank") == 0 and r.get("samples_per_s")
                    ],
                    _COLOURS[2],
                )
            ],
            "seconds since start",
        )
    )

    world = [
        (r["ts"] - t0, r["world_size"])
        for r in events
        if r.get("event") == "worker_start" and r.get("rank") == 0
    ]
    markers = [
        (r["ts"] - t0, f"checkpoint step {r['step']} ({r.get('reason')})", "#2ca02c")
        for r in events
        if r.get("event") == "checkpoint_committed"
    ]
    markers += [
        (f["ts"] - t0, f"{f['fault']}: {f.get('target', '')}", "#d62728") for f in faults if "ts" in f
    ]
    end = events[-1]["ts"] - t0
    sections.append(
        line_chart(
            "World size over time (green: checkpoint commits, red: faults)",
            [("world size", [*world, (end, world[-1][1])] if world else [], "#000")],
            "seconds since start",
            markers=markers,
            step_lines=True,
        )
    )
    evals = [r for r in events if r.get("event") == "eval"]
    sections.append(
        line_chart(
            "Evaluation",
            [
                ("EM", [(r["step"], r["em"]) for r in evals], _COLOURS[0]),
                ("F1", [(r["step"], r["f1"]) for r in evals], _COLOURS[1]),
            ],
            "step",
        )
    )
    restarts = [r for r in events if r.get("event") == "worker_start" and r.get("rank") == 0]
    rows = "".join(
        f"<tr><td>{r['attempt']}</td><td>{r['ts'] - t0:.1f}</td><td>{r['world_size']}</td></tr>"
        for r in restarts
    )
    sections.append(
        f"<h3>Attempts</h3><table border=1 cellpadding=3><tr><th>attempt</th><th>start (s)</th>"
        f"<th>world size</th></tr>{rows}</table>"
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>elastic_qa report</title></head>"
        "<body style='font-family:sans-serif;max-width:800px'>" + "".join(sections) + "</body></html>"
    )
    out = out or run_dir / "report.html"
    out.write_text(page)
    return out
