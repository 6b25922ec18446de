"""Render a run into one self-contained HTML page (inline SVG and CSS, no scripts, no network).

The page opens with a summary (result, steps, wall time, world sizes, restarts, checkpoints, key config),
then charts: loss per rank, world size over time (shaded where no worker ran, with checkpoint commits and
fault markers), evaluation, learning rate, gradient norm, samples/s; then one row per attempt.
`elastic-qa report RUN_DIR` and the chaos verifier (which puts its verdict on top) both use it.
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_qa.observe.events import Event
from elastic_qa.observe.follow import read_events
from elastic_qa.report.charts import Marker, Series, line_chart
from elastic_qa.report.charts import escape as _esc
from elastic_qa.report.summary import attempts, duration, idle_gaps, read_config, run_summary

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
FAULT_TAGS_UP_TO = 20  # more faults (or regroups) than this are marked by ticks alone (tags would overlap)

STYLE = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;padding:20px 28px;
 color:#1d2330;background:#f7f8fa}
h1{font-size:22px;margin:0 0 2px} h2{font-size:17px;margin:26px 0 10px}
.sub{color:#5d6475;margin:0 0 16px;overflow-wrap:anywhere}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(165px,1fr));gap:12px}
.card{background:#fff;border:1px solid #e1e4e8;border-radius:8px;padding:10px 14px}
.k{font-size:12px;text-transform:uppercase;letter-spacing:.04em;color:#5d6475}
.v{font-size:20px;font-weight:600;margin-top:2px;overflow-wrap:anywhere}
.s{font-size:13px;color:#5d6475}
.badge{display:inline-block;padding:1px 10px;border-radius:12px;font-weight:600;font-size:14px;
 vertical-align:middle}
.ok{background:#e2f3e6;color:#17692f} .fail{background:#fbe3e3;color:#a11d1d}
.warn{background:#fff2d4;color:#875800} .muted{color:#5d6475}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:14px}
.chart{margin:0;background:#fff;border:1px solid #e1e4e8;border-radius:8px;padding:6px}
.chart.wide{grid-column:1/-1} .chart svg{display:block} .chart svg.narrow{display:none}
@media (max-width:1110px){.chart svg.across{display:none} .chart svg.narrow{display:block}}
.empty{color:#5d6475;margin:8px}
table{border-collapse:collapse;background:#fff;width:100%;border:1px solid #e1e4e8}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid #e8eaee;vertical-align:top}
th{font-size:12px;text-transform:uppercase;letter-spacing:.03em;color:#5d6475;background:#f1f3f6}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.config th{width:11em;white-space:nowrap} tr.bad td{background:#fff5f5}
ul.plain{margin:0;padding-left:18px} td.name{white-space:nowrap}
details{margin-top:10px} summary{cursor:pointer;color:#1f5fa8;margin-bottom:8px}
"""


def _latest_per_step(rows: list[dict], field: str) -> list[tuple[float, float]]:
    """(step, value) of the last time each step ran: a replayed step shows what training kept."""
    by_step = {row["step"]: row[field] for row in rows if field in row and isinstance(row.get("step"), int)}
    return sorted(by_step.items())


def _per_rank(events: list[dict], field: str) -> dict[int, list[tuple[float, float]]]:
    rows: dict[int, list[dict]] = defaultdict(list)
    for row in events:
        if row.get("event") == Event.STEP:
            rows[row.get("rank", 0)].append(row)
    return {rank: _latest_per_step(rank_rows, field) for rank, rank_rows in sorted(rows.items())}


def _card(key: str, value: str, small: str = "") -> str:
    small_html = f'<div class="s">{small}</div>' if small else ""
    return f'<div class="card"><div class="k">{key}</div><div class="v">{value}</div>{small_html}</div>'


