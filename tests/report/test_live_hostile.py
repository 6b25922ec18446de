"""The dashboard against hostile files: records of every wrong shape, symlinks swapped in while it follows,
an enormous config, torn lines built to be slow, a log too long to keep."""

from __future__ import annotations

import json
import os
import random
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml

from elastic_qa.observe import follow
from elastic_qa.report import live
from elastic_qa.report.live import LiveRun
from tests.report.runs import CONFIG, T0, line, write_run
from tests.report.served import dashboard

# Every field the state reads, with values of the wrong kind for it.
NOT_A_COUNT = [[0], {"a": 1}, "3", True, 1.5, -1, 2**64, float("nan")]
NOT_A_NUMBER = [[0.5], {"a": 1}, "0.5", True, float("nan"), float("inf"), -float("inf"), 1e300]
NOT_TEXT = [[0], {"a": 1}, 3, 2.5, True]
COUNTS = ["rank", "attempt", "world_size", "pid", "step", "max_steps", "saved_world_size"]
NUMBERS = ["loss", "rank_loss", "lr", "grad_norm", "samples_per_s", "em", "f1", "eval_loss"]
FIELDS = {
    **dict.fromkeys(COUNTS, NOT_A_COUNT),
    **dict.fromkeys(NUMBERS, NOT_A_NUMBER),
    **dict.fromkeys(["event", "node", "error", "reason", "time"], NOT_TEXT),
    "ts": [[1.0], "1.0", True, float("nan"), -5.0, 1e300],
}  # fmt: skip
# Lines that name each event the state looks at (a wrong field must not slip through any of them).
SHAPES = [
    line("step", 12.0, 0, 2, 3, step=60, loss=1.0, rank_loss=1.0, lr=0.1, grad_norm=1.0, samples_per_s=9.0),
    line("worker_start", 20.0, 0, 2, 3),
    line("resume", 20.1, 0, 2, 3, step=50, saved_world_size=2),
    line("worker_crash", 21.0, 1, 2, 3, error="boom", node="host/1"),
    line("checkpoint_committed", 22.0, 0, 2, 3, step=60, reason="final"),
    line("eval", 23.0, 0, 2, 3, step=60, em=0.5, f1=0.5, loss=1.0),
    line("train_done", 24.0, 0, 2, 3, step=60, em=0.5, f1=0.5, eval_loss=1.0),
    line("train_start", 1.0, 0, 1, 2, max_steps=100),
]
BROKEN = [
    [1, 2],
    "text",
    {"ts": T0},  # no event
    {"event": "step"},  # no time
    line("eval", 23.0, 0, 2, 3, em=0.5),  # a score without its F1 and step
    json.loads("{" + '"a": {' * 50 + "}" * 50 + "}"),
]
BAD_FAULTS = [
    {"fault": ["kill"]},
    {"fault": "kill-worker", "ts": "now"},
    {"fault": "kill-worker", "step": "3"},
    {"fault": "kill-worker", "target": {"pid": 1}},
    {"fault": "kill-worker", "skipped": 1},
    {"target": "no fault named"},
]
BAD_LAUNCHER = [
    {"event": "agent_started", "agent": [0], "pid": 1},
    {"event": "agent_exit", "agent": {"a": 1}, "code": 0},
    {"event": "agent_exit", "agent": 0, "code": "-9"},
    {"event": "agent_started", "agent": 3, "is_host": "yes"},
    {"event": "job_end", "exit_codes": [1, 2]},
    {"event": "job_end", "exit_codes": {"0": "x"}},
    {"event": ["job_end"]},
]


def hostile_lines() -> list[dict]:
    rows = []
    for shape in SHAPES:
        for field, wrong in FIELDS.items():
            rows += [{**shape, field: value} for value in wrong]
    return rows


def jsonl(rows: list) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)  # NaN and Infinity as Python writes them


def get_state(url: str) -> dict:
    with urllib.request.urlopen(url + "state.json", timeout=120) as answer:
        assert answer.status == 200
        return json.loads(answer.read())


