"""replicas: the replica-group mode under worker kills: what a fault costs the survivors and the killed group.

    elastic-qa bench replicas [--faults 10] [--target worker|lighthouse] [--config tiny] [key=value ...]

One job of 2 replica groups (`elastic-qa replicas`, one worker each) trains while the benchmark SIGKILLs the
worker of one group, then of the other, `--faults` times; each kill waits until the previous one's group has
healed and both groups have committed a step together again. Per fault, from the workers' own lines:

    survivor   kill -> the survivors' next committed step (what a fault costs the job's progress)
    heal       kill -> the restarted worker holds the peer's state (torchrun restart + start-up + transfer)
    rejoin     kill -> the first step committed by both groups again

and the median step interval without faults. At the end the sample ledger is checked: every committed step
by exactly one quorum, its shares exactly its global batch (no window repeated, none skipped).

`--target node` SIGKILLs the group's torchrun agent, then its worker (a lost node): the launcher starts the
group again, and its new worker heals from the survivor; the same three figures.

`--target lighthouse` SIGKILLs the Lighthouse instead (the launcher starts it again at the same address);
per fault: kill -> the first committed step, kill -> the Lighthouse started again, kill -> the first step
committed by both groups; and the ledger's discarded steps (a restarted Lighthouse that gave each group a
quorum of its own for a moment costs the losing lineage's steps).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import (
    BenchError,
    add_config_arguments,
    new_parser,
    positive_int,
    print_table,
    summary,
)
from elastic_qa.config import resolve_config
from elastic_qa.launcher.processes import end_process, python_env
from elastic_qa.models import family_for
from elastic_qa.observe.events import Event
from elastic_qa.observe.follow import LogFollower
from elastic_qa.prep import prepare
from elastic_qa.replica.shares import read_replica_ledger, verify

STEPS_BETWEEN = 10  # steps both groups commit together before the next kill
TARGETS = ("worker", "node", "lighthouse")
SECOND_ROW = {"heal_s": "kill -> healed", "restart_s": "kill -> Lighthouse started again"}


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("replicas", __doc__, reps=None)
    add_config_arguments(parser, "tiny")
    parser.add_argument("--faults", type=positive_int, default=10, help="kills (default 10)")
    parser.add_argument(
        "--target", choices=TARGETS, default="worker", help="what each fault kills (default worker)"
    )
    parser.add_argument("--timeout", type=float, default=180, help="seconds to wait for each recovery")
    return parser


class Watch:
    """The job's worker lines, followed as they come."""

    def __init__(self, run_dir: Path, job: subprocess.Popen, timeout: float) -> None:
        self.follower = LogFollower(run_dir / "logs")
        self.events: list[dict[str, Any]] = []
        self.job, self.timeout = job, timeout

    def until(self, what: str, check: Any) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        seen = 0
        while time.monotonic() < deadline:
            self.events += self.follower.new_events()
            for event in self.events[seen:]:
                if check(event):
                    return event
            seen = len(self.events)
            if self.job.poll() is not None:
                raise BenchError(f"the replica job ended ({self.job.returncode}) while waiting for {what}")
            time.sleep(0.02)
        raise BenchError(f"no {what} within {self.timeout:.0f} s")


def launcher_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "agents" / "replicas.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return [row for row in rows if isinstance(row, dict)]


def kill_lighthouse(watch: Watch, run_dir: Path, faults: list[dict[str, float]]) -> float:
    """SIGKILL the Lighthouse and time the job's way back; the time of the first step of both groups."""
    first = [r for r in launcher_records(run_dir) if r.get("event") == Event.LIGHTHOUSE_STARTED][-1]
    killed = time.time()
    os.kill(first["pid"], signal.SIGKILL)
    step = watch.until("a committed step", lambda e: e.get("event") == Event.STEP and e["ts"] > killed)

    def restarted_record() -> dict[str, Any] | None:
        return next(
            (
                r for r in launcher_records(run_dir)
                if r.get("event") == Event.LIGHTHOUSE_STARTED and r.get("ts", 0) > killed
            ),
            None,
        )  # fmt: skip

    watch.until("the Lighthouse started again", lambda e: restarted_record() is not None)
    restarted = restarted_record()
    assert restarted is not None
    rejoin = watch.until(
        "a step of both groups",
        lambda e: e.get("event") == Event.STEP and e.get("participants") == 2 and e["ts"] > restarted["ts"],
    )
    faults.append(
        {
            "survivor_s": step["ts"] - killed,
            "restart_s": restarted["ts"] - killed,
            "rejoin_s": rejoin["ts"] - killed,
        }
    )
    return float(rejoin["ts"])


