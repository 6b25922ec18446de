"""The fault runner: start a job through the project's launcher, inject a schedule of faults, verify.

Each fault is injected once its trigger (a step or a time since the start) has passed *and* the job has
completed at least one step since the previous fault, so faults hit a training group rather than piling
onto a regroup in progress, and every recovery can be attributed to the fault that caused it. Each action
is one JSON line in `<run-dir>/chaos/faults.jsonl` (fault, target, wall time, step at injection).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from pathlib import Path

from chaos.evidence import final_parameters, load_config
from chaos.faults import Injector, NoTarget
from chaos.job import Job
from chaos.schedule import Fault, restarts_group

# Forced on every chaos run: the evidence the verifier reads.
EVIDENCE = ("debug.sample_ledger=true", "log.every_steps=1")


def log_line(run_dir: Path, record: dict) -> None:
    path = run_dir / "chaos" / "faults.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


def code_fingerprint() -> str:
    """A hash of the trainer's source: a reference trained by other code (another model, say) is stale."""
    import elastic_qa

    digest = hashlib.sha256()
    package = Path(elastic_qa.__file__).parent
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def reference_key(config: str, overrides: list[str], agents: int) -> str:
    """Configs that train the same model the same way, with the same code, share a reference run."""
    from elastic_qa.train import resolve_config

    resolved = resolve_config(config, overrides)
    tree = resolved.to_dict()
    for volatile in ("run", "log", "debug", "checkpoint"):  # where and how it is observed, not what
        tree.pop(volatile)
    blob = json.dumps(
        {"cfg": tree, "seed": resolved.run.seed, "agents": agents, "code": code_fingerprint()}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reference_run(config: str, overrides: list[str], agents: int, cache_root: Path, timeout: float) -> Path:
    """Run (or reuse) the fault-free reference of a chaos run: same config, same starting agents."""
    key = reference_key(config, overrides, agents)
    run_dir = cache_root / key
    if (run_dir / "config.yaml").exists():
        cfg = load_config(run_dir)
        done = final_parameters(cfg)
        if done is not None and done[0] == cfg.train.max_steps:
            print(json.dumps({"event": "reference_reused", "run_dir": str(run_dir)}), flush=True)
            return run_dir
        shutil.rmtree(run_dir)
    print(json.dumps({"event": "reference_start", "run_dir": str(run_dir)}), flush=True)
    job = Job(run_dir, config, [*overrides, *EVIDENCE, "log.console=none"], agents=agents)
    job.start()
    try:
        code = job.wait(timeout)
    finally:
        job.kill_everything()
    if code != 0:
        raise RuntimeError(f"the reference run failed (exit {code}): see {run_dir}/agents")
    return run_dir


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
) -> int:
    """Run the job with its faults; return the launcher's exit code."""
    fault_flag = run_dir / "chaos" / "storage-fault"
    job = Job(
        run_dir,
        config,
        [*overrides, *EVIDENCE, f"debug.storage_fault_file={fault_flag}", "log.console=none"],
        agents=agents,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
    )
    (run_dir / "chaos").mkdir(parents=True, exist_ok=True)
    (run_dir / "chaos" / "schedule.json").write_text(json.dumps([f.to_dict() for f in schedule], indent=1))
    job.start()
    started = time.monotonic()
    cfg = None
    rng = random.Random(seed)
    last_progress = 0  # no fault before the group has trained a step
    try:
        for fault in sorted(schedule, key=lambda f: (f.at_time or 0.0, f.at_step or 0)):
            while True:
                if job.process.poll() is not None:
                    break
                progress = job.progress()
                due = (fault.at_step is not None and progress >= fault.at_step) or (
                    fault.at_time is not None and time.monotonic() - started >= fault.at_time
                )
                if due and progress > last_progress:
                    break
                time.sleep(0.05)
            record = {"fault": fault.kind, "spec": fault.describe()}
            if job.process.poll() is not None:
                log_line(run_dir, {**record, "skipped": "the job had already ended", "ts": time.time()})
                continue
            cfg = cfg or load_config(run_dir)
            injector = Injector(job, rng, Path(cfg.checkpoint_dir), fault_flag)
            step = job.progress()
            attempt_before = job.attempt
            deadline = time.monotonic() + 30
            while True:
                try:
                    outcome = injector.inject(fault)
                    break
                except NoTarget as err:  # e.g. mid-regroup: try again shortly
                    if time.monotonic() > deadline or job.process.poll() is not None:
                        outcome = {"skipped": f"no target: {err}"}
                        break
                    time.sleep(0.2)
                except OSError as err:  # the injector itself failed: record it, keep the run going
                    outcome = {"skipped": f"injection failed: {type(err).__name__}: {err}"}
                    break
            log_line(
                run_dir,
                {
                    **record,
                    **outcome,
                    "step": step,
                    "ts": time.time(),
                    "elapsed_s": round(time.monotonic() - started, 2),
                },
            )
            timeout_s = cfg.dist.timeout.total_seconds()
            if "skipped" not in outcome and restarts_group(fault.kind, fault.duration, timeout_s):
                # One fault at a time: the next one waits until the group has recovered from this one.
                job.wait_for_new_attempt(after=attempt_before, timeout=max(120.0, 3 * timeout_s))
            last_progress = job.progress()
        return job.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
    finally:
        fault_flag.unlink(missing_ok=True)
        job.kill_everything()
