"""Judging each fault from the evidence: the restart it caused, the steps it lost against its bound, and
the checks of its own kind (see elastic_qa.chaos.verify for the list)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_qa.chaos.evidence import Copy, attempts
from elastic_qa.chaos.schedule import ZERO_LOSS, restarts_group
from elastic_qa.observe.events import (
    CheckpointCommittedRecord,
    CheckpointFailedRecord,
    Event,
    ResumeRecord,
    TrainDoneRecord,
    records,
)

# Faults that must not restart the group: any restart after them is a failure for these; for the others
# only one that lost steps is (a restart that lost nothing may be another fault's late regroup).
NO_RESTART_STRICT = frozenset({"log-full", "final-storage-errors"})


def fault_row(fault: dict) -> dict[str, Any]:
    """A fault's row of the report before its checks: ok, nothing lost, no recovery measured yet; a skipped
    fault's row says why it was skipped."""
    row: dict[str, Any] = {
        "fault": fault["fault"], "step": fault.get("step"), "ts": fault.get("ts"), "lost": 0,
        "recovery_s": None, "verdict": "ok", "note": "",
    }  # fmt: skip
    if fault.get("skipped"):
        row.update(verdict="skipped", note=fault["skipped"])
    return row


def corruptions(faults: list[dict]) -> list[tuple[int, float]]:
    """(step, when) of every checkpoint a fault corrupted on purpose."""
    return [
        (f["checkpoint_step"], f["ts"]) for f in faults if "checkpoint_step" in f and not f.get("skipped")
    ]


def corrupted_steps(faults: list[dict]) -> set[int]:
    return {step for step, _ in corruptions(faults)}


def second_job_pids(faults: list[dict]) -> set[int]:
    return {f["pid"] for f in faults if f.get("fault") == "second-job" and "pid" in f}


def resumed_from_corrupted(events: list[dict], faults: list[dict]) -> list[int]:
    """Steps resumed from while their checkpoint was the copy a fault corrupted (no newer commit of the
    same step in between: a replayed run may legitimately commit that step again)."""
    bad = []
    for resume in (e for e in records(events, ResumeRecord) if e.get("rank") == 0):
        step, at = resume["step"], resume["ts"]
        corrupted_at = max((ts for s, ts in corruptions(faults) if s == step and ts < at), default=None)
        if corrupted_at is None:
            continue
        recommitted = any(e["step"] == step and corrupted_at < e["ts"] < at for e in _committed(events))
        if not recommitted:
            bad.append(step)
    return bad


def _committed(events: list[dict]) -> list[CheckpointCommittedRecord]:
    return records(events, CheckpointCommittedRecord)


def reached_before(runs: list[dict], new: dict) -> int:
    """The furthest step reached (completed, or resumed at) by the attempts that started before `new`."""
    before = [a for a in runs if a["start"] < new["start"]]
    return max([a["last_step"] for a in before] + [a["resumed_step"] for a in before] + [0])


def steps_lost(runs: list[dict], new: dict) -> int:
    """Steps lost when attempt `new` (a row of `attempts`) started: the furthest step reached before it,
    minus the step it resumed from."""
    return max(0, reached_before(runs, new) - new["resumed_step"])


def storage_windows(faults: list[dict], actions: list[dict]) -> list[tuple[float, float]]:
    """When checkpoint writes failed: each storage fault from injection to its flag's removal (the runner's
    action line), or to injection + fail_for_s when there is none."""
    closed = {
        (a.get("flag"), a.get("window")): a["ts"]
        for a in actions
        if a.get("action") in ("flag_removed", "window_closed")
    }
    opened = [a for a in actions if a.get("action") == "flag_created" and "storage" in str(a.get("flag"))]
    windows = []
    for fault in faults:
        if fault.get("skipped") or fault.get("fault") not in ("storage-errors", "final-storage-errors"):
            continue
        mine = min(opened, key=lambda a: abs(a["ts"] - fault["ts"]), default=None)
        end = None
        if mine is not None and abs(mine["ts"] - fault["ts"]) < 5:  # its own flag: created within 5 s of it
            end = closed.get((mine.get("flag"), mine.get("window")))
        if end is None:
            end = fault["ts"] + fault.get("fail_for_s", float("inf"))
        windows.append((fault["ts"], end))
    return windows