def test_every_field_of_the_wrong_kind_is_skipped_and_counted_and_the_server_answers(tmp_path: Path) -> None:
    config = {**CONFIG, "data": {"source": "synthetic", "synthetic": [1, 2]}, "train": {"max_steps": "all"}}
    run_dir = write_run(tmp_path / "run", config, **{"rank-009.pid-9.jsonl": hostile_lines() + BROKEN})
    (run_dir / "chaos").mkdir()
    (run_dir / "chaos" / "faults.jsonl").write_text(
        jsonl([*BAD_FAULTS, {"fault": "kill-worker", "ts": T0 + 5}])
    )
    (run_dir / "agents").mkdir()
    (run_dir / "agents" / "launch.jsonl").write_text(
        jsonl([*BAD_LAUNCHER, {"event": "agent_started", "agent": 0, "pid": 10, "is_host": True}])
    )
    plain = LiveRun(write_run(tmp_path / "plain"))
    plain.refresh()
    with dashboard(run_dir) as url:
        state = get_state(url)
        assert state["skipped"] == len(hostile_lines()) + len(BROKEN) + len(BAD_FAULTS) + len(BAD_LAUNCHER)
        assert get_state(url)["version"] == state["version"]  # and the next poll answers too
    expected = plain.state(now=T0 + 40.0)
    for key in (
        "status",
        "step",
        "world_size",
        "attempt",
        "restarts",
        "members",
        "checkpoints",
        "eval",
        "timeline",
    ):
        assert state[key] == expected[key], key
    assert state["max_steps"] is None  # config.yaml's is not a count
    assert [(f["fault"], f["index"]) for f in state["faults"]] == [("kill-worker", 1)]
    assert state["agents"] == [{"agent": 0, "pid": 10, "role": "store host", "state": "started"}]


