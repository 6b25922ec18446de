"""The verdict: from a run's logs, ledger, checkpoints and fault records, did recovery lose anything?

Checks (exit code 0 only when all hold):
1. the job completed train.max_steps;
2. the effective training order (per step, the highest attempt that ran it) is exactly the planned global
   order: no step missing, each sample used exactly once per epoch;
3. every committed checkpoint verifies (except ones a fault corrupted on purpose, which must never have
   been resumed from), and no more are retained than keep_last + milestones;
4. lost work per fault within its bound: 0 for term-node/join-node and faults that need no restart, <= 1
   step for a kill or freeze that leaves survivors, and no older than the newest valid checkpoint when no
   rank survives; recovery time (fault -> first completed step of the new group) reported per fault;
5. the outcome matches a fault-free reference run: bitwise when every attempt ran at the reference's world
   size, else within 1e-4 relative (runs up to 500 steps), else eval loss within 1% and EM/F1 within 1 point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.evidence import (
    attempts,
    check_checkpoints,
    check_ledger,
    final_parameters,
    load_config,
    load_events,
    parameter_difference,
)
from chaos.schedule import ZERO_LOSS, restarts_group
from elastic_qa.data.cache import prepare

SHORT_RUN_STEPS = 500


@dataclass
class Verdict:
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: Any) -> None:
        self.checks[name] = {"ok": bool(ok), "detail": detail}

    @property
    def ok(self) -> bool:
        # A skipped fault (nothing to hit, or the job had ended) is reported, not held against the run.
        return all(c["ok"] for c in self.checks.values()) and all(f["verdict"] != "FAIL" for f in self.faults)


def read_faults(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "chaos" / "faults.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def corrupted_steps(faults: list[dict]) -> set[int]:
    return {
        f["checkpoint_step"] for f in faults if f["fault"] == "corrupt-checkpoint" and "checkpoint_step" in f
    }


def resumed_from_corrupted(events: list[dict], faults: list[dict]) -> list[int]:
    """Steps resumed from while their checkpoint was the copy a fault corrupted (no newer commit of the
    same step in between: a replayed run may legitimately commit that step again)."""
    corruptions = [(f["ts"], f["checkpoint_step"]) for f in faults if "checkpoint_step" in f]
    bad = []
    for resume in (e for e in events if e.get("event") == "resume" and e.get("rank") == 0):
        step, at = resume["step"], resume["ts"]
        corrupted_at = max((ts for ts, s in corruptions if s == step and ts < at), default=None)
        if corrupted_at is None:
            continue
        recommitted = any(e["step"] == step and corrupted_at < e["ts"] < at for e in _committed(events))
        if not recommitted:
            bad.append(step)
    return bad


def _committed(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("event") == "checkpoint_committed"]


def judge_faults(events: list[dict], faults: list[dict], dist_timeout_s: float) -> list[dict[str, Any]]:
    """One row per injected fault: the restart it caused (if any), lost steps, recovery seconds."""
    runs = attempts(events)
    corrupted = corrupted_steps(faults)
    claimed: set[int] = set()
    rows = []
    for fault in faults:
        row = {
            "fault": fault["fault"],
            "step": fault.get("step"),
            "ts": fault.get("ts"),
            "lost": 0,
            "recovery_s": None,
            "verdict": "ok",
            "note": "",
        }
        if fault.get("skipped"):
            row.update(verdict="skipped", note=fault["skipped"])
            rows.append(row)
            continue
        expects_restart = restarts_group(fault["fault"], fault.get("thaw_after_s"), dist_timeout_s)
        if not expects_restart:
            rows.append(row)
            continue
        later = [a for a in runs if a["start"] > fault["ts"] and a["attempt"] not in claimed]
        if not later:
            row.update(verdict="FAIL", note="no restart after the fault")
            rows.append(row)
            continue
        new = later[0]
        claimed.add(new["attempt"])
        before = [a for a in runs if a["start"] < new["start"]]
        completed = max([a["last_step"] for a in before] + [a["resumed_step"] for a in before] + [0])
        row["lost"] = max(0, completed - new["resumed_step"])
        if new["first_step_ts"] is not None:
            row["recovery_s"] = round(new["first_step_ts"] - fault["ts"], 2)
        previous = before[-1] if before else None
        survivors = previous is not None and (previous["world_size"] or 0) > 1
        storage_down = any(
            f["fault"] == "storage-errors"
            and f["ts"] <= new["start"]
            and fault["ts"] <= f["ts"] + f["fail_for_s"]
            for f in faults
            if "fail_for_s" in f
        )
        if fault["fault"] in ZERO_LOSS:
            bound, why = 0, "graceful: the last completed step is committed before leaving"
        elif survivors and not storage_down:
            bound, why = 1, "survivors commit the last completed step"
        else:
            valid = [
                e["step"] for e in _committed(events) if e["ts"] < new["start"] and e["step"] not in corrupted
            ]
            bound = completed - max(valid, default=0)
            why = "no survivor could save: back to the newest valid checkpoint"
        row["bound"] = bound
        if row["lost"] > bound:
            row.update(verdict="FAIL", note=f"lost {row['lost']} steps, bound {bound} ({why})")
        rows.append(row)
    return rows


def _reference_comparison(cfg, events, reference_dir: Path | None) -> tuple[bool, dict[str, Any]]:
    if reference_dir is None:
        return True, {"skipped": "no reference run"}
    ref_cfg = load_config(reference_dir)
    mine, ref = final_parameters(cfg), final_parameters(ref_cfg)
    if mine is None or ref is None:
        return False, {"error": "a final checkpoint is missing"}
    diff = parameter_difference(mine[1], ref[1])
    ref_world = {a["world_size"] for a in attempts(load_events(reference_dir))}
    worlds = {a["world_size"] for a in attempts(events) if a["world_size"]}
    detail = {**diff, "world_sizes": sorted(worlds), "reference_world_sizes": sorted(ref_world)}
    if worlds == ref_world and len(ref_world) == 1:
        detail["rule"] = "bitwise (every attempt at the reference's world size)"
        return diff["bitwise_equal"], detail
    if cfg.train.max_steps <= SHORT_RUN_STEPS:
        detail["rule"] = "relative parameter difference < 1e-4"
        return diff["relative"] < 1e-4, detail
    done = [e for e in events if e.get("event") == "train_done" and "em" in e]
    ref_done = [e for e in load_events(reference_dir) if e.get("event") == "train_done" and "em" in e]
    if not done or not ref_done:
        return False, {**detail, "error": "final evaluation missing"}
    a, b = done[-1], ref_done[-1]
    detail.update(
        rule="eval loss within 1%, EM/F1 within 1 point",
        eval_loss=a["eval_loss"],
        reference_eval_loss=b["eval_loss"],
        em=a["em"],
        reference_em=b["em"],
    )
    ok = (
        abs(a["eval_loss"] - b["eval_loss"]) <= 0.01 * abs(b["eval_loss"])
        and abs(a["em"] - b["em"]) <= 0.01
        and abs(a["f1"] - b["f1"]) <= 0.01
    )
    return ok, detail


def verify_run(run_dir: Path, reference_dir: Path | None = None) -> Verdict:
    run_dir = Path(run_dir)
    cfg = load_config(run_dir)
    events = load_events(run_dir)
    faults = read_faults(run_dir)
    verdict = Verdict()

    done = [e for e in events if e.get("event") == "train_done"]
    final_step = max((e["step"] for e in done), default=0)
    verdict.add(
        "completed",
        final_step == cfg.train.max_steps,
        f"train_done at step {final_step} of {cfg.train.max_steps}",
    )

    ledger = check_ledger(run_dir, cfg, len(prepare(cfg.data).train))
    verdict.add(
        "exactly_once",
        ledger.ok,
        {"steps": ledger.steps, "epochs_completed": ledger.epochs_completed, "problems": ledger.problems},
    )

    corrupted = corrupted_steps(faults)
    problems = check_checkpoints(cfg, exclude=corrupted)
    bad_resumes = resumed_from_corrupted(events, faults)
    if bad_resumes:
        problems.append(f"resumed from a checkpoint corrupted on purpose: steps {bad_resumes}")
    verdict.add("checkpoints", not problems, problems)

    dist_timeout = cfg.dist.timeout.total_seconds()
    verdict.faults = judge_faults(events, faults, dist_timeout)

    ok, detail = _reference_comparison(cfg, events, reference_dir)
    verdict.add("matches_reference", ok, detail)
    return verdict


def format_table(verdict: Verdict) -> str:
    lines = [f"{'fault':<20}{'step':>6}{'lost':>6}{'recovery_s':>12}  verdict"]
    for row in verdict.faults:
        recovery = "-" if row["recovery_s"] is None else f"{row['recovery_s']:.1f}"
        note = f"  ({row['note']})" if row["note"] else ""
        lines.append(
            f"{row['fault']:<20}{row['step'] if row['step'] is not None else '-':>6}"
            f"{row['lost']:>6}{recovery:>12}  {row['verdict']}{note}"
        )
    lines.append("")
    for name, check in verdict.checks.items():
        detail = check["detail"]
        if name == "matches_reference" and isinstance(detail, dict) and "relative" in detail:
            detail = (
                f"{detail.get('rule')}: relative diff {detail['relative']:.3g}, max abs "
                f"{detail['max_abs']:.3g}, bitwise {detail['bitwise_equal']}, worlds {detail['world_sizes']}"
            )
        lines.append(f"{'PASS' if check['ok'] else 'FAIL'}  {name}: {detail}")
    injected = sum(row["verdict"] != "skipped" for row in verdict.faults)
    lines.append(f"\nfaults injected: {injected}, skipped: {len(verdict.faults) - injected}")
    lines.append(f"verdict: {'PASS' if verdict.ok else 'FAIL'}")
    return "\n".join(lines)


def write_report(run_dir: Path, verdict: Verdict, reference_dir: Path | None) -> tuple[Path, Path]:
    from elastic_qa.observe.report import render_report

    out_dir = Path(run_dir) / "chaos"
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"ok": verdict.ok, "checks": verdict.checks, "faults": verdict.faults}
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(report, indent=1, default=str))
    summary = "<pre>" + format_table(verdict).replace("&", "&amp;").replace("<", "&lt;") + "</pre>"
    page = render_report(Path(run_dir), out_dir / "report.html", reference_dir, read_faults(run_dir), summary)
    return json_path, page
