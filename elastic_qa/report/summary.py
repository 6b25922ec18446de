"""What a run did, in a few facts: its attempts (when each ran, at which world size, how it ended), the
gaps when no worker ran, and the summary a report opens with (result, steps, wall time, restarts, ...).
All read from the run's logs and its config.yaml; nothing here needs the checkpoints.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from elastic_qa.observe.events import (
    CheckpointCommittedRecord,
    EvalRecord,
    Event,
    TrainDoneRecord,
    TrainStartRecord,
    records,
)

# The last words an attempt can leave, most telling first; none of them means it was killed outright.
_ENDINGS = {
    "train_done": "finished",
    "bad_input": "bad input",
    "worker_crash": "crashed",
    "checkpoint_fenced": "fenced (a newer attempt had registered)",
    "agent_lost": "its agent was lost",
    "peer_failure": "a peer failed",
    "stopping": "stopped by a signal, after saving",
}
MIN_GAP_S = 0.5  # shorter pauses between attempts are not worth shading


@dataclass
class Attempt:
    attempt: int
    world_size: int
    start: float  # seconds since the run's first log line
    end: float  # the attempt's last log line: its last sign of life
    first_step: int | None
    last_step: int | None
    ending: str


def attempts(events: list[dict[str, Any]], t0: float) -> list[Attempt]:
    """One entry per attempt number, in start order."""
    by_attempt: dict[int, list[dict]] = {}
    for row in events:
        if isinstance(row.get("attempt"), int):
            by_attempt.setdefault(row["attempt"], []).append(row)
    found = []
    for number, rows in by_attempt.items():
        starts = [r for r in rows if r.get("event") == Event.WORKER_START]
        steps = [r["step"] for r in rows if r.get("event") == Event.STEP and isinstance(r.get("step"), int)]
        resumed = [
            r["step"] for r in rows if r.get("event") == Event.RESUME and isinstance(r.get("step"), int)
        ]
        names = {r.get("event") for r in rows}
        ending = next((text for name, text in _ENDINGS.items() if name in names), "no last word (killed?)")
        world = max((r.get("world_size") or 0 for r in starts or rows), default=0)
        found.append(
            Attempt(
                attempt=number,
                world_size=world,
                start=min(r["ts"] for r in rows) - t0,
                end=max(r["ts"] for r in rows) - t0,
                first_step=min(resumed) if resumed else (0 if "start_fresh" in names else None),
                last_step=max(steps, default=None),
                ending=ending,
            )
        )
    return sorted(found, key=lambda a: a.start)


def idle_gaps(runs: list[Attempt], end: float) -> list[tuple[float, float]]:
    """The stretches between 0 and `end` (seconds) when no attempt was running."""
    gaps, covered = [], 0.0
    for run in runs:
        if run.start - covered > MIN_GAP_S:
            gaps.append((covered, run.start))
        covered = max(covered, run.end)
    if runs and end - covered > MIN_GAP_S:
        gaps.append((covered, end))
    return gaps


def read_config(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config (config.yaml), or {} when it is missing or unreadable."""
    try:
        config = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


def duration(seconds: float) -> str:
    """12.3 s, 4 min 05 s, 2 h 03 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _section(config: dict, name: str) -> dict:
    value = config.get(name)
    return value if isinstance(value, dict) else {}


def key_config(config: dict[str, Any]) -> list[tuple[str, str]]:
    """The settings that shape a run, as (name, value) text pairs."""
    data, model, train = _section(config, "data"), _section(config, "model"), _section(config, "train")
    ckpt = _section(config, "checkpoint")
    rows = []
    if data:
        source = data.get("source", "?")
        if source == "synthetic":
            synthetic = data.get("synthetic") or {}
            source = (
                f"synthetic, {synthetic.get('train_examples', '?')} train / "
                f"{synthetic.get('eval_examples', '?')} eval examples"
            )
        rows.append(("data", str(source)))
    if model:
        shape = ", ".join(f"{k} {model[k]}" for k in ("d_model", "n_layers", "n_heads") if k in model)
        kind = str(model.get("kind", ""))
        rows.append(("model", f"{kind} ({shape})" if kind and shape else kind or shape))
    if train:
        if train.get("epochs"):  # train.max_steps is 0 then: the steps are in train_start (run_length.py)
            rows.append(("epochs", str(train["epochs"])))
        else:
            rows.append(("max steps", str(train.get("max_steps", "?"))))
        rows.append(
            (
                "batch",
                f"{train.get('global_batch_size', '?')} global, {train.get('micro_batch_size', '?')} micro",
            )
        )
        rows.append(
            ("learning rate", f"{train.get('lr', '?')}, warm-up {train.get('warmup_steps', '?')} steps")
        )
        rows.append(("precision", str(train.get("precision", "?"))))
    if ckpt:
        when = [f"every {ckpt['interval']}" if ckpt.get("interval") else ""]
        when.append(f"every {ckpt['every_steps']} steps" if ckpt.get("every_steps") else "")
        keep = f"keep last {ckpt.get('keep_last', '?')}"
        rows.append(("checkpoints", ", ".join([w for w in when if w] + [keep])))
    return rows


def run_summary(events: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """The facts a report opens with (plain values; the page formats them)."""
    t0, t_end = events[0]["ts"], events[-1]["ts"]
    runs = attempts(events, t0)
    steps = [r for r in events if r.get("event") == Event.STEP]
    done = [r for r in events if r.get("event") == Event.TRAIN_DONE]
    evals = [r for r in records(events, EvalRecord) if "em" in r]
    commits = records(events, CheckpointCommittedRecord)
    max_steps = _section(config, "train").get("max_steps") or next(
        (r["max_steps"] for r in records(events, TrainStartRecord)), None
    )
    final = next((r for r in reversed(records(done, TrainDoneRecord)) if "em" in r), None)
    result = None
    if final is not None:
        result = {"em": final["em"], "f1": final["f1"], "loss": final.get("eval_loss"), "step": final["step"]}
    elif evals:
        last = evals[-1]
        result = {"em": last["em"], "f1": last["f1"], "loss": last.get("loss"), "step": last["step"]}
    worlds: list[int] = []
    for run in runs:
        if run.world_size and (not worlds or worlds[-1] != run.world_size):
            worlds.append(run.world_size)
    throughput = [r["samples_per_s"] for r in steps if r.get("rank") == 0 and r.get("samples_per_s")]
    gaps = idle_gaps(runs, t_end - t0)
    return {
        "finished": bool(done),
        "result": result,
        "result_is_final": final is not None,
        "step": max([r["step"] for r in steps + done if isinstance(r.get("step"), int)], default=0),
        "max_steps": max_steps,
        "wall_s": t_end - t0,
        "started": events[0].get("time", ""),
        "world_sizes": worlds,
        "attempts": len(runs),
        "restarts": max(len(runs) - 1, 0),
        "idle_s": sum(b - a for a, b in gaps),
        "checkpoints": len(commits),
        "last_checkpoint": max((r["step"] for r in commits), default=None),
        "samples_per_s": statistics.median(throughput) if throughput else None,
        "config": key_config(config),
    }
