"""Fault injectors: each acts on the real processes and files of a running job and says what it hit.

An injector returns its record at once; what a fault does later (end a storage-error window, thaw a
worker, stop a second job) runs on a timer or a watcher thread and is logged as an action line of its
own, so that the evidence says when each window really ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from elastic_qa.chaos.job import Job
from elastic_qa.chaos.schedule import Fault
from elastic_qa.launcher.processes import alive, python_env
from elastic_qa.observe.events import AttemptStartRecord, records
from elastic_qa.observe.follow import read_events
from elastic_qa.session.hold import REFUSED_LINE

STATE_FILES = ("model.pt", "optimizer.pt", "trainer.pt")


class NoTarget(RuntimeError):
    """The fault has nothing to act on right now (e.g. no worker is running during a regroup)."""


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise NoTarget(f"pid {pid} is gone") from None


def rank_zero_worker(job: Job) -> int:
    """pid of the rank-0 worker of the job's newest attempt (the checkpoint writer)."""
    starts = [
        (row["attempt"], row["pid"])
        for row in records(read_events(job.run_dir, "rank-000.*.pid-*.jsonl"), AttemptStartRecord)
        if "attempt" in row
        and "pid" in row
        and row["pid"] not in job.ignored_pids  # a second job is not this job's writer
    ]
    newest = max(starts, key=lambda start: start[0], default=None)
    if newest is None or not alive(newest[1]) or newest[1] not in all_workers(job):
        raise NoTarget("no live rank-0 worker")
    return newest[1]


def registered_attempt(run_dir: Path, pid: int) -> int | None:
    """The attempt number a process registered (from its worker_start line), if it has yet."""
    for row in records(read_events(run_dir, f"rank-*.pid-{pid}.jsonl"), AttemptStartRecord):
        if "attempt" in row:
            return row["attempt"]
    return None


def all_workers(job: Job) -> list[int]:
    return [pid for agent in job.live_agents() for pid in job.workers(agent)]


class FlagFile:
    """A fault flag file that exists while any of its windows is open: storage-errors and
    final-storage-errors share the storage flag, and one closing must not end the other's window."""

    def __init__(self, path: Path, log: Callable[[dict], None]) -> None:
        self.path = path
        self.log = log
        self._open: set[int] = set()
        self._next = 0
        self._lock = threading.Lock()

    def open(self, fault: str) -> int:
        with self._lock:
            self._next += 1
            self._open.add(self._next)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
            self.log({"action": "flag_created", "fault": fault, "flag": str(self.path), "window": self._next})
            return self._next

    def close(self, window: int, fault: str, why: str) -> None:
        with self._lock:
            if window not in self._open:
                return
            self._open.discard(window)
            if not self._open:
                self.path.unlink(missing_ok=True)
            self.log(
                {
                    "action": "flag_removed" if not self._open else "window_closed",
                    "fault": fault,
                    "flag": str(self.path),
                    "window": window,
                    "why": why,
                }
            )

    def close_all(self, why: str) -> None:
        for window in sorted(self._open):
            self.close(window, "(cleanup)", why)
        self.path.unlink(missing_ok=True)