@dataclass
class Evidence:
    """Everything a fault row is judged from."""

    events: list[dict]  # the main job's log lines (a second job's excluded)
    all_events: list[dict]
    faults: list[dict]
    actions: list[dict]
    copies: list[Copy]
    ledger: list[dict]
    dist_timeout_s: float
    final_retry_s: float
    max_steps: int


def judge_faults(
    events: list[dict],
    faults: list[dict],
    dist_timeout_s: float,
    evidence: Evidence | None = None,
) -> list[dict[str, Any]]:
    """One row per injected fault: the restart it caused (if any), lost steps, recovery seconds, and the
    kind's own check. `evidence` (the full picture) may be left out when only events and faults exist."""
    ev = evidence or Evidence(events, events, faults, [], [], [], dist_timeout_s, float("inf"), 0)
    runs = attempts(events)
    claimed: set[int] = set()
    rows = []
    pending = []
    for index, fault in enumerate(faults):
        row = fault_row(fault)
        rows.append(row)
        if fault.get("skipped"):
            continue
        duration = fault.get("thaw_after_s", fault.get("fail_after_max_steps_s"))
        if fault["fault"] == "second-job" and _finished_before(fault, ev):
            # The main job had committed its final step before the second one registered: the run was
            # free, so the second job may run. It is still judged.
            row["note"] = "the main job had committed its final step before the second job registered"
            _judge_second_job(row, fault, ev, done_first=True)
        elif (
            fault["fault"] == "join-node" and (ended := _ended_before_admission(fault, runs, ev)) is not None
        ):
            # Admitting a joiner takes a regroup; a job that finished first had none to make. The fault
            # could not act: skipped, like one injected too late, not a recovery that failed.
            row.update(
                verdict="skipped",
                note=f"job ended first: it completed its last step {ended - fault['ts']:.1f} s after the "
                "agent joined, before any new group admitted it",
            )
        elif restarts_group(fault["fault"], duration, ev.dist_timeout_s, ev.final_retry_s):
            _judge_restart(row, fault, runs, claimed, ev)
        else:
            pending.append((index, row, fault))
    # Faults that must not restart the group: judged once every restart has been claimed by its fault.
    for index, row, fault in pending:
        later = [f["ts"] for f in faults[index + 1 :] if not f.get("skipped") and "ts" in f]
        until = min(later, default=float("inf"))
        unexpected = [a for a in runs if fault["ts"] < a["start"] < until and a["attempt"] not in claimed]
        if unexpected:
            first = unexpected[0]
            row["lost"] = steps_lost(runs, first)
            what = f"the group restarted (attempt {first['attempt']}, {row['lost']} steps lost)"
            if fault["fault"] in NO_RESTART_STRICT or row["lost"] > 0:
                row.update(verdict="FAIL", note=f"{what}; this fault must not restart it")
                continue
            row["note"] = f"{what}: an unexpected regroup"
        _judge_no_restart_kind(row, fault, runs, ev)
    return rows


def _registered_at(fault: dict, ev: Evidence) -> float:
    """When a second job registered its attempt (its worker_start line), else when it was started."""
    starts = [
        e["ts"]
        for e in ev.all_events
        if e.get("event") == Event.WORKER_START and e.get("pid") == fault.get("pid")
    ]
    return min(starts, default=fault["ts"])


def _finished_before(fault: dict, ev: Evidence) -> bool:
    registered = _registered_at(fault, ev)
    return any(e["ts"] < registered for e in _ends(ev))


def _ends(ev: Evidence) -> list[TrainDoneRecord | CheckpointCommittedRecord]:
    """The main job's train_done lines and its commits of the final step."""
    return [
        *records(ev.events, TrainDoneRecord),
        *(e for e in _committed(ev.events) if ev.max_steps and e["step"] == ev.max_steps),
    ]


