"""The dashboard's state from a run's files: what it says of a known run, what it reads, what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_qa.report import live
from elastic_qa.report.live import LiveRun
from tests.report.runs import CONFIG, T0, line, write_run

HOSTILE_HOST = "<script>window.pwned=1</script>"
HOSTILE_ERROR = "<img src=x onerror=window.pwned=2>"


def state_of(run_dir: Path) -> dict:
    run = LiveRun(run_dir)
    run.refresh()
    return run.state(now=T0 + 40.0)


def hostile_run(run_dir: Path) -> Path:
    """The written run, with a crash on a host named like markup, and a data source named like markup."""
    crash = line("worker_crash", 9.5, 1, 1, 2, error=HOSTILE_ERROR, node=f"{HOSTILE_HOST}/1", pid=1001)
    config = {**CONFIG, "data": {"source": HOSTILE_ERROR}}
    return write_run(run_dir, config, **{"rank-001.pid-1001.jsonl": [crash]})


def test_a_finished_run_shows_its_progress_world_restarts_checkpoints_and_members(tmp_path: Path) -> None:
    state = state_of(write_run(tmp_path / "run"))
    assert state["status"] == "finished"
    assert (state["step"], state["max_steps"], state["eta_s"]) == (100, 100, None)
    assert (state["world_size"], state["attempt"], state["restarts"]) == (3, 2, 1)
    assert state["checkpoints"]["committed"] == 2 and [r["step"] for r in state["checkpoint_rows"]] == [
        50,
        100,
    ]
    assert state["eval"] == {"step": 100, "em": 0.625, "f1": 0.75}
    assert [(m["rank"], m["step"]) for m in state["members"]] == [(0, 100), (1, 100), (2, 100)]
    assert state["members"][0]["state"] == "finished"
    texts = [row["text"] for row in state["timeline"]]
    assert texts[0] == "attempt 1 started with 2 workers" and texts[-1] == "finished at step 100"
    assert "attempt 2 started with 3 workers" in texts and "resumed from step 50" in texts
    assert state["idle_s"] == 5.0 and state["behind"] is False
    assert "World size over time" in state["html"]["charts"] and "2 → 3" in state["html"]["summary"]
    assert state["replicas"] is None  # a run of the default mode has no quorum view


def test_a_running_job_has_an_eta_at_its_recent_pace_and_a_lost_peer_reads_as_regrouping(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    rows = [line("worker_start", 0.0, 0, 1, 2)] + [
        line("step", step / 10, 0, 1, 2, step=step, loss=1.0) for step in range(10, 51, 10)
    ]  # 10 steps a second: 50 of 100 left
    (logs / "rank-000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run" / "config.yaml").write_text(json.dumps(CONFIG))  # YAML reads JSON
    run = LiveRun(tmp_path / "run")
    run.refresh()
    state = run.state()
    assert (state["status"], state["step"], state["eta_s"]) == ("training", 50, pytest.approx(5.0))
    with open(logs / "rank-000.jsonl", "a") as handle:
        handle.write(json.dumps(line("peer_failure", 5.5, 0, 1, 2, error="peer gone")) + "\n")
    run.refresh()
    state = run.state()
    assert state["status"] == "regrouping" and state["members"][0]["state"] == "lost a peer"
    assert state["timeline"][-1]["text"] == "rank 0 on ? lost a peer: peer gone"


def test_a_hostile_host_name_and_message_stay_text_in_the_state_and_escaped_in_its_html(
    tmp_path: Path,
) -> None:
    state = state_of(hostile_run(tmp_path / "run"))
    crash = next(row["text"] for row in state["timeline"] if "crashed" in row["text"])
    assert crash == f"rank 1 on {HOSTILE_HOST} crashed: {HOSTILE_ERROR}"  # data, which the page sets as text
    html = "".join(state["html"].values())
    assert "&lt;img src=x onerror=window.pwned=2&gt;" in state["html"]["summary"]  # the config's data source
    assert HOSTILE_ERROR not in html and HOSTILE_HOST not in html and "<script" not in html


def test_only_appended_bytes_are_read_and_a_line_being_written_waits_for_its_newline(tmp_path: Path) -> None:
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    first = json.dumps(line("worker_start", 0.0, 0, 1, 1)) + "\n"
    second = json.dumps(line("step", 1.0, 0, 1, 1, step=1, loss=1.0))
    (logs / "rank-000.jsonl").write_text(first + second[:20])
    run = LiveRun(tmp_path / "run")
    run.refresh()
    assert (run.version, len(run.events), run.state()["step"]) == (1, 1, 0)
    run.refresh()
    assert run.version == 1  # nothing new: the state is not recomputed
    with open(logs / "rank-000.jsonl", "a") as handle:
        handle.write(second[20:] + "\n")
    run.refresh()
    assert (run.version, len(run.events), run.state()["step"]) == (2, 2, 1)


def test_a_refresh_reads_a_bounded_number_of_bytes_and_later_ones_catch_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = write_run(tmp_path / "run")
    everything = LiveRun(run_dir)
    everything.refresh()
    monkeypatch.setattr(live, "READ_CAP", 300)  # a line or so of each file a read
    run = LiveRun(run_dir)
    run.refresh()
    files = len(list((run_dir / "logs").glob("*.jsonl")))
    assert run.behind() and len(run.events) <= 2 * files < len(everything.events) / 3
    refreshes = 1
    while run.behind():
        run.refresh()
        refreshes += 1
    assert refreshes > 5 and len(run.events) == len(everything.events)
    assert run.state()["step"] == 100


def test_symlinks_are_not_followed_whether_they_leave_the_run_or_not(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    outside = tmp_path / "secret.jsonl"
    outside.write_text(json.dumps(line("step", 36.0, 0, 9, 1, step=999, loss=1.0, secret="s3cret")) + "\n")
    (run_dir / "logs" / "evil.jsonl").symlink_to(outside)
    (run_dir / "logs" / "again.jsonl").symlink_to(run_dir / "logs" / "rank-000.pid-1000.jsonl")
    (run_dir / "config.yaml").unlink()
    (run_dir / "config.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    (tmp_path / "elsewhere.yaml").write_text("train: {max_steps: 12345}\n")
    other = tmp_path / "other-logs"
    other.mkdir()
    (other / "x.jsonl").write_text(outside.read_text())
    (run_dir / "chaos").symlink_to(other)  # a whole directory elsewhere
    state = state_of(run_dir)
    assert "s3cret" not in json.dumps(state) and state["step"] == 100 and state["faults"] == []
    assert state["max_steps"] is None  # config.yaml leads out of the run: not read
    run, plain = LiveRun(run_dir), LiveRun(write_run(tmp_path / "plain"))
    run.refresh()
    plain.refresh()
    assert len(run.events) == len(plain.events)  # again.jsonl, a link within the run, is not read either


def test_a_long_run_is_drawn_from_every_kth_step_alike_on_every_rank_and_its_counts_stay_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    for rank in range(2):
        rows = [line("worker_start", 0.0, rank, 1, 2)]
        rows += [line("step", step / 10, rank, 1, 2, step=step, loss=1.0) for step in range(1, 61)]
        (logs / f"rank-{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(live, "CHART_STEPS", 10)
    run = LiveRun(tmp_path / "run")
    run.refresh()
    drawn = live._thinned(run.events)
    for rank in range(2):
        kept = [e["step"] for e in drawn if e["event"] == "step" and e["rank"] == rank]
        assert kept == list(range(6, 61, 6))
    assert [e for e in drawn if e["event"] != "step"] == [e for e in run.events if e["event"] != "step"]
    assert run.state()["step"] == 60 and run.state()["members"][1]["step"] == 60


def test_a_run_directory_without_logs_yet_is_waiting_and_its_first_lines_show_up(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run = LiveRun(run_dir)
    run.refresh()
    state = run.state()
    assert (state["status"], state["step"], state["idle_s"], state["html"]["charts"]) == (
        "waiting for the first log line",
        0,
        None,
        "",
    )
    write_run(run_dir)
    run.refresh()
    assert (run.state()["status"], run.state()["step"]) == ("finished", 100)


def test_the_agents_table_follows_the_launchers_records_as_each_agent_ends(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    records = [
        {"event": "agent_started", "agent": 0, "pid": 10, "is_host": True},
        {"event": "agent_started", "agent": 1, "pid": 11, "is_host": False},
        {"event": "agent_started", "agent": 2, "pid": 12, "is_host": False},
        {"event": "agent_leave", "agent": 2, "pid": 12},
        {"event": "agent_exit", "agent": 1, "pid": 11, "code": -15},  # ended by a signal, not by a command
        {"event": "agent_exit", "agent": 2, "pid": 12, "code": 0},
    ]
    launch = run_dir / "agents" / "launch.jsonl"
    launch.parent.mkdir(parents=True, exist_ok=True)
    launch.write_text("".join(json.dumps(r) + "\n" for r in records))
    states = {a["agent"]: (a["role"], a["state"]) for a in state_of(run_dir)["agents"]}
    assert states == {0: ("store host", "started"), 1: ("agent", "exited -15"), 2: ("agent", "left")}