def summary_html(facts: dict[str, Any]) -> str:
    """The summary cards and the key config, as HTML (every value escaped)."""
    result = facts["result"]
    if result is None:
        outcome = _card("Final EM / F1 (%)", "—", "no evaluation ran")
    else:
        where = f"at step {result['step']}" + ("" if facts["result_is_final"] else " (last evaluation)")
        loss = f"eval loss {result['loss']:.4g} " if isinstance(result.get("loss"), float) else ""
        scores = f"{100 * result['em']:.1f} / {100 * result['f1']:.1f}"
        outcome = _card("Final EM / F1 (%)", scores, loss + where)
    status = (
        '<span class="badge ok">finished</span>'
        if facts["finished"]
        else ('<span class="badge warn">not finished</span>')
    )
    of = f" of {facts['max_steps']}" if facts["max_steps"] else ""
    sequence = facts["world_sizes"]
    worlds = (
        " → ".join(str(w) for w in sequence)
        if len(sequence) <= 5
        else ", ".join(str(w) for w in sorted(set(sequence)))
    )
    idle = f"no worker ran for {duration(facts['idle_s'])} in all" if facts["idle_s"] else "no pause"
    last = facts["last_checkpoint"]
    plural = "" if facts["attempts"] == 1 else "s"
    speed = facts["samples_per_s"]
    started = _esc(facts["started"].replace("T", " ").rstrip("Z")[:19] + " UTC") if facts["started"] else ""
    cards = [
        outcome,
        _card("Steps", f"{facts['step']}{of}", status),
        _card("Wall time", duration(facts["wall_s"]), f"started {started}" if started else ""),
        _card("World sizes", _esc(worlds or "—"), f"{facts['attempts']} attempt{plural}"),
        _card("Restarts", str(facts["restarts"]), idle),
        _card("Checkpoints", str(facts["checkpoints"]), f"last at step {last}" if last is not None else ""),
        _card("Samples/s", f"{speed:.0f}" if speed else "—", "median of rank 0's log lines"),
    ]
    config = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in facts["config"])
    config_html = f'<h2>Configuration</h2><table class="config">{config}</table>' if config else ""
    return f'<div class="cards">{"".join(cards)}</div>{config_html}'


def charts_html(
    events: list[dict], config: dict, reference_dir: Path | None, faults: Sequence[dict[str, Any]]
) -> list[str]:
    """The report's charts, each a <figure> of inline SVG (every label escaped); `events` in time order."""
    t0, end = events[0]["ts"], events[-1]["ts"] - events[0]["ts"]
    runs = attempts(events, t0)
    gaps = idle_gaps(runs, end)
    max_steps = (
        (config.get("train") or {}).get("max_steps") if isinstance(config.get("train"), dict) else None
    )
    steps = [r["step"] for r in events if r.get("event") == Event.STEP and isinstance(r.get("step"), int)]
    step_range = (0.0, float(max([*steps, max_steps or 0, 1])))
    rank0 = [r for r in events if r.get("event") == Event.STEP and r.get("rank") == 0]

    loss = []
    if reference_dir is not None:  # first and wide, so that a run that matches it shows on top of it
        reference = [
            r for r in read_events(Path(reference_dir)) if r.get("event") == Event.STEP and r.get("rank") == 0
        ]
        loss.append(Series("fault-free reference", _latest_per_step(reference, "loss"), "#c8c8c8", stroke=5))
    loss += [
        Series(f"rank {rank}", pts, COLOURS[rank % len(COLOURS)])
        for rank, pts in _per_rank(events, "rank_loss").items()
    ]
    loss.append(Series("global (all-reduced)", _latest_per_step(rank0, "loss"), "#222"))
    resumes = [
        Marker(run.first_step, f"attempt {run.attempt} started at step {run.first_step}", "#888")
        for run in runs
        if run.first_step
    ]
    charts = [
        line_chart(
            "Loss per rank (ranks are renumbered at each restart)",
            loss,
            "step",
            "loss",
            log_y=True,
            x_range=step_range,
            markers=resumes,
            wide=True,
            height=340,
        )
    ]

    tagged = len(faults) <= FAULT_TAGS_UP_TO
    markers = [
        Marker(
            r["ts"] - t0, f"checkpoint of step {r.get('step')} committed ({r.get('reason', '')})", "#2ca02c"
        )
        for r in events
        if r.get("event") == Event.CHECKPOINT_COMMITTED
    ]
    markers += [
        Marker(
            f["ts"] - t0,
            f"fault {i}: {f['fault']} {f.get('target', '')}",
            "#d62728",
            str(i) if tagged else "",
        )
        for i, f in enumerate(faults, start=1)
        if isinstance(f.get("ts"), (int, float)) and not f.get("skipped")
    ]
    markers += [
        Marker(
            run.start,
            f"attempt {run.attempt} started with {run.world_size} worker{'' if run.world_size == 1 else 's'}"
            " (a regroup)",
            "#666",
            "↻" if len(runs) <= FAULT_TAGS_UP_TO else "",
        )
        for run in runs[1:]
    ]
    world = [
        Series("world size", [(run.start, run.world_size), (run.end, run.world_size)], "#222", i == 0, 2.2)
        for i, run in enumerate(r for r in runs if r.world_size)
    ]
    title = "World size over time (↻ a regroup; green ticks: checkpoint commits" + (
        ", red: faults)" if faults else ")"
    )
    charts.append(
        line_chart(
            title,
            world,
            "seconds since the run started",
            "workers",
            x_range=(0.0, end),
            y_range=(0.0, max((run.world_size for run in runs), default=0) + 1.0),
            markers=markers,
            gaps=gaps,
            gap_label="no worker",
            step_lines=True,
            wide=True,
            height=250,
        )
    )
    evals = [r for r in events if r.get("event") == Event.EVAL and "em" in r]
    charts.append(
        line_chart(
            "Evaluation",
            [
                Series("EM", _latest_per_step(evals, "em"), COLOURS[0], stroke=4.5),
                Series("F1", _latest_per_step(evals, "f1"), COLOURS[3]),
            ],
            "step",
            "score (1 = every answer right)",
            x_range=step_range,
            y_range=(0.0, 1.0),
        )
    )
    charts.append(
        line_chart(
            "Learning rate",
            [Series("lr", _latest_per_step(rank0, "lr"), COLOURS[0])],
            "step",
            "learning rate",
            x_range=step_range,
        )
    )
    norms = [
        Series(f"rank {rank}", pts, COLOURS[rank % len(COLOURS)])
        for rank, pts in _per_rank(events, "grad_norm").items()
    ]
    charts.append(
        line_chart(
            "Gradient norm (of the all-reduced gradient: ranks agree unless one diverged)",
            norms,
            "step",
            "gradient norm",
            log_y=True,
            x_range=step_range,
        )
    )
    speed = [(r["ts"] - t0, r["samples_per_s"]) for r in rank0 if r.get("samples_per_s")]
    charts.append(
        line_chart(
            "Throughput",
            [Series("samples/s", speed, COLOURS[2])],
            "seconds since the run started",
            "samples/s (all ranks)",
            x_range=(0.0, end),
            gaps=gaps,
            gap_label="no worker",
        )
    )
    return charts


