"""The verifier must be able to fail: doctored evidence is caught, check by check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elastic_qa.chaos.evidence import run_config
from elastic_qa.chaos.verify import judge_faults, verify_run
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.payload import MODEL_FILE
from elastic_qa.checkpoint.store import serialize
from elastic_qa.observe.follow import read_events
from tests.chaos.conftest import STEPS
from tests.leftovers import DAMAGED_ON_PURPOSE


def ledger_lines(run_dir: Path) -> tuple[Path, list[dict]]:
    path = next((run_dir / "ledger").glob("*.jsonl"))
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_untouched_evidence_passes_every_check(copy_of) -> None:
    run, reference = copy_of("run"), copy_of("reference")
    verdict = verify_run(run, reference)
    assert verdict.ok, verdict.checks
    assert verdict.checks["matches_reference"]["detail"]["bitwise_equal"]


def test_a_duplicated_sample_is_caught(copy_of) -> None:
    run = copy_of("run")
    path, rows = ledger_lines(run)
    rows[4]["samples"][0] = rows[3]["samples"][0]  # step 5 trains on a sample of step 4
    write_lines(path, rows)
    verdict = verify_run(run, copy_of("reference"))
    assert not verdict.checks["exactly_once"]["ok"]
    assert not verdict.ok


def test_a_missing_step_is_caught(copy_of) -> None:
    run = copy_of("run")
    path, rows = ledger_lines(run)
    write_lines(path, [row for row in rows if row["step"] != 7])
    verdict = verify_run(run, copy_of("reference"))
    assert not verdict.checks["exactly_once"]["ok"]
    assert any("missing" in problem for problem in verdict.checks["exactly_once"]["detail"]["problems"])


def test_a_corrupt_retained_checkpoint_is_caught(copy_of) -> None:
    run = copy_of("run")
    victim = run / "checkpoints" / "step-00000020" / "optimizer.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    (run / DAMAGED_ON_PURPOSE).touch()  # doctored evidence, not what a job left (tests.leftovers)
    verdict = verify_run(run, copy_of("reference"))
    assert not verdict.checks["checkpoints"]["ok"]
    assert verdict.checks["matches_reference"]["ok"]  # the final checkpoint is intact


def test_a_final_model_that_differs_is_caught(copy_of) -> None:
    run, reference = copy_of("run"), copy_of("reference")
    cfg = run_config(reference)
    store = open_store(cfg.checkpoint_dir)
    final = Path(store.path(f"step-{STEPS:08d}"))
    files = {name: (final / name).read_bytes() for name in ("model.pt", "optimizer.pt", "trainer.pt")}
    model = torch.load(final / MODEL_FILE, weights_only=True)
    model["span_head.weight"] = model["span_head.weight"] + 1e-3
    files[MODEL_FILE] = serialize(model)
    manifest = json.loads((final / "manifest.json").read_text())
    store.remove(str(final))
    store.commit(
        STEPS, files, {k: manifest[k] for k in ("epoch", "world_size", "attempt", "config_hash", "versions")}
    )
    verdict = verify_run(run, reference)
    assert verdict.checks["checkpoints"]["ok"] and verdict.checks["exactly_once"]["ok"]
    assert not verdict.checks["matches_reference"]["ok"]
    assert verdict.checks["matches_reference"]["detail"]["relative"] > 0


def _events(*attempts: tuple[float, int, int, int]) -> list[dict]:
    """(start time, world size, resumed step, last step) per attempt -> the log events the judge reads."""
    events = []
    for number, (start, world, resumed, last) in enumerate(attempts, start=1):
        events.append(
            {"event": "worker_start", "ts": start, "attempt": number, "world_size": world, "rank": 0}
        )
        if resumed:
            events.append({"event": "resume", "ts": start + 0.1, "attempt": number, "step": resumed})
        for step in range(resumed + 1, last + 1):
            events.append({"event": "step", "ts": start + 1 + step * 0.01, "attempt": number, "step": step})
    return sorted(events, key=lambda e: e["ts"])


def test_lost_work_beyond_the_bound_of_a_graceful_leave_is_caught() -> None:
    events = _events((0.0, 2, 0, 40), (20.0, 1, 35, 60))  # resumed 5 steps behind
    rows = judge_faults(events, [{"fault": "term-node", "ts": 10.0, "step": 40}], dist_timeout_s=30)
    assert rows[0]["lost"] == 5 and rows[0]["verdict"] == "FAIL"


def test_a_kill_with_survivors_may_lose_one_step_but_not_two() -> None:
    fault = [{"fault": "kill-worker", "ts": 10.0, "step": 40}]
    one = judge_faults(_events((0.0, 2, 0, 40), (20.0, 2, 39, 60)), fault, dist_timeout_s=30)
    two = judge_faults(_events((0.0, 2, 0, 40), (20.0, 2, 38, 60)), fault, dist_timeout_s=30)
    assert one[0]["verdict"] == "ok" and one[0]["recovery_s"] == pytest.approx(11.4, abs=0.01)
    assert two[0]["verdict"] == "FAIL"


def test_a_fault_that_should_restart_the_group_but_did_not_is_caught() -> None:
    rows = judge_faults(_events((0.0, 2, 0, 60)), [{"fault": "kill-node", "ts": 5.0, "step": 30}], 30)
    assert rows[0]["verdict"] == "FAIL"


def test_resuming_from_a_corrupted_copy_is_caught_but_not_from_a_later_recommit() -> None:
    from elastic_qa.chaos.verify import resumed_from_corrupted

    corrupt = [{"fault": "corrupt-checkpoint", "ts": 10.0, "checkpoint_step": 40}]
    resume = {"event": "resume", "rank": 0, "ts": 20.0, "step": 40}
    assert resumed_from_corrupted([resume], corrupt) == [40]
    recommit = {"event": "checkpoint_committed", "ts": 15.0, "step": 40}  # the step was replayed and saved
    assert resumed_from_corrupted([recommit, resume], corrupt) == []


def _evidence(events: list[dict], faults: list[dict], copies=(), actions=(), ledger=()):
    from elastic_qa.chaos.verify import Evidence

    return Evidence(events, events, faults, list(actions), list(copies), list(ledger), 30.0, 600.0, 60)


def test_a_sighup_that_lost_a_rank_instead_of_stopping_the_group_is_caught() -> None:
    events = _events((0.0, 2, 0, 40), (20.0, 2, 40, 60))
    fault = [{"fault": "hup", "ts": 10.0, "step": 40}]
    assert judge_faults(events, fault, 30, _evidence(events, fault))[0]["verdict"] == "FAIL"
    stopping = {"event": "stopping", "ts": 10.5, "attempt": 1, "rank": 0, "step": 40}
    graceful = sorted([*events, stopping], key=lambda e: e["ts"])
    assert judge_faults(graceful, fault, 30, _evidence(graceful, fault))[0]["verdict"] == "ok"


def test_a_full_log_disk_that_restarted_the_group_or_stopped_training_is_caught() -> None:
    fault = [{"fault": "log-full", "ts": 10.0, "step": 30, "log_full_for_s": 3.0}]
    went_on = _events((0.0, 2, 0, 60))
    assert judge_faults(went_on, fault, 30, _evidence(went_on, fault))[0]["verdict"] == "ok"
    restarted = _events((0.0, 2, 0, 30), (14.0, 2, 30, 60))
    assert judge_faults(restarted, fault, 30, _evidence(restarted, fault))[0]["verdict"] == "FAIL"
    stalled = _events((0.0, 2, 0, 30))
    assert judge_faults(stalled, fault, 30, _evidence(stalled, fault))[0]["verdict"] == "FAIL"
    # its step lines were dropped, but the ledger shows that the same attempt trained on
    ledger = [{"attempt": 1, "step": step, "rank": 0} for step in range(1, 61)]
    assert judge_faults(stalled, fault, 30, _evidence(stalled, fault, ledger=ledger))[0]["verdict"] == "ok"


def test_final_storage_errors_that_restarted_the_job_or_left_no_final_checkpoint_are_caught() -> None:
    from elastic_qa.chaos.evidence import Copy

    final = Copy(60, "/c/step-00000060", False, {"attempt": 1, "created_ts": 20.0}, ok=True)
    fault = [{"fault": "final-storage-errors", "ts": 10.0, "step": 55, "fail_after_max_steps_s": 3.0}]
    clean = _events((0.0, 2, 0, 60))
    assert judge_faults(clean, fault, 30, _evidence(clean, fault, [final]))[0]["verdict"] == "ok"
    assert judge_faults(clean, fault, 30, _evidence(clean, fault, []))[0]["verdict"] == "FAIL"
    restarted = _events((0.0, 2, 0, 60), (25.0, 2, 50, 60))
    assert judge_faults(restarted, fault, 30, _evidence(restarted, fault, [final]))[0]["verdict"] == "FAIL"


def test_a_replay_that_loaded_the_corrupt_checkpoint_or_did_not_quarantine_it_is_caught() -> None:
    from elastic_qa.chaos.evidence import Copy
    from elastic_qa.chaos.verify import resumed_from_corrupted

    fault = {"fault": "corrupt-replay", "ts": 10.0, "step": 45, "checkpoint_step": 40}
    fault.update(copy_attempt=1, copy_created_ts=9.0)
    commits = [
        {"event": "checkpoint_committed", "ts": ts, "step": step, "attempt": 1}
        for ts, step in ((5.0, 30), (9.0, 40))
    ]
    bad_copy = Copy(40, "/c/rejected/step-00000040.x", True, {"attempt": 1, "created_ts": 9.0}, ok=False)
    replayed = sorted([*_events((0.0, 2, 0, 45), (20.0, 2, 30, 60)), *commits], key=lambda e: e["ts"])
    good = judge_faults(replayed, [fault], 30, _evidence(replayed, [fault], [bad_copy]))
    assert good[0]["verdict"] == "ok" and good[0]["lost"] == 15 == good[0]["bound"]
    not_quarantined = judge_faults(replayed, [fault], 30, _evidence(replayed, [fault], []))
    assert not_quarantined[0]["verdict"] == "FAIL"
    loaded = sorted([*_events((0.0, 2, 0, 45), (20.0, 2, 40, 60)), *commits], key=lambda e: e["ts"])
    for event in loaded:
        event.setdefault("rank", 0)
    assert judge_faults(loaded, [fault], 30, _evidence(loaded, [fault], [bad_copy]))[0]["verdict"] == "FAIL"
    assert resumed_from_corrupted(loaded, [fault]) == [40]
    stale_in_place = Copy(40, "/c/step-00000040", False, {"attempt": 1, "created_ts": 9.0}, ok=True)
    rows = judge_faults(replayed, [fault], 30, _evidence(replayed, [fault], [bad_copy, stale_in_place]))
    assert rows[0]["verdict"] == "FAIL"  # the copy of step 40 in place is not a newer attempt's replay


def test_a_second_job_on_a_live_run_must_be_refused_and_restart_nothing() -> None:
    main = _events((0.0, 2, 0, 60))
    line = "elastic-qa: /r/checkpoints is held by a live job: run eqa-1 (rank 0 pid 5 on host h, since ...)"
    refused = {"fault": "second-job", "ts": 10.0, "step": 40, "pid": 77, "refused": line}
    exit_2 = {"action": "second_job_exit", "pid": 77, "exit_code": 2, "ts": 13.0}
    ev = _evidence(main, [refused], actions=[exit_2])
    (row,) = judge_faults(main, [refused], 30, ev)
    assert row["verdict"] == "ok" and "refused" in row["note"]

    # Registered an attempt on the live run (the old behaviour: it fenced the main job, which restarted).
    registered = {"fault": "second-job", "ts": 10.0, "step": 40, "pid": 77, "attempt": 2}
    fenced_main = _events((0.0, 2, 0, 45), (20.0, 2, 40, 60))
    for event in fenced_main:
        event["attempt"] += event["attempt"] > 1  # the main job's restart registers attempt 3
    started = {"event": "worker_start", "ts": 12.0, "attempt": 2, "pid": 77, "rank": 0, "world_size": 1}
    exit_1 = {"action": "second_job_exit", "pid": 77, "exit_code": 1, "ts": 23.0}
    ev = _evidence(fenced_main, [registered], actions=[exit_1])
    ev.all_events = sorted([*fenced_main, started], key=lambda e: e["ts"])
    assert judge_faults(fenced_main, [registered], 30, ev)[0]["verdict"] == "FAIL"

    # Exit 2 for another reason (bad input): not a refusal by the live job's hold.
    other = {"fault": "second-job", "ts": 10.0, "step": 40, "pid": 77}
    ev = _evidence(main, [other], actions=[exit_2])
    assert judge_faults(main, [other], 30, ev)[0]["verdict"] == "FAIL"


def test_log_lines_cut_short_by_a_full_disk_are_read_back_as_far_as_they_are_whole(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    whole = json.dumps({"event": "step", "step": 7, "ts": 2.0})
    (logs / "rank-000.pid-1.jsonl").write_text(
        json.dumps({"event": "step", "step": 6, "ts": 1.0}) + "\n"
        '{"event": "step", "st'  # a write cut short, then the next line glued to it
         + whole + "\n" + '{"event": "step", "step": 8, "ts"'  # the last line of a killed writer
    )
    assert [e["step"] for e in read_events(tmp_path)] == [6, 7]


def test_a_fault_that_was_requested_but_never_injected_fails_the_run(copy_of) -> None:
    run = copy_of("run")
    (run / "chaos").mkdir()
    (run / "chaos" / "schedule.json").write_text(json.dumps([{"kind": "kill-worker"}, {"kind": "hup"}]))
    records = [
        {"fault": "corrupt-checkpoint", "ts": 1.0, "step": 5, "checkpoint_step": 10},
        {"fault": "hup", "ts": 2.0, "skipped": "the job had already ended"},
    ]
    (run / "chaos" / "faults.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    verdict = verify_run(run, None)
    assert verdict.checks["faults_injected"]["detail"]["injected"] == 1
    assert not verdict.checks["faults_injected"]["ok"] and not verdict.ok


def test_a_storage_fault_after_which_the_group_restarted_and_lost_work_is_caught() -> None:
    fault = [{"fault": "storage-errors", "ts": 1.0, "step": 1, "fail_for_s": 5.0}]
    # the final save failed, the job restarted from scratch and trained all 40 steps again (seed 11)
    events = _events((0.0, 2, 0, 40), (8.0, 2, 0, 40))
    rows = judge_faults(events, fault, 30, _evidence(events, fault))
    assert rows[0]["verdict"] == "FAIL" and rows[0]["lost"] == 40
    graceful = _events((0.0, 2, 0, 20), (8.0, 2, 20, 40))  # another fault's late regroup lost nothing
    assert judge_faults(graceful, fault, 30, _evidence(graceful, fault))[0]["verdict"] == "ok"


def test_a_join_the_job_ended_before_admitting_is_skipped_not_a_failed_recovery() -> None:
    fault = [{"fault": "join-node", "ts": 10.0, "step": 58}]
    events = _events((0.0, 2, 0, 60))
    done = {"event": "train_done", "ts": 12.0, "attempt": 1, "step": 60, "rank": 0}
    ended = judge_faults([*events, done], fault, 30, _evidence([*events, done], fault))
    assert ended[0]["verdict"] == "skipped" and ended[0]["note"].startswith("job ended first")
    # Not admitted and the job never finished: the joiner broke the job.
    assert judge_faults(events, fault, 30, _evidence(events, fault))[0]["verdict"] == "FAIL"
    # Admitted: judged as the restart it caused.
    admitted = _events((0.0, 2, 0, 40), (20.0, 3, 40, 60))
    rows = judge_faults(admitted, fault, 30, _evidence(admitted, fault))
    assert rows[0]["verdict"] == "ok" and rows[0]["attempt"] == 2


def test_a_join_the_job_ended_before_admitting_is_not_counted_as_injected(copy_of) -> None:
    run = copy_of("run")
    events = read_events(run)
    done = next(e for e in events if e["event"] == "train_done")
    started = max(e["ts"] for e in events if e["event"] == "train_start")
    (run / "chaos").mkdir()
    (run / "chaos" / "schedule.json").write_text(json.dumps([{"kind": "join-node"}]))
    # Between the last group's start and the end, however fast the run trained (30 steps: well under 1 s)
    at = (started + done["ts"]) / 2
    join = {"fault": "join-node", "ts": at, "step": STEPS - 1, "target": "new agent pid 9"}
    (run / "chaos" / "faults.jsonl").write_text(json.dumps(join) + "\n")
    verdict = verify_run(run, None)
    assert verdict.faults[0]["verdict"] == "skipped"
    detail = verdict.checks["faults_injected"]["detail"]
    assert detail["injected"] == 0 and detail["skipped"][0].startswith("join-node: job ended first")
    assert not verdict.checks["faults_injected"]["ok"]
