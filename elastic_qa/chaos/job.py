"""Drive a training job on this host through the project's own launcher, and reach its processes.

Used by the fault runner, the recovery benchmark and the integration tests: start a job with N agents
(`python -m elastic_qa.launcher.local`, as a subprocess), add one, find an agent's workers, send signals,
and follow the job's progress from its logs.

A job never outlives whoever drives it: the launcher is tied to this process (it gets SIGTERM when this
process dies, even by SIGKILL, and stops its agents, which stop their workers), and `kill_everything`
ends the whole tree at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from elastic_qa.chaos.evidence import run_config
from elastic_qa.checkpoint.node_local import NodeLocalCopy
from elastic_qa.launcher.processes import (
    alive,
    cmdline,
    kill_trees,
    python_env,
    tied_to_this_process,
    workers_of,
)
from elastic_qa.observe.events import Event
from elastic_qa.observe.follow import LogFollower

LAUNCHER = "elastic_qa.launcher.local"


class Job:
    def __init__(
        self,
        run_dir: Path,
        config: str = "tiny",
        overrides: tuple[str, ...] | list[str] = (),
        agents: int = 2,
        min_nodes: int = 1,
        max_nodes: int = 4,
        python: str = sys.executable,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self.overrides = [f"run.dir={self.run_dir}", *overrides]
        self.agents_at_start = agents
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.python = python
        self.process: subprocess.Popen | None = None
        self.ignored_pids: set[int] = set()  # processes writing to the same logs that are not this job's
        self._lock = threading.Lock()  # progress() is called from the runner and its follow-up threads
        self._follower = LogFollower(self.run_dir / "logs")
        self._progress = 0
        self.attempt = 0  # newest attempt that logged worker_start
        self.attempt_steps: dict[int, int] = {}  # attempt -> highest step it completed

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> None:
        """Start the launcher; TimeoutError when it has started no agent within `timeout` seconds (it
        imports torch and builds the data cache first: for a pretrained encoder on a loaded host, minutes)."""
        (self.run_dir / "chaos").mkdir(parents=True, exist_ok=True)
        out = open(self.run_dir / "chaos" / "launcher.log", "ab")  # noqa: SIM115 - lives with the job
        self.process = subprocess.Popen(
            [
                self.python,
                "-m",
                LAUNCHER,
                "start",
                "--agents",
                str(self.agents_at_start),
                "--min",
                str(self.min_nodes),
                "--max",
                str(self.max_nodes),
                "--config",
                self.config,
                *self.overrides,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=python_env(),
            preexec_fn=tied_to_this_process(),
        )
        deadline = time.monotonic() + timeout
        while not (self.run_dir / "launch.json").exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"launcher exited with {self.process.returncode}: see {out.name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"launcher did not start any agent within {timeout:.0f} s")
            time.sleep(0.05)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_everything()
            raise

    def kill_everything(self) -> None:
        """Last resort (test teardown, an interrupted benchmark): SIGKILL the launcher, every agent (those
        `join` added too, which are not the launcher's children) and every process under them."""
        # An agent's pid is only trusted while its command line names this run (pids are reused).
        agents = [
            a["pid"] for a in self.agents() if any(str(self.run_dir) in arg for arg in cmdline(a["pid"]))
        ]
        launcher = [self.process.pid] if self.process and self.process.poll() is None else []
        kill_trees([*launcher, *agents])
        if self.process:
            self.process.wait()

    def remove_node_local_copy(self) -> None:
        """Remove this run's node-local copy (checkpoint/node_local.py) from this machine's memory, once the
        job is gone: for a benchmark's throwaway job, which ends killed, so its workers never remove it
        (a job that ends 0 does). The durable checkpoints stay. Nothing to do when the run wrote no config
        (no worker started) or the copy is off."""
        try:
            cfg = run_config(self.run_dir)
        except (OSError, ValueError, TypeError, KeyError):
            return
        copy = NodeLocalCopy.for_run(cfg)
        if copy is not None:
            copy.remove()

    # ---- processes ----------------------------------------------------------------------------------
    def agents(self) -> list[dict]:
        try:
            job = json.loads((self.run_dir / "launch.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return []
        for agent in job["agents"]:
            agent["alive"] = alive(agent["pid"])
        return job["agents"]

    def live_agents(self) -> list[dict]:
        return [a for a in self.agents() if a["alive"]]

    def workers(self, agent: dict) -> list[int]:
        return [pid for pid in workers_of(agent["pid"]) if alive(pid)]

    def join(self) -> int:
        result = subprocess.run(
            [self.python, "-m", LAUNCHER, "join", "--run-dir", str(self.run_dir)],
            capture_output=True,
            text=True,
            env=python_env(),
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"join failed: {result.stderr.strip()}")
        return int(result.stdout.split("(pid ", 1)[1].split(")", 1)[0])  # "joined: agent N (pid P) ..."

    # ---- progress -----------------------------------------------------------------------------------
    def progress(self) -> int:
        """Highest step any rank has logged as completed (reads only what was appended since last call).

        Lines of `ignored_pids` (a second job sharing the run directory) are skipped; so are unreadable
        lines (log writes may fail while the disk is full).
        """
        with self._lock:
            for row in self._follower.new_events():
                if row.get("pid") in self.ignored_pids:
                    continue
                event = row["event"]
                if event in (Event.STEP, Event.RESUME) and "step" in row:
                    self._progress = max(self._progress, int(row["step"]))
                    if event == Event.STEP:
                        attempt = row.get("attempt", 0)
                        self.attempt_steps[attempt] = max(self.attempt_steps.get(attempt, 0), row["step"])
                elif event == Event.WORKER_START:
                    self.attempt = max(self.attempt, row.get("attempt", 0))
            return self._progress

    def wait_for_new_attempt(self, after: int, timeout: float = 180) -> bool:
        """Wait until an attempt newer than `after` has completed a step; False if the job ended first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.progress()
            if any(attempt > after for attempt in self.attempt_steps):
                return True
            if self.process is not None and self.process.poll() is not None:
                return False
            time.sleep(0.05)
        raise TimeoutError(f"no attempt after {after} trained a step within {timeout} s")

    def wait_for_step(self, step: int, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while self.progress() < step:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"job ended (exit {self.process.returncode}) before step {step}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step} not reached within {timeout} s (at {self.progress()})")
            time.sleep(0.05)
        return self.progress()
