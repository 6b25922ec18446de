"""The replica-group mode as a side of `elastic-qa bench goodput`: `elastic-qa replicas`, the same faults.

One job of `replica.groups=2` replica groups (one torchrun job each, `replica.nproc_per_group` workers,
the Lighthouse run and supervised by the replica launcher), the sample ledger on, every step logged.

Faults, each on one replica group drawn from --seed, by pid:
- kill-worker SIGKILLs one of its workers; its torchrun restarts them, and they heal from the live peer
  while the survivors train on.
- kill-node SIGKILLs its torchrun agent and its workers (a lost node); term-node SIGTERMs the agent alone,
  which SIGTERMs its workers: they finish the step, the group's step is committed unless a peer of its
  lineage already wrote it, and they leave; the agent then exits. Either way the launcher starts the group
  again, as a scheduler would replace the node: a new agent, whose workers hold no state and heal from the
  live peer. The job allows a group restart per fault (`replica.max_group_restarts`): every fault may hit
  the same group.
The group's agent is the launcher's newest `group_started` record of it (agents/replicas.jsonl), its
workers the `worker_start` lines after it of the highest torchrun restart count (a new agent counts its
restarts from 0 again).

Like the torchft side's, a fault waits until the job is whole again: every group's agent and newest
workers alive and none of them one the bench signalled, and a step committed by every group after the
newest worker started. A fault while the other group is still restarting would leave no live peer to heal
from: both groups would then restore the newest checkpoint, and the bench's tiny job saves none
(checkpoint.interval 30 min).

Figures from the job's step lines (written by the quorum's rank 0, group rank 0, every step with
`log.every_steps=1`), each a `Step` of the writing process with weight 1: every committed step trained the
whole global batch, split over whoever took part. Lost steps per fault: the step attempts that did not
commit (trained again with the same windows by the next quorum), charged to the latest fault before them.
Exactly-once: the replica ledger (`read_replica_ledger` + `verify`) over every step the ledger says was
committed; the run fails when it does not pass.
"""

from __future__ import annotations

import contextlib
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
from elastic_qa.config import ReplicaConfig, resolve_config
from elastic_qa.launcher.processes import (
    alive,
    children,
    cmdline,
    end_process,
    kill_trees,
    python_env,
    tied_to_this_process,
)
from elastic_qa.models import family_for
from elastic_qa.observe.events import Event
from elastic_qa.observe.follow import LogFollower
from elastic_qa.prep import prepare
from elastic_qa.replica.shares import read_replica_ledger, verify

KINDS = frozenset({"kill-worker", "kill-node", "term-node"})
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
# The workers' events, and the launcher's group_started (agents/replicas.jsonl).
EVENTS = frozenset({
    Event.STEP, Event.WORKER_START, Event.STEP_NOT_COMMITTED, Event.HEAL, Event.TRAIN_DONE,
    Event.GROUP_STARTED,
})  # fmt: skip