def _ended_before_admission(fault: dict, runs: list[dict], ev: Evidence) -> float | None:
    """When the main job completed (its train_done, or its final commit) if no group started after the
    fault, else None."""
    if any(a["start"] > fault["ts"] for a in runs):
        return None
    return min((e["ts"] for e in _ends(ev)), default=None)


def _judge_restart(row: dict, fault: dict, runs: list[dict], claimed: set[int], ev: Evidence) -> None:
    after = fault["ts"]
    if fault["fault"] == "second-job":  # the main group restarts once fenced, after the registration
        after = max(after, _registered_at(fault, ev))
    later = [a for a in runs if a["start"] > after and a["attempt"] not in claimed]
    if not later:
        row.update(verdict="FAIL", note="no restart after the fault")
        return
    new = later[0]
    claimed.add(new["attempt"])
    before = [a for a in runs if a["start"] < new["start"]]
    completed = reached_before(runs, new)
    row["lost"] = steps_lost(runs, new)
    row["attempt"] = new["attempt"]
    if new["first_step_ts"] is not None:
        row["recovery_s"] = round(new["first_step_ts"] - fault["ts"], 2)
    previous = before[-1] if before else None
    survivors = previous is not None and (previous["world_size"] or 0) > 1
    storage_down = any(
        start <= new["start"] and fault["ts"] <= end for start, end in storage_windows(ev.faults, ev.actions)
    )
    kind = fault["fault"]
    if kind in ZERO_LOSS:
        bound, why = 0, "graceful: the last completed step is committed before leaving"
    elif survivors and not storage_down and kind not in ("corrupt-replay", "second-job"):
        bound, why = 1, "survivors commit the last completed step"
    else:
        bad = corruptions(ev.faults)
        valid = [
            e["step"]
            for e in _committed(ev.all_events)
            if e["ts"] < new["start"] and not any(s == e["step"] and e["ts"] <= ts for s, ts in bad)
        ]
        bound = max(0, completed - max(valid, default=0))  # a second job may have saved further ahead
        why = "no survivor could save: back to the newest valid checkpoint"
    row["bound"] = bound
    if row["lost"] > bound:
        row.update(verdict="FAIL", note=f"lost {row['lost']} steps, bound {bound} ({why})")
        return
    if kind == "hup":
        _judge_hup(row, fault, previous, new, ev)
    elif kind == "corrupt-replay":
        _judge_corrupt_replay(row, fault, new, ev)
    elif kind == "second-job":
        _judge_second_job(row, fault, ev)


def _judge_hup(row: dict, fault: dict, previous: dict | None, new: dict, ev: Evidence) -> None:
    stopped = [
        e
        for e in ev.events
        if e.get("event") in (Event.STOPPING, Event.STOP_REQUESTED)
        and previous is not None
        and e.get("attempt") == previous["attempt"]
        and fault["ts"] <= e["ts"] <= new["start"]
    ]
    if not stopped:
        row.update(verdict="FAIL", note="SIGHUP did not stop the group gracefully (no `stopping` line)")


