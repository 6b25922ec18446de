"""Checks on the checkpoint history: who may claim done, who may commit, and that nothing was lost.

Two jobs may share one run directory: the chaos `second-job` fault starts a single-process
`python -m elastic_qa.train` on the main job's config while the main (torchrun) job runs. Fencing decides
between them. Every (re)start of a worker group, and the second job's start, registers the next attempt
number in `<checkpoint.dir>/attempts/` (atomically: no number is handed out twice), and a writer may
publish a checkpoint only while no newer attempt is registered. The check and the publish are two steps,
so a writer that passed the check just before a newer attempt registered still publishes that one save;
it is refused at its next. A refused worker exits 1 (`checkpoint_fenced`, then `checkpoint_fatal`); under
torchrun its agents restart the group, which registers a newer attempt and so fences the other job in
turn, until one of them is left. What must hold, and how each is read from the evidence:

1. No job ends "done" without its result committed. A done claim is a `train_done` line (by an attempt
   of either job), a second job's exit 0, or the main launcher's exit 0. The checkpoint at
   `train.max_steps` in place must verify, must have been written (its manifest's `created_ts`) no later
   than the claim, and must be the claiming job's own: written by the claiming attempt (for an exit 0: by
   one of the job's attempts), or the checkpoint that attempt resumed from at `train.max_steps` (it had
   nothing left to commit, and checked that it still verifies). The one later copy accepted is a newer
   attempt's identical replay that superseded a copy the claimant provably committed (its
   `checkpoint_committed` line, or its copy set aside in `rejected/`): a commit of a step replaces an older
   attempt's copy, and the ledger and the reference comparison check that the replay trained the same.
   So a fenced or failed final save can never end done, and neither can a job that merely finds another
   job's checkpoint of the last step: it must commit its own or exit 1.
2. No stale commit: a copy (in place or quarantined) written by attempt `a` must have been created before
   any newer attempt registered (`created_ts` is taken before the fencing check), give or take
   `SLACK_S` for the registration record's own clock; and each writer of an attempt publishes at most one
   checkpoint after a newer attempt registered (the check-then-publish window above).
3. Attempt numbers are unique: no two processes of different jobs start with the same attempt.
4. No checkpoint is lost: replaying the commits and quarantines in time order, with the retention
   policy pruning after each commit, gives the checkpoints that must still be in place; pruning never
   removes those, so a missing one was deleted or overwritten by someone that should not have (a stale
   writer's prune, a quarantine of a valid checkpoint that left no copy). Log lines can be missing (a
   full disk drops them), so commits are also read from the manifests on disk, and a missing step is not
   counted when a `checkpoint_pruned` line follows its last commit or log lines were dropped after it.
Overwriting is covered by 2: a commit of a step supersedes only an older attempt's copy (a writer that
finds a newer attempt's copy is stale and refused), and a stale writer's copy would postdate a newer
registration.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elastic_qa.chaos.evidence import Copy
from elastic_qa.checkpoint.policy import retained_steps
from elastic_qa.observe.events import (
    CheckpointCommittedRecord,
    CheckpointPrunedRecord,
    Event,
    LogLinesDroppedRecord,
    ResumeRecord,
    TrainDoneRecord,
    records,
)

SLACK_S = 0.5


@dataclass
class Claim:
    who: str
    attempts: set[int]  # the claiming attempt (train_done), or every attempt of the job (exit 0)
    ts: float


def done_claims(
    events: list[dict[str, Any]], actions: list[dict[str, Any]], second_pids: set[int]
) -> list[Claim]:
    """Every claim that a job ended done: train_done lines, a second job's or the launcher's exit 0."""
    claims = []
    started = {
        e["pid"]: e.get("attempt") for e in events if e.get("event") == Event.WORKER_START and "pid" in e
    }
    main_attempts = {
        e["attempt"] for e in events if e.get("pid") not in second_pids and e.get("attempt") is not None
    }
    for done in records(events, TrainDoneRecord):
        if done.get("rank", 0) == 0 and "attempt" in done:
            job = "second job" if done.get("pid") in second_pids else "main job"
            who = f"{job} attempt {done['attempt']} (train_done)"
            claims.append(Claim(who, {done["attempt"]}, done["ts"]))
    for action in actions:
        if action.get("exit_code") != 0:
            continue
        if action.get("action") == "job_exit":
            claims.append(Claim("the main job (exit 0)", main_attempts, action["ts"]))
        elif action.get("action") == "second_job_exit":
            pid = action.get("pid")
            attempt = started.get(pid)
            attempts = {attempt} if attempt is not None else set()
            claims.append(Claim(f"second job pid {pid} (exit 0)", attempts, action["ts"]))
    return claims


def check_claims(
    claims: list[Claim], copies: list[Copy], events: list[dict[str, Any]], max_steps: int
) -> list[str]:
    """(1) for every done claim."""
    final = next((c for c in copies if c.step == max_steps and not c.quarantined), None)
    resumed_at_end = {e.get("attempt") for e in records(events, ResumeRecord) if e["step"] == max_steps}
    commits = records(events, CheckpointCommittedRecord)
    problems = []
    for claim in claims:
        if final is None or not final.ok:
            why = "none exists" if final is None else f"it does not verify: {final.reason}"
            problems.append(f"{claim.who} ended done, but no checkpoint at step {max_steps} verifies ({why})")
            continue
        written_before = final.created_ts is not None and final.created_ts <= claim.ts
        own = final.attempt in claim.attempts or bool(claim.attempts & resumed_at_end)
        if written_before and own:
            continue
        committed_own = any(
            e["step"] == max_steps and e.get("attempt") in claim.attempts and e["ts"] <= claim.ts
            for e in commits
        ) or any(
            c.quarantined
            and c.step == max_steps
            and c.attempt in claim.attempts
            and (c.created_ts or 0) <= claim.ts
            for c in copies
        )
        newer = final.attempt is not None and all(final.attempt > a for a in claim.attempts)
        if committed_own and newer:
            continue  # a newer attempt's replay superseded the claimant's own commit
        why = (
            f"written at {final.created_ts}, after the claim"
            if not written_before
            else f"written by attempt {final.attempt}, not by the claimant nor resumed from by it"
        )
        problems.append(
            f"{claim.who} ended done at {claim.ts:.3f} without its own final state committed: the "
            f"checkpoint at step {max_steps} was {why}"
        )
    return problems


def check_fencing(
    copies: list[Copy], events: list[dict[str, Any]], registered: dict[int, float], second_pids: set[int]
) -> list[str]:
    """No stale commit (2) and unique attempt numbers (3)."""
    problems = []

    def superseded_at(attempt: int | None) -> float | None:
        if attempt is None:
            return None
        return min((ts for number, ts in registered.items() if number > attempt), default=None)

    for copy in copies:
        since = superseded_at(copy.attempt)
        if since is not None and copy.created_ts is not None and copy.created_ts > since + SLACK_S:
            where = "quarantined copy" if copy.quarantined else "checkpoint"
            problems.append(
                f"{where} step {copy.step} by attempt {copy.attempt} was written "
                f"{copy.created_ts - since:.2f}s after a newer attempt registered: a stale writer committed"
            )
    late: Counter[tuple[int, int | None]] = Counter()  # (attempt, pid)
    for commit in records(events, CheckpointCommittedRecord):
        since = superseded_at(commit.get("attempt"))
        if since is not None and commit["ts"] > since + SLACK_S:
            late[(commit["attempt"], commit.get("pid"))] += 1  # an attempt: superseded_at found it newer
    for (attempt, pid), count in sorted(late.items()):
        if count > 1:
            problems.append(
                f"attempt {attempt} (pid {pid}) committed {count} checkpoints after a newer attempt "
                f"registered (at most 1: the save that passed the check just before)"
            )
    jobs_by_attempt: dict[int, set[str]] = {}
    for event in events:
        if event.get("event") == Event.WORKER_START and event.get("attempt") is not None:
            job = f"second job {event.get('pid')}" if event.get("pid") in second_pids else "main job"
            jobs_by_attempt.setdefault(event["attempt"], set()).add(job)
    for attempt, jobs in sorted(jobs_by_attempt.items()):
        if len(jobs) > 1:
            problems.append(f"attempt {attempt} was handed to two jobs: {sorted(jobs)}")
    return problems


def blind_windows(events: list[dict[str, Any]], actions: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """When log lines may be missing: each writer's `log_lines_dropped` gap, and each log-full window."""
    windows = [(float(e["since_ts"]), e["ts"]) for e in records(events, LogLinesDroppedRecord)]
    opened = {}
    for action in actions:
        if "log-fault" not in str(action.get("flag")):
            continue
        key = action.get("window")
        if action.get("action") == "flag_created":
            opened[key] = action["ts"]
        elif key in opened:
            windows.append((opened.pop(key), action["ts"]))
    windows += [(start, float("inf")) for start in opened.values()]
    return windows


