"""A benchmark stopped half-way (Ctrl-C, SIGTERM from a scheduler or a test timeout, SIGKILL) leaves no
process of the jobs it started: launcher, agents and workers all end with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_qa.launcher.processes import alive, cmdline, descendants, kill_trees, python_env, workers_of

pytestmark = [pytest.mark.integration, pytest.mark.bench]


def processes_of(run_dir: Path) -> list[int]:
    """Every live process whose command line names `run_dir` (the launcher, its agents, cold workers)."""
    pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and int(entry) != os.getpid()]
    return [pid for pid in pids if any(str(run_dir) in arg for arg in cmdline(pid)) and alive(pid)]


def job_tree(run_dir: Path) -> set[int]:
    """Those and every process under them: a warm worker (a fork of its agent's forkserver) carries the
    forkserver's command line, not the run's."""
    named = processes_of(run_dir)
    return {*named, *(kid for pid in named for kid in descendants(pid))}


def workers_up(run_dir: Path) -> bool:
    """Both agents of the job have a worker."""
    agents = [pid for pid in processes_of(run_dir) if "torch.distributed.run" in cmdline(pid)]
    return len(agents) == 2 and all(workers_of(agent) for agent in agents)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:.0f} s")
        time.sleep(0.2)


# SIGTERM unwinds as Ctrl-C does (the same KeyboardInterrupt), and a Ctrl-C at a terminal also reaches the
# launcher itself; SIGKILL runs no handler at all.
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_recovery_benchmark_stopped_while_its_job_runs_leaves_no_process_of_it(
    tmp_path: Path, cache_dir: Path, signum: signal.Signals
) -> None:
    work = tmp_path / "work"
    run_dir = work / "worker-product-0"  # the product job of its first repetition: it never ends by itself
    # --kill-after: the benchmark waits for that step, with its job training meanwhile.
    recovery = ["recovery", "--config", "tiny", "--reps", "1", "--cases", "worker", "--kill-after", "1000000"]
    work_dir = ["--timeout", "900", "--work-dir", str(work), f"data.cache_dir={cache_dir}"]
    bench = subprocess.Popen(
        [sys.executable, "-m", "elastic_qa.cli", "bench", *recovery, *work_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=python_env(),
    )
    job: set[int] = set()
    try:
        # The launcher, two agents and a worker each: the whole job is up.
        wait_until(
            lambda: bench.poll() is not None or workers_up(run_dir),
            timeout=180,
            what="the benchmark's job did not start its workers",
        )
        assert bench.poll() is None, bench.communicate()[0].decode()[-2000:]
        job = job_tree(run_dir)  # orphans of the job are no longer under it once the launcher ends

        bench.send_signal(signum)  # to the benchmark alone, as a scheduler or a test timeout would
        output = bench.communicate(timeout=120)[0].decode()
        if signum != signal.SIGKILL:
            assert bench.returncode == 128 + signum, output[-2000:]
            assert f"stopped by {signum.name}" in output
        # SIGKILL runs no handler: the launcher, tied to the benchmark, stops its agents, which stop
        # their workers (gracefully: they save first), so that takes a little longer.
        wait_until(
            lambda: not processes_of(run_dir) and not [pid for pid in job if alive(pid)],
            timeout=90,
            what="processes of the job remain",
        )
    finally:
        if bench.poll() is None:
            bench.kill()
        kill_trees([*processes_of(run_dir), *(pid for pid in job if alive(pid))])
