"""throughput: the product's training loop against a plain DDP loop: same model, data, batch and world size.

Both run as `torchrun --standalone --nproc_per_node=W`, with the same threads per process, alternately.
Steady-state steps/s comes from the same steps of each run (the first ~20% dropped): rank 0's `step` events
for the product, per-step timestamps for the plain loop (elastic_qa/bench/plain_ddp.py). The product's eval
and checkpoints stay out of the measured window, unless --checkpoint-interval asks for timed async
checkpoints inside it. ratio = product step time / plain step time (1.02 = 2% overhead).
Goals: ratio <= 1.02 without checkpoints, <= 1.05 with async checkpoints every 10 s.
Also shown: the ratio of median step times over 10-step chunks (log.every_steps), which outside load on a
shared machine barely moves, and which leaves periodic checkpoint stalls out (the ratio keeps them in).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import (
    UsageError,
    add_config_arguments,
    alternate,
    duration,
    goal_line,
    new_parser,
    positive_int,
    print_table,
    show,
    summary,
)
from elastic_qa.bench.runs import (
    Spec,
    bench_config,
    default_threads,
    median_chunk_step_s,
    run_logged,
    run_product,
    steps_per_s,
    torchrun,
    worker_env,
)
from elastic_qa.config import format_duration, parse_duration

GOAL_PLAIN, GOAL_CHECKPOINTS = 1.02, 1.05
# The product's step_breakdown fields; comm_s is inside forward_backward_s, checkpoint_stall_s inside
# log_and_save_s, which step_breakdown does not report: it is the rest of step_s (see log_and_save).
PHASES = (
    "data_s",
    "forward_backward_s",
    "comm_s",
    "optimizer_s",
    "log_and_save_s",
    "checkpoint_stall_s",
    "other_s",
)
PLAIN_PHASES = ("data_s", "forward_backward_s", "optimizer_s")  # what plain_ddp.py times per step


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("throughput", __doc__, reps=3)
    add_config_arguments(parser, "default")
    parser.add_argument("--world-size", type=positive_int, default=2, help="processes (default 2)")
    parser.add_argument(
        "--steps", type=positive_int, help="steps per run (default 300; 1200 with --checkpoint-interval)"
    )
    parser.add_argument("--threads", type=positive_int, help="threads per process (default: cores / world)")
    parser.add_argument(
        "--checkpoint-interval", type=duration, help="run the product with async checkpoints this often"
    )
    parser.add_argument("--skip", type=float, default=0.2, help="share of steps dropped as warm-up (0.2)")
    parser.add_argument(
        "--tuned-baseline",
        action="store_true",
        help="give the plain loop the product's optimizer, DDP gradient_as_bucket_view and no broadcast of "
        "constant buffers, so the ratio isolates the product's per-step machinery",
    )
    return parser


@dataclass
class PlainRun:
    steps_per_s: float
    chunk_step_s: float
    breakdown: dict[str, float]  # phase -> mean seconds per step over the window


def log_and_save(row: dict[str, Any]) -> dict[str, Any]:
    """A step_breakdown event with its missing phase: logging, the save decision and any save."""
    timed = row["data_s"] + row["forward_backward_s"] + row["optimizer_s"] + row["other_s"]
    return {**row, "log_and_save_s": max(0.0, row["step_s"] - timed)}


def run_plain(spec: Spec, world: int, threads: int, run_dir: Path, tuned: bool = False) -> PlainRun:
    """The plain loop under torchrun, timed over the same window and chunks as the product."""
    out = run_dir / "stamps.json"
    overrides = [
        *spec.overrides,
        f"run.dir={run_dir}",
        f"train.max_steps={spec.steps}",
        f"train.threads={threads}",
    ]
    tuning = ["--tuned"] if tuned else []
    command = torchrun(
        world, "elastic_qa.bench.plain_ddp", ["--config", spec.config, "--out", str(out), *tuning, *overrides]
    )
    run_logged(
        f"plain run {run_dir.name}",
        command,
        run_dir / "output.log",
        worker_env(threads),
        300 + 2 * spec.steps,
    )
    recorded = json.loads(out.read_text())
    stamps = dict(enumerate(recorded["ts"], start=1))  # step -> end-of-step time
    first, last = spec.window
    steady = recorded["phases"][first:last]  # steps first+1 .. last, as the window's time span
    breakdown = {name: statistics.fmean(row[i] for row in steady) for i, name in enumerate(PLAIN_PHASES)}
    return PlainRun(
        steps_per_s(stamps, spec.window), median_chunk_step_s(stamps, spec.window, spec.every), breakdown
    )


@dataclass
class Measured:
    """What the alternating runs collected, per variant (rates, chunks) and for the product."""

    rates: dict[str, list[float]]  # steady-state steps/s
    chunks: dict[str, list[float]]  # median chunk step time, s
    checkpoints: list[int] = field(default_factory=list)  # periodic checkpoints inside each window
    stalls: list[float] = field(default_factory=list)  # blocking_seconds of those checkpoints
    breakdowns: list[dict[str, Any]] = field(default_factory=list)
    plain_breakdowns: list[dict[str, float]] = field(default_factory=list)
    window_s: list[float] = field(default_factory=list)


def measure(
    args: argparse.Namespace, spec: Spec, threads: int, work: Path, plain: str, product: str
) -> Measured:
    got = Measured({plain: [], product: []}, {plain: [], product: []})
    for rep, variant in alternate(args.reps, [plain, product]):
        run_dir = work / f"{variant}-{rep}"
        print(f"[throughput] rep {rep + 1}/{args.reps}: {variant} ...", flush=True)
        if variant == plain:
            baseline = run_plain(spec, args.world_size, threads, run_dir, args.tuned_baseline)
            rate, chunk = baseline.steps_per_s, baseline.chunk_step_s
            got.plain_breakdowns.append(baseline.breakdown)
        else:
            result = run_product(spec, args.world_size, threads, run_dir, args.checkpoint_interval)
            rate, chunk = result.steps_per_s, result.chunk_step_s
            got.checkpoints.append(len(result.checkpoints))
            got.stalls.extend(row["blocking_seconds"] for row in result.checkpoints)
            got.breakdowns.extend(log_and_save(row) for row in result.breakdowns)
            got.window_s.append(result.window_s[1] - result.window_s[0])
        got.rates[variant].append(rate)
        got.chunks[variant].append(chunk)
    return got


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    if not 0 <= args.skip < 1:
        raise UsageError(f"--skip {args.skip}: must be in [0, 1)")
    world, interval = args.world_size, args.checkpoint_interval
    steps = args.steps or (1200 if interval else 300)
    threads = args.threads or default_threads(world)
    cfg = bench_config(args.config, [*args.overrides, f"train.max_steps={steps}", f"train.threads={threads}"])
    batch = cfg.train.global_batch_size
    if batch % world:
        raise UsageError(f"train.global_batch_size={batch} must be divisible by --world-size {world}")
    spec = Spec(args.config, args.overrides, steps, cfg.log.every_steps, args.skip)
    spec.window  # noqa: B018 - too few steps for a window: a usage error now, not after the first run
    product = "product+ckpt" if interval else "product"
    plain = "plain-tuned" if args.tuned_baseline else "plain"
    got = measure(args, spec, threads, work, plain, product)

    # Paired: each product run against the plain run just before it, so slow spells cancel out.
    ratios = [p / q for p, q in zip(got.rates[plain], got.rates[product], strict=True)]
    chunk_ratios = [p / q for p, q in zip(got.chunks[product], got.chunks[plain], strict=True)]
    variants = {
        name: {
            "steps_per_s": summary(values),
            "samples_per_s": summary([v * batch for v in values]),
            "step_ms": summary([1000 / v for v in values]),
            "median_chunk_step_ms": summary([1000 * c for c in got.chunks[name]]),
        }
        for name, values in got.rates.items()
    }
    variants[plain]["breakdown_ms"] = {
        phase: statistics.median(row[phase] for row in got.plain_breakdowns) * 1000 for phase in PLAIN_PHASES
    }
    variants[product]["checkpoints_in_window"] = summary(got.checkpoints)
    if got.breakdowns:
        variants[product]["breakdown_ms"] = {
            phase: statistics.median(row[phase] for row in got.breakdowns) * 1000 for phase in PHASES
        }
    if got.stalls:
        variants[product]["checkpoint_stall_ms"] = summary([s * 1000 for s in got.stalls])
    goal = GOAL_CHECKPOINTS if interval else GOAL_PLAIN
    result = {
        "benchmark": "throughput",
        "settings": {
            "config": args.config,
            "overrides": args.overrides,
            "world_size": world,
            "threads_per_process": threads,
            "steps": steps,
            "window_steps": list(spec.window),
            "global_batch_size": batch,
            "checkpoint_interval": format_duration(interval) if interval else None,
            "tuned_baseline": args.tuned_baseline,
            "reps": args.reps,
        },
        "variants": variants,
        "ratio": statistics.median(ratios),
        "ratio_spread": summary(ratios),
        # The same from median chunk step times: robust to outside load, blind to periodic stalls.
        "ratio_median_chunks": statistics.median(chunk_ratios),
        "ratio_median_chunks_spread": summary(chunk_ratios),
        "goal": goal,
        "goal_met": statistics.median(ratios) <= goal,
    }
    report(result, product, min(got.window_s))
    return result


def report(result: dict[str, Any], product: str, shortest_window_s: float) -> None:
    variants = result["variants"]
    print_table(
        ["variant", "steps/s", "samples/s", "step ms", "median-chunk step ms", "ckpts in window"],
        [
            [
                name,
                show(v["steps_per_s"], ".2f"),
                show(v["samples_per_s"], ".1f"),
                show(v["step_ms"], ".2f"),
                show(v["median_chunk_step_ms"], ".2f"),
                show(v["checkpoints_in_window"], ".0f") if "checkpoints_in_window" in v else "-",
            ]
            for name, v in variants.items()
        ],
    )
    print(f"ratio (product step time / plain step time): {show(result['ratio_spread'])}")
    print(f"ratio of median-chunk step times: {show(result['ratio_median_chunks_spread'])}")
    for name, v in variants.items():  # the product's from its step_breakdown events, the plain loop's own
        if "breakdown_ms" in v:
            parts = ", ".join(f"{k[:-2]} {ms:.2f}" for k, ms in v["breakdown_ms"].items())
            print(f"{name} step breakdown, ms: {parts}")
    if "checkpoint_stall_ms" in variants[product]:
        stall = variants[product]["checkpoint_stall_ms"]
        print(f"training stall per async save (blocking_seconds), ms: {show(stall, '.1f')}")
    interval = result["settings"]["checkpoint_interval"]
    if interval and shortest_window_s < 3 * parse_duration(interval).total_seconds():
        print(f"warning: a measured window ({shortest_window_s:.1f} s) is under 3 checkpoint intervals")
    print(goal_line("ratio", result["ratio"], result["goal"]))
