"""The replica-group mode as a side of `elastic-qa bench goodput`: `elastic-qa replicas`, the same faults.

One job of `replica.groups=2` replica groups (one torchrun job each, `replica.nproc_per_group` workers,
the Lighthouse run and supervised by the replica launcher), the sample ledger on, every step logged.

Faults. Only `kill-worker` is supported: it SIGKILLs one worker (by pid) of one replica group, drawn from
--seed; that group's torchrun restarts its workers, which heal from the live peer while the survivors train
on. A node fault would kill a group's torchrun agent with its workers; the replica launcher starts that
group again, but this side tells a group's workers apart by torchrun's restart count, which a new agent
starts over, so it does not follow them yet. `goodput` therefore refuses `--kinds` with a node kind for
this side (or leaves the side out of the default sides, saying why).

Like the torchft side's, a fault waits until the job is whole again: every group's newest workers alive and
none of them one the bench killed, and a step committed by every group after the newest worker started.
A kill while the other group is still restarting would leave no live peer to heal from: both groups would
then restore the newest checkpoint, and the bench's tiny job saves none (checkpoint.interval 30 min).

Figures from the job's step lines (written by the quorum's rank 0, group rank 0, every step with
`log.every_steps=1`), each a `Step` of the writing process with weight 1: every committed step trained the
whole global batch, split over whoever took part. Lost steps per fault: the step attempts that did not
commit (trained again with the same windows by the next quorum), charged to the latest fault before them.
Exactly-once: the replica ledger (`read_replica_ledger` + `verify`) over every step the ledger says was
committed; the run fails when it does not pass.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import BenchError
from elastic_qa.bench.goodput_figures import Step
from elastic_qa.chaos.faults import NoTarget
from elastic_qa.config import resolve_config
from elastic_qa.launcher.processes import alive, cmdline, end_process, python_env, tied_to_this_process
from elastic_qa.models import family_for
from elastic_qa.observe.events import Event
from elastic_qa.observe.follow import LogFollower
from elastic_qa.prep import prepare
from elastic_qa.replica.shares import read_replica_ledger, verify

KINDS = frozenset({"kill-worker"})
UNSUPPORTED = (
    "the replica side supports only kill-worker: a node fault kills a replica group's torchrun agent, and "
    "the launcher's new agent for that group is not followed by this side yet (it tells a group's workers "
    "apart by torchrun's restart count, which a new agent starts over)"
)
GROUPS = 2
# Every step logged, the sample ledger on, no end in reach (the bench stops the job).
REPLICA = (
    "debug.sample_ledger=true",
    "log.every_steps=1",
    "log.console=none",
    "train.max_steps=10000000",
    "train.eval_every=0",
    f"replica.groups={GROUPS}",
)
EVENTS = frozenset({Event.STEP, Event.WORKER_START, Event.STEP_NOT_COMMITTED, Event.HEAL, Event.TRAIN_DONE})


class ReplicaSide:
    """`elastic-qa replicas` with two groups; kills a worker of one group per fault; reads its lines back."""

    name = "replicas"

    def __init__(
        self, run_dir: Path, config: str, overrides: list[str], seed: int, timeout: float = 60
    ) -> None:
        self.run_dir, self.config, self.timeout = run_dir, config, timeout
        self.overrides = [*overrides, *REPLICA, f"run.dir={run_dir}"]
        self.cfg = resolve_config(config, self.overrides)
        self.rng = random.Random(seed)
        self.follower = LogFollower(run_dir / "logs")
        self.events: list[dict[str, Any]] = []
        self.victims: set[int] = set()
        self.job: subprocess.Popen | None = None
        self.stopped_at: float | None = None  # when stop() began: what the stop itself costs is no fault's
        self.lock = threading.Lock()

    def start(self) -> None:
        """Start the replica launcher (from the thread that drives this side, which outlives it)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        launch = [sys.executable, "-m", "elastic_qa.replica.launch"]
        command = [*launch, "--config", self.config, *self.overrides]
        with open(self.run_dir / "launcher.log", "ab") as out:
            self.job = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=python_env(),
                preexec_fn=tied_to_this_process(),
            )  # fmt: skip

    def _read(self) -> list[dict[str, Any]]:
        with self.lock:
            self.events.extend(row for row in self.follower.new_events() if row.get("event") in EVENTS)
            return self.events

    def steps(self) -> list[Step]:
        return [Step(row["ts"], int(row["step"]), f"pid-{row['pid']}") for row in self._of(Event.STEP)]

    def _of(self, event: str) -> list[dict[str, Any]]:
        return [row for row in self._read() if row.get("event") == event and "ts" in row]

    def current_workers(self) -> dict[int, list[int]]:
        """group -> the pids of its newest generation of workers (the highest torchrun restart count)."""
        newest: dict[int, tuple[int, list[int]]] = {}
        for row in self._of(Event.WORKER_START):
            group, restart = int(row["replica_group"]), int(row.get("restart_count", 0))
            count, pids = newest.get(group, (-1, []))
            if restart > count:
                newest[group] = (restart, [row["pid"]])
            elif restart == count:
                pids.append(row["pid"])
        return {group: pids for group, (_, pids) in newest.items()}

    def whole(self, since: float = 0.0) -> bool:
        """Every group's newest workers are up, none is one the bench killed, and every group took part in
        a committed step after the newest worker started (and after `since`)."""
        workers = self.current_workers()
        nproc = self.cfg.replica.nproc_per_group
        if len(workers) < GROUPS or any(len(pids) < nproc for pids in workers.values()):
            return False
        pids = [pid for group in workers.values() for pid in group]
        if any(pid in self.victims or not alive(pid) for pid in pids):
            return False
        started = max(row["ts"] for row in self._of(Event.WORKER_START) if row["pid"] in pids)
        after = max(started, since)
        return any(row["ts"] > after and row.get("participants") == GROUPS for row in self._of(Event.STEP))

    def recovered(self, last_fault: float) -> bool:
        """The end of the run: the group killed last is back and trained with the others."""
        return self.whole(last_fault)

    def inject(self, kind: str) -> dict[str, Any]:
        if kind not in KINDS:
            raise BenchError(f"{self.name}: {kind}: {UNSUPPORTED}")
        assert self.job is not None  # started
        if self.job.poll() is not None:
            raise BenchError(
                f"{self.name}: the job ended (launcher exit {self.job.returncode}); see "
                f"{self.run_dir / 'launcher.log'} and {self.run_dir / 'agents'}"
            )
        if not self.whole():
            raise NoTarget("a replica group is still restarting or healing from the previous fault")
        workers = self.current_workers()
        group = self.rng.choice(sorted(workers))
        victim = self.rng.choice(sorted(workers[group]))
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            raise NoTarget(f"the worker of group {group} (pid {victim}) is gone") from None
        self.victims.add(victim)
        return {"target": f"replica group {group} worker (pid {victim})", "signal": "SIGKILL"}

    def stop(self) -> None:
        """SIGTERM the launcher (it ends its groups and the Lighthouse), then SIGKILL any worker of this run
        that outlived it."""
        if self.stopped_at is None:
            self.stopped_at = time.time()
        if self.job is not None:
            end_process(self.job, grace_s=60)
        for row in self._of(Event.WORKER_START):
            pid = row["pid"]
            if alive(pid) and any(str(self.run_dir) in arg for arg in cmdline(pid)):
                os.kill(pid, signal.SIGKILL)
        self._read()

    def lost(self, steps: list[Step], faults: list[float]) -> list[int]:
        """Per fault, the step attempts no quorum committed (each (step, quorum) once, whichever workers
        said so), charged to the latest fault before the first report; those the bench's own stop caused are
        left out. A healed group takes the peer's committed state: it loses nothing."""
        lost = [0] * len(faults)
        seen: set[tuple[int, int]] = set()
        stopped = self.stopped_at or float("inf")
        for row in sorted(self._of(Event.STEP_NOT_COMMITTED), key=lambda r: r["ts"]):
            key = (int(row["step"]), int(row.get("quorum", -1)))
            if key in seen or row["ts"] >= stopped:
                continue
            seen.add(key)
            earlier = [i for i, fault in enumerate(faults) if fault < row["ts"]]
            if earlier:
                lost[earlier[-1]] += 1
        return lost

    def report(self, steps: list[Step], faults: list[float]) -> dict[str, Any]:
        """The ledger's verdict, the heals and restarts, and the replicas' final parameter digests (from
        their train_done lines: a run the bench stops has none, see `params`)."""
        cfg = self.cfg
        windows = len(prepare(cfg, family_for(cfg.model)).train)
        ledger = read_replica_ledger(self.run_dir)
        committed = max(
            (row["step"] for row in ledger if row.get("kind") == "commit" and row.get("committed")), default=0
        )
        verdict = verify(
            ledger, windows, cfg.train.global_batch_size, cfg.run.seed, committed, cfg.replica.nproc_per_group
        )
        # The first workers, then every restart (a crash before training included).
        starts = len(self._of(Event.WORKER_START))
        return {
            "ledger": {
                "ok": verdict.ok and committed > 0,
                "steps_checked": committed,
                "retried_steps": verdict.retried,
                "problems": verdict.problems[:10] or ([] if committed else ["no step committed"]),
            },
            "heals": len(self._of(Event.HEAL)),  # a group that joins the first quorum late heals too
            "worker_restarts": max(0, starts - GROUPS * cfg.replica.nproc_per_group),
            "params": params_digests(self._of(Event.TRAIN_DONE)),
        }


def params_digests(done: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the replicas ended bitwise equal: each worker's params_sha256 from its train_done line."""
    digests = {f"group-{row.get('replica_group')}.pid-{row['pid']}": row["params_sha256"] for row in done}
    if not digests:
        return {
            "digests": {},
            "equal": None,
            "note": "no train_done line: the bench stops the job before train.max_steps, and a stopped "
            "worker logs no digest",
        }
    return {"digests": digests, "equal": len(set(digests.values())) == 1}
