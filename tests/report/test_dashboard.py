"""`elastic-qa dashboard RUN_DIR`: a real server process answers the page and its state and nothing else,
and headless Chromium shows a finished run, markup in its files shown as text."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.browser import Browser, browser_missing
from tests.report.runs import T0
from tests.report.served import dashboard, screenshot_path
from tests.report.test_live import HOSTILE_ERROR, HOSTILE_HOST, hostile_run

FAULTS = [
    {"fault": "kill-worker", "spec": "kill-worker@step=20", "target": "rank 1", "step": 20, "ts": T0 + 5},
    {"action": "thawed", "fault": "kill-worker", "ts": T0 + 6},
    {"fault": "<b>bold</b>", "target": HOSTILE_HOST, "step": 60, "ts": T0 + 25},
]


def chaos_run(run_dir: Path) -> Path:
    hostile_run(run_dir)
    (run_dir / "chaos").mkdir()
    (run_dir / "chaos" / "faults.jsonl").write_text("".join(json.dumps(f) + "\n" for f in FAULTS))
    return run_dir


def get(url: str, path: str, host: str | None = None) -> tuple[int, bytes]:
    """GET `path` exactly as written (no normalising of `..` or escapes)."""
    address = urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname or "", address.port, timeout=60)
    try:
        connection.putrequest("GET", path, skip_host=host is not None)
        if host is not None:
            connection.putheader("Host", host)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_the_server_answers_the_page_and_its_state_and_refuses_every_other_path(tmp_path: Path) -> None:
    run_dir = chaos_run(tmp_path / "run")
    (tmp_path / "secret.txt").write_text("s3cret")
    with dashboard(run_dir) as url:
        status, page = get(url, "/")
        assert status == 200 and b"<script nonce=" in page
        status, body = get(url, "/state.json")
        state = json.loads(body)
        assert status == 200 and (state["step"], state["world_size"], state["restarts"]) == (100, 3, 1)
        assert [f["fault"] for f in state["faults"]] == ["kill-worker", "<b>bold</b>"]
        status, body = get(url, f"/state.json?since={state['version']}")
        assert json.loads(body)["unchanged"] is True
        for path in (
            "/../../etc/passwd",
            "/%2e%2e/%2e%2e/etc/passwd",
            "/..%2f..%2fsecret.txt",
            "/../secret.txt",
            "/config.yaml",
            "/logs/rank-000.pid-1000.jsonl",
            "/state.json/../config.yaml",
            "//etc/passwd",
        ):
            status, body = get(url, path)
            assert (status, b"s3cret" in body, b"root:" in body) == (404, False, False), path
        assert get(url, "/", host="evil.example:80")[0] == 403  # DNS rebinding: another name for loopback
        assert get(url, "/", host="localhost:9999")[0] == 200  # ssh -L to another local port


def run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "elastic_qa.cli", "dashboard", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_a_missing_run_directory_or_a_busy_port_is_bad_input_with_exit_2(tmp_path: Path) -> None:
    result = run_cli(str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "is not a directory" in result.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run_cli(str(tmp_path), "--port", str(taken.getsockname()[1]))
    assert result.returncode == 2 and "cannot listen on 127.0.0.1:" in result.stderr
    assert run_cli(str(tmp_path), "--port", "70000").returncode == 2


@pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or "")
def test_a_finished_run_shows_in_the_browser_with_markup_from_its_files_as_text(tmp_path: Path) -> None:
    run_dir = chaos_run(tmp_path / "run")
    with dashboard(run_dir) as url, Browser(tmp_path) as browser:
        browser.get(url)
        browser.wait_for("return document.body.dataset.version >= 1", "the first state")
        shown = {
            name: browser.text(f"#{name}") for name in ("status", "step", "max-steps", "world", "restarts")
        }
        assert shown == {
            "status": "finished",
            "step": "100",
            "max-steps": "100",
            "world": "3",
            "restarts": "1",
        }
        assert browser.text("#fault-count") == "2"
        timeline, faults = browser.text("#timeline"), browser.text("#faults")
        assert f"rank 1 on {HOSTILE_HOST} crashed: {HOSTILE_ERROR}" in timeline  # as text
        assert "<b>bold</b>" in faults and HOSTILE_HOST in faults
        assert HOSTILE_ERROR in browser.text("#summary")  # the config's data source, as text
        assert browser.run("return typeof window.pwned") == "undefined"
        assert browser.run("return document.querySelectorAll('b, img, #timeline script').length") == 0
        assert browser.run("return document.querySelectorAll('#charts svg').length") >= 6
        assert browser.console_errors() == []
        browser.screenshot(screenshot_path(tmp_path, "finished-top"))
        browser.run("document.getElementById('faults').scrollIntoView()")
        browser.screenshot(screenshot_path(tmp_path, "finished-tables"))
