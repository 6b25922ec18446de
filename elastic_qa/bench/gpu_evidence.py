"""What the gpu check reads back from one case's run: figures and pass/fail checks (see bench/gpu.py).

Everything comes from what the run left on disk (rank 0's log events, the sample ledger, the resumed
checkpoint) and the time of the kill, never from the harness's memory of what it did.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from elastic_qa.chaos.evidence import check_ledger, checkpoint_store, run_config
from elastic_qa.checkpoint.payload import TRAINER_FILE
from elastic_qa.checkpoint.store import step_dir_name
from elastic_qa.models import family_for
from elastic_qa.observe.events import (
    CheckpointCommittedRecord,
    Event,
    ResumeRecord,
    StepProgressRecord,
    StepRecord,
    TrainDoneRecord,
    WorkerStartRecord,
    records,
)
from elastic_qa.observe.follow import read_events
from elastic_qa.observe.ledger import read_ledger
from elastic_qa.prep import prepare

SKIP = 0.2  # share of a worker's logged steps dropped as warm-up before its steps/s


def steps_per_s(steps: Sequence[Mapping[str, Any]]) -> float | None:
    """Steps/s between the first logged step past the warm-up share and the last one (None: too few)."""
    steps = steps[int(len(steps) * SKIP) :]
    if len(steps) < 2 or steps[-1]["ts"] <= steps[0]["ts"]:
        return None
    return (steps[-1]["step"] - steps[0]["step"]) / (steps[-1]["ts"] - steps[0]["ts"])


class Checks:
    """Named pass/fail checks of one case, in the order they were made."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def __call__(self, name: str, ok: bool, detail: str = "") -> bool:
        self.rows.append({"check": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if not row["ok"]]


def analyse(run_dir: Path, kill: dict[str, Any], cuda: bool, precision: str, steps: int) -> dict[str, Any]:
    """The case's figures and checks, from its logs, ledger and checkpoints."""
    check = Checks()
    check("the job ended with exit code 0", kill["exit_code"] == 0, f"exit code {kill['exit_code']}")
    killed_pid, killed = kill["killed_pid"], kill["killed_ts"]
    events = [e for e in read_events(run_dir) if e.get("rank") == 0]
    old = [e for e in events if e.get("pid") == killed_pid]
    new = [e for e in events if e.get("pid") != killed_pid and e.get("ts", 0) >= killed]

    def of(rows: list[dict[str, Any]], name: Event) -> list[dict[str, Any]]:
        return [e for e in rows if e.get("event") == name]

    starts = records(events, WorkerStartRecord)
    restarted = records(new, WorkerStartRecord)
    check("one worker before the kill, one after", len(starts) == 2 and len(restarted) == 1)
    backend, device = ("nccl", "cuda") if cuda else ("gloo", "cpu")
    for number, start in enumerate(starts, start=1):
        check(
            f"worker {number} of {len(starts)} ran on {backend}, {device}",
            start.get("backend") == backend and str(start.get("device", "")).startswith(device),
            f"backend {start.get('backend')}, device {start.get('device')}",
        )
    commits = [e for e in records(events, CheckpointCommittedRecord) if e.get("reason") == "periodic"]
    committed_before = [e["step"] for e in commits if e.get("pid") == killed_pid and e["ts"] <= killed]
    check("a checkpoint was committed before the kill", bool(committed_before))
    resume = records(new, ResumeRecord)
    resumed = resume[0]["step"] if resume else None
    check("the new worker resumed from a checkpoint", resumed is not None, "it started fresh")
    attempt = next((e.get("attempt") for e in records(old, WorkerStartRecord)), None)
    reached = max((r["step"] for r in read_ledger(run_dir) if r["attempt"] == attempt), default=None)
    if resumed is not None and committed_before and reached is not None:
        check(
            "it resumed from the newest checkpoint committed before the kill",
            max(committed_before) <= resumed <= reached,
            f"resumed at {resumed}; newest committed before the kill {max(committed_before)}; "
            f"the killed worker reached step {reached}",
        )
    losses = [e["loss"] for e in records(events, StepRecord)]
    check(
        "every logged loss is finite",
        bool(losses) and all(math.isfinite(x) for x in losses),
        f"{losses[-3:]}",
    )
    done = records(new, TrainDoneRecord)
    check("training reached the last step", bool(done) and done[-1].get("step") == steps)
    cfg = run_config(run_dir)
    ledger = check_ledger(run_dir, cfg, len(prepare(cfg, family_for(cfg.model)).train))
    check("each sample was used exactly once per epoch", ledger.ok, "; ".join(ledger.problems[:3]))
    scaler = {}
    if precision == "fp16" and resume:
        saved = cast(Mapping[str, Any], resume[0]).get("grad_scaler")  # a field no record names
        scaler = scaler_restored(cfg, resume[0]["step"], saved, check)
    new_steps = records(new, StepProgressRecord)
    stall = [e["blocking_seconds"] for e in commits]
    breakdowns = of(events, Event.STEP_BREAKDOWN)
    memory = [e["peak_memory_mb"] for e in breakdowns if "peak_memory_mb" in e]
    return {
        "steps_per_s_before_kill": steps_per_s(records(old, StepProgressRecord)),
        "steps_per_s_after_resume": steps_per_s(new_steps),
        "async_saves": len(stall),
        "async_stall_ms": summary_ms(stall),
        "async_save_total_ms": summary_ms([e["seconds"] for e in commits]),
        "saves_that_waited_for_the_previous": len(of(events, Event.CHECKPOINT_WAIT)),
        "peak_memory_mb": max(memory) if memory else None,
        # Where the step time goes, as rank 0's step_breakdown events say (medians over the run).
        "data_share": _median([e["data_share"] for e in breakdowns if "data_share" in e]),
        "comm_share": _median([e["comm_share"] for e in breakdowns if "comm_share" in e]),
        "resumed_step": resumed,
        "killed_worker_reached_step": reached,
        "steps_trained_again": reached - resumed if reached is not None and resumed is not None else None,
        "kill_to_worker_start_s": _after(of(new, Event.WORKER_START), killed),
        "kill_to_resume_s": _after(resume, killed),
        "kill_to_first_step_s": _after(new_steps, killed),
        "em": done[-1].get("em") if done else None,
        "f1": done[-1].get("f1") if done else None,
        **scaler,
        "checks": check.rows,
        "failures": [row["check"] + (f" ({row['detail']})" if row["detail"] else "") for row in check.failed],
    }


def scaler_restored(cfg: Any, step: int, restored: Any, check: Checks) -> dict[str, Any]:
    """Compare the GradScaler state in the checkpoint of `step` with what the new worker logged."""
    store = checkpoint_store(cfg)
    path = store.path(step_dir_name(step))
    saved = store.load_file(path, store.read_manifest(path), TRAINER_FILE).get("grad_scaler") or {}
    keys = ("scale", "_growth_tracker")
    check("the checkpoint holds the GradScaler state", all(k in saved for k in keys), f"{saved}")
    same = isinstance(restored, dict) and all(restored.get(k) == saved.get(k) for k in keys)
    check("the new worker's GradScaler state is the saved one", same, f"saved {saved}, restored {restored}")
    return {"grad_scaler_saved": saved, "grad_scaler_restored": restored}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary_ms(seconds: list[float]) -> dict[str, Any] | None:
    if not seconds:
        return None
    ms = [s * 1000 for s in seconds]
    return {"median": statistics.median(ms), "max": max(ms), "values": ms}


def _after(rows: Sequence[Mapping[str, Any]], since: float) -> float | None:
    return round(rows[0]["ts"] - since, 3) if rows else None
