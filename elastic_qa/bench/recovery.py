"""recovery: seconds from a kill to the first completed step of the new worker group.

Two agents through the local launcher (the product's rendezvous settings), then either a worker kill (SIGKILL
one worker of the non-host agent) or a node loss (SIGKILL that agent and its workers at once). The same
kills hit a bare baseline: elastic_qa/bench/trivial_worker.py launched by the same launcher and agents
(`--module`), which has nothing to load or restore. Recovery = ts of the first `step` event written by a
process that did not exist before the kill, minus the kill time. Product and baseline alternate.
Goal: product / bare <= 1.5 for each case. `--compile` trains the product with train.compile=true (its
restarted workers load their graphs from the run's compile cache); `--no-compile-cache` adds
train.compile_cache=false, for what a restart costs when every new worker compiles from nothing.

`--replicas` adds the replica-group mode (`elastic-qa replicas`, 2 groups of one worker; torchft extra) for
each case, after the product/bare pairs: one job whose groups are killed `--reps` times in turn (worker: a
group's worker; node: its torchrun agent and worker, which the launcher starts again), as `bench replicas
--target worker|node` does. Per kill: the survivors' next committed step, the killed group healed from the
survivor, and its first step trained with the survivor again; that last figure against the bare side's
first step (the torchrun floor of a restart) is the replica mode's own ratio.

When the kill falls matters: a dead node is noticed once its last rendezvous heartbeat (every
keep_alive_interval, from the agents' rendezvous on) is keep_alive_interval x max_attempt old, so recovery
after a node loss varies by up to one heartbeat interval with the kill's phase. Killing "as soon as step N
is done" would put the fast-starting baseline and the product on different phases (a bias of seconds), so
each rep kills on a fixed phase of that grid, counted from the agents' start, the same phase for product
and baseline, and phases spread evenly over the interval across reps.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import (
    BenchError,
    add_config_arguments,
    alternate,
    choice_list,
    goal_line,
    new_parser,
    positive_int,
    print_table,
    show,
    summary,
)
from elastic_qa.bench.recovery_timeline import medians, timeline
from elastic_qa.bench.runs import bench_config
from elastic_qa.chaos.job import Job
from elastic_qa.exits import UsageError
from elastic_qa.launcher.rendezvous import KEEP_ALIVE_INTERVAL_S
from elastic_qa.observe.events import AttemptStartRecord, Event, StepProgressRecord, record
from elastic_qa.observe.follow import LogFollower

GOAL = 1.5
CASES = ("worker", "node")
TRIVIAL = "elastic_qa.bench.trivial_worker"
STARTUP_WAIT_S = 10.0  # for the `startup` line after the new group's first step
SETTLE_S = 6.0  # earliest kill after the agents start: past the first rendezvous and a heartbeat or two
# The product logs every step (so the first one after the kill is seen) and never ends on its own.
PRODUCT = (
    "log.every_steps=1",
    "log.console=none",
    "train.max_steps=10000000",
    "train.eval_every=0",
    "checkpoint.interval=1000h",
)


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("recovery", __doc__, reps=3)
    add_config_arguments(parser, "default")
    parser.add_argument(
        "--cases", type=choice_list(CASES), default=list(CASES), help="worker,node (default both)"
    )
    parser.add_argument("--kill-after", type=positive_int, default=10, help="steps trained before the kill")
    parser.add_argument("--timeout", type=float, default=180, help="seconds to wait for any phase")
    parser.add_argument(
        "--replicas", action="store_true", help="also the replica-group mode (extra torchft), per case"
    )
    parser.add_argument("--compile", action="store_true", help="the product trains with train.compile=true")
    parser.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="with --compile: train.compile_cache=false, so that every new worker compiles from nothing",
    )
    return parser


def replica_cases(args: argparse.Namespace, work: Path, cases: dict[str, Any]) -> None:
    """The replica-group mode's figures per case (`bench replicas` with `--reps` kills), put in `cases`."""
    from elastic_qa.bench import replicas

    rows = []
    for case in args.cases:
        print(f"[recovery] replica mode: {args.reps} {case} kills ...", flush=True)
        (directory := work / f"{case}-replicas").mkdir(parents=True, exist_ok=True)
        settings = {"config": args.config, "overrides": args.overrides, "timeout": args.timeout}
        measured = replicas.run(argparse.Namespace(**settings, faults=args.reps, target=case), directory)
        figures = {key: measured[key] for key in ("survivor_s", "heal_s", "rejoin_s", "ledger")}
        figures["rejoin_to_bare"] = (
            measured["rejoin_s"]["median"] / cases[case]["bare"]["first_step_s"]["median"]
        )
        cases[case]["replicas"] = figures
        rows.append([
            case, show(figures["survivor_s"], ".2f"), show(figures["heal_s"], ".2f"),
            show(figures["rejoin_s"], ".2f"), f"{figures['rejoin_to_bare']:.2f}",
        ])  # fmt: skip
    print_table(
        ["case", "replicas: kill -> survivors' next step s", "kill -> healed s", "kill -> its first step s",
         "first step / bare"],
        rows,
    )  # fmt: skip


