"""The verdict: from a run's logs, ledger, checkpoints and fault records, did recovery lose anything?

A run of the replica-group mode (`elastic-qa replicas`: its launcher left agents/replicas.jsonl) is judged
by that mode's own checks instead (elastic_qa.chaos.replica_verdict). Checks (exit code 0 only when all hold):
1. the job completed train.max_steps (the main job: a second job's lines do not count) and, where the
   runner recorded it, exited 0;
2. the effective training order (per step, the highest attempt that ran it) is exactly the planned global
   order: no step missing, each sample used exactly once per epoch (from the sample ledger, which log
   faults cannot touch);
3. every committed checkpoint verifies (except copies a fault corrupted on purpose, which must never have
   been resumed from; a later commit of their step must verify), a quarantined one that verifies was
   superseded by a newer commit of its step, and no more are retained than keep_last + milestones;
4. done claims, fencing and retention (see elastic_qa.chaos.history): no job ends done without its own
   final checkpoint committed and verified, no stale attempt commits, no attempt number is handed out twice,
   no checkpoint the policy keeps is gone;
5. per fault (elastic_qa.chaos.judge), lost work within its bound: 0 for term-node/join-node/hup and faults
   that need no restart, <= 1 step for a kill or freeze that leaves survivors, and no older than the newest
   valid checkpoint when no rank can save (every worker killed, the survivors fenced, or storage down);
   recovery time (fault -> first completed step of the new group) reported per fault; plus each new kind's
   check:
   - hup: the group stopped gracefully (a `stopping` line) rather than losing a rank;
   - log-full: no restart, and the attempt that was training went on training through the window;
   - final-storage-errors: no restart (the final save retries for checkpoint.final_retry_for), and the
     final checkpoint in place verifies;
   - corrupt-replay: the corrupted copy was quarantined (in rejected/, failing verification), the next
     group resumed from an older step and replayed across it, and a copy of that step in place now is a
     newer attempt's replay;
   - second-job: the live main job holds its run, so the second job was refused (exit 2, registering no
     attempt) and the main group did not restart; one started after the main job was done may run;
6. every requested fault was injected and could act (a skipped one is listed with the reason: the runner
   found no target, or the job ended first, e.g. before a joining agent was admitted);
7. the outcome matches a fault-free reference run: bitwise when every attempt ran at the reference's world
   size, else within 1e-4 relative (runs up to 500 steps), else eval loss within 1% and EM/F1 within 1 point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_qa.chaos.evidence import (
    Copy,
    attempts,
    check_checkpoints,
    check_ledger,
    checkpoint_copies,
    final_parameters,
    parameter_difference,
    registrations,
    run_config,
)
from elastic_qa.chaos.history import (
    blind_windows,
    check_claims,
    check_fencing,
    check_nothing_lost,
    done_claims,
)
from elastic_qa.chaos.judge import (
    Evidence,
    corrupted_steps,
    corruptions,
    judge_faults,
    resumed_from_corrupted,
    second_job_pids,
)
from elastic_qa.config import Config
from elastic_qa.models import family_for
from elastic_qa.observe.events import TrainDoneRecord, records
from elastic_qa.observe.follow import read_events
from elastic_qa.observe.ledger import read_ledger
from elastic_qa.prep import prepare

SHORT_RUN_STEPS = 500
__all__ = [
    "Verdict",
    "corrupted_steps",
    "judge_faults",
    "resumed_from_corrupted",
    "verify_run",
]


@dataclass
class Verdict:
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: Any) -> None:
        self.checks[name] = {"ok": bool(ok), "detail": detail}

    @property
    def ok(self) -> bool:
        # A skipped fault fails the `faults_injected` check, not its own row.
        return all(c["ok"] for c in self.checks.values()) and all(f["verdict"] != "FAIL" for f in self.faults)


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "chaos" / "faults.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def read_faults(run_dir: Path) -> list[dict[str, Any]]:
    """The injections (one line per fault; a line by hand on a cluster needs only fault, ts and step)."""
    return [r for r in read_records(run_dir) if "fault" in r and "action" not in r]


def read_actions(run_dir: Path) -> list[dict[str, Any]]:
    """What the runner did after injecting (windows closed, a second job's exit, the job's exit code)."""
    return [r for r in read_records(run_dir) if "action" in r]


def requested_faults(run_dir: Path, faults: list[dict]) -> int:
    path = Path(run_dir) / "chaos" / "schedule.json"
    if path.exists():
        return len(json.loads(path.read_text()))
    return len(faults)


def _reference_comparison(
    cfg: Config, events: list[dict[str, Any]], reference_dir: Path | None
) -> tuple[bool, dict[str, Any]]:
    if reference_dir is None:
        return True, {"skipped": "no reference run"}
    ref_cfg = run_config(reference_dir)
    mine, ref = final_parameters(cfg), final_parameters(ref_cfg)
    if mine is None or ref is None:
        return False, {"error": "a final checkpoint is missing"}
    diff = parameter_difference(mine[1], ref[1])
    ref_world = {a["world_size"] for a in attempts(read_events(reference_dir))}
    worlds = {a["world_size"] for a in attempts(events) if a["world_size"]}
    detail = {**diff, "world_sizes": sorted(worlds), "reference_world_sizes": sorted(ref_world)}
    if worlds == ref_world and len(ref_world) == 1:
        detail["rule"] = "bitwise (every attempt at the reference's world size)"
        return diff["bitwise_equal"], detail
    if cfg.train.max_steps <= SHORT_RUN_STEPS:
        detail["rule"] = "relative parameter difference < 1e-4"
        return diff["relative"] < 1e-4, detail
    done = [e for e in records(events, TrainDoneRecord) if "em" in e]
    ref_done = [e for e in records(read_events(reference_dir), TrainDoneRecord) if "em" in e]
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


def _completed(cfg: Config, events: list[dict], actions: list[dict], copies: list[Copy]) -> tuple[bool, str]:
    max_steps = cfg.train.max_steps
    final_step = max((e["step"] for e in records(events, TrainDoneRecord)), default=0)
    exits = [a["exit_code"] for a in actions if a.get("action") == "job_exit"]
    code = exits[-1] if exits else None
    detail = f"train_done at step {final_step} of {max_steps}" + ("" if code is None else f", exit {code}")
    if code not in (None, 0):
        return False, detail
    if final_step == max_steps:
        return True, detail
    final = next((c for c in copies if c.step == max_steps and not c.quarantined and c.ok), None)
    if code == 0 and final is not None:  # the train_done line itself may have been dropped (disk full)
        return True, detail + f" (no train_done line; the checkpoint at step {max_steps} verifies)"
    return False, detail


def verify_run(run_dir: Path, reference_dir: Path | None = None) -> Verdict:
    from elastic_qa.chaos.replica_verdict import is_replica_run, verify_replica_run

    run_dir = Path(run_dir)
    if is_replica_run(run_dir):  # `elastic-qa replicas`: judged by the replica mode's checks
        return verify_replica_run(run_dir, reference_dir)
    cfg = run_config(run_dir)
    all_events = read_events(run_dir)
    faults, actions = read_faults(run_dir), read_actions(run_dir)
    second = second_job_pids(faults)
    events = [e for e in all_events if e.get("pid") not in second]
    copies = checkpoint_copies(cfg)
    verdict = Verdict()

    ok, detail = _completed(cfg, events, actions, copies)
    verdict.add("completed", ok, detail)

    ledger_rows = read_ledger(run_dir)
    ledger = check_ledger(run_dir, cfg, len(prepare(cfg, family_for(cfg.model)).train))
    verdict.add(
        "exactly_once",
        ledger.ok,
        {"steps": ledger.steps, "epochs_completed": ledger.epochs_completed, "problems": ledger.problems},
    )

    problems = check_checkpoints(cfg, corruptions=corruptions(faults))
    bad_resumes = resumed_from_corrupted(all_events, faults)
    if bad_resumes:
        problems.append(f"resumed from a checkpoint corrupted on purpose: steps {bad_resumes}")
    verdict.add("checkpoints", not problems, problems)

    claims = done_claims(all_events, actions, second)
    history = check_claims(claims, copies, all_events, cfg.train.max_steps)
    history += check_fencing(copies, all_events, registrations(cfg), second)
    blind = blind_windows(all_events, actions)
    keep = (cfg.checkpoint.keep_last, cfg.checkpoint.keep_every_steps)
    history += check_nothing_lost(copies, all_events, *keep, blind)
    verdict.add("checkpoint_history", not history, {"done_claims": len(claims), "problems": history})

    evidence = Evidence(
        events,
        all_events,
        faults,
        actions,
        copies,
        ledger_rows,
        cfg.dist.timeout.total_seconds(),
        cfg.checkpoint.final_retry_for.total_seconds(),
        cfg.train.max_steps,
    )
    verdict.faults = judge_faults(events, faults, evidence.dist_timeout_s, evidence)

    # Skipped: faults the runner could not inject, and those the job ended before they could act.
    requested = requested_faults(run_dir, faults)
    injected = sum(1 for row in verdict.faults if row["verdict"] != "skipped")
    skipped = [f"{row['fault']}: {row['note']}" for row in verdict.faults if row["verdict"] == "skipped"]
    verdict.add(
        "faults_injected",
        injected >= requested,
        {"requested": requested, "injected": injected, "skipped": skipped},
    )

    ok, comparison = _reference_comparison(cfg, all_events, reference_dir)
    verdict.add("matches_reference", ok, comparison)
    return verdict
