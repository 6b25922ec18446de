"""Fault injectors: each acts on the real processes and files of a running job and says what it hit."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

from chaos.job import Job, is_alive
from chaos.schedule import Fault


class NoTarget(RuntimeError):
    """The fault has nothing to act on right now (e.g. no worker is running during a regroup)."""


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise NoTarget(f"pid {pid} is gone") from None


def rank_zero_worker(job: Job) -> int:
    """pid of the rank-0 worker of the newest attempt (the checkpoint writer)."""
    newest: tuple[int, int] | None = None
    for path in (job.run_dir / "logs").glob("rank-000.pid-*.jsonl"):
        for line in path.read_text().splitlines():
            if '"event": "worker_start"' in line:
                row = json.loads(line)
                if newest is None or row["attempt"] > newest[0]:
                    newest = (row["attempt"], row["pid"])
    if newest is None or not is_alive(newest[1]):
        raise NoTarget("no live rank-0 worker")
    return newest[1]


class Injector:
    def __init__(self, job: Job, rng: random.Random, checkpoint_dir: Path, fault_flag: Path) -> None:
        self.job = job
        self.rng = rng
        self.checkpoint_dir = checkpoint_dir
        self.fault_flag = fault_flag

    def inject(self, fault: Fault) -> dict:
        handler = getattr(self, "_" + fault.kind.replace("-", "_"))
        return handler(fault)

    # ---- processes ----------------------------------------------------------------------------------
    def _any_worker(self) -> tuple[dict, int]:
        candidates = [(agent, pid) for agent in self.job.live_agents() for pid in self.job.workers(agent)]
        if not candidates:
            raise NoTarget("no live worker")
        return self.rng.choice(candidates)

    def _non_host_agent(self) -> dict:
        agents = [a for a in self.job.live_agents() if not a["is_host"]]
        if not agents:
            raise NoTarget("no live agent other than the store host")
        return self.rng.choice(agents)

    def _kill_worker(self, fault: Fault) -> dict:
        agent, pid = self._any_worker()
        _kill(pid, signal.SIGKILL)
        return {"target": f"worker pid {pid} of agent {agent['index']}"}

    def _kill_node(self, fault: Fault) -> dict:
        agent = self._non_host_agent()
        workers = self.job.workers(agent)
        for pid in [agent["pid"], *workers]:
            _kill(pid, signal.SIGKILL)
        return {"target": f"agent {agent['index']} (pid {agent['pid']}) and workers {workers}"}

    def _term_node(self, fault: Fault) -> dict:
        agent = self._non_host_agent()
        _kill(agent["pid"], signal.SIGTERM)
        return {"target": f"agent {agent['index']} (pid {agent['pid']})"}

    def _join_node(self, fault: Fault) -> dict:
        try:
            pid = self.job.join()
        except RuntimeError as err:  # e.g. the job already has its maximum of agents
            raise NoTarget(str(err)) from None
        return {"target": f"new agent pid {pid}"}

    def _freeze_worker(self, fault: Fault) -> dict:
        agent, pid = self._any_worker()
        _kill(pid, signal.SIGSTOP)
        if fault.duration is not None:
            # SIGCONT later, from a timer: the runner goes on watching the job meanwhile.
            timer = threading.Timer(fault.duration, lambda: _continue(pid))
            timer.daemon = True
            timer.start()
        return {"target": f"worker pid {pid} of agent {agent['index']}", "thaw_after_s": fault.duration}

    def _kill_during_save(self, fault: Fault) -> dict:
        """SIGKILL the rank-0 worker while a checkpoint is being written (a `.tmp-step-*` dir exists)."""
        pid = rank_zero_worker(self.job)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            writing = [p.name for p in self.checkpoint_dir.glob(".tmp-step-*") if "-deleted-" not in p.name]
            if writing:
                _kill(pid, signal.SIGKILL)
                return {"target": f"rank-0 worker pid {pid} while writing {writing[0]}"}
            if not is_alive(pid):
                raise NoTarget("the rank-0 worker exited before a save started")
            time.sleep(0.002)
        raise NoTarget("no checkpoint save started within 60 s")

    # ---- files --------------------------------------------------------------------------------------
    def _corrupt_checkpoint(self, fault: Fault) -> dict:
        steps = sorted(p for p in self.checkpoint_dir.glob("step-*") if (p / "manifest.json").exists())
        if not steps:
            raise NoTarget("no committed checkpoint")
        newest = steps[-1]
        victim = newest / self.rng.choice(["model.pt", "optimizer.pt", "trainer.pt"])
        size = victim.stat().st_size
        if self.rng.random() < 0.5:
            os.truncate(victim, size // 2)
            how = f"truncated to {size // 2} of {size} bytes"
        else:
            offset = self.rng.randrange(size)
            with open(victim, "r+b") as handle:
                handle.seek(offset)
                byte = handle.read(1)
                handle.seek(offset)
                handle.write(bytes([byte[0] ^ 0xFF]))
            how = f"flipped byte {offset}"
        step = int(newest.name.split("-")[-1])
        return {"target": str(victim), "checkpoint_step": step, "how": how}

    def _storage_errors(self, fault: Fault) -> dict:
        self.fault_flag.parent.mkdir(parents=True, exist_ok=True)
        self.fault_flag.touch()
        seconds = fault.duration or 5.0
        timer = threading.Timer(seconds, lambda: self.fault_flag.unlink(missing_ok=True))
        timer.daemon = True
        timer.start()
        return {"target": f"checkpoint writes fail for {seconds:g}s", "fail_for_s": seconds}


def _continue(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
