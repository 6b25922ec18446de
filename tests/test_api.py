"""The Python API: fit in this process and under agents, predict as `ask`, evaluate as `eval`, and the
`elastic-qa train` command that fit(agents=0) stands for."""

from __future__ import annotations

import fcntl
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import elastic_qa
from elastic_qa.api import build_config
from elastic_qa.checkpoint.locate import load_checkpoint
from elastic_qa.cli import main as cli_main
from elastic_qa.config import ConfigError, parse_override
from elastic_qa.data.examples import DataError
from elastic_qa.dist import denormals_flushed
from elastic_qa.exits import UsageError
from elastic_qa.export import EXPORT_FILE
from elastic_qa.observe.follow import read_events
from elastic_qa.prep.cache import cache_key
from tests.conftest import FIXTURES

QUESTIONS = [
    ("where does bako live ?", "bako lives in rome . bako owns a red car ."),
    ("what does bako own ?", "bako lives in rome . bako owns a red car ."),
]


def tiny(run_dir: Path, cache: Path, **train: Any) -> dict[str, Any]:
    """fit's keyword sections for the tiny config in `run_dir`, sharing the session's feature cache."""
    return {"run": {"dir": run_dir}, "data": {"cache_dir": cache}, "log": {"console": "none"}, "train": train}


def test_import_elastic_qa_is_cheap_and_its_api_loads_on_first_use() -> None:
    code = "import sys, elastic_qa; elastic_qa.fit; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]
    importlib.import_module("elastic_qa.evaluation")  # the prediction and scoring module ...
    assert elastic_qa.evaluate is elastic_qa.api.evaluate  # ... is no attribute named like the API's function


def test_fit_in_this_process_from_a_thread_returns_the_final_metrics_and_model_paths(
    tmp_path: Path, cache_dir: Path
) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    handler = signal.getsignal(signal.SIGINT)
    outcome: dict[str, Any] = {}

    def work() -> None:  # off the main thread, as under a web server: no signal handlers can be taken
        try:
            outcome["result"] = elastic_qa.fit(
                "tiny", export=tmp_path / "export", **tiny(tmp_path / "run", cache_dir, max_steps=4)
            )
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = err

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(timeout=300)
    assert not worker.is_alive() and "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert (result.step, result.stopped, result.run_dir) == (4, False, tmp_path / "run")
    assert set(result.metrics) == {"em", "f1", "eval_loss"} and 0 <= result.em <= result.f1 <= 1
    assert result.checkpoint == str(tmp_path / "run" / "checkpoints" / "step-00000004")
    assert (result.export / EXPORT_FILE).is_file()
    assert result.config.train.max_steps == 4
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert (os.umask(umask), signal.getsignal(signal.SIGINT)) == (umask, handler)  # the process's own


