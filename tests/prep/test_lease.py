"""A cache lease left by a builder that is gone never makes anyone wait; a wait for a live builder is
bounded, says whom it waits for, and ends at Ctrl-C (real `elastic-qa prepare` processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from elastic_qa.config import load_config, packaged_config
from elastic_qa.liveness import HOST, this_process
from elastic_qa.prep import cache_key


def prepare_command(cache: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "elastic_qa.cli",
        "prepare",
        "--config",
        "tiny",
        f"data.cache_dir={cache}",
        *extra,
    ]


def plant_lease(cache: Path, record: dict, age_s: float) -> Path:
    key = cache_key(load_config(packaged_config("tiny"), [f"data.cache_dir={cache}"]))
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{key}.lease"
    path.write_text(json.dumps(record))
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_a_lease_whose_pid_was_reused_since_an_hour_does_not_hold_prepare(tmp_path: Path) -> None:
    # The old format ({host, pid}) and pid 1, which always runs: judged by pid plus age, it is gone.
    cache = tmp_path / "cache"
    plant_lease(cache, {"host": HOST, "pid": 1, "token": "x"}, age_s=3600)
    result = subprocess.run(prepare_command(cache), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "training windows" in result.stdout


def test_a_fresh_lease_of_my_parents_pid_with_another_start_time_does_not_hold_prepare(
    tmp_path: Path,
) -> None:
    # The new format: the parent (pytest) runs, but not as the process that took the lease.
    cache = tmp_path / "cache"
    record = this_process(os.getpid()).to_dict()
    record["start"] -= 1
    plant_lease(cache, {**record, "since": time.time(), "token": "x"}, age_s=0)
    result = subprocess.run(prepare_command(cache), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr


def _live_holder(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record = {**this_process(holder.pid).to_dict(), "since": time.time(), "token": "x"}
    return holder, plant_lease(tmp_path / "cache", record, age_s=0)


def test_a_wait_for_a_live_builder_says_whom_it_waits_for_and_gives_up_after_build_wait(
    tmp_path: Path,
) -> None:
    holder, lease = _live_holder(tmp_path)
    try:
        result = subprocess.run(
            prepare_command(tmp_path / "cache", "data.build_wait=2s"),
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "waiting_for_cache_build" in lines[0] and f"pid {holder.pid} on host {HOST}" in lines[0]
    assert lines[-1].startswith("elastic-qa: waited ") and f"pid {holder.pid}" in lines[-1], lines
    assert "data.build_wait" in lines[-1] and "Traceback" not in result.stderr
    assert lease.exists()  # a live builder's lease is never broken


def test_ctrl_c_ends_a_wait_for_a_live_builder(tmp_path: Path) -> None:
    holder, _ = _live_holder(tmp_path)
    waiter = subprocess.Popen(
        prepare_command(tmp_path / "cache"), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(waiter.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("waiting_for_cache_build" in line for line in said):
            assert waiter.poll() is None and time.monotonic() < deadline, f"the wait was never said: {said}"
            time.sleep(0.05)
        waiter.send_signal(signal.SIGINT)
        code = waiter.wait(timeout=60)
        reader.join(timeout=30)
    finally:
        for process in (waiter, holder):
            process.kill()
            process.wait()
    assert code == 130, said
    assert "interrupted" in said[-1] and not any("Traceback" in line for line in said)


def test_a_wait_in_the_hosts_queue_behind_a_live_builder_is_said_and_bounded(tmp_path: Path) -> None:
    # The builder ahead holds the per-host flock (as a rank of this host building does) and the lease.
    cache = tmp_path / "cache"
    key = cache_key(load_config(packaged_config("tiny"), [f"data.cache_dir={cache}"]))
    cache.mkdir(parents=True)
    hold = (
        "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('locked', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(cache / f"{key}.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        plant_lease(cache, {**this_process(holder.pid).to_dict(), "since": time.time(), "token": "x"}, 0)
        result = subprocess.run(
            prepare_command(cache, "data.build_wait=2s"), capture_output=True, text=True, timeout=180
        )
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "waiting_for_cache_build" in lines[0] and f"pid {holder.pid}" in lines[0], lines
    assert lines[-1].startswith("elastic-qa: waited ") and "data.build_wait" in lines[-1], lines
