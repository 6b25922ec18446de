"""The run's hold (session/hold.py): a live job keeps it against any other run id, the same job's regroup
takes it over, a holder that is provably gone (dead processes, a stale heartbeat elsewhere) does not."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_qa.checkpoint.errors import CheckpointError
from elastic_qa.liveness import this_process
from elastic_qa.session import hold
from elastic_qa.session.hold import RunHeldError, RunHold


def record_of(run_id: str, processes: list[dict], since: float, heartbeat: float | None = None) -> dict:
    beat = time.time() if heartbeat is None else heartbeat
    return {"run_id": run_id, "since": since, "heartbeat": beat, "run_dir": "/r", "processes": processes}


def plant(root: Path, record: dict) -> Path:
    (root / "holders").mkdir(parents=True, exist_ok=True)
    path = root / "holders" / f"{record['run_id']}.json"
    path.write_text(json.dumps(record))
    return path


def dead_process() -> dict:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    record = this_process(child.pid).to_dict()
    child.wait()
    return record


def test_a_live_job_refuses_another_run_id_with_one_line_naming_it(tmp_path: Path) -> None:
    live = RunHold(str(tmp_path), "eqa-1", "/runs/r")
    live.acquire([this_process().to_dict()])
    intruder = RunHold(str(tmp_path), "single-2", "/runs/r")
    with pytest.raises(RunHeldError) as refused:
        intruder.check()
    message = str(refused.value)
    assert "\n" not in message and "run eqa-1" in message and f"pid {this_process().pid}" in message
    assert "since " in message and "launch/local.sh join --run-dir /runs/r" in message
    with pytest.raises(RunHeldError):
        intruder.acquire([this_process().to_dict()])
    assert sorted(p.name for p in (tmp_path / "holders").iterdir()) == ["eqa-1.json"]  # withdrew


def test_the_same_job_regrouped_takes_the_hold_over_and_keeps_since(tmp_path: Path) -> None:
    first = RunHold(str(tmp_path), "eqa-1", "/r")
    since = first.acquire([dead_process()]).since
    again = RunHold(str(tmp_path), "eqa-1", "/r").acquire([this_process().to_dict()])
    assert again.since == since and again.processes == [this_process().to_dict()]


def test_a_holder_whose_processes_all_died_is_taken_over(tmp_path: Path) -> None:
    plant(tmp_path, record_of("eqa-old", [dead_process(), dead_process()], since=1.0))
    RunHold(str(tmp_path), "single-new", "/r").acquire([this_process().to_dict()])
    assert sorted(p.name for p in (tmp_path / "holders").iterdir()) == ["single-new.json"]


def test_a_holder_with_one_process_alive_is_not_gone(tmp_path: Path) -> None:
    plant(tmp_path, record_of("eqa-old", [dead_process(), this_process().to_dict()], since=1.0))
    with pytest.raises(RunHeldError):
        RunHold(str(tmp_path), "single-new", "/r").acquire([this_process().to_dict()])


def test_another_hosts_holder_is_gone_only_once_its_heartbeat_is_stale(tmp_path: Path) -> None:
    remote = {"host": "elsewhere", "pid": 1, "boot_id": "b", "start": 5}
    path = plant(tmp_path, record_of("eqa-remote", [remote], since=1.0))
    with pytest.raises(RunHeldError) as refused:
        RunHold(str(tmp_path), "single-new", "/r").check()
    assert "host elsewhere" in str(refused.value)
    plant(tmp_path, record_of("eqa-remote", [remote], since=1.0, heartbeat=time.time() - hold.STALE_S - 5))
    RunHold(str(tmp_path), "single-new", "/r").acquire([this_process().to_dict()])
    assert not path.exists()


def test_of_two_live_starts_the_later_one_withdraws(tmp_path: Path) -> None:
    # The earlier one wrote its record but had not listed yet: the later one sees it and withdraws.
    plant(tmp_path, record_of("eqa-a", [this_process().to_dict()], since=time.time() - 1))
    with pytest.raises(RunHeldError):
        RunHold(str(tmp_path), "eqa-b", "/r").acquire([this_process().to_dict()])
    # The later one wrote first: the earlier one goes on (the later one withdraws when it lists).
    plant(tmp_path, record_of("eqa-c", [this_process().to_dict()], since=time.time() + 60))
    RunHold(str(tmp_path), "eqa-a", "/r").acquire([this_process().to_dict()])


def test_the_heartbeat_refreshes_the_record_and_release_removes_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(hold, "HEARTBEAT_S", 0.01)
    held = RunHold(str(tmp_path), "eqa-1", "/r")
    first = held.acquire([this_process().to_dict()]).heartbeat
    held.start_heartbeat()
    path = tmp_path / "holders" / "eqa-1.json"
    deadline = time.monotonic() + 60
    while json.loads(path.read_text())["heartbeat"] == first:
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.01)
    held.release()
    assert not path.exists()


def test_a_failing_heartbeat_never_raises_into_training(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(hold, "HEARTBEAT_S", 0.01)
    held = RunHold(str(tmp_path), "eqa-1", "/r")
    held.acquire([this_process().to_dict()])

    def broken(_record: object) -> None:
        raise OSError(5, "injected")

    monkeypatch.setattr(held, "_write", broken)
    held.start_heartbeat()
    deadline = time.monotonic() + 60
    while held.beat_error is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert held._thread is not None and held._thread.is_alive()
    held.stop_heartbeat()


def test_an_unreadable_record_is_no_holder_and_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "holders").mkdir()
    (tmp_path / "holders" / "junk.json").write_text("{not json")
    RunHold(str(tmp_path), "single-new", "/r").check()
    RunHold(str(tmp_path), "single-new", "/r").acquire([this_process().to_dict()])
    assert sorted(p.name for p in (tmp_path / "holders").iterdir()) == ["junk.json", "single-new.json"]


def test_a_record_that_is_a_directory_is_no_holder_and_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "holders" / "eqa-dir.json").mkdir(parents=True)
    (tmp_path / "holders" / "eqa-dir.json" / "notes").write_text("mine")
    RunHold(str(tmp_path), "single-new", "/r").check()
    RunHold(str(tmp_path), "single-new", "/r").acquire([this_process().to_dict()])
    assert (tmp_path / "holders" / "eqa-dir.json" / "notes").read_text() == "mine"


def test_a_record_that_is_a_link_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"  # a live job's record, elsewhere
    outside.write_text(json.dumps(record_of("eqa-live", [this_process().to_dict()], since=1.0)))
    (tmp_path / "holders").mkdir()
    (tmp_path / "holders" / "eqa-link.json").symlink_to(outside)
    RunHold(str(tmp_path), "single-new", "/r").check()
    RunHold(str(tmp_path), "single-new", "/r").acquire([this_process().to_dict()])
    assert (tmp_path / "holders" / "eqa-link.json").is_symlink() and outside.exists()


def test_a_holders_directory_that_links_elsewhere_is_neither_written_nor_cleaned(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.json").write_text('{"mine": true}')
    gone = record_of("eqa-old", [dead_process()], since=1.0)  # a record a start would take over
    (elsewhere / "eqa-old.json").write_text(json.dumps(gone))
    store = tmp_path / "checkpoints"
    store.mkdir()
    (store / "holders").symlink_to(elsewhere)
    held = RunHold(str(store), "single-new", "/r")
    for attempt in (held.check, lambda: held.acquire([this_process().to_dict()])):
        with pytest.raises(CheckpointError, match=r"holders is a symbolic link to .*elsewhere"):
            attempt()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["eqa-old.json", "keep.json"]


@pytest.mark.parametrize("heartbeat", [float("nan"), float("inf"), 1e12])
def test_a_remote_holder_whose_heartbeat_is_no_time_or_far_ahead_holds_nothing(
    tmp_path: Path, heartbeat: float
) -> None:
    remote = {"host": "elsewhere", "pid": 1, "boot_id": "b", "start": 5}
    plant(tmp_path, record_of("eqa-remote", [remote], since=1.0, heartbeat=heartbeat))
    RunHold(str(tmp_path), "single-new", "/r").check()
    RunHold(str(tmp_path), "single-new", "/r").acquire([this_process().to_dict()])


def test_launcher_start_refuses_a_run_a_live_job_holds_before_starting_any_agent(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    plant(run_dir / "checkpoints", record_of("eqa-live", [this_process().to_dict()], since=time.time()))
    start = [sys.executable, "-m", "elastic_qa.launcher.local", "start", "--agents", "1", "--config", "tiny"]
    overrides = [f"run.dir={run_dir}", f"data.cache_dir={cache_dir}", "log.console=none"]
    result = subprocess.run([*start, *overrides], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "is held by a live job: run eqa-live" in result.stderr and "Traceback" not in result.stderr
    assert not (run_dir / "launch.json").exists() and not (run_dir / "agents").exists()