def test_a_second_fit_in_this_process_is_refused_while_one_trains_and_the_first_logs_only_its_own_steps(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Run a waits in its cache build, behind a lock this test holds, with its log already open: a fit from
    another thread is refused then, naming run a; run a's log holds its own steps once; a later fit works."""
    sections = tiny(tmp_path / "a", tmp_path / "cache-a", max_steps=3, warmup_steps=0)
    sections["log"]["every_steps"] = 1
    cfg = build_config("tiny", sections=sections)
    (tmp_path / "cache-a").mkdir()
    build_queue = open(tmp_path / "cache-a" / f"{cache_key(cfg)}.lock", "w")  # noqa: SIM115 (released below)
    fcntl.flock(build_queue, fcntl.LOCK_EX)
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["result"] = elastic_qa.fit("tiny", **sections)
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = err

    first = threading.Thread(target=work)
    first.start()
    try:
        while not list((tmp_path / "a" / "logs").glob("*.jsonl")):  # its logging is set up: it trains
            assert first.is_alive(), outcome
            first.join(timeout=0.05)
        with pytest.raises(elastic_qa.FitInProgress, match=r"^run .*a is already training in this process"):
            elastic_qa.fit("tiny", **tiny(tmp_path / "b", cache_dir, max_steps=2))
    finally:
        build_queue.close()  # run a builds its cache and trains
        first.join(timeout=300)
    assert not first.is_alive() and "error" not in outcome, outcome.get("error")
    assert not (tmp_path / "b").exists()  # refused before it wrote anything
    events = read_events(tmp_path / "a")
    assert [row["event"] for row in events].count("train_start") == 1
    assert [row["step"] for row in events if row["event"] == "step"] == [1, 2, 3]

    flushed = denormals_flushed()
    later = elastic_qa.fit("tiny", **tiny(tmp_path / "c", cache_dir, max_steps=2, warmup_steps=0))
    assert (later.step, later.stopped) == (2, False)
    assert denormals_flushed() == flushed  # train.flush_denormals is the run's: the caller's flag is put back


def test_fit_raises_bad_input_instead_of_exiting(tmp_path: Path, cache_dir: Path) -> None:
    sections = tiny(tmp_path / "run", cache_dir)
    with pytest.raises(ConfigError, match=r"^train.epochs=2: train.max_steps=40 sets the length too"):
        elastic_qa.fit("tiny", overrides={"train.epochs": 2}, **sections)
    with pytest.raises(ConfigError, match=r"^train.max_step: unknown key"):
        elastic_qa.fit("tiny", overrides={"train.max_step": 5}, **sections)
    with pytest.raises(ConfigError, match=r"^train=5: a section takes a dict"):
        elastic_qa.fit("tiny", train=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^agents=-1"):
        elastic_qa.fit("tiny", agents=-1, **sections)
    with pytest.raises(DataError, match="nonexistent"):
        elastic_qa.fit({"data": {"source": str(tmp_path / "nonexistent.json")}}, **sections)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"^export=.*taken: not an empty directory"):
        elastic_qa.fit("tiny", export=tmp_path / "taken", **tiny(tmp_path / "run2", cache_dir))
    assert not (tmp_path / "run2").exists()  # refused before training


def test_predict_answers_as_ask_json_does(trained: Path, capsys: pytest.CaptureFixture) -> None:
    answers = elastic_qa.predict(trained, [{"question": q, "context": c} for q, c in QUESTIONS])
    assert elastic_qa.predict(trained, QUESTIONS) == answers  # pairs or dicts: the same
    for threshold in (-1e9, 1e9):  # nothing answered, everything answered
        answers = elastic_qa.predict(trained, QUESTIONS, null_threshold=threshold)
        for (question, context), answer in zip(QUESTIONS, answers, strict=True):
            args = ["--checkpoint", str(trained), "--question", question, "--context", context]
            code = cli_main(["ask", *args, "--json", f"--null-threshold={threshold}"])
            assert code == 0
            reply = json.loads(capsys.readouterr().out)
            assert (answer.text, answer.start, answer.end) == (reply["answer"], reply["start"], reply["end"])
            assert (answer.score, answer.null_odds) == (reply["score"], reply["null_odds"])
            span = reply["best_span"]
            assert (answer.best_span, answer.best_start, answer.best_end) == (
                (span["text"], span["start"], span["end"]) if span else ("", None, None)
            )
            assert answer.no_answer == (threshold < 0)
    with pytest.raises(ValueError, match=r"^questions\[0\]="):
        elastic_qa.predict(trained, [{"question": "no context"}])


def test_evaluate_returns_the_scores_of_eval_json(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = str(FIXTURES / "squad-v2-dev-sample.json")
    code = cli_main(["eval", "--checkpoint", str(trained), "--data", data, "--out", str(tmp_path), "--json"])
    assert code == 0
    reply = json.loads(capsys.readouterr().out)
    scores = elastic_qa.evaluate(trained, data)
    assert scores == {k: v for k, v in reply.items() if k not in ("predictions", "null_odds")}
    assert {"exact", "f1", "total", "best_f1"} <= set(scores) and scores["step"] == 30


def test_elastic_qa_train_trains_in_one_process_and_exits_0_or_2_on_a_bad_config(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    overrides = [f"run.dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", "log.console=none"]
    assert cli_main(["train", "--config", "tiny", *overrides, "train.epochs=1"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("elastic-qa: config error: train.epochs=1: train.max_steps=40 sets the length")
    assert not (tmp_path / "run").exists()  # refused before anything is written
    command = [sys.executable, "-m", "elastic_qa.cli", "train", "--config", "tiny", *overrides]
    done = subprocess.run([*command, "train.max_steps=3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("final: step 3  EM ")
    assert (tmp_path / "run" / "checkpoints" / "step-00000003" / "manifest.json").is_file()


def test_fit_with_two_agents_resumes_an_epochs_run_at_the_end_it_first_resolved(
    tmp_path: Path, cache_dir: Path
) -> None:
    """One process starts train.epochs=2 and is killed after a saved step; two agents resume it with
    another global batch, under which the epochs would come to other steps: the run ends where it was first
    resolved, and its LR schedule was aimed at that step."""
    run_dir = tmp_path / "run"
    data = ["data.synthetic.train_examples=48", "data.synthetic.eval_examples=8"]
    length = ["train.max_steps=0", "train.epochs=2", "train.global_batch_size=16", "train.warmup_steps=0"]
    saves = ["checkpoint.every_steps=2", "checkpoint.async=false"]  # step 2 committed before the kill
    command = [sys.executable, "-m", "elastic_qa.train", "--config", "tiny", f"run.dir={run_dir}"]
    command += [f"data.cache_dir={cache_dir}", "log.console=none", *data, *length, *saves]
    killed = subprocess.run([*command, "debug.kill_at_step=3"], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    [first] = [row for row in read_events(run_dir) if row["event"] == "train_start"]
    end = 2 * math.ceil(first["train_windows"] / 16)
    assert (first["max_steps"], first["epochs"]) == (end, 2)
    saved = load_checkpoint(str(run_dir / "checkpoints" / "step-00000002")).trainer
    assert saved["length"] == {"epochs": 2, "end_step": end}
    assert [entry["total_steps"] for entry in saved["lr_scheduler"]["lr_lambdas"]] == [end, end]

    overrides = dict(parse_override(text) for text in [*data, *length, *saves])
    overrides["train.global_batch_size"] = 8  # 2 epochs would now be about twice as many steps
    result = elastic_qa.fit("tiny", agents=2, overrides=overrides, **tiny(run_dir, cache_dir))

    assert (result.step, result.stopped) == (end, False)
    assert set(result.metrics) == {"em", "f1", "eval_loss"}
    resumed = [row for row in read_events(run_dir) if row["event"] == "train_start"][1:]
    assert {(row["world_size"], row["max_steps"]) for row in resumed} == {(2, end)}
    final = load_checkpoint(result.checkpoint).trainer
    assert final["counters"]["step"] == end and final["length"] == {"epochs": 2, "end_step": end}