def run(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    run_dir = work_dir / "run"
    overrides = [
        *args.overrides, f"run.dir={run_dir}", "train.max_steps=1000000", "log.every_steps=1",
        "log.console=none", "debug.sample_ledger=true", "model.dropout=0.0",
        *([f"replica.max_group_restarts={args.faults}"] if args.target == "node" else []),
    ]  # fmt: skip
    cfg = resolve_config(args.config, overrides)
    windows = len(prepare(cfg, family_for(cfg.model)).train)  # built once, before the clock runs
    command = [sys.executable, "-m", "elastic_qa.replica.launch", "--config", args.config, *overrides]
    with open(work_dir / "launcher.log", "ab") as out:
        job = subprocess.Popen(command, env=python_env(), stdout=out, stderr=subprocess.STDOUT)
    faults: list[dict[str, float]] = []
    try:
        watch = Watch(run_dir, job, args.timeout)
        since = 0.0  # the previous fault's rejoin: the next kill waits for steps of both groups after it
        for fault in range(args.faults):
            group = fault % 2
            together = watch.until(
                "steps of both groups",
                lambda e, t=since: (
                    e.get("event") == Event.STEP and e.get("participants") == 2 and e["ts"] > t
                ),
            )
            watch.until(
                "more steps together",
                lambda e, s=together["step"]: (
                    e.get("event") == Event.STEP
                    and e.get("participants") == 2
                    and e["step"] >= s + STEPS_BETWEEN
                ),
            )
            if args.target == "lighthouse":
                since = kill_lighthouse(watch, run_dir, faults)
                continue
            starts = [
                e
                for e in watch.events
                if e.get("event") == Event.WORKER_START and e.get("replica_group") == group
            ]
            victims = [starts[-1]["pid"]]
            if args.target == "node":  # the agent first, so that it starts no worker again
                agents = [r for r in launcher_records(run_dir) if r.get("event") == Event.GROUP_STARTED]
                victims.insert(0, [r for r in agents if r.get("group") == group][-1]["pid"])
            killed = time.time()
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):  # the worker may end with its agent
                    os.kill(pid, signal.SIGKILL)
            survivor = watch.until(
                "a survivor's step", lambda e, t=killed: e.get("event") == Event.STEP and e["ts"] > t
            )
            heal = watch.until(
                "the heal",
                lambda e, g=group, t=killed: (
                    e.get("event") == Event.HEAL and e.get("replica_group") == g and e["ts"] > t
                ),
            )
            rejoin = watch.until(
                "a step of both groups",
                lambda e, t=heal["ts"]: (
                    e.get("event") == Event.STEP and e.get("participants") == 2 and e["ts"] > t
                ),
            )
            since = rejoin["ts"]
            faults.append(
                {
                    "survivor_s": survivor["ts"] - killed,
                    "heal_s": heal["ts"] - killed,
                    "rejoin_s": rejoin["ts"] - killed,
                }
            )
        steps = sorted(
            (e["ts"], e["step"])
            for e in watch.events
            if e.get("event") == Event.STEP and e.get("participants") == 2
        )
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
        end_process(job, grace_s=60)
    intervals = [b[0] - a[0] for a, b in itertools.pairwise(steps) if b[1] == a[1] + 1]
    ledger = read_replica_ledger(run_dir)
    # The newest step any group committed.
    committed = max(
        (row["step"] for row in ledger if row.get("kind") == "commit" and row.get("committed")), default=0
    )
    verdict = verify(ledger, windows, cfg.train.global_batch_size, cfg.run.seed, committed, 1)
    second = "restart_s" if args.target == "lighthouse" else "heal_s"
    result = {
        "target": args.target,
        "faults": len(faults),
        "survivor_s": summary([f["survivor_s"] for f in faults]),
        second: summary([f[second] for f in faults]),
        "rejoin_s": summary([f["rejoin_s"] for f in faults]),
        "step_interval_s": statistics.median(intervals) if intervals else None,
        "committed_steps": committed,
        "ledger": {
            "ok": verdict.ok,
            "retried_steps": verdict.retried,
            "discarded_steps": verdict.discarded,
            "lineages": len(verdict.lineages),
            "problems": verdict.problems[:10],
        },
        "per_fault": faults,
        "config": args.config,
        "overrides": args.overrides,
    }
    rows = [
        [name, f"{result[key]['median']:.3f}", f"{result[key]['min']:.3f}..{result[key]['max']:.3f}"]
        for name, key in (("kill -> next committed step", "survivor_s"),
                          (SECOND_ROW[second], second), ("kill -> both groups' step", "rejoin_s"))
    ]  # fmt: skip
    print_table(["per fault (s)", "median", "min..max"], rows)
    print(f"step interval without faults: {result['step_interval_s']:.4f} s; committed steps: {committed}")
    print(
        f"ledger: {'ok' if verdict.ok else 'FAILED'} ({verdict.retried} step attempts retried, "
        f"{verdict.discarded} committed steps discarded, {len(verdict.lineages)} lineages)"
    )
    if not verdict.ok:
        raise BenchError("the ledger check failed: " + "; ".join(verdict.problems[:3]))
    return result