class Injector:
    """Acts on one job. `log` writes an action line; `storage` and `logs` are the two fault flags."""

    def __init__(
        self,
        job: Job,
        rng: random.Random,
        checkpoint_dir: Path,
        storage: FlagFile,
        logs: FlagFile,
        log: Callable[[dict], None],
        max_steps: int,
    ) -> None:
        self.job = job
        self.rng = rng
        self.checkpoint_dir = checkpoint_dir
        self.storage, self.logs = storage, logs
        self.log = log
        self.max_steps = max_steps
        self.second_jobs: list[subprocess.Popen] = []
        self._stopping = threading.Event()
        self._watchers: list[threading.Thread] = []
        # Called by an injector that hits what the job does next, once it has its target: the runner
        # then lets the job, held at the fault's step, go on (see runner.py).
        self.ready: Callable[[], None] = lambda: None

    def inject(self, fault: Fault) -> tuple[dict, threading.Event | None]:
        """Inject now: (the record, an event that is set once the fault's own window is over, if the next
        fault should wait for it). Raises NoTarget when there is nothing to hit right now."""
        handler = getattr(self, "_" + fault.kind.replace("-", "_"))
        result = handler(fault)
        return result if isinstance(result, tuple) else (result, None)

    def close(self) -> None:
        """End every window and stop every second job (the run is over)."""
        self._stopping.set()
        self.storage.close_all("the run is over")
        self.logs.close_all("the run is over")
        for watcher in self._watchers:  # each stops its second job and logs how it ended
            watcher.join(timeout=30)

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

    def _hup(self, fault: Fault) -> dict:
        agent, pid = self._any_worker()
        _kill(pid, signal.SIGHUP)
        return {"target": f"worker pid {pid} of agent {agent['index']}", "signal": "SIGHUP"}

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
        if fault.duration is None:
            # Frozen for ever, a worker is only noticed by its peers' collective timeout: alone in its
            # group, nothing would ever notice and the job would hang. Wait until it has a peer.
            workers = [pid for agent in self.job.live_agents() for pid in self.job.workers(agent)]
            if len(workers) < 2:
                raise NoTarget("a worker frozen for ever needs a peer to notice it: the group has one")
        agent, pid = self._any_worker()
        _kill(pid, signal.SIGSTOP)
        if fault.duration is not None:
            # SIGCONT later, from a timer: the runner goes on watching the job meanwhile.
            self._later(fault.duration, lambda: self._thaw(pid))
        return {"target": f"worker pid {pid} of agent {agent['index']}", "thaw_after_s": fault.duration}

    def _thaw(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            self.log({"action": "thawed", "pid": pid})

    def _kill_during_save(self, fault: Fault) -> dict:
        """SIGKILL the rank-0 worker while a checkpoint is being written (a `.tmp-...step-...` staging
        directory exists; `.tmp-step-N-deleted-*` is a checkpoint being pruned, not written)."""
        pid = rank_zero_worker(self.job)
        self.ready()  # the job may go on to its save: this polls from now on
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            writing = [p.name for p in self.checkpoint_dir.glob(".tmp-*step-*") if "-deleted-" not in p.name]
            if writing:
                _kill(pid, signal.SIGKILL)
                return {"target": f"rank-0 worker pid {pid} while writing {writing[0]}"}
            if not alive(pid):
                raise NoTarget("the rank-0 worker exited before a save started")
            time.sleep(0.002)
        raise NoTarget("no checkpoint save started within 60 s")

    # ---- files --------------------------------------------------------------------------------------
    def _committed(self) -> list[Path]:
        return sorted(p for p in self.checkpoint_dir.glob("step-*") if (p / "manifest.json").exists())

    def _corrupt(self, newest: Path) -> dict:
        """Truncate or flip one byte of one state file of `newest`; say which copy it was (its manifest)."""
        manifest = json.loads((newest / "manifest.json").read_text())
        victim = newest / self.rng.choice(STATE_FILES)
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
        return {
            "target": str(victim),
            "checkpoint_step": int(newest.name.split("-")[-1]),
            "how": how,
            "copy_attempt": manifest.get("attempt"),
            "copy_created_ts": manifest.get("created_ts"),
        }

    def _corrupt_checkpoint(self, fault: Fault) -> dict:
        steps = self._committed()
        if not steps:
            raise NoTarget("no committed checkpoint")
        return self._corrupt(steps[-1])

    def _corrupt_replay(self, fault: Fault) -> dict:
        """SIGKILL every worker at once (no survivor can save a newer step), then corrupt the newest
        committed checkpoint: the next group must reject it, quarantine it, resume from an older one and
        replay across its step. Needs two committed checkpoints, so that an older valid one exists."""
        steps = self._committed()
        if len(steps) < 2:
            raise NoTarget(f"{len(steps)} committed checkpoints; need 2 (one to corrupt, one to resume)")
        workers = all_workers(self.job)
        if not workers:
            raise NoTarget("no live worker")
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.01)  # a dead writer can no longer publish: only then pick the newest
        record = self._corrupt(self._committed()[-1])
        return {**record, "killed_workers": workers}

    def _storage_errors(self, fault: Fault) -> dict:
        seconds = fault.duration or 5.0
        window = self.storage.open(fault.kind)
        self._later(seconds, lambda: self.storage.close(window, fault.kind, f"after {seconds:g}s"))
        return {"target": f"checkpoint writes fail for {seconds:g}s", "fail_for_s": seconds}

    def _log_full(self, fault: Fault) -> tuple[dict, threading.Event]:
        seconds = fault.duration or 3.0
        window = self.logs.open(fault.kind)
        over = threading.Event()

        def end() -> None:
            self.logs.close(window, fault.kind, f"after {seconds:g}s")
            over.set()

        self._later(seconds, end)
        return {"target": f"log writes fail for {seconds:g}s", "log_full_for_s": seconds}, over

    def _final_storage_errors(self, fault: Fault) -> dict:
        """Storage errors from now until `for=` seconds after the job completed max_steps: across the
        final save, which must retry until it commits (or the job must fail, never claim done)."""
        seconds = fault.duration or 3.0
        window = self.storage.open(fault.kind)

        def watch() -> None:
            while self.job.progress() < self.max_steps:
                if self._stopping.is_set() or (self.job.process and self.job.process.poll() is not None):
                    self.storage.close(window, fault.kind, "the job ended before max_steps")
                    return
                time.sleep(0.05)
            self.log({"action": "max_steps_reached", "fault": fault.kind, "step": self.max_steps})
            if not self._stopping.wait(seconds):
                self.storage.close(window, fault.kind, f"{seconds:g}s after step {self.max_steps}")

        watcher = threading.Thread(target=watch, name="final-storage-errors", daemon=True)
        watcher.start()
        self._watchers.append(watcher)
        return {
            "target": f"checkpoint writes fail until {seconds:g}s after step {self.max_steps}",
            "fail_after_max_steps_s": seconds,
        }

    # ---- a second job -------------------------------------------------------------------------------
    def _second_job(self, fault: Fault) -> tuple[dict, threading.Event]:
        """A single-process job on the same config and run directory: the live main job holds its run, so
        the second job must be refused (exit 2, its line naming the main job) and fence nothing. It is
        stopped (SIGKILL) after `for=` seconds if still running.

        Returns once the second job was refused or registered an attempt (a few seconds: it imports torch
        first); a registration is judged a failure. If the main job reached max_steps first, there was
        nothing to race: the second job is stopped and the fault is recorded as skipped.
        """
        lifetime = fault.duration or 60.0
        index = len(self.second_jobs) + 1
        out_path = self.job.run_dir / "chaos" / f"second-job-{index}.log"
        overrides = [o for o in self.job.overrides if not o.startswith("debug.hold_dir=")]
        with open(out_path, "ab") as out:
            process = subprocess.Popen(
                # Not held at the main job's step holds: nobody releases them for it.
                [self.job.python, "-m", "elastic_qa.train", "--config", self.job.config, *overrides],
                stdout=out,
                stderr=subprocess.STDOUT,
                # Not part of the main job's torchrun group: none of its agent's variables.
                env=python_env(
                    {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
                ),
            )
        self.job.ignored_pids.add(process.pid)
        self.second_jobs.append(process)
        ended, stop = threading.Event(), threading.Event()
        reason: list[str] = []

        def watch() -> None:
            deadline, why = time.monotonic() + lifetime, "exited"
            while process.poll() is None:
                if self._stopping.is_set() or stop.is_set() or time.monotonic() > deadline:
                    why = reason[0] if reason else f"still running after {lifetime:g}s"
                    why = "the run is over" if self._stopping.is_set() else why
                    process.kill()
                    break
                time.sleep(0.1)
            code = process.wait()
            self.log({"action": "second_job_exit", "pid": process.pid, "exit_code": code, "why": why})
            ended.set()

        watcher = threading.Thread(target=watch, name=f"second-job-{index}", daemon=True)
        watcher.start()
        self._watchers.append(watcher)
        record = {
            "target": f"second job pid {process.pid} (python -m elastic_qa.train, output {out_path.name})",
            "pid": process.pid,
            "lifetime_s": lifetime,
        }
        while (attempt := registered_attempt(self.job.run_dir, process.pid)) is None:
            if ended.is_set():
                said = out_path.read_text(errors="replace") if out_path.exists() else ""
                refused = [line for line in said.splitlines() if REFUSED_LINE in line]
                if process.returncode == 2 and refused:
                    return {**record, "refused": refused[-1][-600:]}, ended
                return {
                    **record,
                    "skipped": f"the second job exited {process.returncode} before registering",
                }, ended
            assert self.job.process is not None  # a fault is injected into a started job
            if self.job.progress() >= self.max_steps or self.job.process.poll() is not None:
                reason.append("the main job reached max_steps before the second job registered")
                stop.set()
                ended.wait(30)
                return {**record, "skipped": f"nothing to race: {reason[0]}"}, ended
            time.sleep(0.05)
        return {**record, "attempt": attempt}, ended

    # ---- timers -------------------------------------------------------------------------------------
    def _later(self, seconds: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, action)
        timer.daemon = True
        timer.start()
