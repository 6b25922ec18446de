"""overhead: what the product's step costs above a plain DDP step, both timed inside the same processes.

Back-to-back runs cannot resolve a few percent on a shared machine: two runs of the same loop, seconds
apart, can differ by 25% while each is steady within itself. Here one torchrun job holds every side (the
tuned plain DDP skeleton, the skeleton with the recipe's clipping and LR schedule, the product's real
training step) and runs `--block` steps of each in turn, the order rotating every round
(elastic_qa/bench/interleaved.py); a slow spell of the machine falls on all sides alike.

Per pair of sides: ratio of totals = one side's summed block times / the other's over the same rounds (what
every step costs on average, periodic work included: the step line every log.every_steps, the control
all-reduce about every dist.control_period), with a 95% bootstrap interval over the rounds, and the median
of the per-round ratios (robust to a burst that hits one block). Each rep is a fresh job; "pooled" takes
the rounds of all reps together. `--sides skeleton,skeleton2` measures the method against itself (A/A).
Goal: product / skeleton <= 1.02.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from elastic_qa.bench.common import (
    BenchError,
    UsageError,
    add_config_arguments,
    choice_list,
    goal_line,
    new_parser,
    positive_int,
    print_table,
    show,
    summary,
)
from elastic_qa.bench.interleaved import SIDES
from elastic_qa.bench.runs import (
    bench_config,
    default_threads,
    product_overrides,
    records_of,
    run_logged,
    torchrun,
    worker_env,
)
from elastic_qa.observe.events import StepProgressRecord

GOAL = 1.02
GOAL_PAIR = ("product", "skeleton")
BOOTSTRAP_RESAMPLES = 2000


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("overhead", __doc__, reps=3)
    add_config_arguments(parser, "default")
    parser.add_argument("--world-size", type=positive_int, default=2, help="processes (default 2)")
    parser.add_argument("--threads", type=positive_int, help="threads per process (default: cores / world)")
    parser.add_argument(
        "--sides",
        type=choice_list(SIDES),
        default=["skeleton", "recipe", "product"],
        help=f"comma-separated, from {','.join(SIDES)} (default skeleton,recipe,product)",
    )
    parser.add_argument(
        "--block", type=positive_int, help="steps of one side in a row (default: 4 x log.every_steps)"
    )
    parser.add_argument("--rounds", type=positive_int, default=30, help="measured rounds per rep (30)")
    parser.add_argument(
        "--warmup-rounds", type=int, default=1, help="rounds run first and dropped (default 1)"
    )
    return parser


def compare(a: list[float], b: list[float], seed: int = 0) -> dict[str, Any]:
    """Side a against side b over the same rounds: ratio of totals with its 95% bootstrap interval
    (rounds resampled with replacement), and the median of the rounds' ratios."""
    if len(a) != len(b) or not a:
        raise ValueError(f"rounds differ or are missing: {len(a)} and {len(b)}")
    ta, tb = np.asarray(a), np.asarray(b)
    picks = np.random.default_rng(seed).integers(0, len(ta), size=(BOOTSTRAP_RESAMPLES, len(ta)))
    resampled = ta[picks].sum(axis=1) / tb[picks].sum(axis=1)
    low, high = np.percentile(resampled, [2.5, 97.5])
    return {
        "ratio_of_totals": float(ta.sum() / tb.sum()),
        "ci95": [float(low), float(high)],
        "median_round_ratio": float(np.median(ta / tb)),
        "rounds": len(ta),
    }


def step_ms(reps: list[dict[str, list[float]]], side: str, block: int) -> dict[str, Any]:
    """A side's milliseconds a step: its median block over each rep, summarised over the reps."""
    return summary([1000 * statistics.median(rep[side]) / block for rep in reps])