def test_a_logs_directory_swapped_for_a_symlink_while_followed_is_not_read(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    run = LiveRun(run_dir)
    run.refresh()
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = line("step", 36.0, 0, 2, 3, step=999, loss=1.0, node="s3cret/0")
    for log in (run_dir / "logs").iterdir():  # the same names, longer than what was read of them
        (outside / log.name).write_text(log.read_text() + jsonl([secret]))
    (run_dir / "logs").rename(tmp_path / "old-logs")
    (run_dir / "logs").symlink_to(outside)
    (run_dir / "chaos").symlink_to(outside)
    run.refresh()
    state = run.state(now=T0 + 40.0)
    assert "s3cret" not in json.dumps(state) and state["step"] == 100


def test_a_log_file_swapped_for_a_symlink_or_a_fifo_while_followed_is_not_read(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    run = LiveRun(run_dir)
    run.refresh()
    outside = tmp_path / "secret.jsonl"
    log = run_dir / "logs" / "rank-000.pid-2000.jsonl"
    outside.write_text(log.read_text() + jsonl([line("step", 36.0, 0, 2, 3, step=999, node="s3cret/0")]))
    log.unlink()
    log.symlink_to(outside)
    fifo = run_dir / "logs" / "rank-001.pid-2001.jsonl"
    fifo.unlink()
    os.mkfifo(fifo)  # opening one to read waits for a writer: a poll would hang
    refresh = threading.Thread(target=run.refresh, daemon=True)
    refresh.start()
    refresh.join(timeout=120)
    if refresh.is_alive():  # let it go (a writer that closes at once), then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("a refresh waits on a FIFO swapped in for a log")
    assert "s3cret" not in json.dumps(run.state(now=T0 + 40.0))


def test_an_enormous_config_is_not_read_and_a_config_is_read_again_only_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = []
    load = yaml.load
    monkeypatch.setattr(yaml, "load", lambda *a, **k: parsed.append(1) or load(*a, **k))
    run_dir = write_run(tmp_path / "run")
    with open(run_dir / "config.yaml", "r+b") as handle:
        handle.truncate(64 << 20)  # sparse: costs no disk, would cost each poll its memory and time
    run = LiveRun(run_dir)
    for _ in range(3):
        run.refresh()
    assert run.state()["max_steps"] is None and parsed == []
    (run_dir / "config.yaml").write_text(json.dumps({**CONFIG, "train": {"max_steps": 120}}))
    for _ in range(3):
        run.refresh()
    assert run.state()["max_steps"] == 120 and len(parsed) == 1
    (run_dir / "config.yaml").write_text(json.dumps({**CONFIG, "train": {"max_steps": 1200}}))
    run.refresh()
    assert run.state()["max_steps"] == 1200 and len(parsed) == 2


def test_a_line_built_to_be_slow_costs_a_bounded_number_of_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    parses = []
    loads = follow.json.loads
    monkeypatch.setattr(follow.json, "loads", lambda text: parses.append(len(text)) or loads(text))
    slow = b'{"a' * 20_000  # every `{"` a start to try, each one scanning to the end of the line
    assert follow.parse_log_line(slow) is None
    assert len(parses) < 20
    assert follow.parse_log_line(b'{"x": 1}' + b" " * (2 << 20)) is None  # longer than a log line
    deep = b'{"a": ' * 100_000 + b"1" + b"}" * 100_000  # nested deeper than the parser recurses
    assert follow.parse_log_line(deep) is None
    torn = b'{"event": "st' + json.dumps({"event": "step", "step": 3, "more": {"a": 1}}).encode()
    assert follow.parse_log_line(torn) == {"event": "step", "step": 3, "more": {"a": 1}}


def test_a_long_log_is_kept_thinned_and_its_counts_and_latest_steps_stay_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live, "KEEP_STEPS", 100, raising=False)
    monkeypatch.setattr(live, "CHART_STEPS", 25)
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    steps = 5000
    for rank in range(2):
        rows = [line("worker_start", 0.0, rank, 1, 2)]
        rows += [line("step", s / 100, rank, 1, 2, step=s, loss=1.0, lr=0.1) for s in range(1, steps + 1)]
        rows += [line("checkpoint_committed", s / 100, 0, 1, 2, step=s) for s in range(500, steps + 1, 500)]
        (logs / f"rank-{rank}.jsonl").write_text(jsonl(rows if rank == 0 else rows[: -steps // 500]))
    (tmp_path / "run" / "config.yaml").write_text(json.dumps({**CONFIG, "train": {"max_steps": 10_000}}))
    run = LiveRun(tmp_path / "run")
    run.refresh()
    assert (
        len(run.events) < 2 * 2 * 100 + 50
    )  # of 10,012 lines: at most twice KEEP_STEPS a rank, and the rest
    state = run.state()
    assert state["step"] == steps and [m["step"] for m in state["members"]] == [steps, steps]
    assert state["checkpoints"]["committed"] == 10
    assert state["eta_s"] == pytest.approx(50.0)  # 100 steps a second, 5000 left


# Values of the wrong kind for any field, drawn at random by the fuzz test below: each makes its record
# malformed wherever it lands (a field the state reads, or a required one).
def wrong_value(rng: random.Random, field_kind: str) -> object:
    pool: list[object] = [
        [rng.randint(0, 9)], {"a": [1, {"b": None}]}, [[[]]], True, False, "0", "", "\u202e3",
        float("nan"), float("inf"), -float("inf"), 10**20, -(10**20), 1e300, -1e300,
    ]  # fmt: skip
    if field_kind == "text":
        pool = [value for value in pool if not isinstance(value, str)] + [rng.randint(-5, 5), rng.random()]
    elif field_kind == "count":
        pool += [-rng.randint(1, 10**6), rng.random() * 100, 2**53 + rng.randint(0, 9)]
    elif field_kind == "time":
        pool += [-rng.random(), 1e12 + rng.random()]
    return rng.choice(pool)


LOG_KINDS = {
    **dict.fromkeys(COUNTS, "count"),
    **dict.fromkeys(NUMBERS, "number"),
    **dict.fromkeys(["event", "node", "error", "reason", "time"], "text"),
    "ts": "time",
}  # fmt: skip
FAULT = {"fault": "kill-worker", "target": "rank 1", "step": 30, "ts": T0 + 5}
FAULT_KINDS = {"fault": "text", "target": "text", "step": "count", "ts": "time", "skipped": "text"}
LAUNCHER = {"event": "agent_exit", "ts": T0 + 9, "agent": 1, "pid": 11, "code": -9, "is_host": False}
LAUNCHER_KINDS = {"event": "text", "ts": "time", "agent": "count", "pid": "count", "code": "integer"}


def hostile_variant(rng: random.Random) -> tuple[str, str]:
    """(the file it goes to, one malformed line): a record of a kind the dashboard reads, broken at random."""
    where = rng.choice(["logs/rank-009.pid-9.jsonl"] * 6 + ["chaos/faults.jsonl", "agents/launch.jsonl"])
    if where.startswith("logs"):
        row, kinds, required = dict(rng.choice(SHAPES)), LOG_KINDS, ("event", "ts")
    elif where.startswith("chaos"):
        row, kinds, required = dict(FAULT), FAULT_KINDS, ("fault",)
    else:
        row, kinds, required = dict(LAUNCHER), LAUNCHER_KINDS, ("event",)
    how = rng.randrange(10)
    if how == 0:  # not an object at all
        return where, json.dumps(rng.choice([[row], list(row), "step", 3, None, 1e300]))
    if how == 1:  # a required field missing (or null, which counts as missing)
        field = rng.choice(required)
        if rng.random() < 0.5:
            del row[field]
        else:
            row[field] = None
    else:  # one to three fields of the wrong kind, and perhaps fields nobody reads
        for field in rng.sample(sorted(kinds), rng.randint(1, 3)):
            row[field] = wrong_value(rng, kinds[field])
        if rng.random() < 0.3:
            row["x" * rng.randint(1, 50)] = {"deep": [[rng.random()]] * 3}
    text = json.dumps(row)
    if how == 9:  # and a tail that is no JSON
        text += rng.choice(["}", "]]", ", ", "\x00", "{"])
    return where, text


def test_fuzz_every_poll_answers_and_each_hostile_line_is_skipped_and_counted(tmp_path: Path) -> None:
    def run_with_records(path: Path) -> Path:
        run_dir = write_run(path)
        (run_dir / "chaos").mkdir()
        (run_dir / "chaos" / "faults.jsonl").write_text(jsonl([FAULT]))
        (run_dir / "agents").mkdir()
        (run_dir / "agents" / "launch.jsonl").write_text(
            jsonl([{"event": "agent_started", "ts": T0, "agent": 1, "pid": 11, "is_host": False}, LAUNCHER])
        )
        return run_dir

    expected = LiveRun(run_with_records(tmp_path / "plain"))
    expected.refresh()
    want = expected.state(now=T0 + 40.0)
    run_dir = run_with_records(tmp_path / "run")
    run = LiveRun(run_dir)
    rng = random.Random(38)
    for count in range(1, 1501):
        where, text = hostile_variant(rng)
        with open(run_dir / where, "a") as handle:
            handle.write(text + "\n")
        run.refresh()
        state = run.state(now=T0 + 40.0)
        json.dumps(state, allow_nan=False)  # the page's JSON.parse takes no NaN
        assert state["skipped"] == count, f"not skipped: {where}: {text}"
        for key in ("status", "step", "max_steps", "world_size", "attempt", "members", "checkpoints",
                    "eval", "timeline", "faults", "agents"):  # fmt: skip
            assert state[key] == want[key], (key, where, text)


def test_lines_longer_than_a_log_line_are_skipped_and_counted_and_the_next_is_read(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    log = run_dir / "logs" / "rank-000.pid-2000.jsonl"
    torn = '{"event": "st' + '{"a' * (700 << 10)  # 2.1 MiB: every `{"` a start to try
    huge = '{"event": "step", "pad": "' + "x" * (live.READ_CAP + (1 << 20)) + '"}'  # longer than a read
    after = line("eval", 35.5, 0, 2, 3, step=100, em=0.875, f1=0.9, loss=0.4)
    with open(log, "a") as handle:
        handle.write(torn + "\n" + huge + "\n" + json.dumps(after) + "\n")
    run = LiveRun(run_dir)
    while True:
        run.refresh()
        if not run.behind():
            break
    state = run.state(now=T0 + 40.0)
    assert state["skipped"] == 2
    assert state["eval"] == {"step": 100, "em": 0.875, "f1": 0.9}  # the line after them is read
    assert state["step"] == 100 and len(state["members"]) == 3


# Values at the edges of what a field may hold: such a record is kept, and must not break a poll either.
EDGES = {
    "count": [0, 1, 2**53 - 1, 2**31, 7],
    "number": [0, 0.0, -0.0, 1e-300, -1e-300, 2**53 - 1, -(2**53 - 1), 5e-324, 1.0],
    "text": ["", "x" * 5000, "\ud800", "<script>", "\x00", "/", "@/", "a/b/c@d"],
    "time": [0, 0.0, 1e11 - 1, T0, T0 + 1e-9, 5e-324],
}


def test_fuzz_records_at_the_edges_of_each_field_never_break_a_poll(tmp_path: Path) -> None:
    rng = random.Random(39)
    for index in range(150):
        rows = []
        for _ in range(rng.randint(1, 6)):
            row = dict(rng.choice(SHAPES))
            for field in rng.sample(sorted(LOG_KINDS), rng.randint(1, 5)):
                row[field] = rng.choice(EDGES[LOG_KINDS[field]])
            if "em" in row:  # a score comes with its F1 and step (else it is malformed)
                row = {"f1": 0.5, "step": 1, **row}
            rows.append(row)
        run = LiveRun(write_run(tmp_path / f"run-{index}", **{"rank-009.pid-9.jsonl": rows}))
        run.refresh()
        state = run.state()
        json.dumps(state, allow_nan=False)
        assert state["skipped"] == 0, rows
        run.close()
