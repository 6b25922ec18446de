"""The dashboard of a real 2-agent job, live in headless Chromium: the page shows the steps advance at world
size 2, then a worker killed with SIGKILL (shown as killed by SIGKILL, as its agent logged it) and the
regroup that follows, then the finished run.

The job is held after steps 5 and 10 (elastic_qa/step_holds.py), so what the page must show cannot race
the job: while held at 5 it shows step 5; the kill lands while the job is held at 10.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from elastic_qa.chaos.job import Job
from elastic_qa.step_holds import arm, release
from tests.browser import Browser, browser_missing
from tests.report.served import dashboard, screenshot_path

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or ""),
]
MAX_STEPS = 30


def shows(browser: Browser, **expected: str) -> str:
    """Wait until each element (by id) shows its text; `step_at_least` compares the step as a number."""
    least = expected.pop("step_at_least", None)
    checks = [
        f"document.getElementById({k.replace('_', '-')!r}).textContent === {v!r}" for k, v in expected.items()
    ]
    if least is not None:
        checks.append(f"Number(document.getElementById('step').textContent) >= {least}")
    return browser.wait_for(f"return {' && '.join(checks)}", f"the page to show {expected} step>={least}")


def test_the_page_follows_a_live_job_through_a_killed_worker_and_its_regroup(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir, holds = tmp_path / "run", tmp_path / "holds"
    arm(holds, [5, 10])
    overrides = [f"data.cache_dir={cache_dir}", f"train.max_steps={MAX_STEPS}", "log.every_steps=1",
                 "log.console=none", "checkpoint.every_steps=5", f"debug.hold_dir={holds}"]  # fmt: skip
    job = Job(run_dir, "tiny", overrides, agents=2)
    job.start()
    try:
        job.wait_for_step(5, timeout=300)  # the feature cache is built first: minutes on a loaded machine
        with dashboard(run_dir) as url, Browser(tmp_path) as browser:
            browser.get(url)
            shows(browser, step="5", world="2", attempt="1", status="training")  # held after step 5
            browser.screenshot(screenshot_path(tmp_path, "live-step5"))
            release(holds, 5)
            shows(browser, step="10", world="2", attempt="1")  # the steps advanced; held after step 10
            assert browser.run("return document.querySelectorAll('#members tbody tr').length") == 2
            victim = next(agent for agent in job.live_agents() if not agent["is_host"])
            for pid in job.workers(victim):
                os.kill(pid, signal.SIGKILL)
            release(holds, 10)
            shows(browser, attempt="2", world="2", restarts="1", step_at_least=11)
            assert "attempt 2 started with 2 workers" in browser.text("#timeline")
            # The killed worker, as its torchrun agent logged it, not only its peer's gloo error.
            killed = "document.getElementById('timeline').textContent.includes('killed by SIGKILL')"
            browser.wait_for(f"return {killed}", "the timeline to show the worker killed by SIGKILL")
            browser.screenshot(screenshot_path(tmp_path, "live-regrouped"))
            assert job.wait(300) == 0
            shows(browser, status="finished", step=str(MAX_STEPS), restarts="1")
            assert browser.console_errors() == []
            browser.screenshot(screenshot_path(tmp_path, "live-finished"))
            browser.run("document.getElementById('charts').scrollIntoView()")
            browser.screenshot(screenshot_path(tmp_path, "live-charts"))
    finally:
        job.kill_everything()
