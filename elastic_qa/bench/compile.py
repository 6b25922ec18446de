"""compile: the product's training loop eager against `train.compile=true`, same model, data and world size.

Both run as `torchrun --standalone --nproc_per_node=W -m elastic_qa.train`, alternately, each in a run
directory of its own (so every compiled run compiles from an empty cache: the first step's time is the
cold compile). Steady-state steps/s comes from the same steps of each run (the first ~20% dropped, which
keeps compilation out of the window). ratio = compiled steps/s / eager steps/s (above 1: compiling pays).
Also shown: the compiled runs' first step (a cold compile) and the seconds of all their steps during which
torch compiled (their `compile` events).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import (
    UsageError,
    add_config_arguments,
    alternate,
    new_parser,
    positive_int,
    print_table,
    show,
    summary,
)
from elastic_qa.bench.runs import Spec, bench_config, default_threads, events_of, run_product
from elastic_qa.observe.events import Event

EAGER, COMPILED = "eager", "compiled"


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("compile", __doc__, reps=3)
    add_config_arguments(parser, "default")
    parser.add_argument("--world-size", type=positive_int, default=2, help="processes (default 2)")
    parser.add_argument("--steps", type=positive_int, default=150, help="steps per run (default 150)")
    parser.add_argument("--threads", type=positive_int, help="threads per process (default: cores / world)")
    parser.add_argument("--skip", type=float, default=0.2, help="share of steps dropped as warm-up (0.2)")
    return parser


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    if not 0 <= args.skip < 1:
        raise UsageError(f"--skip {args.skip}: must be in [0, 1)")
    if any(o.split("=", 1)[0] == "train.compile" for o in args.overrides):
        raise UsageError("train.compile is what this benchmark varies: leave it out of the overrides")
    world, threads = args.world_size, args.threads or default_threads(args.world_size)
    cfg = bench_config(args.config, [*args.overrides, f"train.max_steps={args.steps}"])
    if cfg.train.global_batch_size % world:
        raise UsageError(
            f"train.global_batch_size={cfg.train.global_batch_size} must be divisible by {world}"
        )
    specs = {
        name: Spec(
            args.config,
            # The compile caches in the work directory (removed with it); the overrides may name another.
            [f"train.compile_cache_dir={work / 'compile-caches'}", *args.overrides, f"train.compile={flag}"],
            args.steps,
            cfg.log.every_steps,
            args.skip,
        )
        for name, flag in ((EAGER, "false"), (COMPILED, "true"))
    }
    specs[EAGER].window  # noqa: B018 - too few steps for a window: a usage error now, not after a run
    rates: dict[str, list[float]] = {EAGER: [], COMPILED: []}
    first_step_s: list[float] = []
    compile_s: list[float] = []
    for rep, variant in alternate(args.reps, [EAGER, COMPILED]):
        run_dir = work / f"{variant}-{rep}"
        print(f"[compile] rep {rep + 1}/{args.reps}: {variant} ...", flush=True)
        rates[variant].append(run_product(specs[variant], world, threads, run_dir).steps_per_s)
        if variant == COMPILED:
            compiles = events_of(run_dir, Event.COMPILE)
            compile_s.append(sum(row["step_s"] for row in compiles))
            first = [row["step_s"] for row in compiles if row["step"] == 1]
            if first:
                first_step_s.append(first[0])
    ratios = [c / e for e, c in zip(rates[EAGER], rates[COMPILED], strict=True)]
    batch = cfg.train.global_batch_size
    variants = {
        name: {"steps_per_s": summary(values), "samples_per_s": summary([v * batch for v in values])}
        for name, values in rates.items()
    }
    result = {
        "benchmark": "compile",
        "settings": {
            "config": args.config,
            "overrides": args.overrides,
            "world_size": world,
            "threads_per_process": threads,
            "steps": args.steps,
            "window_steps": list(specs[EAGER].window),
            "global_batch_size": batch,
            "reps": args.reps,
        },
        "variants": variants,
        "compiled_first_step_s": summary(first_step_s) if first_step_s else None,
        "compiled_compile_s": summary(compile_s) if compile_s else None,
        "ratio": statistics.median(ratios),
        "ratio_spread": summary(ratios),
    }
    print_table(
        ["variant", "steps/s", "samples/s"],
        [
            [name, show(v["steps_per_s"], ".2f"), show(v["samples_per_s"], ".1f")]
            for name, v in variants.items()
        ],
    )
    if first_step_s:
        print(f"compiled runs' first step (cold compile), s: {show(summary(first_step_s), '.1f')}")
    if compile_s:
        print(f"compiled runs' steps that compiled, s in all: {show(summary(compile_s), '.1f')}")
    print(f"ratio (compiled steps/s / eager steps/s): {show(summary(ratios))}")
    return result