def pairs(sides: list[str]) -> list[tuple[str, str]]:
    """Each side against every side listed before it (later / earlier)."""
    return [(later, earlier) for earlier, later in itertools.combinations(sides, 2)]


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    sides: list[str] = args.sides
    if len(set(sides)) != len(sides) or len(sides) < 2:
        raise UsageError(f"--sides {','.join(sides)}: at least two, each once")
    if args.warmup_rounds < 0:
        raise UsageError(f"--warmup-rounds {args.warmup_rounds}: must be >= 0")
    world = args.world_size
    threads = args.threads or default_threads(world)
    cfg = bench_config(args.config, [*args.overrides, f"train.threads={threads}"])
    every = cfg.log.every_steps
    block = args.block or 4 * every
    if cfg.train.global_batch_size % world:
        raise UsageError(
            f"train.global_batch_size={cfg.train.global_batch_size} must be divisible by --world-size {world}"
        )
    per_side = (args.warmup_rounds + args.rounds) * block
    reps: list[dict[str, list[float]]] = []
    for rep in range(args.reps):
        print(f"[overhead] rep {rep + 1}/{args.reps}: {len(sides)} sides x {per_side} steps ...", flush=True)
        reps.append(run_rep(args, work / f"rep-{rep}", sides, block, per_side, threads))

    def figures(times: dict[str, list[float]]) -> dict[str, Any]:
        return {f"{a}/{b}": compare(times[a], times[b]) for a, b in pairs(sides)}

    pooled = {side: [t for rep in reps for t in rep[side]] for side in sides}
    result: dict[str, Any] = {
        "benchmark": "overhead",
        "settings": {
            "config": args.config,
            "overrides": args.overrides,
            "world_size": world,
            "threads_per_process": threads,
            "global_batch_size": cfg.train.global_batch_size,
            "sides": sides,
            "block": block,
            "rounds": args.rounds,
            "warmup_rounds": args.warmup_rounds,
            "reps": args.reps,
        },
        "step_ms": {side: step_ms(reps, side, block) for side in sides},
        "per_rep": [figures(rep) for rep in reps],
        "pooled": figures(pooled),
        "block_s": reps,
    }
    goal_key = "/".join(GOAL_PAIR)
    if goal_key in result["pooled"]:
        result["goal"] = GOAL
        result["goal_met"] = result["pooled"][goal_key]["ratio_of_totals"] <= GOAL
    report(result)
    return result


def run_rep(
    args: argparse.Namespace, run_dir: Path, sides: list[str], block: int, per_side: int, threads: int
) -> dict[str, list[float]]:
    """One fresh job (the product starts from step 0 in its own run directory): its block times."""
    out = run_dir / "blocks.json"
    # Room past the last measured step: the product must never reach its own end inside the job.
    overrides = product_overrides(args.overrides, run_dir, per_side + block, threads, None)
    command = torchrun(
        args.world_size,
        "elastic_qa.bench.interleaved",
        [
            "--config",
            args.config,
            "--out",
            str(out),
            "--sides",
            ",".join(sides),
            "--block",
            str(block),
            "--rounds",
            str(args.rounds),
            "--warmup-rounds",
            str(args.warmup_rounds),
            *overrides,
        ],
    )
    run_logged(
        f"interleaved run {run_dir.name}",
        command,
        run_dir / "output.log",
        worker_env(threads),
        timeout=600 + len(sides) * per_side,  # a generous second a step
    )
    recorded = json.loads(out.read_text())
    times: dict[str, list[float]] = recorded["block_s"]
    if any(len(times.get(side, [])) != args.rounds for side in sides):
        raise BenchError(f"{out}: not {args.rounds} blocks for every side of {','.join(sides)}")
    if "product" in sides:  # the product really trained every step it was timed for, and logged them
        logged = [row["step"] for row in records_of(run_dir, StepProgressRecord)]
        if not logged or max(logged) != per_side:
            last = max(logged) if logged else None
            raise BenchError(f"{run_dir}: the product's last step line is {last}, expected {per_side}")
    return times


def report(result: dict[str, Any]) -> None:
    block = result["settings"]["block"]
    print(f"ms per step (median block of {block} steps; median over reps, min..max):")
    print_table(["side", "ms/step"], [[side, show(stat, ".2f")] for side, stat in result["step_ms"].items()])
    rows = []
    for key, pooled in result["pooled"].items():
        per_rep = [rep[key]["ratio_of_totals"] for rep in result["per_rep"]]
        low, high = pooled["ci95"]
        rows.append(
            [
                key,
                f"{pooled['ratio_of_totals']:.3f} [{low:.3f}..{high:.3f}]",
                f"{pooled['median_round_ratio']:.3f}",
                show(summary(per_rep)),
            ]
        )
    print_table(["pair", "ratio of totals, pooled [95% CI]", "median round ratio", "per rep"], rows)
    if "goal" in result:
        key = "/".join(GOAL_PAIR)
        print(goal_line(key, result["pooled"][key]["ratio_of_totals"], result["goal"]))