def _judge_corrupt_replay(row: dict, fault: dict, new: dict, ev: Evidence) -> None:
    step = fault.get("checkpoint_step")
    if step is None:
        return
    quarantined = [
        c
        for c in ev.copies
        if c.quarantined
        and c.step == step
        and (fault.get("copy_created_ts") is None or c.created_ts == fault["copy_created_ts"])
    ]
    problems = []
    if not quarantined:
        problems.append(f"the corrupted step {step} was not quarantined (rejected/ holds no copy of it)")
    elif any(c.ok for c in quarantined):
        problems.append(f"the quarantined copy of step {step} verifies: it is not the corrupted one")
    if new["resumed_step"] >= step:
        problems.append(f"the next group resumed from step {new['resumed_step']}, not before step {step}")
    in_place = next((c for c in ev.copies if c.step == step and not c.quarantined), None)
    recommits = [
        e
        for e in _committed(ev.all_events)
        if e["step"] == step
        and e["ts"] > fault["ts"]
        and (e.get("attempt") or 0) > (fault.get("copy_attempt") or 0)
    ]
    if in_place is not None:
        newer = (in_place.attempt or 0) > (fault.get("copy_attempt") or 0)
        if not (in_place.ok and newer and (in_place.created_ts or 0) > fault["ts"]):
            problems.append(
                f"step {step} in place (attempt {in_place.attempt}) is not a verifying replay by a newer "
                "attempt"
            )
        else:
            row["note"] = (
                f"step {step} quarantined, replayed and committed again by attempt {in_place.attempt}"
            )
    elif recommits:
        row["note"] = (
            f"step {step} quarantined, replayed and committed again by attempt {recommits[0].get('attempt')} "
            "(pruned since)"
        )
    else:
        row["note"] = f"step {step} quarantined and replayed (no save fell on it during the replay)"
    if problems:
        row.update(verdict="FAIL", note="; ".join(problems))


def _judge_second_job(row: dict, fault: dict, ev: Evidence, done_first: bool = False) -> None:
    """A second job on a live run must be refused (exit 2, never registering: it fences nothing); one that
    started after the main job was done may run (it finds the final state, exit 0)."""
    pid = fault.get("pid")
    mine = [e for e in ev.all_events if e.get("pid") == pid]
    attempt = next((e.get("attempt") for e in mine if e.get("event") == Event.WORKER_START), None)
    exits = [a for a in ev.actions if a.get("action") == "second_job_exit" and a.get("pid") == pid]
    code = exits[-1].get("exit_code") if exits else None
    errors = [e.get("error") for e in mine if e.get("event") in (Event.WORKER_CRASH, Event.BAD_INPUT)]
    ran = (row["note"] + "; " if row["note"] else "") + f"second job pid {pid} "
    if fault.get("refused") and attempt is None and code == 2:
        row["note"] = ran + "was refused (exit 2): the live job holds its run"
    elif done_first and code == 0:
        row["note"] = ran + f"(attempt {attempt}) finished (exit 0)"
    elif done_first and code is not None and code < 0:
        row["note"] = ran + f"was stopped by the runner ({exits[-1].get('why')})"
    elif attempt is not None:
        row.update(
            verdict="FAIL", note=ran + f"registered attempt {attempt} on a live run: it was not refused"
        )
    else:
        row.update(
            verdict="FAIL",
            note=ran + f"exited {code} without being refused" + (f": {errors[0]}" if errors else ""),
        )


def _judge_no_restart_kind(row: dict, fault: dict, runs: list[dict], ev: Evidence) -> None:
    kind = fault["fault"]
    if kind == "second-job":
        _judge_second_job(row, fault, ev)
    elif kind == "log-full":
        running = [a for a in runs if a["start"] < fault["ts"]]
        attempt = running[-1]["attempt"] if running else None
        step = fault.get("step") or 0
        reached = max([r["step"] for r in ev.ledger if r.get("attempt") == attempt] + [0])
        reached = max(reached, next((a["last_step"] for a in runs if a["attempt"] == attempt), 0))
        if reached <= step + 1 and reached < ev.max_steps:
            row.update(verdict="FAIL", note=f"training stopped at step {reached} (attempt {attempt})")
        else:
            row["note"] = (
                row["note"] + "; " if row["note"] else ""
            ) + f"attempt {attempt} trained on to {reached}"
    elif kind == "final-storage-errors":
        final = next((c for c in ev.copies if c.step == ev.max_steps and not c.quarantined), None)
        failed = [
            e
            for e in records(ev.events, CheckpointFailedRecord)
            if e["step"] == ev.max_steps and e["ts"] >= fault["ts"]
        ]
        if final is None or not final.ok:
            row.update(verdict="FAIL", note=f"no verifying final checkpoint at step {ev.max_steps}")
        else:
            row["note"] = f"final save failed {len(failed)} times, then committed (attempt {final.attempt})"
