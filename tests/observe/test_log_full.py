"""Logging never kills training: a full log disk or a stdout nobody reads any more costs log lines, not
the run. Each test trains the tiny config as one real process and checks what it committed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.observe.follow import read_events
from elastic_qa.observe.log import file_safe, node_name
from tests.conftest import tiny_overrides

STEPS = 12


def command(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    overrides = tiny_overrides(run_dir, cache, f"train.max_steps={STEPS}", "log.every_steps=1", *extra)
    return [sys.executable, "-m", "elastic_qa.train", "--config", "tiny", *overrides]


def committed_steps(run_dir: Path) -> list[int]:
    store = open_store(str(run_dir / "checkpoints"))
    return [info.step for info in store.list_steps() if store.verify(info.path).ok]


def test_a_run_whose_log_file_is_on_a_full_disk_and_whose_stdout_reader_went_away_trains_to_the_end(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Both faults on one run (two tests of one run each before: a start costs seconds of CPU): every write
    of the worker's own log file fails (ENOSPC) and every console line meets EPIPE, and it commits."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    # The worker's own log file is /dev/full (every write fails with ENOSPC): `exec` keeps the pid that
    # names the file.
    name = f"rank-000.{file_safe(node_name())}.pid-$$.jsonl"
    script = f'ln -s /dev/full "{run_dir}/logs/{name}" && exec "$@"'
    worker = subprocess.Popen(
        ["sh", "-c", script, "sh", *command(run_dir, cache_dir, "log.console=plain")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    worker.stdout.close()  # `train | head -0`: every console line now meets EPIPE
    try:
        _, stderr = worker.communicate(timeout=120)
    finally:
        worker.kill()
    assert worker.returncode == 0, stderr.decode()[-2000:]
    assert committed_steps(run_dir) == [STEPS]
    assert (run_dir / "logs" / name.replace("$$", str(worker.pid))).resolve() == Path("/dev/full")


def test_the_log_fault_file_from_step_5_to_the_end_costs_no_training(tmp_path: Path, cache_dir: Path) -> None:
    run_dir = tmp_path / "run"
    flag = tmp_path / "log-full"
    worker = subprocess.Popen(
        command(run_dir, cache_dir, f"debug.log_fault_file={flag}", "debug.step_delay=100ms"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(e.get("event") == "step" and e["step"] >= 5 for e in read_events(run_dir)):
            assert worker.poll() is None and time.monotonic() < deadline, "no step 5"
            time.sleep(0.05)
        flag.touch()
        _, stderr = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert worker.returncode == 0, stderr[-2000:]
    assert committed_steps(run_dir) == [STEPS]
    (log,) = (run_dir / "logs").glob("*.jsonl")
    steps = [json.loads(text) for text in log.read_text().splitlines()]  # whole lines only
    assert max(e["step"] for e in steps if e["event"] == "step") < STEPS  # the fault did hit the log
