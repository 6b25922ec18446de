"""Chaos in the replica-group mode: `elastic-qa chaos run --replicas N --run-dir DIR --fault ... [key=value]`
(or a random schedule: `--seed S --faults K [--kinds ...]`).

It starts `elastic-qa replicas` (`python -m elastic_qa.replica.launch`: a Lighthouse and one torchrun job per
replica group) with the sample ledger on, injects this mode's faults at their steps, and hands the run to the
verdict (chaos/replica_verdict.py). The faults:

    kill-worker        SIGKILL one worker of one group: the others train on, the group's torchrun restarts
                       it and it heals from a live peer
    kill-node          SIGKILL one group's torchrun agent, then its workers (the agent: the group's newest
                       `group_started` line of <run.dir>/agents/replicas.jsonl; the workers: its children and
                       the `worker_start` lines since): the launcher starts the group again, as a scheduler
                       replaces a lost node, and it heals from a live peer
    kill-lighthouse    SIGKILL the Lighthouse (its pid: the newest `lighthouse_started` line of
                       <run.dir>/agents/replicas.jsonl): the launcher starts it again at the same address;
                       the groups, held at the step meanwhile, then ask the new one for their quorums
    stall-replica      SIGSTOP every worker of one group, SIGCONT after `for=`: past the collective timeout
                       the others move on without it, and it must commit nothing they moved past
    kill-during-heal   SIGKILL a worker of one group; once it is back and a peer serves it the training
                       state, SIGKILL that sending group while it is held before the state leaves

A fault at step N holds the job twice (elastic_qa/step_holds.py, armed before the job starts): after step
N until the fault is delivered (for kill-lighthouse: until the new Lighthouse listens), and after step N+1
until the group it took out is back (its restarted workers started training, its stopped ones were thawed;
after kill-lighthouse, every group was given a quorum or, if its request went unanswered and it restarted,
its new workers started training). So the others
commit a step without that group (the quorum moves past it), yet cannot train on to the next fault or to
the end before it rejoins: a restarted group's quorum request waits for its live peers, and peers held at
a later step would leave it waiting. `kill-during-heal` also arms a heal hold at N (the first heal a group
serves from then on waits for its release), which is what lets the sender be killed mid-heal on any
machine. The next fault waits until every group has committed a step together again. Faults therefore
fire by step only, MIN_GAP steps apart at least, none within MIN_GAP steps of train.max_steps.

A random schedule draws its kinds uniformly from `--kinds` (default all of this mode's: every group a fault
takes out comes back, so there are no node bounds to keep) and places them as the default mode does
(schedule.spread: one per slice of train.max_steps, the last slice left for recovery), MIN_GAP steps apart;
kill-node at most replica.max_group_restarts times (its victims, drawn as the run goes, may be one group).
A stall is drawn past the others' timeout, 1.5 to 2.5 times max(collective, heartbeat) timeout: shorter,
it would only be a slow step.

Every action is one JSON line in `<run-dir>/chaos/faults.jsonl` and on stdout, as in the default mode:
an injection (fault, spec, target, the step, the wall time) or a later `action` (a hold released, a group
thawed, the job's exit code).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_qa.chaos.evidence import final_parameters, run_config
from elastic_qa.chaos.faults import NoTarget
from elastic_qa.chaos.runner import EVIDENCE, HOLDS, NOT_TRAINING, RETRY_EVERY_S, log_line, reference_key
from elastic_qa.chaos.schedule import KINDS, Fault, ordered, parse_fault, spread
from elastic_qa.config import Config, ConfigError, resolve_config
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
from elastic_qa.replica.ft import require_torchft
from elastic_qa.replica.launch import not_in_this_mode
from elastic_qa.step_holds import arm, release, release_all, release_heal

KILL_WORKER, KILL_NODE, KILL_LIGHTHOUSE, STALL, KILL_DURING_HEAL = (
    "kill-worker",
    "kill-node",
    "kill-lighthouse",
    "stall-replica",
    "kill-during-heal",
)
REPLICA_KINDS = (KILL_WORKER, KILL_NODE, KILL_LIGHTHOUSE, STALL, KILL_DURING_HEAL)
# Steps a fault needs: held at N until it lands, at N+1 until its group is back, healed by N+2.
MIN_GAP = 3
LAUNCHER = "elastic_qa.replica.launch"
RECORDS = Path("agents") / "replicas.jsonl"  # the launcher's own lines, under run.dir


def parse_replica_fault(text: str) -> Fault:
    """`KIND@step=N` (`stall-replica@step=N,for=15s`): a fault of the replica-group mode, fired at a step."""
    kind = text.partition("@")[0]
    if kind in KINDS and kind not in REPLICA_KINDS:
        raise ValueError(
            f"--fault {text!r}: {kind} has no meaning with --replicas (the replica-group mode's faults: "
            f"{', '.join(REPLICA_KINDS)})"
        )
    fault = parse_fault(text, REPLICA_KINDS)
    if fault.at_step is None:
        raise ValueError(
            f"--fault {text!r}: with --replicas a fault fires at a step (step=N): the job is held there "
            "until it lands"
        )
    if fault.kind == STALL and fault.duration is None:
        raise ValueError(
            f"--fault {text!r}: say how long the group stalls, e.g. {STALL}@step={fault.at_step},for=15s "
            "(past replica.collective_timeout, the others move on without it)"
        )
    if fault.kind != STALL and fault.duration is not None:
        raise ValueError(f"--fault {text!r}: only {STALL} lasts for= a while")
    return fault


def validate_replica_schedule(
    faults: list[Fault], groups: int, max_steps: int, max_group_restarts: int | None = None
) -> None:
    """Refuse a schedule this mode cannot honour: every fault needs a group left training, its steps N and
    N+1 held, and its group healed by N+2 before the next fault or the end; and every node killed needs the
    launcher to start its group again, which it does `replica.max_group_restarts` times per group (the
    victims are drawn as the run goes, so all of them may be one group's)."""
    if groups < 2:
        raise ValueError(
            f"--replicas {groups}: every fault of this mode needs a group that trains on; give --replicas 2 "
            "or more"
        )
    nodes = sum(1 for fault in faults if fault.kind == KILL_NODE)
    if max_group_restarts is not None and nodes > max_group_restarts:
        raise ValueError(
            f"{nodes} {KILL_NODE} faults, but the launcher starts a group again at most "
            f"replica.max_group_restarts={max_group_restarts} times: give fewer, or raise it"
        )
    previous: Fault | None = None
    for fault in ordered(faults):
        assert fault.at_step is not None  # parse_replica_fault: by step only
        if fault.at_step > max_steps - MIN_GAP:
            raise ValueError(
                f"{fault.describe()}: the job ends at step {max_steps}; a fault needs {MIN_GAP} steps after "
                f"its own (held at N, at N+1 until its group is back, healed by N+2): step <= "
                f"{max_steps - MIN_GAP}"
            )
        if (
            previous is not None
            and previous.at_step is not None
            and fault.at_step - previous.at_step < MIN_GAP
        ):
            raise ValueError(
                f"{fault.describe()} is {fault.at_step - previous.at_step} steps after "
                f"{previous.describe()}: give each fault {MIN_GAP} steps (held at N, at N+1 until its group "
                "is back, healed by N+2)"
            )
        previous = fault


def replica_kinds(text: str) -> tuple[str, ...]:
    """`--kinds a,b` of a random schedule in this mode (empty: all of this mode's kinds)."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip()) or REPLICA_KINDS
    for kind in kinds:
        if kind in KINDS and kind not in REPLICA_KINDS:
            raise ValueError(
                f"--kinds: {kind} has no meaning with --replicas (one of {', '.join(REPLICA_KINDS)})"
            )
        if kind not in REPLICA_KINDS:
            raise ValueError(f"--kinds: unknown fault {kind!r} (one of {', '.join(REPLICA_KINDS)})")
    return kinds


def random_replica_schedule(
    seed: int, count: int, cfg: Config, kinds: tuple[str, ...] = REPLICA_KINDS
) -> list[Fault]:
    """`count` faults of `kinds` drawn from `seed` (the same seed, the same schedule) and spread over the
    job as the default mode's random schedules are, MIN_GAP steps apart (see the module's docstring)."""
    rng = random.Random(seed)
    drawn: list[str] = []
    for _ in range(count):  # kill-node no more often than the launcher replaces a group (the same group)
        spent = drawn.count(KILL_NODE) >= cfg.replica.max_group_restarts
        drawn.append(rng.choice([k for k in kinds if not (spent and k == KILL_NODE)] or kinds))
    replica = cfg.replica
    bound = max(replica.collective_timeout, replica.heartbeat_timeout).total_seconds()

    def duration(kind: str) -> float | None:
        return round(rng.uniform(1.5, 2.5) * bound, 2) if kind == STALL else None

    return spread(rng, drawn, cfg.train.max_steps, duration, gap=MIN_GAP)


def replica_schedule(args: argparse.Namespace, cfg: Config) -> list[Fault]:
    """The faults of `chaos run/schedule --replicas`: explicit (`--fault`) or random (`--seed`, `--faults`,
    `--kinds`), refused (ValueError) when this mode cannot honour them."""
    if cfg.train.epochs:  # faults, the verdict and the reference run count steps: the job must too
        raise ValueError(f"train.epochs={cfg.train.epochs}: chaos runs take a train.max_steps, not epochs")
    if args.fault and args.faults:
        raise ValueError("give either --fault ... or --faults N, not both")
    if args.kinds and not args.faults:
        raise ValueError("--kinds picks the kinds of a random schedule: give --faults N too")
    if args.faults:
        schedule = random_replica_schedule(args.seed, args.faults, cfg, replica_kinds(args.kinds))
    else:
        schedule = [parse_replica_fault(text) for text in args.fault]
    validate_replica_schedule(schedule, args.replicas, cfg.train.max_steps, cfg.replica.max_group_restarts)
    return schedule


def refuse_other_options(args: argparse.Namespace) -> None:
    """The default mode's options that mean nothing here, refused with one line."""
    for flag in ("agents", "min", "max"):
        if getattr(args, flag) is not None:
            raise ValueError(
                f"--{flag} has no meaning with --replicas: the job is --replicas groups of "
                "replica.nproc_per_group workers each"
            )
    if args.min_gap is not None:
        raise ValueError(
            "--min-gap has no meaning with --replicas: each fault holds the job at its step until it lands "
            "and its group is back, however fast the steps are"
        )
    for override in args.overrides:
        key, _, value = override.partition("=")
        if key.strip() == "replica.groups" and value.strip() != str(args.replicas):
            raise ValueError(f"{override}: the groups are --replicas {args.replicas}; give one or the other")