def attempts_html(events: list[dict]) -> str:
    """The attempts table, as HTML (every value escaped)."""
    rows = []
    for run in attempts(events, events[0]["ts"]):
        first = "—" if run.first_step is None else run.first_step
        last = "—" if run.last_step is None else run.last_step
        rows.append(
            f"<tr><td class='n'>{run.attempt}</td><td class='n'>{run.world_size}</td>"
            f"<td class='n'>{run.start:.1f}</td><td class='n'>{run.end:.1f}</td>"
            f"<td class='n'>{first}</td><td class='n'>{last}</td><td>{_esc(run.ending)}</td></tr>"
        )
    head = (
        "<tr><th>attempt</th><th>world size</th><th>first line (s)</th><th>last line (s)</th>"
        "<th>from step</th><th>last logged step</th><th>how it ended</th></tr>"
    )
    return f"<h2>Attempts</h2><table>{head}{''.join(rows)}</table>"


def render_report(
    run_dir: Path,
    out: Path | None = None,
    reference_dir: Path | None = None,
    faults: Sequence[dict[str, Any]] = (),
    header_html: str = "",
    title: str = "Run report",
) -> Path:
    """Write the page (default <run_dir>/report.html) and return its path. `header_html` (already
    escaped HTML, e.g. the chaos verdict) goes above the run's own summary."""
    run_dir = Path(run_dir)
    events = [e for e in read_events(run_dir) if isinstance(e.get("ts"), (int, float))]
    if not events:
        raise FileNotFoundError(f"{run_dir}/logs holds no log lines")
    config = read_config(run_dir)
    made = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    heading = f"{title}: {run_dir.resolve().name}"
    body = [
        f"<h1>{_esc(heading)}</h1>",
        f'<p class="sub">{_esc(run_dir.resolve())} · rendered {made}</p>',
        header_html,
        "<h2>Run</h2>" if header_html else "",
        summary_html(run_summary(events, config)),
        "<h2>Charts</h2>",
        '<div class="charts">',
        *charts_html(events, config, reference_dir, faults),
        "</div>",
        attempts_html(events),
    ]
    page = (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{_esc(heading)}</title><style>{STYLE}</style></head><body>{''.join(body)}</body></html>"
    )
    out = out or run_dir / "report.html"
    out.write_text(page, encoding="utf-8")
    return out