def check_nothing_lost(
    copies: list[Copy],
    events: list[dict[str, Any]],
    keep_last: int,
    keep_every_steps: int,
    blind: Sequence[tuple[float, float]] = (),
) -> list[str]:
    """(4): replay the history of commits (`checkpoint_committed` lines, and the manifests of the copies
    still on disk) and quarantines (the time in a quarantined copy's REJECTED.json; at the end when
    unknown), pruning after each commit as the policy does: the newest keep_last and the milestones stay,
    and so does anything newer than the step just committed. A step that history keeps must be in place
    at the end, unless a `checkpoint_pruned` line explains it, or log lines were being dropped (`blind`)
    after its commit: then the lines that would explain it may be gone, and it is not counted."""
    timeline: list[tuple[float, int, int]] = []  # (when, 0 commit / 1 quarantine, step)
    for commit in records(events, CheckpointCommittedRecord):
        timeline.append((commit["ts"], 0, commit["step"]))
    for copy in copies:
        if copy.created_ts is not None:
            timeline.append((copy.created_ts, 0, copy.step))
        if copy.quarantined:
            when = (copy.note or {}).get("time")
            timeline.append((float(when) if isinstance(when, int | float) else float("inf"), 1, copy.step))
    kept: set[int] = set()
    last_commit: dict[int, float] = {}
    for when, what, step in sorted(timeline):
        if what == 1:
            kept.discard(step)
            continue
        last_commit[step] = when
        candidates = kept | {step}
        retained = retained_steps(sorted(candidates), keep_last, keep_every_steps)
        kept = {s for s in candidates if s in retained or s >= step}
    in_place = {copy.step for copy in copies if not copy.quarantined}
    pruned = {(e["step"], e["ts"]) for e in records(events, CheckpointPrunedRecord)}
    missing = []
    for step in sorted(kept - in_place):
        since = last_commit.get(step, 0.0)
        if any(s == step and ts >= since for s, ts in pruned):
            continue
        if any(end >= since for _, end in blind):
            continue
        missing.append(step)
    if missing:
        return [f"checkpoints committed and kept by the retention policy are gone: steps {missing}"]
    return []