class ReplicaSide:
    """`elastic-qa replicas` with two groups; one fault on one group at a time; reads its lines back."""

    name = "replicas"

    def __init__(
        self,
        run_dir: Path,
        config: str,
        overrides: list[str],
        seed: int,
        timeout: float = 60,
        faults: int = 0,
    ) -> None:
        self.run_dir, self.config, self.timeout = run_dir, config, timeout
        # Every fault may end the same group's agent: the launcher must start it again as often.
        restarts = f"replica.max_group_restarts={max(faults, ReplicaConfig.max_group_restarts)}"
        self.overrides = [*overrides, *REPLICA, restarts, f"run.dir={run_dir}"]
        self.cfg = resolve_config(config, self.overrides)
        self.rng = random.Random(seed)
        self.followers = (LogFollower(run_dir / "logs"), LogFollower(run_dir / "agents", "replicas.jsonl"))
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
            for follower in self.followers:
                self.events.extend(row for row in follower.new_events() if row.get("event") in EVENTS)
            return self.events

    def steps(self) -> list[Step]:
        return [Step(row["ts"], int(row["step"]), f"pid-{row['pid']}") for row in self._of(Event.STEP)]

    def _of(self, event: str) -> list[dict[str, Any]]:
        return [row for row in self._read() if row.get("event") == event and "ts" in row]

    def agents(self) -> dict[int, dict[str, Any]]:
        """group -> the launcher's newest `group_started` record of it: the group's torchrun agent now."""
        newest: dict[int, dict[str, Any]] = {}
        for row in self._of(Event.GROUP_STARTED):
            group = int(row["group"])
            if group not in newest or row["ts"] >= newest[group]["ts"]:
                newest[group] = row
        return newest

    def current_workers(self) -> dict[int, list[int]]:
        """group -> the pids of its newest workers: of those started after the group's newest agent (the
        earlier ones were an agent's the launcher has replaced), the highest torchrun restart count."""
        agents = self.agents()
        newest: dict[int, tuple[int, list[int]]] = {}
        for row in self._of(Event.WORKER_START):
            group, restart = int(row["replica_group"]), int(row.get("restart_count", 0))
            if group in agents and row["ts"] < agents[group]["ts"]:
                continue
            count, pids = newest.get(group, (-1, []))
            if restart > count:
                newest[group] = (restart, [row["pid"]])
            elif restart == count:
                pids.append(row["pid"])
        return {group: pids for group, (_, pids) in newest.items()}

    def node_pids(self) -> list[int]:
        """The live torchrun agents of the groups (the replica launcher's children that run torchrun)."""
        if self.job is None:
            return []
        return [pid for pid in children(self.job.pid) if "torch.distributed.run" in cmdline(pid)]

    def whole(self, since: float = 0.0) -> bool:
        """Every group's agent and newest workers are up, none is one the bench signalled, and every group
        took part in a committed step after the newest worker started (and after `since`)."""
        agents, workers = self.agents(), self.current_workers()
        nproc = self.cfg.replica.nproc_per_group
        if len(agents) < GROUPS or len(workers) < GROUPS or any(len(p) < nproc for p in workers.values()):
            return False
        pids = [pid for group in workers.values() for pid in group]
        processes = [*pids, *(int(agent["pid"]) for agent in agents.values())]
        if any(pid in self.victims or not alive(pid) for pid in processes):
            return False
        started = max(row["ts"] for row in self._of(Event.WORKER_START) if row["pid"] in pids)
        after = max(started, since)
        return any(row["ts"] > after and row.get("participants") == GROUPS for row in self._of(Event.STEP))

    def recovered(self, last_fault: float) -> bool:
        """The end of the run: the group hit last is back and trained with the others."""
        return self.whole(last_fault)

    def inject(self, kind: str) -> dict[str, Any]:
        if kind not in KINDS:
            raise BenchError(f"{self.name}: {kind}: not a fault of this side ({', '.join(sorted(KINDS))})")
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
        if kind == "kill-worker":
            victim = self.rng.choice(sorted(workers[group]))
            self._signal(victim, signal.SIGKILL, f"the worker of group {group}")
            return {"target": f"replica group {group} worker (pid {victim})", "signal": "SIGKILL"}
        agent = int(self.agents()[group]["pid"])
        if kind == "term-node":  # the agent ends its workers itself
            self._signal(agent, signal.SIGTERM, f"the torchrun agent of group {group}")
            return {"target": f"replica group {group} agent (pid {agent})", "signal": "SIGTERM"}
        # kill-node: the agent first, so that it restarts none of the workers killed after it.
        self._signal(agent, signal.SIGKILL, f"the torchrun agent of group {group}")
        for pid in workers[group]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.victims.add(pid)
        return {
            "target": f"replica group {group} agent (pid {agent}) and workers {workers[group]}",
            "signal": "SIGKILL",
        }

    def _signal(self, pid: int, signum: int, what: str) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            raise NoTarget(f"{what} (pid {pid}) is gone") from None
        self.victims.add(pid)

    def stop(self) -> None:
        """SIGTERM the launcher (it ends its groups and the Lighthouse), then SIGKILL any torchrun agent of
        this run that outlived it with everything under it (a warm worker's command line is its forkserver's,
        which names no run: it is found under its agent), and any cold worker of this run left."""
        if self.stopped_at is None:
            self.stopped_at = time.time()
        if self.job is not None:
            end_process(self.job, grace_s=60)

        def names_this_run(pid: int) -> bool:
            return alive(pid) and any(str(self.run_dir) in arg for arg in cmdline(pid))

        kill_trees([row["pid"] for row in self._of(Event.GROUP_STARTED) if names_this_run(row["pid"])])
        for row in self._of(Event.WORKER_START):
            if names_this_run(row["pid"]):
                os.kill(row["pid"], signal.SIGKILL)
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
        # The first workers, then every restart (a crash before training included), new agents' included.
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
            "group_restarts": max(0, len(self._of(Event.GROUP_STARTED)) - GROUPS),  # new agents
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