def compile_overrides(args: argparse.Namespace, work: Path) -> list[str]:
    """With --compile: its settings, the compile caches in the work directory (removed with it) unless the
    overrides name another place."""
    if not args.compile:
        return []
    settings = ["train.compile=true", f"train.compile_cache={str(not args.no_compile_cache).lower()}"]
    if not any(o.startswith("train.compile_cache_dir=") for o in args.overrides):
        settings.append(f"train.compile_cache_dir={work / 'compile-caches'}")
    return settings


def wait_for_phase(started: float, phase: float, interval: float) -> None:
    """Sleep until started + SETTLE_S + phase + k * interval, the first such time not yet past."""
    kill_at = started + SETTLE_S + phase
    while kill_at < time.time():
        kill_at += interval
    time.sleep(kill_at - time.time())


def measure(variant: str, case: str, args: argparse.Namespace, run_dir: Path, phase: float) -> dict[str, Any]:
    # `--module` goes last: the launcher reads options after the overrides too.
    extra = (
        [*PRODUCT, *compile_overrides(args, run_dir.parent)]
        if variant == "product"
        else ["--module", TRIVIAL]
    )
    job = Job(run_dir, args.config, [*args.overrides, *extra], agents=2, min_nodes=1, max_nodes=4)
    follower = LogFollower(run_dir / "logs")
    try:
        job.start(args.timeout)
        started = min(agent["started"] for agent in job.agents())
        job.wait_for_step(args.kill_after, args.timeout)
        wait_for_phase(started, phase, KEEP_ALIVE_INTERVAL_S)
        before = {row["pid"] for row in follower.new_events() if "pid" in row}
        victim = next((a for a in job.live_agents() if not a["is_host"]), None)
        workers = job.workers(victim) if victim else []
        if victim is None or not workers:
            raise BenchError(f"{variant}: no worker of a non-host agent to kill (logs: {run_dir})")
        victims = workers[:1] if case == "worker" else [victim["pid"], *workers]
        killed = time.time()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        # For reading the agents' and workers' logs against the kill afterwards (--work-dir keeps them).
        record = {"ts": killed, "case": case, "pids": victims, "since_agents_started": killed - started}
        (run_dir / "bench-kill.json").write_text(json.dumps(record))
        starts, steps = new_group_events(
            follower, before, killed, args.timeout, f"{variant} {case} ({run_dir})"
        )
        first_step = min(steps, key=lambda row: row["ts"])
        if variant == "product":  # its `startup` line follows the step's: for recovery_timeline
            wait_for_event(follower, Event.STARTUP, first_step.get("pid"), STARTUP_WAIT_S)
    finally:
        job.kill_everything()
        job.remove_node_local_copy()
    return {
        "first_step_s": first_step["ts"] - killed,
        "worker_start_s": min([row["ts"] for row in starts] or [first_step["ts"]]) - killed,
        "new_world_size": first_step.get("world_size"),
    }