def replica_overrides(overrides: list[str], groups: int, run_dir: Path) -> list[str]:
    return [*overrides, f"replica.groups={groups}", f"run.dir={run_dir}"]


class ReplicaDriver:
    """One `elastic-qa replicas` job on this host, started from this process and reached by pid.

    Like chaos/job.py's Job for the default mode: the launcher is tied to this process (it gets SIGTERM
    when this process dies, and stops its groups), and `kill_everything` ends the whole tree at once."""

    def __init__(
        self, run_dir: Path, config: str, overrides: list[str], cfg: Config, python: str = sys.executable
    ) -> None:
        self.run_dir, self.config, self.overrides, self.cfg = Path(run_dir), config, overrides, cfg
        self.python = python
        self.process: subprocess.Popen | None = None
        self.events: list[dict[str, Any]] = []  # the workers' lines read so far, in the order read
        self._follower = LogFollower(self.run_dir / "logs")
        self._lock = threading.Lock()
        self._progress = 0

    def start(self, timeout: float = 300) -> None:
        """Start the launcher; RuntimeError when it exits, TimeoutError when it has not started every group
        within `timeout` seconds. The run's resolved config is written first (<run.dir>/config.yaml, which
        the replica workers do not write): the verdict reads it."""
        (self.run_dir / "chaos").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(self.cfg.to_yaml())
        out = open(self.run_dir / "chaos" / "launcher.log", "ab")  # noqa: SIM115 - lives with the job
        self.process = subprocess.Popen(
            [self.python, "-m", LAUNCHER, "--config", self.config, *self.overrides],
            stdout=out, stderr=subprocess.STDOUT, env=python_env(), preexec_fn=tied_to_this_process(),
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while len(self.agents()) < self.cfg.replica.groups:
            if self.process.poll() is not None:
                raise RuntimeError(f"the replica launcher exited {self.process.returncode}: see {out.name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replica launcher did not start its groups within {timeout:.0f} s")
            time.sleep(0.05)

    def ended(self) -> bool:
        return self.process is None or self.process.poll() is not None

    def kill_everything(self) -> None:
        """SIGKILL the launcher and everything under it (the Lighthouse, the groups' agents, their workers),
        and any group agent left from it (an agent's pid is trusted only while it names this run)."""
        agents = [pid for pid in self.agents().values() if self.names_this_run(pid)]
        launcher = [self.process.pid] if self.process and self.process.poll() is None else []
        kill_trees([*launcher, *agents])
        if self.process:
            self.process.wait()

    # ---- the launcher's lines and the processes they name ---------------------------------------------
    def records(self) -> list[dict[str, Any]]:
        path = self.run_dir / RECORDS
        rows = []
        for line in path.read_text().splitlines() if path.exists() else []:
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
        return [row for row in rows if isinstance(row, dict)]

    def agents(self) -> dict[int, int]:
        """Each group's newest torchrun agent pid (`group_started`)."""
        return {row["group"]: row["pid"] for row in self.records() if row.get("event") == Event.GROUP_STARTED}

    def workers(self, group: int) -> list[int]:
        agent = self.agents().get(group)
        return [] if agent is None else [pid for pid in workers_of(agent) if alive(pid)]

    def group_agent(self, group: int) -> tuple[int, float]:
        """The group's newest torchrun agent and when it was started (its newest `group_started` line);
        NoTarget while it is gone (the launcher is starting the group again) or its pid names no agent of
        this run."""
        started = [
            r for r in self.records() if r.get("event") == Event.GROUP_STARTED and r.get("group") == group
        ]
        if not started or not self.names_this_run(started[-1]["pid"]):
            raise NoTarget(f"replica group {group} has no live torchrun agent")
        return started[-1]["pid"], started[-1].get("ts", 0.0)

    def group_workers(self, group: int, agent: int, since: float) -> list[int]:
        """The live workers of `group` under `agent`: its children, and every process that logged
        `worker_start` for the group since `since` and still names this run (one its agent no longer
        parents)."""
        logged = {
            row["pid"]
            for row in self.follow()
            if row.get("event") == Event.WORKER_START
            and row.get("replica_group") == group
            and isinstance(row.get("pid"), int)
            and row.get("ts", 0) >= since
        }
        found = {*workers_of(agent), *(pid for pid in logged if self.names_this_run(pid))}
        return sorted(pid for pid in found if alive(pid))

    def names_this_run(self, pid: int) -> bool:
        """Whether `pid` is a live process started for this run (its command line names the run's
        directory): a pid read from a line is trusted only then."""
        return any(str(self.run_dir) in arg for arg in cmdline(pid))

    def lighthouse(self) -> dict[str, Any]:
        """The newest `lighthouse_started` line; NoTarget while there is none or its process is gone."""
        started = [row for row in self.records() if row.get("event") == Event.LIGHTHOUSE_STARTED]
        if not started or not alive(started[-1]["pid"]):
            raise NoTarget("no live Lighthouse")
        return started[-1]

    # ---- the workers' lines --------------------------------------------------------------------------
    def follow(self) -> list[dict[str, Any]]:
        """Every worker line read so far (reads what was appended since the last call)."""
        with self._lock:
            for row in self._follower.new_events():
                self.events.append(row)
                if row.get("event") == Event.STEP and isinstance(row.get("step"), int):
                    self._progress = max(self._progress, row["step"])
            return self.events

    def progress(self) -> int:
        """The highest step committed (a step line, written by each quorum's rank 0 group)."""
        self.follow()
        return self._progress

    def seen(self, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((row for row in self.follow() if check(row)), None)


class ReplicaRunner:
    """Injects a schedule of this mode's faults into one replica job (see the module's docstring)."""

    def __init__(
        self, run_dir: Path, job: ReplicaDriver, schedule: list[Fault], seed: int, timeout: float, cfg: Config
    ) -> None:
        self.run_dir, self.job, self.schedule, self.cfg = run_dir, job, schedule, cfg
        self.timeout = timeout
        self.rng = random.Random(seed)
        self.groups, self.per_group = cfg.replica.groups, cfg.replica.nproc_per_group
        replica = cfg.replica
        # The longest a recovery may take before the runner says so and goes on: a restart, a quorum timeout
        # and a transfer, on a loaded machine.
        self.wait_s = max(120.0, 3 * (replica.quorum_timeout + replica.collective_timeout).total_seconds())
        self.hold_dir = run_dir / "chaos" / HOLDS
        self.thawed: dict[int, threading.Event] = {}  # fault index -> set once its group is thawed
        self._timers: list[tuple[threading.Timer, Callable[[], None]]] = []
        self.started = time.monotonic()

    def log(self, record: dict[str, Any]) -> None:
        log_line(self.run_dir, {**record, "elapsed_s": round(time.monotonic() - self.started, 2)})

    def out_of_time(self) -> bool:
        return time.monotonic() - self.started > self.timeout

    def wait_until(self, condition: Callable[[], object], limit_s: float, poll_s: float = 0.05) -> bool:
        """Poll `condition` until it holds (True), the job ends, time is up, or `limit_s` passes."""
        deadline = time.monotonic() + limit_s
        while not condition():
            if self.job.ended() or self.out_of_time() or time.monotonic() > deadline:
                return bool(condition())
            time.sleep(poll_s)
        return True

    def waited(self, condition: Callable[[], object], fault: Fault, what: str) -> bool:
        """wait_until(condition, wait_s); a wait that ran out is logged (the run goes on)."""
        if self.wait_until(condition, self.wait_s):
            return True
        if not self.job.ended():
            self.log({"action": "wait_timeout", "fault": fault.kind, "waited_for": what})
        return False

    def _release(self, fault: Fault, step: int, why: str) -> None:
        if release(self.hold_dir, step):
            self.log({"action": "released", "fault": fault.kind, "hold": step, "why": why})

    # ---- the run --------------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self.job.start()
        except (RuntimeError, TimeoutError) as err:
            self.log({"action": "job_start_failed", "error": str(err)})
            self.job.kill_everything()
            return 1
        self.started = time.monotonic()
        injected = 0
        try:
            for index, fault in enumerate(ordered(self.schedule), start=1):
                assert fault.at_step is not None  # parse_replica_fault: by step only
                record = {
                    "fault": fault.kind,
                    "spec": fault.describe(),
                    "index": index,
                    "of": len(self.schedule),
                }
                due = functools.partial(self._due, fault.at_step)
                self.wait_until(due, limit_s=float("inf"))
                if self.job.ended() or self.out_of_time():
                    why = "the job had already ended" if self.job.ended() else "the run ran out of time"
                    self.log({**record, "skipped": why})
                    continue
                self.waited(
                    functools.partial(self._all_held, fault.at_step),
                    fault,
                    f"every group held at {fault.at_step}",
                )
                step = self.job.progress()
                outcome = self._inject(fault, index)
                self.log({**record, **outcome, "step": step})
                self._release(fault, fault.at_step, "the fault was delivered")
                if "skipped" in outcome:
                    self._release(fault, fault.at_step + 1, "the fault was skipped")
                    continue
                injected += 1
                self._rejoin(fault, index, outcome)
            self.log({"action": "schedule_done", "requested": len(self.schedule), "injected": injected})
            return self._wait_for_exit()
        finally:
            release_all(self.hold_dir)  # a fault skipped or a run cut short: nothing stays held
            for timer, thaw in self._timers:  # nothing stays stopped either
                timer.cancel()
                thaw()
            self.job.kill_everything()

    def _inject(self, fault: Fault, index: int) -> dict[str, Any]:
        """Inject `fault`, retrying while it has no target (a group mid-restart); its record's fields."""
        handler = getattr(self, "_" + fault.kind.replace("-", "_"))
        retry_until = time.monotonic() + self.wait_s
        tries, first_miss = 0, None
        while True:
            tries += 1
            try:
                outcome: dict[str, Any] = handler(fault, index)
                break
            except NoTarget as err:
                first_miss = first_miss or str(err)
                if self.job.ended() or self.out_of_time() or time.monotonic() > retry_until:
                    outcome = {"skipped": f"no target: {err}"}
                    break
                time.sleep(RETRY_EVERY_S)
            except OSError as err:  # the injector itself failed: record it, keep the run going
                outcome = {"skipped": f"injection failed: {type(err).__name__}: {err}"}
                break
        return {**outcome, "tries": tries, "first_miss": first_miss} if tries > 1 else outcome

    def _rejoin(self, fault: Fault, index: int, outcome: dict[str, Any]) -> None:
        """Release the hold at N+1 once the fault's group is back, then wait until every group has committed
        a step together again: the next fault finds the whole job."""
        assert fault.at_step is not None
        since = float(outcome.get("ts", time.time()))
        back: Callable[[], object]
        if fault.kind == KILL_LIGHTHOUSE:
            what = "every group asking the new Lighthouse"
            back = functools.partial(self._every_group_asks, self._lighthouse_started_at(outcome["pid"]))
        elif fault.kind == STALL:
            what = f"group {outcome['group']} thawed"
            back = self.thawed[index].is_set
        else:
            what = f"group {outcome['group']} started again"
            back = functools.partial(self._group_back, outcome["group"], set(outcome["pids"]), since)
        self.waited(back, fault, what)
        self._release(fault, fault.at_step + 1, f"{what}: it may rejoin")
        self.waited(functools.partial(self._whole, time.time()), fault, "a step of every group together")

    # ---- conditions, read from the job's own lines ---------------------------------------------------
    def _due(self, step: int) -> bool:
        return self.job.progress() >= step

    def _all_held(self, step: int) -> bool:
        held: dict[int, int] = {}
        for row in self.job.follow():
            if row.get("event") == Event.HOLD and row.get("hold") == step and not row.get("heal"):
                held[row.get("replica_group", -1)] = held.get(row.get("replica_group", -1), 0) + 1
        return all(held.get(group, 0) >= self.per_group for group in range(self.groups))

    def _group_back(self, group: int, gone: set[int], since: float) -> bool:
        """Every worker of `group` started anew since `since` (a train_start line of a pid not in `gone`)."""
        fresh = {
            row["pid"]
            for row in self.job.follow()
            if row.get("event") == Event.TRAIN_START
            and row.get("replica_group") == group
            and row.get("pid") not in gone
            and row.get("ts", 0) >= since - 1
        }
        return len(fresh) >= self.per_group

    def _lighthouse_again(self, killed: int) -> bool:
        """The launcher started a Lighthouse after the one killed (it records it once it listens)."""
        started = [row for row in self.job.records() if row.get("event") == Event.LIGHTHOUSE_STARTED]
        pids = [row.get("pid") for row in started]
        return killed in pids and pids.index(killed) < len(pids) - 1

    def _lighthouse_started_at(self, killed: int) -> float:
        """When the Lighthouse after the one killed was listening (the launcher's line)."""
        started = [row for row in self.job.records() if row.get("event") == Event.LIGHTHOUSE_STARTED]
        after = [row["ts"] for i, row in enumerate(started) if i and started[i - 1].get("pid") == killed]
        return after[0] if after else time.time()

    def _every_group_asks(self, since: float) -> bool:
        """Every group has been given a quorum since `since` (a `quorum` line: its quorum id changed), or,
        when its request got none (`no_quorum`: it saved and its torchrun restarts it), its new workers
        started training: they ask at once, and a peer held meanwhile would leave them waiting."""
        asked = {
            row.get("replica_group")
            for row in self.job.follow()
            if row.get("event") in (Event.QUORUM, Event.TRAIN_START) and row.get("ts", 0) > since
        }
        return all(group in asked for group in range(self.groups))

    def _whole(self, since: float) -> bool:
        return (
            self.job.seen(
                lambda row: (
                    row.get("event") == Event.STEP
                    and row.get("participants") == self.groups
                    and row.get("ts", 0) > since
                )
            )
            is not None
        )

    def _victim(self) -> tuple[int, list[int]]:
        """A group chosen by the run's seed, with its live workers; NoTarget while it has none."""
        group = self.rng.randrange(self.groups)
        workers = self.job.workers(group)
        if not workers:
            raise NoTarget(f"replica group {group} has no live worker")
        return group, workers

    # ---- the faults ----------------------------------------------------------------------------------
    def _kill_worker(self, fault: Fault, index: int) -> dict[str, Any]:
        group, workers = self._victim()
        pid = self.rng.choice(workers)
        _kill(pid, signal.SIGKILL)
        return {
            "target": f"worker pid {pid} of replica group {group}",
            "group": group,
            "pids": [pid],
            "ts": time.time(),
        }

    def _kill_node(self, fault: Fault, index: int) -> dict[str, Any]:
        """SIGKILL one group's torchrun agent and its workers, as a lost node: the launcher starts the group
        again (its first workers ask for a quorum and heal from a live peer)."""
        group = self.rng.randrange(self.groups)
        agent, since = self.job.group_agent(group)
        _kill(agent, signal.SIGSTOP)  # it starts no worker between the listing and the kill
        workers = self.job.group_workers(group, agent, since)
        if not workers:  # its torchrun is restarting them: try again once they are up
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent, signal.SIGCONT)
            raise NoTarget(f"replica group {group} has no live worker")
        for pid in [agent, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return {
            "target": f"replica group {group}: torchrun agent pid {agent} and workers {workers}",
            "group": group,
            "agent": agent,
            "pids": [agent, *workers],
            "ts": time.time(),
        }

    def _kill_lighthouse(self, fault: Fault, index: int) -> dict[str, Any]:
        """SIGKILL the Lighthouse and wait (held at N) until the launcher has it listening again: the groups
        then ask the new one for their quorums (as tests/replica/test_faults.py does)."""
        started = self.job.lighthouse()
        _kill(started["pid"], signal.SIGKILL)
        record = {
            "target": f"the Lighthouse, pid {started['pid']} (port {started.get('port')})",
            "pid": started["pid"],
            "port": started.get("port"),
            "ts": time.time(),
        }
        if not self.waited(
            functools.partial(self._lighthouse_again, started["pid"]), fault, "a new Lighthouse"
        ):
            return {
                **record,
                "skipped": f"the launcher did not start a Lighthouse again within {self.wait_s:g} s",
            }
        return record

    def _stall_replica(self, fault: Fault, index: int) -> dict[str, Any]:
        group, workers = self._victim()
        for pid in workers:
            _kill(pid, signal.SIGSTOP)
        seconds = fault.duration or 0.0
        thawed = self.thawed[index] = threading.Event()

        def thaw() -> None:
            if thawed.is_set():
                return
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            thawed.set()
            self.log({"action": "thawed", "fault": fault.kind, "group": group, "pids": workers})

        timer = threading.Timer(seconds, thaw)
        timer.daemon = True
        timer.start()
        self._timers.append((timer, thaw))
        return {
            "target": f"replica group {group}: workers {workers} stopped for {seconds:g} s",
            "group": group,
            "pids": workers,
            "stall_s": seconds,
            "ts": time.time(),
        }

    def _kill_during_heal(self, fault: Fault, index: int) -> dict[str, Any]:
        """Kill a worker of one group; once it is back, let the others go on (N+1) so that a peer serves it
        the state, and SIGKILL every worker of that sending group while it is held before the state leaves;
        then release the heal hold (no process is left waiting on it)."""
        assert fault.at_step is not None
        victim, workers = self._victim()
        first = self.rng.choice(workers)
        _kill(first, signal.SIGKILL)
        first_ts = time.time()
        killed = {"victim_group": victim, "victim_pids": [first], "first_ts": first_ts}
        self._release(fault, fault.at_step, "the first kill was delivered")
        if not self.waited(
            functools.partial(self._group_back, victim, {first}, first_ts),
            fault,
            f"group {victim} started again",
        ):
            return {**killed, "skipped": f"group {victim} was not started again within {self.wait_s:g} s"}
        self._release(fault, fault.at_step + 1, f"group {victim} started again: a peer may heal it")

        def sending(row: dict[str, Any]) -> bool:
            return (
                row.get("event") == Event.HOLD
                and row.get("heal") is True
                and row.get("hold") == fault.at_step
                and row.get("released") is False
                and row.get("replica_group") != victim
            )

        if not self.waited(lambda: self.job.seen(sending), fault, "a heal held before the state leaves"):
            release_heal(self.hold_dir, fault.at_step)
            return {**killed, "skipped": f"no peer served group {victim} a heal within {self.wait_s:g} s"}
        held = self.job.seen(sending)
        assert held is not None
        sender = held["replica_group"]
        senders = sorted({held["pid"], *self.job.workers(sender)})
        for pid in senders:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        release_heal(self.hold_dir, fault.at_step)
        self.log({"action": "heal_released", "fault": fault.kind, "hold": fault.at_step})
        return {
            "target": (
                f"replica group {sender} (workers {senders}) while held sending the state of step "
                f"{held['step']} to group {victim}, whose worker pid {first} was killed first"
            ),
            "group": sender,
            "pids": senders,
            "sender_step": held["step"],
            "held_at_heal": True,
            **killed,
            "ts": time.time(),
        }

    def _wait_for_exit(self) -> int:
        remaining = self.timeout - (time.monotonic() - self.started)
        self.wait_until(self.job.ended, limit_s=max(1.0, remaining), poll_s=0.2)
        if not self.job.ended():
            self.log({"action": "job_timeout", "after_s": self.timeout})
            self.job.kill_everything()
            code = 124
        else:
            assert self.job.process is not None
            code = self.job.process.returncode
        self.log({"action": "job_exit", "exit_code": code})
        return code


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise NoTarget(f"pid {pid} is gone") from None


def run_replica_schedule(
    run_dir: Path, config: str, overrides: list[str], schedule: list[Fault], seed: int, timeout: float
) -> int:
    """Run the replica job with its faults; the launcher's exit code (124: killed after `timeout`)."""
    chaos = run_dir / "chaos"
    job_overrides = [*overrides, *EVIDENCE, f"debug.hold_dir={chaos / HOLDS}", "log.console=none"]
    cfg = resolve_config(config, job_overrides)
    chaos.mkdir(parents=True, exist_ok=True)
    steps = [f.at_step for f in schedule if f.at_step is not None]
    heals = [f.at_step for f in schedule if f.at_step is not None and f.kind == KILL_DURING_HEAL]
    arm(chaos / HOLDS, sorted({*steps, *(s + 1 for s in steps)}), heals=heals)
    (chaos / "schedule.json").write_text(json.dumps([f.to_dict() for f in schedule], indent=1))
    job = ReplicaDriver(run_dir, config, job_overrides, cfg)
    return ReplicaRunner(run_dir, job, schedule, seed, timeout, cfg).run()


def replica_reference_run(
    config: str, overrides: list[str], groups: int, cache_root: Path, timeout: float
) -> Path:
    """Run (or reuse) the fault-free reference of a replica chaos run: the same config and groups, without
    the debug and checkpoint overrides; cached apart from the default mode's references."""
    key = "replicas-" + reference_key(config, [*overrides, f"replica.groups={groups}"], groups)
    run_dir = cache_root / key
    if (run_dir / "config.yaml").exists():
        done = final_parameters(run_config(run_dir))
        if done is not None and done[0] == run_config(run_dir).train.max_steps:
            print(json.dumps({"event": "reference_reused", "run_dir": str(run_dir)}), flush=True)
            return run_dir
        shutil.rmtree(run_dir)
    print(json.dumps({"event": "reference_start", "run_dir": str(run_dir)}), flush=True)
    training = [o for o in overrides if not o.strip().startswith(NOT_TRAINING)]
    job_overrides = [*replica_overrides(training, groups, run_dir), *EVIDENCE, "log.console=none"]
    job = ReplicaDriver(run_dir, config, job_overrides, resolve_config(config, job_overrides))
    job.start()
    try:
        assert job.process is not None
        code = job.process.wait(timeout=timeout)
    finally:
        job.kill_everything()
    if code != 0:
        raise RuntimeError(f"the reference run failed (exit {code}): see {run_dir}/agents")
    return run_dir


def cmd_run_replicas(args: argparse.Namespace) -> int:
    """`chaos run --replicas N`: refuse what this mode cannot do (ValueError, ConfigError: exit 2), run the
    job with its faults, print and write the verdict; 0 only when every check holds."""
    from elastic_qa.chaos.present import format_table, write_report
    from elastic_qa.chaos.verify import verify_run

    refuse_other_options(args)
    run_dir = Path(args.run_dir)
    overrides = replica_overrides(args.overrides, args.replicas, run_dir)
    cfg = resolve_config(args.config, overrides)  # bad config: exit 2 before anything starts
    if (refusal := not_in_this_mode(cfg)) is not None:
        raise ConfigError(refusal)
    require_torchft()
    if (run_dir / RECORDS).exists() or (run_dir / "launch.json").exists():
        raise ValueError(f"{run_dir} already holds a job; use a new --run-dir")
    schedule = replica_schedule(args, cfg)
    print("schedule: " + " ".join(f.describe() for f in schedule), flush=True)
    reference = None
    if not args.no_reference:
        cache_root = Path(args.reference_cache).expanduser()
        reference = replica_reference_run(
            args.config, args.overrides, args.replicas, cache_root, args.timeout
        )
    code = run_replica_schedule(run_dir, args.config, overrides, schedule, args.seed, args.timeout)
    print(f"job ended with exit code {code}", flush=True)
    verdict = verify_run(run_dir, reference)
    json_path, page = write_report(run_dir, verdict, reference)
    print(format_table(verdict))
    print(f"report: {json_path}  picture: {page}")
    return 0 if verdict.ok else 1


def cmd_schedule_replicas(args: argparse.Namespace) -> int:
    """`chaos schedule --replicas N`: print the schedule `chaos run` would inject, one fault a line."""
    refuse_other_options(args)
    cfg = resolve_config(args.config, [*args.overrides, f"replica.groups={args.replicas}"])
    for fault in replica_schedule(args, cfg):
        print(fault.describe())
    return 0
