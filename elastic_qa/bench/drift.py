"""drift: does the trajectory depend on the world size? How does the gap grow?

The same job (global batch fixed, dropout off) runs at each world size, and once with a mid-run resize
(killed at one size, resumed at another); milestone checkpoints every `--every` steps are compared with the
1-rank run: relative L2 difference of all parameters. Data parallelism is exact; what remains is float
summation order (all-reduce of partial sums instead of one sum). One run per world size: the runs are
deterministic, so repetitions would repeat the same figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import (
    UsageError,
    add_config_arguments,
    int_list,
    new_parser,
    positive_int,
)
from elastic_qa.bench.runs import bench_config, run_logged, torchrun, worker_env
from elastic_qa.chaos.evidence import parameter_difference
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.config import CheckpointConfig


def resize(text: str) -> tuple[int, int] | None:
    """argparse type: FROM:TO world sizes, or '' for no resized run."""
    if not text:
        return None
    try:
        first, second = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not FROM:TO, e.g. 2:3") from None
    if first < 1 or second < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: world sizes must be >= 1")
    return first, second


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("drift", __doc__, reps=None)
    add_config_arguments(parser, "tiny")
    parser.add_argument(
        "--world-sizes", type=int_list, default=[1, 2, 3, 4], help="comma-separated (1, the baseline, added)"
    )
    parser.add_argument("--steps", type=positive_int, default=400, help="steps per run (default 400)")
    parser.add_argument("--every", type=positive_int, default=100, help="milestone interval (default 100)")
    parser.add_argument(
        "--resize", type=resize, default=(2, 3), help="FROM:TO world sizes of the resized run ('' to skip)"
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per process")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    return parser


def train(run_dir: Path, world: int, args: argparse.Namespace, *extra: str, check: bool = True) -> None:
    overrides = [
        *args.overrides,
        f"run.dir={run_dir}",
        f"train.max_steps={args.steps}",
        "model.dropout=0.0",
        f"checkpoint.keep_every_steps={args.every}",  # milestones: saved at each multiple, never pruned
        "log.console=none",
        "train.eval_every=0",
        f"train.threads={args.threads}",
        *extra,
    ]
    entry = ["--config", args.config, *overrides]
    command = (
        [sys.executable, "-m", "elastic_qa.train", *entry]
        if world == 1
        else torchrun(world, "elastic_qa.train", entry)
    )
    name = f"{world}-rank run {run_dir.name}"
    run_logged(name, command, run_dir / "output.log", worker_env(args.threads), args.timeout, check=check)


def milestones(run_dir: Path) -> dict[int, dict]:
    store = open_store(str(run_dir / "checkpoints"))
    checkpointer = Checkpointer(CheckpointConfig(), store)
    return {info.step: checkpointer.load_step(info.path, info.step).model for info in store.list_steps()}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    if any(world < 1 for world in args.world_sizes):
        raise UsageError(f"--world-sizes {args.world_sizes}: must be >= 1")
    if args.every > args.steps:
        raise UsageError(f"--every {args.every} is more than --steps {args.steps}: no milestone to compare")
    bench_config(args.config, args.overrides)  # a bad config is a usage error now, not a failed run later
    worlds = sorted({1, *args.world_sizes})
    runs: dict[str, dict[int, dict]] = {}
    for world in worlds:
        print(f"[drift] {world} rank(s) ...", flush=True)
        run_dir = work / f"w{world}"
        train(run_dir, world, args)
        runs[f"{world}"] = milestones(run_dir)
    if args.resize:
        first, second = args.resize
        print(f"[drift] {first} -> {second} ranks ...", flush=True)
        run_dir = work / "resize"
        # SIGKILL (debug.kill_at_step) half-way at one size, resume from the newest checkpoint at another
        train(run_dir, first, args, f"debug.kill_at_step={args.steps // 2}", check=False)
        train(run_dir, second, args)
        runs[f"{first}->{second}"] = milestones(run_dir)
    baseline = runs["1"]
    steps = sorted(baseline)
    table = {
        name: {
            step: parameter_difference(params[step], baseline[step])["relative"]
            for step in steps  # the milestones (a resized run may also keep an emergency checkpoint)
            if step in params
        }
        for name, params in runs.items()
        if name != "1"
    }
    print(f"relative parameter difference vs 1 rank ({args.config}, global batch fixed, dropout 0)")
    print("step  " + "".join(f"{name:>12}" for name in table))
    for step in steps:
        print(f"{step:<6}" + "".join(f"{table[name].get(step, float('nan')):>12.2e}" for name in table))
    return {
        "benchmark": "drift",
        "settings": {
            "config": args.config,
            "overrides": args.overrides,
            "steps": args.steps,
            "every": args.every,
            "threads": args.threads,
        },
        "relative_difference": table,
    }