def new_group_events(
    follower: LogFollower, before: set[int], killed: float, timeout: float, what: str
) -> tuple[list[AttemptStartRecord], list[StepProgressRecord]]:
    """worker_start and step events of processes that did not exist before the kill, until the first step.
    A new rank 0 also writes the step lines the old one had in flight (`recovered`, with the time they were
    trained, which can fall just after the kill): those are not the new group's."""
    starts: list[AttemptStartRecord] = []
    steps: list[StepProgressRecord] = []
    while not steps:
        for row in follower.new_events():
            if row.get("pid") in before or row.get("ts", 0) < killed or row.get("recovered"):
                continue
            if (start := record(row, AttemptStartRecord)) is not None:
                starts.append(start)
            elif (step := record(row, StepProgressRecord)) is not None:
                steps.append(step)
        if not steps and time.time() - killed > timeout:
            raise BenchError(f"{what}: no step of a new group within {timeout:.0f} s")
        time.sleep(0.02)
    return starts, steps


def wait_for_event(follower: LogFollower, event: Event, pid: Any, timeout: float) -> bool:
    """Whether process `pid` logged `event` within `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(row.get("event") == event and row.get("pid") == pid for row in follower.new_events()):
            return True
        time.sleep(0.02)
    return False


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    if args.no_compile_cache and not args.compile:
        raise UsageError("--no-compile-cache: only with --compile")
    # bad config: one line now, not a launcher failure later
    bench_config(args.config, [*args.overrides, *compile_overrides(args, work)])
    pairs = [(case, variant) for case in args.cases for variant in ("product", "bare")]
    figures: dict[tuple[str, str], list[dict[str, Any]]] = {pair: [] for pair in pairs}
    for rep, (case, variant) in alternate(args.reps, pairs):
        print(f"[recovery] rep {rep + 1}/{args.reps}: {case} kill, {variant} ...", flush=True)
        run_dir = work / f"{case}-{variant}-{rep}"
        phase = KEEP_ALIVE_INTERVAL_S * (rep + 0.5) / args.reps  # stratified; product and bare alike
        figures[case, variant].append(measure(variant, case, args, run_dir, phase))
    cases: dict[str, Any] = {}
    for case in args.cases:
        product, bare = figures[case, "product"], figures[case, "bare"]
        ratios = [p["first_step_s"] / b["first_step_s"] for p, b in zip(product, bare, strict=True)]
        cases[case] = {
            variant: {
                "first_step_s": summary([row["first_step_s"] for row in rows]),
                "worker_start_s": summary([row["worker_start_s"] for row in rows]),
                "new_world_size": rows[-1]["new_world_size"],
            }
            for variant, rows in (("product", product), ("bare", bare))
        }
        cases[case]["ratio"] = statistics.median(ratios)
        cases[case]["ratio_spread"] = summary(ratios)
    print_table(
        ["case", "variant", "new world", "kill -> worker start s", "kill -> first step s", "product/bare"],
        [
            [
                case,
                variant,
                str(cases[case][variant]["new_world_size"]),
                show(cases[case][variant]["worker_start_s"], ".2f"),
                show(cases[case][variant]["first_step_s"], ".2f"),
                show(cases[case]["ratio_spread"], ".2f") if variant == "product" else "",
            ]
            for case in args.cases
            for variant in ("product", "bare")
        ],
    )
    for case in args.cases:
        print(goal_line(f"{case} kill product/bare", cases[case]["ratio"], GOAL, ".2f"))
    if args.replicas:
        replica_cases(args, work, cases)
    for case in args.cases:
        kills = [timeline(work / f"{case}-product-{rep}") for rep in range(args.reps)]
        cases[case]["product"]["timeline"] = medians([row for row in kills if row])
        shown = ", ".join(f"{k} {v:.2f}" for k, v in cases[case]["product"]["timeline"].items())
        print(f"{case} kill, product, medians (s; milestones after the kill, then phases): {shown}")
    return {
        "benchmark": "recovery",
        "settings": {
            "config": args.config,
            "overrides": args.overrides,
            "agents": 2,
            "kill_after_steps": args.kill_after,
            "heartbeat_interval_s": float(KEEP_ALIVE_INTERVAL_S),
            "reps": args.reps,
            "compile": args.compile,
            "compile_cache": args.compile and not args.no_compile_cache,
            "replicas": args.replicas,
        },
        "cases": cases,
        "goal": GOAL,
        "goal_met": all(cases[case]["ratio"] <= GOAL for case in args.cases),
    }
