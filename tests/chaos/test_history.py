"""The checkpoint-history checks must be able to fail: done claims, fencing, lost checkpoints."""

from __future__ import annotations

import json
import shutil
import time

from elastic_qa.chaos.evidence import Copy
from elastic_qa.chaos.history import check_claims, check_fencing, check_nothing_lost, done_claims
from elastic_qa.chaos.verify import verify_run
from tests.chaos.conftest import STEPS

MAIN, SECOND = 100, 200  # pids


def copy(step: int, attempt: int, created: float, ok: bool = True, quarantined: bool = False) -> Copy:
    manifest = {"step": step, "attempt": attempt, "created_ts": created}
    return Copy(step, f"/ckpt/step-{step:08d}", quarantined, manifest, ok)


def event(name: str, ts: float, attempt: int, pid: int = MAIN, **fields) -> dict:
    return {"event": name, "ts": ts, "attempt": attempt, "pid": pid, "rank": 0, **fields}


def claims_problems(events: list[dict], copies: list[Copy], actions: list[dict] = ()) -> list[str]:
    claims = done_claims(events, list(actions), second_pids={SECOND})
    return check_claims(claims, copies, events, max_steps=50)


def test_a_job_that_committed_its_final_step_before_claiming_done_passes() -> None:
    events = [
        event("worker_start", 1.0, 3),
        event("checkpoint_committed", 9.0, 3, step=50),
        event("train_done", 10.0, 3, step=50),
    ]
    actions = [{"action": "job_exit", "exit_code": 0, "ts": 12.0}]
    assert claims_problems(events, [copy(50, 3, 8.9)], actions) == []


def test_a_job_that_ended_0_without_its_final_checkpoint_is_caught() -> None:
    events = [event("worker_start", 1.0, 3), event("train_done", 10.0, 3, step=50)]
    actions = [{"action": "job_exit", "exit_code": 0, "ts": 12.0}]
    assert len(claims_problems(events, [copy(40, 3, 5.0)], actions)) == 2  # train_done and exit 0
    assert len(claims_problems(events, [copy(50, 3, 8.9, ok=False)], actions)) == 2


def test_claiming_done_before_the_final_checkpoint_was_committed_is_caught() -> None:
    events = [event("worker_start", 1.0, 3), event("train_done", 10.0, 3, step=50)]
    # a later attempt committed the final step: the claim came before any final state was durable
    assert len(claims_problems(events, [copy(50, 4, 20.0)])) == 1


def test_a_second_job_that_claimed_done_on_another_jobs_checkpoint_is_caught() -> None:
    events = [
        event("worker_start", 1.0, 3),
        event("checkpoint_committed", 9.0, 3, step=50),
        event("worker_start", 5.0, 4, pid=SECOND),
        event("train_done", 11.0, 4, pid=SECOND, step=50),  # never resumed at 50, never committed it
    ]
    actions = [{"action": "second_job_exit", "pid": SECOND, "exit_code": 0, "ts": 12.0}]
    assert len(claims_problems(events, [copy(50, 3, 8.9)], actions)) == 2


def test_an_attempt_that_resumed_at_the_last_step_may_claim_done_on_that_checkpoint() -> None:
    events = [
        event("worker_start", 11.0, 4, pid=SECOND),
        event("resume", 11.5, 4, pid=SECOND, step=50),
        event("train_done", 12.0, 4, pid=SECOND, step=50),
    ]
    assert claims_problems(events, [copy(50, 3, 8.9)]) == []


def test_a_newer_replay_may_supersede_a_final_checkpoint_its_claimant_committed() -> None:
    events = [
        event("worker_start", 1.0, 3, pid=SECOND),
        event("checkpoint_committed", 9.0, 3, pid=SECOND, step=50),
        event("train_done", 10.0, 3, pid=SECOND, step=50),
    ]
    copies = [copy(50, 5, 30.0), copy(50, 3, 8.9, quarantined=True)]
    assert claims_problems(events, copies) == []


def test_a_stale_attempt_that_commits_after_a_newer_one_registered_is_caught() -> None:
    registered = {3: 1.0, 4: 10.0}
    assert check_fencing([copy(40, 3, 9.9), copy(50, 4, 15.0)], [], registered, {SECOND}) == []
    assert len(check_fencing([copy(40, 3, 12.0)], [], registered, {SECOND})) == 1
    one_late = [event("checkpoint_committed", 11.0, 3, step=40)]
    two_late = [*one_late, event("checkpoint_committed", 13.0, 3, step=45)]
    assert check_fencing([], one_late, registered, {SECOND}) == []  # passed the check just before
    assert len(check_fencing([], two_late, registered, {SECOND})) == 1


def test_an_attempt_number_handed_to_two_jobs_is_caught() -> None:
    events = [event("worker_start", 1.0, 3), event("worker_start", 1.1, 3, pid=SECOND)]
    assert len(check_fencing([], events, {3: 1.0}, {SECOND})) == 1


def test_a_committed_checkpoint_that_the_policy_keeps_must_still_be_there() -> None:
    commits = [event("checkpoint_committed", float(s), 3, step=s) for s in (10, 20, 30, 40)]
    kept = [copy(s, 3, float(s)) for s in (20, 30, 40)]
    assert check_nothing_lost(kept, commits, keep_last=3, keep_every_steps=0) == []
    assert len(check_nothing_lost(kept[1:], commits, keep_last=3, keep_every_steps=0)) == 1
    quarantined = [*kept[:2], copy(40, 3, 40.0, ok=False, quarantined=True)]  # set aside, not lost
    assert check_nothing_lost(quarantined, commits, keep_last=3, keep_every_steps=0) == []


def test_a_checkpoint_pruned_while_log_lines_were_dropped_is_not_taken_for_lost() -> None:
    # 50 was committed while the log disk was full: only its manifest tells; 30 was pruned then
    commits = [event("checkpoint_committed", float(s), 3, step=s) for s in (10, 20, 30, 40, 60)]
    kept = [copy(s, 3, float(s)) for s in (40, 50, 60)]
    assert check_nothing_lost(kept, commits, keep_last=3, keep_every_steps=0) == []
    # 40 is gone and no line or manifest explains it: lost, unless log lines were dropped after its commit
    gone = [copy(s, 3, float(s)) for s in (50, 60)]
    assert len(check_nothing_lost(gone, commits, keep_last=3, keep_every_steps=0)) == 1
    assert check_nothing_lost(gone, commits, keep_last=3, keep_every_steps=0, blind=[(65.0, 72.0)]) == []


def test_a_real_run_that_exited_0_after_losing_its_final_checkpoint_fails_verification(copy_of) -> None:
    run = copy_of("run")
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS:08d}")
    record = {"action": "job_exit", "exit_code": 0, "ts": time.time()}
    (run / "chaos").mkdir()
    (run / "chaos" / "faults.jsonl").write_text(json.dumps(record) + "\n")
    verdict = verify_run(run, None)
    assert not verdict.checks["checkpoint_history"]["ok"]
    assert verdict.checks["exactly_once"]["ok"]  # every step ran exactly once: only the result is gone
