"""The local launcher run again in a run directory whose logs hold the crash loop of an earlier run."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from elastic_qa.chaos.job import Job
from elastic_qa.observe.follow import CrashLoopDetector, read_events

pytestmark = pytest.mark.integration

STEPS = 6


def old_crash_loop(run_dir: Path, when: float) -> None:
    """What an earlier launch left: three worker processes of this host, one after the other, each
    refusing the same bad input before training a step."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True)
    host = socket.gethostname()
    for n, pid in enumerate((4101, 4102, 4103)):
        line = {
            "event": "bad_input",
            "level": "error",
            "error": "train.lr must be > 0",
            "rank": 0,
            "node": f"{host}/0",
            "pid": pid,
            "attempt": 0,
            "ts": when + n,
        }
        (logs / f"rank-000.{host}.pid-{pid}.jsonl").write_text(json.dumps(line) + "\n")


def test_a_start_after_an_old_crash_loop_in_the_same_run_dir_trains_to_the_end(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    old_crash_loop(run_dir, when=time.time() - 600)
    old = CrashLoopDetector()
    old.feed(read_events(run_dir))
    assert old.verdict() == ("train.lr must be > 0", True)  # read whole, the logs are a crash loop

    job = Job(
        run_dir, "tiny", [f"data.cache_dir={cache_dir}", f"train.max_steps={STEPS}"], agents=1, max_nodes=1
    )
    job.start()
    try:
        code = job.wait(timeout=150)
    finally:
        job.kill_everything()

    launcher_output = (run_dir / "chaos" / "launcher.log").read_text()
    assert code == 0, launcher_output[-2000:]
    actions = [json.loads(line)["event"] for line in (run_dir / "agents" / "launch.jsonl").open()]
    assert "crash_loop" not in actions
    assert actions.count("agent_exit") == 1 and actions.index("agent_exit") < actions.index("job_end")
    done = [e for e in read_events(run_dir) if e["event"] == "train_done"]
    assert [e["step"] for e in done] == [STEPS]
    assert f"result: step {STEPS}" in launcher_output


@pytest.mark.parametrize("blocked", ["run.dir under a file", "agents/ a file"])
def test_a_run_directory_the_launcher_cannot_write_is_refused_in_one_line_before_any_agent(
    tmp_path: Path, cache_dir: Path, blocked: str
) -> None:
    import subprocess
    import sys

    from elastic_qa.launcher.processes import python_env

    if blocked == "run.dir under a file":
        (tmp_path / "a-file").write_text("")
        run_dir = tmp_path / "a-file" / "run"
    else:  # the directory exists, but what the launcher writes into it cannot be created
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "agents").write_text("kept")
    result = subprocess.run(
        [sys.executable, "-m", "elastic_qa.launcher.local", "start", "--agents", "2", "--config", "tiny",
         f"run.dir={run_dir}", f"data.cache_dir={cache_dir}"],
        capture_output=True, text=True, env=python_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"elastic-qa: run.dir={run_dir}: cannot write ") and "nothing was started" in line
    assert not (run_dir / "launch.json").exists()
    if blocked == "agents/ a file":
        assert (run_dir / "agents").read_text() == "kept"


def test_a_compile_cache_the_workers_could_not_use_is_refused_before_any_agent(
    tmp_path: Path, cache_dir: Path
) -> None:
    """train.compile with a compile cache directory that cannot be created: one line naming the setting,
    exit 2, nothing started (not each worker's bad-input exit, three times over, in a crash loop)."""
    import subprocess
    import sys

    from elastic_qa.launcher.processes import python_env

    (tmp_path / "a-file").write_text("")
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "elastic_qa.launcher.local", "start", "--agents", "2", "--config", "tiny",
         f"run.dir={run_dir}", f"data.cache_dir={cache_dir}", "train.compile=true",
         f"train.compile_cache_dir={tmp_path / 'a-file' / 'cache'}"],
        capture_output=True, text=True, env=python_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("elastic-qa: train.compile_cache_dir: ") and "a-file" in line, line
    assert not (run_dir / "launch.json").exists()


def test_status_whose_stdout_reader_left_ends_quietly_with_the_status_sigpipe_gives(tmp_path: Path) -> None:
    """`launch/local.sh status --run-dir DIR | head -1`: the reader here closes before reading a byte, so
    every line meets a broken pipe: exit 141 as a Unix tool, no traceback."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from elastic_qa.launcher.processes import python_env

    agents = [{"index": i, "pid": os.getpid(), "is_host": i == 0} for i in range(2000)]  # > a pipe buffer
    (tmp_path / "launch.json").write_text(json.dumps({"agents": agents}))
    reader, writer = os.pipe()
    os.close(reader)
    with os.fdopen(writer, "wb") as stdout:
        result = subprocess.run(
            [sys.executable, "-m", "elastic_qa.launcher.local", "status", "--run-dir", str(tmp_path)],
            stdout=stdout, stderr=subprocess.PIPE, text=True, env=python_env(), timeout=120,
        )  # fmt: skip
    assert (result.returncode, result.stderr) == (128 + signal.SIGPIPE, "")
