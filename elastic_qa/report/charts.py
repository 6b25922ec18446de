"""SVG line charts for the HTML reports: responsive (a viewBox drawn at the page's width), gridlines at
readable ticks, axis titles that say when a scale is logarithmic, shaded gaps where nothing ran.
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from elastic_qa.report.ticks import log_ticks, nice_ticks, padded_range, tick_labels

FONT = 12
LEFT, RIGHT, TOP, BOTTOM = 66, 16, 40, 46  # margins around the plot area: labels and titles live there
GAP_FILL = "#e9e9e9"
WIDTH = 720  # of a chart in the viewBox's units; a wide one is twice as wide, so text keeps its size
CHAR = 6.6  # the mean width of a character at FONT, to lay out the legend


class Series(NamedTuple):
    label: str
    points: list[tuple[float, float]]
    colour: str
    legend: bool = True  # False: a further piece of a series already in the legend
    stroke: float = 1.6  # wider to show beneath a series drawn later that may cover it


class Marker(NamedTuple):
    x: float
    title: str  # shown on hover
    colour: str
    tag: str = ""  # drawn above the plot; without one, a short tick on the x axis (many markers stay quiet)


def escape(text: object) -> str:
    """Text for HTML or SVG, quotes included."""
    return html.escape(str(text), quote=True)


def _split_at_gaps(
    points: list[tuple[float, float]], gaps: Sequence[tuple[float, float]], typical: float | None
) -> list[list[tuple[float, float]]]:
    """Pieces of a sorted line: cut where it crosses a gap (a time nothing ran) or where x jumps by more
    than 5x its usual spacing (a rank absent for a while): a line there would draw values never measured."""
    pieces = [[points[0]]]
    for a, b in itertools.pairwise(points):
        spans_gap = any(a[0] <= g0 + 1e-9 and b[0] >= g1 - 1e-9 for g0, g1 in gaps)
        if spans_gap or (typical is not None and b[0] - a[0] > 5 * typical):
            pieces.append([])
        pieces[-1].append(b)
    return pieces


def _typical_spacing(points: list[tuple[float, float]]) -> float | None:
    spacings = sorted(b[0] - a[0] for a, b in itertools.pairwise(points) if b[0] > a[0])
    return max(spacings[len(spacings) // 2], 1e-12) if len(spacings) >= 2 else None


def _spaced(positions: list[float], ticks: list[float]) -> set[float]:
    """The ticks whose labels fit without overlapping: on a log axis with a tick at every digit the
    labels crowd near each power of ten, so 1s go first, then 5s and 2s, then the rest where room is."""

    def rank(tick: float) -> int:
        digit = f"{tick:e}"[0]
        return {"1": 0, "5": 1, "2": 2}.get(digit, 3)

    kept: dict[float, float] = {}
    for position, tick in sorted(zip(positions, ticks, strict=True), key=lambda pt: rank(pt[1])):
        if all(abs(position - other) >= FONT + 2 for other in kept.values()):
            kept[tick] = position
    return set(kept)


def _axis(
    values: list[float],
    fixed: tuple[float, float] | None,
    log: bool = False,
    x: bool = False,
    integer: bool = False,
) -> tuple[float, float, list[float], list[str]]:
    """(start, end, ticks, labels) of an axis. A y axis ends at its outer ticks; an x axis ends where
    the data (or `fixed`) does, with its ticks inside when 4 to 8 fit there."""
    lo, hi = fixed or (min(values), max(values))
    if log:
        ticks, step = log_ticks(max(lo, 1e-30), max(hi, 1e-30))
        return ticks[0], ticks[-1], ticks, tick_labels(ticks, step)
    lo, hi = padded_range(lo, hi)
    ticks, step = nice_ticks(lo, hi, inside=x, integer=integer)
    return (
        min(lo, ticks[0]) if x else ticks[0],
        max(hi, ticks[-1]) if x else ticks[-1],
        ticks,
        tick_labels(ticks, step),
    )


def line_chart(title: str, series: Sequence[Series], x_label: str, y_label: str, **options: Any) -> str:
    """One chart as a <figure> whose <svg> scales to the container's width. Options: `log_y`, `x_range`
    and `y_range` (fixed axis ranges), `markers`, `gaps` (x intervals shaded, which no line crosses)
    with `gap_label`, `step_lines` (levels: a count held until the next point), `height`, and `wide`:
    across the page, twice as wide in the viewBox so that text keeps its size; it also carries a
    half-width drawing that a narrow window shows instead (CSS, no script)."""
    wide = options.pop("wide", False)
    drawing = _svg(title, series, x_label, y_label, width=WIDTH, **options)
    if not drawing:
        return (
            f'<figure class="chart"><figcaption>{escape(title)}</figcaption><p class="empty">no data</p>'
            + ("</figure>")
        )
    if not wide:
        return f'<figure class="chart">{drawing}</figure>'
    across = _svg(title, series, x_label, y_label, width=2 * WIDTH, **options).replace(
        "<svg ", '<svg class="across" ', 1
    )
    narrow = drawing.replace("<svg ", '<svg class="narrow" ', 1)
    return f'<figure class="chart wide">{across}{narrow}</figure>'


def _svg(
    title: str,
    series: Sequence[Series],
    x_label: str,
    y_label: str,
    *,
    width: int,
    log_y: bool = False,
    x_range: tuple[float, float] | None = None,
    y_range: tuple[float, float] | None = None,
    markers: Sequence[Marker] = (),
    gaps: Sequence[tuple[float, float]] = (),
    gap_label: str = "",
    step_lines: bool = False,
    height: int = 280,
) -> str:
    """The <svg> of a chart `width` units wide, or "" when there is nothing to draw."""
    finite = [
        Series(s.label, [(x, y) for x, y in s.points if math.isfinite(x) and math.isfinite(y)], *s[2:])
        for s in series
    ]
    if log_y:
        finite = [Series(s.label, [(x, y) for x, y in s.points if y > 0], *s[2:]) for s in finite]
    points = [p for s in finite for p in s.points]
    if not points:
        return ""
    marked = [m.x for m in markers if math.isfinite(m.x)]
    if x_range is not None and marked:  # a fault after the last log line still shows
        x_range = (min(x_range[0], *marked), max(x_range[1], *marked))
    x0, x1, x_ticks, x_text = _axis([x for x, _ in points] + marked, x_range, x=True)
    y_values = [y for _, y in points] + ([0.0] if step_lines else [])  # counts: from zero
    y0, y1, y_ticks, y_text = _axis(y_values, y_range, log=log_y, integer=step_lines)
    if log_y:
        y0, y1 = math.log10(y0), math.log10(y1)
    left, right, top, bottom = LEFT, width - RIGHT, TOP, height - BOTTOM
    entries = [s for s in finite if s.legend and s.points]
    legend_width = sum(CHAR * len(s.label) + 30 for s in entries)
    # Beside the title when both fit, else on a row of its own under it.
    row = 16 if 8 + (CHAR + 1) * len(title) + 24 + legend_width <= right else 34
    top += row - 16
    legend: list[str] = []
    legend_x: float = right
    for s in reversed(entries):
        legend_x -= CHAR * len(s.label) + 30
        legend.append(
            f'<rect x="{legend_x:.1f}" y="{row - 5}" width="16" height="3" fill="{s.colour}"/>'
            f'<text x="{legend_x + 20:.1f}" y="{row}">{escape(s.label)}</text>'
        )

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (right - left)

    def py(y: float) -> float:
        value = math.log10(y) if log_y else y
        return bottom - (value - y0) / (y1 - y0) * (bottom - top)

    parts = [
        f'<svg viewBox="0 0 {width} {height}" width="100%" role="img" '
        f'xmlns="http://www.w3.org/2000/svg" font-family="system-ui, sans-serif" font-size="{FONT}">',
        f"<title>{escape(title)}</title>",
        f'<text x="8" y="16" font-weight="600" font-size="{FONT + 2}">{escape(title)}</text>',
    ]
    for g0, g1 in gaps:
        a, b = max(px(g0), left), min(px(g1), right)
        if b > a:
            parts.append(
                f'<rect x="{a:.1f}" y="{top}" width="{b - a:.1f}" height="{bottom - top}" fill="{GAP_FILL}">'
                f"<title>{escape(gap_label)}: {g1 - g0:.1f} s</title></rect>"
            )
            if gap_label and b - a > 8 * len(gap_label):
                parts.append(
                    f'<text x="{(a + b) / 2:.1f}" y="{top + 14}" text-anchor="middle" fill="#777">'
                    f"{escape(gap_label)}</text>"
                )
    labelled = _spaced([py(t) for t in y_ticks], y_ticks)
    for tick, text in zip(y_ticks, y_text, strict=True):
        y = py(tick)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#e3e3e3"/>')
        if tick in labelled:
            parts.append(
                f'<text class="y-tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{text}</text>'
            )
    for tick, text in zip(x_ticks, x_text, strict=True):
        x = px(tick)
        parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#eee"/>')
        parts.append(f'<text class="x-tick" x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{text}</text>')
    parts += [
        f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" '
        'stroke="#aaa"/>',
        f'<text x="{(left + right) / 2}" y="{height - 8}" text-anchor="middle">{escape(x_label)}</text>',
        f'<text transform="translate(16 {(top + bottom) / 2}) rotate(-90)" text-anchor="middle">'
        f"{escape(y_label + (' (log scale)' if log_y else ''))}</text>",
    ]
    for marker in markers:
        x = px(marker.x)
        if marker.tag:
            parts.append(
                f'<g><title>{escape(marker.title)}</title><line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" '
                f'y2="{bottom}" stroke="{marker.colour}" stroke-dasharray="4,3"/><text x="{x:.1f}" '
                f'y="{top - 3}" text-anchor="middle" fill="{marker.colour}" font-size="{FONT - 1}">'
                f"{escape(marker.tag)}</text></g>"
            )
        else:
            parts.append(
                f'<line x1="{x:.1f}" y1="{bottom - 10}" x2="{x:.1f}" y2="{bottom}" stroke="{marker.colour}" '
                f'stroke-width="2.5"><title>{escape(marker.title)}</title></line>'
            )
    parts += legend
    for s in finite:
        parts += _draw_series(s, px, py, gaps, step_lines)
    parts.append("</svg>")
    return "".join(parts)


def _draw_series(
    s: Series,
    px: Callable[[float], float],
    py: Callable[[float], float],
    gaps: Sequence[tuple[float, float]],
    step_lines: bool,
) -> list[str]:
    if not s.points:
        return []
    points = sorted(s.points)
    if step_lines:  # a level holds until the next point
        points = [q for a, b in itertools.pairwise(points) for q in (a, (b[0], a[1]))] + [points[-1]]
    # Where the gaps are known (time axes), only they cut a line: a few slow steps are not an absence.
    pieces = _split_at_gaps(points, gaps, None if step_lines or gaps else _typical_spacing(points))
    parts = []
    for piece in pieces:
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in piece)
        parts.append(
            f'<polyline fill="none" stroke="{s.colour}" stroke-width="{s.stroke}" points="{coords}">'
            f"<title>{escape(s.label)}</title></polyline>"
        )
    if len(s.points) <= 30 and not step_lines:  # few points (evaluations): dots, so that a single one shows
        parts += [
            f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="{3 + (s.stroke - 1.6) / 2:.1f}" fill="{s.colour}">'
            f"<title>{escape(s.label)}: {y:.4g} at {x:g}</title></circle>"
            for x, y in s.points
        ]
    else:
        parts += [
            f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2" fill="{s.colour}"/>'
            for piece in pieces
            if len(piece) == 1
            for x, y in piece
        ]
    return parts
