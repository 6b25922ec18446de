"""scaling: the same job (same global batch) at 1, 2, ... ranks: samples/s, speed-up, communication share.

Each world size runs `torchrun --standalone --nproc_per_node=W -m elastic_qa.train` with the product's own
thread default (cores / ranks on the host) unless --threads says otherwise; world sizes alternate within
each rep. samples/s is steady state from rank 0's `step` events (first ~20% dropped); the communication
share is the median `comm_share` of rank 0's `step_breakdown` events in that window (gradient all-reduce
time as seen by the timing DDP comm hook, over the step time; buckets overlap backward, so this is time
spent in communication, not all of it exposed).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import (
    UsageError,
    add_config_arguments,
    alternate,
    int_list,
    new_parser,
    positive_int,
    print_table,
    show,
    summary,
)
from elastic_qa.bench.runs import Spec, bench_config, default_threads, run_product


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("scaling", __doc__, reps=3)
    add_config_arguments(parser, "default")
    parser.add_argument("--world-sizes", type=int_list, default=[1, 2], help="comma-separated (default 1,2)")
    parser.add_argument("--steps", type=positive_int, default=300, help="steps per run (default 300)")
    parser.add_argument("--threads", type=positive_int, help="threads per process (default: cores / ranks)")
    parser.add_argument("--skip", type=float, default=0.2, help="share of steps dropped as warm-up (0.2)")
    return parser


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    worlds = sorted(set(args.world_sizes))
    if worlds[0] < 1:
        raise UsageError(f"--world-sizes: {worlds[0]} is not a positive number of ranks")
    if not 0 <= args.skip < 1:
        raise UsageError(f"--skip {args.skip}: must be in [0, 1)")
    cfg = bench_config(args.config, [*args.overrides, f"train.max_steps={args.steps}"])
    batch = cfg.train.global_batch_size
    spec = Spec(args.config, args.overrides, args.steps, cfg.log.every_steps, args.skip)
    spec.window  # noqa: B018 - too few steps for a window: a usage error now, not after the first run
    threads = {w: args.threads or default_threads(w) for w in worlds}
    rates: dict[int, list[float]] = {w: [] for w in worlds}
    comm: dict[int, list[float]] = {w: [] for w in worlds}
    for rep, world in alternate(args.reps, worlds):
        print(f"[scaling] rep {rep + 1}/{args.reps}: {world} rank(s) ...", flush=True)
        result = run_product(spec, world, threads[world], work / f"w{world}-{rep}")
        rates[world].append(result.steps_per_s * batch)
        if result.breakdowns:  # one figure per rep, like samples/s: the median over its windows
            comm[world].append(statistics.median(row["comm_share"] for row in result.breakdowns))
    base = statistics.median(rates[worlds[0]])
    results = {
        str(w): {
            "world_size": w,
            "threads_per_process": threads[w],
            "samples_per_s": summary(rates[w]),
            "speedup": statistics.median(rates[w]) / base,
            "efficiency": statistics.median(rates[w]) / base / (w / worlds[0]),
            "comm_share": summary(comm[w]) if comm[w] else None,
        }
        for w in worlds
    }
    print_table(
        ["ranks", "threads/rank", "samples/s", f"speed-up vs {worlds[0]}", "efficiency", "comm share"],
        [
            [
                str(w),
                str(r["threads_per_process"]),
                show(r["samples_per_s"], ".1f"),
                f"{r['speedup']:.2f}",
                f"{r['efficiency']:.2f}",
                show(r["comm_share"], ".3f") if r["comm_share"] else "-",
            ]
            for w, r in ((int(k), v) for k, v in results.items())
        ],
    )
    return {
        "benchmark": "scaling",
        "settings": {
            "config": args.config,
            "overrides": args.overrides,
            "steps": args.steps,
            "global_batch_size": batch,
            "cpu_count": os.cpu_count(),
            "reps": args.reps,
        },
        "world_sizes": results,
    }
