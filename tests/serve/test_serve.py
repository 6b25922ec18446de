"""A real `elastic-qa serve` process on a tiny trained model: its answers are `elastic-qa ask --json`'s,
batched or not; 8 clients x 200 requests get no error and the single-request answers; the page shows an
answer highlighted and a question with HTML in it as text; bad model paths exit 2; SIGTERM exits 0."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastic_qa.bench.serve import (
    QUESTIONS,
    ServerProcess,
    answer_differences,
    connect,
    drive,
    request,
    single_answers,
    start_server,
)
from elastic_qa.cli import main as cli_main
from tests.browser import Browser, browser_missing
from tests.conftest import REPO

SCORE_TOLERANCE = 1e-4  # a batch pads windows to its longest: scores may differ in their last digits


def ask_json(trained: Path, question: dict[str, str], capsys: pytest.CaptureFixture, *flags: str) -> Any:
    args = ["ask", "--checkpoint", str(trained), "--question", question["question"], "--context"]
    assert cli_main([*args, question["context"], "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def post(url: str, body: Any) -> tuple[int, Any]:
    connection = connect(url)
    try:
        status, reply, _ = request(connection, "POST", "/v1/answer", body)
        return status, reply
    finally:
        connection.close()


def test_the_long_context_needs_several_windows(trained: Path) -> None:
    import torch

    from elastic_qa.data.examples import QAExample
    from elastic_qa.export import load_for_prediction

    loaded = load_for_prediction(str(trained), torch.device("cpu"))
    long = QUESTIONS[-1]
    features = loaded.family.features([QAExample("0", long["question"], long["context"])], loaded.cfg)
    assert len(features) > 5


def test_answers_equal_ask_json_one_at_a_time_and_batched(
    server: ServerProcess, trained: Path, capsys: pytest.CaptureFixture
) -> None:
    expected = [ask_json(trained, question, capsys) for question in QUESTIONS]
    assert single_answers(server.url, QUESTIONS) == expected
    status, reply = post(server.url, {"questions": QUESTIONS})
    assert status == 200
    batched = reply["answers"]
    for got, want in zip(batched, expected, strict=True):
        exact = ("answer", "start", "end", "best_span", "null_threshold")
        assert {k: got[k] for k in exact} == {k: want[k] for k in exact}
        assert got["score"] == pytest.approx(want["score"], abs=SCORE_TOLERANCE)
        assert got["null_odds"] == pytest.approx(want["null_odds"], abs=SCORE_TOLERANCE)
    largest = max(
        abs(g[k] - w[k]) for g, w in zip(batched, expected, strict=True) for k in ("score", "null_odds")
    )
    print(f"batched vs single: largest score difference {largest:.3g}")


def test_a_null_threshold_below_every_null_odds_gives_no_answer_as_ask_does(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    flags = ["--null-threshold=-1e9"]
    nothing = start_server(str(trained), flags, tmp_path / "stderr", cwd=REPO)
    try:
        answers = single_answers(nothing.url, QUESTIONS[:3])
    finally:
        nothing.process.send_signal(signal.SIGINT)  # Ctrl-C: stops as SIGTERM does
        assert nothing.stop() == 0
    for question, answer in zip(QUESTIONS[:3], answers, strict=True):
        assert answer == ask_json(trained, question, capsys, *flags)
        assert (answer["answer"], answer["start"], answer["end"]) == ("", None, None)
        assert answer["best_span"] is not None and answer["null_threshold"] == -1e9


def test_the_server_keeps_serving_after_bad_requests(server: ServerProcess) -> None:
    assert post(server.url, {"questions": [{"question": "q", "context": 3}]}) == (
        400,
        {"error": "questions[0].context: expected a string, got a number"},
    )
    assert post(server.url, b"{" + b" " * (1 << 20)) == (
        413,
        {"error": f"body: {(1 << 20) + 1} bytes, at most {1 << 20}"},
    )
    status, reply = post(server.url, QUESTIONS[0])
    assert status == 200 and set(reply) == {
        "answer",
        "start",
        "end",
        "score",
        "null_odds",
        "null_threshold",
        "best_span",
    }


def load_figures(server: ServerProcess, label: str) -> None:
    reference = single_answers(server.url, QUESTIONS)
    before = server.rss_bytes()
    load = drive(server.url, clients=8, requests=200, questions=QUESTIONS)
    after = server.rss_bytes()
    assert load.errors() == []
    assert len(load.rows) == 1600
    wrong, largest = answer_differences(load, reference)
    assert wrong == []
    assert largest <= SCORE_TOLERANCE
    assert after - before < 256 * 2**20, f"RSS grew from {before >> 20} MiB to {after >> 20} MiB"
    connection = connect(server.url)
    _, health, _ = request(connection, "GET", "/healthz")
    connection.close()
    print(
        f"{label}: p50 {load.percentile_ms(0.5):.1f} ms, p99 {load.percentile_ms(0.99):.1f} ms, "
        f"{len(load.rows) / load.wall_s:.0f} requests/s, "
        f"RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB, "
        f"{health['questions'] / max(health['batches'], 1):.2f} questions per model call, "
        f"largest score difference {largest:.3g}"
    )


def test_8_clients_x_200_requests_get_no_error_and_the_single_request_answers(
    server: ServerProcess, trained: Path, tmp_path: Path
) -> None:
    load_figures(server, "batching")
    single = start_server(str(trained), ["--max-batch", "1"], tmp_path / "stderr", cwd=REPO)
    try:
        load_figures(single, "--max-batch 1")
    finally:
        assert single.stop() == 0


def test_a_model_that_does_not_load_or_a_taken_port_exits_2_with_one_line(
    server: ServerProcess, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "elastic_qa.cli", "serve"]
    for args in ([str(tmp_path / "nothing-here")], [str(tmp_path)]):
        done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, cwd=REPO)
        assert done.returncode == 2 and done.stdout == ""
        assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("elastic-qa: ")
    port = server.url.rsplit(":", 1)[1].strip("/")
    model = server.process.args[4]  # type: ignore[index]
    done = subprocess.run(
        [*command, model, "--port", port], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 2 and done.stderr.startswith(
        f"elastic-qa: --host 127.0.0.1 --port {port}: cannot listen"
    )
    done = subprocess.run(
        [*command, model, "--max-batch", "0"], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 2 and "--max-batch: '0': expected a whole number >= 1" in done.stderr


@pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))
def test_the_page_shows_the_answer_highlighted_and_html_in_a_question_as_text(
    trained: Path, tmp_path: Path
) -> None:
    answering = start_server(str(trained), ["--null-threshold=1e9"], tmp_path / "stderr", cwd=REPO)
    try:
        context = "bako lives in rome . bako owns a red car ."
        question = "what does bako own ? <img src=x onerror=\"document.title='pwned'\">"
        expected = post(answering.url, {"question": question, "context": context})[1]
        assert expected["answer"]  # every question is answered at this threshold
        with Browser(tmp_path) as browser:
            browser.get(answering.url)
            browser.type("#context-input", context)
            browser.type("#question", question)
            browser.click("#submit")
            browser.wait_for("return !document.getElementById('result').hidden", "the answer to appear")
            assert browser.text("#asked") == f"Q: {question}"  # shown as text, not made an element
            assert browser.run("return document.querySelectorAll('#result img').length") == 0
            assert browser.run("return document.title") == "elastic-qa serve"
            assert browser.text("#answer") == expected["answer"]
            assert browser.text("#context mark.answer") == expected["answer"]
            assert (
                browser.run("return document.querySelector('#context mark').previousSibling.textContent")
                == (context[: expected["start"]])
            )
            assert browser.text("#context") == context
            assert browser.console_errors() == []
            shot = browser.screenshot(tmp_path / "serve.png")
    finally:
        assert answering.stop() == 0
    if os.environ.get("EQA_SHOTS"):
        shutil.copy(shot, Path(os.environ["EQA_SHOTS"]) / "serve.png")


def test_bench_serve_reports_both_variants_and_checks_their_answers(trained: Path, tmp_path: Path) -> None:
    from elastic_qa.bench.cli import main as bench_main

    out = tmp_path / "figures.json"
    argv = ["serve", "--model", str(trained), "--clients", "2", "--requests", "5", "--reps", "1"]
    assert bench_main([*argv, "--json", str(out), "--work-dir", str(tmp_path / "work")]) == 0
    result = json.loads(out.read_text())
    assert set(result["figures"]) == {"batching", "no batching"}
    for figures in result["figures"].values():
        assert figures["p50_ms"]["median"] <= figures["p99_ms"]["median"]
        assert figures["requests_per_s"]["median"] > 0 and figures["rss_after_mib"]["median"] > 0
    assert result["figures"]["no batching"]["mean_batch"]["median"] == 1.0
    assert result["largest_score_difference"] <= SCORE_TOLERANCE
    assert bench_main(["serve", "--model", str(tmp_path / "nothing")]) == 2
