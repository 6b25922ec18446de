"""The fault runner: start a job through the project's own launcher, inject a schedule of faults, verify.

Each fault is injected once its trigger (a step, or a time since the start) has passed *and* the job has
completed at least one step since the previous fault, so faults hit a training group rather than piling onto a
regroup in progress, and every recovery can be attributed to the fault that caused it. A fault triggered at
step N does not race the job: the job is held after step N (elastic_qa/step_holds.py, armed before it starts)
until the fault has fired, so however slow the machine (a recovery of a minute, say) the job can neither run
past N nor end first. The hold is released once the fault is delivered (a kill sent, a flag created); for
`join-node` once the joining agent is admitted (a newer group has started: the held workers' agents stop them
to regroup, which a hold never delays); for `kill-during-save`, which hits the job's next save (asked for at
N+1), by the injector once it has its target. A fault whose target is momentarily absent (no worker during a
regroup, no checkpoint yet) releases the hold, since the job may have to move on to make one, and is retried
every 0.2 s until it lands or the job ends. After a fault that restarts the group the runner waits for the new
group to train; after `log-full` for the end of its window (log lines written meanwhile are lost, and the
verifier must not need them to attribute a restart). A second job is waited for until it is refused (the live
job holds its run) or registers (a failure), and judged by its exit and its own lines.

Every action is one JSON line in `<run-dir>/chaos/faults.jsonl` and on stdout: an injection has `fault`
(kind, spec, target, step at injection, wall time); what happens later (a flag removed, a worker thawed,
a second job's exit, the job's exit code) has `action`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from elastic_qa.chaos.evidence import final_parameters, run_config
from elastic_qa.chaos.faults import FlagFile, Injector, NoTarget
from elastic_qa.chaos.job import Job
from elastic_qa.chaos.schedule import Fault, ordered, restarts_group
from elastic_qa.config import Config, resolve_config
from elastic_qa.step_holds import arm, release, release_all

# Forced on every chaos run: the evidence the verifier reads.
EVIDENCE = ("debug.sample_ledger=true", "log.every_steps=1")
# Settings that change how a run is observed or slowed down, not what it trains: a reference run goes
# without them (it is cached by what it trains, and a slowed-down reference only costs time).
NOT_TRAINING = ("debug.", "checkpoint.")
RETRY_EVERY_S = 0.2
# Faults whose hold is released before they are injected: they act on what the job does next.
RELEASE_FIRST = frozenset({"kill-during-save"})
# Under <run-dir>/chaos: the step holds (debug.hold_dir), one per step-triggered fault.
HOLDS = "holds"
# Subpackages that start, break or measure training but take no part in it: not in the code fingerprint.
TOOLING = frozenset({"bench", "chaos", "launcher"})

_log_lock = threading.Lock()


def log_line(run_dir: Path, record: dict) -> None:
    record = {**record, "ts": record.get("ts", time.time())}
    path = run_dir / "chaos" / "faults.jsonl"
    with _log_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


def code_fingerprint() -> str:
    """A hash of the trainer's source: a reference trained by other code (another model, say) is stale;
    a change to the tooling (TOOLING) keeps it."""
    import elastic_qa

    digest = hashlib.sha256()
    package = Path(elastic_qa.__file__).parent
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] in TOOLING:
            continue
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def reference_key(config: str, overrides: list[str], agents: int) -> str:
    """Configs that train the same model the same way, with the same code, share a reference run."""
    resolved = resolve_config(config, overrides)
    tree = resolved.to_dict()
    for volatile in ("run", "log", "debug", "checkpoint"):  # where and how it is observed, not what
        tree.pop(volatile)
    blob = json.dumps(
        {"cfg": tree, "seed": resolved.run.seed, "agents": agents, "code": code_fingerprint()}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reference_run(config: str, overrides: list[str], agents: int, cache_root: Path, timeout: float) -> Path:
    """Run (or reuse) the fault-free reference of a chaos run: same config, same starting agents.

    It runs without the chaos run's debug and checkpoint overrides: no step delay (what takes a soak
    minutes takes its reference seconds), and its checkpoints in its own directory.
    """
    key = reference_key(config, overrides, agents)
    run_dir = cache_root / key
    if (run_dir / "config.yaml").exists():
        cfg = run_config(run_dir)
        done = final_parameters(cfg)
        if done is not None and done[0] == cfg.train.max_steps:
            print(json.dumps({"event": "reference_reused", "run_dir": str(run_dir)}), flush=True)
            return run_dir
        shutil.rmtree(run_dir)
    print(json.dumps({"event": "reference_start", "run_dir": str(run_dir)}), flush=True)
    training = [o for o in overrides if not o.strip().startswith(NOT_TRAINING)]
    job = Job(run_dir, config, [*training, *EVIDENCE, "log.console=none"], agents=agents)
    job.start()
    try:
        code = job.wait(timeout)
    finally:
        job.kill_everything()
    if code != 0:
        raise RuntimeError(f"the reference run failed (exit {code}): see {run_dir}/agents")
    return run_dir


class Runner:
    def __init__(
        self, run_dir: Path, job: Job, schedule: list[Fault], seed: int, timeout: float, cfg: Config
    ) -> None:
        self.run_dir, self.job, self.schedule, self.cfg = run_dir, job, schedule, cfg
        self.timeout = timeout
        self.rng = random.Random(seed)
        self.dist_timeout_s = cfg.dist.timeout.total_seconds()
        self.final_retry_s = cfg.checkpoint.final_retry_for.total_seconds()
        chaos = run_dir / "chaos"
        self.hold_dir = chaos / HOLDS
        self.storage = FlagFile(chaos / "storage-fault", self.log)
        self.logs = FlagFile(chaos / "log-fault", self.log)
        self.injector = Injector(
            job,
            self.rng,
            Path(cfg.checkpoint_dir),
            self.storage,
            self.logs,
            self.log,
            cfg.train.max_steps,
        )
        self.started = time.monotonic()

    def log(self, record: dict) -> None:
        log_line(self.run_dir, {**record, "elapsed_s": round(time.monotonic() - self.started, 2)})

    # ---- waiting --------------------------------------------------------------------------------------
    def ended(self) -> bool:
        assert self.job.process is not None  # run_chaos starts the job before the Runner runs
        return self.job.process.poll() is not None

    def out_of_time(self) -> bool:
        return time.monotonic() - self.started > self.timeout

    def wait_until(self, condition: Callable[[], object], limit_s: float, poll_s: float = 0.05) -> bool:
        """Poll `condition` until it holds (True), the job ends, time is up, or `limit_s` passes."""
        deadline = time.monotonic() + limit_s
        while not condition():
            if self.ended() or self.out_of_time() or time.monotonic() > deadline:
                return bool(condition())
            time.sleep(poll_s)
        return True

    def _due(self, fault: Fault, after_progress: int) -> bool:
        progress = self.job.progress()
        due = (fault.at_step is not None and progress >= fault.at_step) or (
            fault.at_time is not None and time.monotonic() - self.started >= fault.at_time
        )
        return due and progress > after_progress

    # ---- the run --------------------------------------------------------------------------------------
    def run(self) -> int:
        self.job.start()
        self.started = time.monotonic()
        injected = 0
        try:
            last_progress = 0  # no fault before the group has trained a step
            for index, fault in enumerate(ordered(self.schedule), start=1):
                record = {
                    "fault": fault.kind,
                    "spec": fault.describe(),
                    "index": index,
                    "of": len(self.schedule),
                }
                self.wait_until(functools.partial(self._due, fault, last_progress), limit_s=float("inf"))
                if self.ended() or self.out_of_time():
                    why = "the job had already ended" if self.ended() else "the run ran out of time"
                    self.log({**record, "skipped": why})
                    continue
                outcome, last_progress = self._inject(fault, record)
                if "skipped" not in outcome:
                    injected += 1
            self.log({"action": "schedule_done", "requested": len(self.schedule), "injected": injected})
            return self._wait_for_exit()
        finally:
            release_all(self.hold_dir)  # a fault skipped or a run cut short: nothing stays held
            self.injector.close()
            self.job.kill_everything()

    def _release(self, fault: Fault, why: str) -> None:
        if fault.at_step is not None and release(self.hold_dir, fault.at_step):
            self.log({"action": "released", "fault": fault.kind, "hold": fault.at_step, "why": why})

    def _inject(self, fault: Fault, record: dict) -> tuple[dict, int]:
        """Inject `fault` (retrying while it has no target); (its outcome, the step it was injected at)."""
        step = self.job.progress()
        attempt_before = self.job.attempt
        # A fault that hits what the job does next is released by the injector once it has its target.
        self.injector.ready = lambda: self._release(fault, "it hits the save the job makes next")
        retry_until = time.monotonic() + max(60.0, 2 * self.dist_timeout_s)
        tries, first_miss, waiter = 0, None, None
        while True:
            tries += 1
            try:
                outcome, waiter = self.injector.inject(fault)
                break
            except NoTarget as err:  # e.g. mid-regroup: try again shortly
                if first_miss is None:  # the job may have to move on to make a target (a checkpoint)
                    self._release(fault, f"no target yet: {err}")
                first_miss = first_miss or str(err)
                if self.ended() or self.out_of_time() or time.monotonic() > retry_until:
                    outcome = {"skipped": f"no target: {err}"}
                    break
                time.sleep(RETRY_EVERY_S)
            except OSError as err:  # the injector itself failed: record it, keep the run going
                outcome = {"skipped": f"injection failed: {type(err).__name__}: {err}"}
                break
        if tries > 1:
            outcome = {**outcome, "tries": tries, "first_miss": first_miss}
        self.log({**record, **outcome, "step": step})
        if "skipped" in outcome:
            self._release(fault, "the fault was skipped")
            return outcome, step
        if fault.kind == "join-node":
            self._wait_for_admission(attempt_before)
            self._release(fault, "the joining agent was admitted")
        self._release(fault, "the fault was delivered")  # before any wait for the recovery it causes
        if restarts_group(fault.kind, fault.duration, self.dist_timeout_s, self.final_retry_s):
            self._wait_for_recovery(fault, outcome, attempt_before)
        if waiter is not None and fault.kind == "log-full":
            limit = (fault.duration or 60.0) + 30.0
            if not self.wait_until(waiter.is_set, limit_s=limit):
                self.log({"action": "wait_timeout", "fault": fault.kind, "waited_for": "the fault's window"})
        return outcome, step

    def _wait_for_admission(self, attempt_before: int) -> None:
        """A join has fired once the joiner is admitted: a newer group has started (the held group's
        agents stop it to regroup). Until then the job stays held, so it cannot end first."""
        limit = max(120.0, 3 * self.dist_timeout_s)
        admitted = self.wait_until(lambda: self._newest_attempt() > attempt_before, limit)
        if not admitted and not self.ended():
            waited_for = "the joining agent's admission"
            self.log({"action": "wait_timeout", "fault": "join-node", "waited_for": waited_for})

    def _newest_attempt(self) -> int:
        self.job.progress()  # reads the worker_start lines logged since
        return self.job.attempt

    def _wait_for_recovery(self, fault: Fault, outcome: dict, attempt_before: int) -> None:
        """One fault at a time: the next waits until a newer group has trained a step."""
        after = attempt_before
        limit = max(120.0, 3 * self.dist_timeout_s)
        recovered = self.wait_until(lambda: any(a > after for a in self._main_attempts_with_steps()), limit)
        if not recovered and not self.ended():
            self.log(
                {"action": "wait_timeout", "fault": fault.kind, "waited_for": f"an attempt after {after}"}
            )

    def _main_attempts_with_steps(self) -> list[int]:
        self.job.progress()
        return list(self.job.attempt_steps)

    def _wait_for_exit(self) -> int:
        remaining = self.timeout - (time.monotonic() - self.started)
        self.wait_until(self.ended, limit_s=max(1.0, remaining), poll_s=0.2)
        if not self.ended():
            self.log({"action": "job_timeout", "after_s": self.timeout})
            self.job.kill_everything()
            code = 124
        else:
            assert self.job.process is not None  # ended() saw it
            code = self.job.process.returncode
        self.log({"action": "job_exit", "exit_code": code})
        return code


def run_schedule(
    run_dir: Path,
    config: str,
    overrides: list[str],
    schedule: list[Fault],
    agents: int,
    min_nodes: int,
    max_nodes: int,
    seed: int,
    timeout: float,
    fitted: dict[str, str] | None = None,
) -> int:
    """Run the job with its faults; return the launcher's exit code (124: killed after `timeout`)."""
    chaos = run_dir / "chaos"
    flags = [
        f"debug.storage_fault_file={chaos / 'storage-fault'}",
        f"debug.log_fault_file={chaos / 'log-fault'}",
        f"debug.hold_dir={chaos / HOLDS}",
    ]
    fitted = fitted or {}
    job_overrides = [
        *overrides,
        *(f"{k}={v}" for k, v in fitted.items()),
        *EVIDENCE,
        *flags,
        "log.console=none",
    ]
    job = Job(run_dir, config, job_overrides, agents=agents, min_nodes=min_nodes, max_nodes=max_nodes)
    cfg = resolve_config(config, job.overrides)
    chaos.mkdir(parents=True, exist_ok=True)
    # kill-during-save at N: the job saves at N+1 (asked for through the hold directory), just after the
    # runner, holding it at N, has found its target and released it.
    arm(
        chaos / HOLDS,
        [f.at_step for f in schedule if f.at_step is not None],
        saves=[f.at_step + 1 for f in schedule if f.at_step is not None and f.kind in RELEASE_FIRST],
    )
    (chaos / "schedule.json").write_text(json.dumps([f.to_dict() for f in schedule], indent=1))
    if fitted:
        log_line(run_dir, {"action": "fit_job", "overrides": fitted})
    return Runner(run_dir, job, schedule, seed, timeout, cfg).run()
