"""prepare: building the feature cache at growing sizes, with 1 and 2 tokenising workers.

For each size a SQuAD v2.0-shaped training file (the synthetic generator's facts, contexts of about 120
words, five questions each) and an evaluation file a tenth of its size are written as streams: SQuAD JSON,
or with `--format parquet` the hub's squad_v2 rows in Parquet row groups of 10,000 (pyarrow). Each
build is `elastic-qa prepare --workers N` in a fresh process and cache directory, timed from Popen to
exit; its peak memory is the sum of the resident sets of the whole process tree (the command and its
workers), sampled every 50 ms from /proc (pages shared after fork count once per process: an upper
bound). Worker counts alternate within each rep. Then, alternating over the sizes, the time from process
start to the first trained step with that cache: `python -m elastic_qa.train` with the same data, timed
to its `train_start` event
(cache key, opening the cache, model, restore, loader: everything before the loop) and to its first
`step` event, then killed. The start runs use a small model and batch (START_OVERRIDES; the cache does
not depend on them): the first step's compute does not depend on the data, and on a shared machine a
big one is noise that would hide what does.

What more workers can give depends on the machine as much as on the code: virtual cores that share a
physical core or its caches, or a busy host, make two processes tokenising at once each take longer per
question than one alone. So each rep also measures the machine's ceiling for this work: the first 2,000
questions of the file windowed 8 times by one process, then by N independent processes at once (fresh
interpreters, no pipes, no reader, no writer); N x t(1) / t(N) is what N workers could at best achieve
on that machine at that moment.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import (
    BenchError,
    add_config_arguments,
    alternate,
    int_list,
    new_parser,
    positive_int,
    print_table,
    show,
    summary,
)
from elastic_qa.bench.runs import STOP_GRACE_S, start_tied, worker_env
from elastic_qa.launcher.processes import end_process
from elastic_qa.observe.events import StepProgressRecord, TrainStartRecord, records
from elastic_qa.observe.follow import LogFollower
from elastic_qa.prep.synthetic import write_squad_file

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
START_OVERRIDES = [
    "model.d_model=64",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.d_ff=128",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
]
SAMPLE_S = 0.05
CEILING_QUESTIONS = 2000
CEILING_PASSES = 8
# The tokenising work itself, in a fresh interpreter that shares nothing with the others: the file's first
# questions, windowed CEILING_PASSES times from a common start time (argv: file, start, config, overrides).
CEILING_PROBE = f"""import itertools, sys, time
from elastic_qa.config import resolve_config
from elastic_qa.prep.windows import features_for
from elastic_qa.prep.sources import ExampleReader
cfg = resolve_config(sys.argv[3], sys.argv[4:]).data
examples = list(itertools.islice(iter(ExampleReader(sys.argv[1])), {CEILING_QUESTIONS}))
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
started = time.perf_counter()
for _ in range({CEILING_PASSES}):
    features_for(examples, cfg)
print(time.perf_counter() - started)
"""


def parallel_ceiling(processes: int, train_file: Path, config: str, overrides: list[str]) -> float:
    """processes x t(1) / t(processes), t the time to window the same questions in each of `processes`
    independent processes at once: what the machine lets that many tokenisers do now, with no pipes, no
    reader and no writer (everything prepare adds to share the work is left out)."""

    def timed(count: int) -> float:
        start = time.time() + 3.0  # every probe has read its questions by then
        command = [sys.executable, "-c", CEILING_PROBE, str(train_file), str(start), config, *overrides]
        probes = [
            subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=worker_env())
            for _ in range(count)
        ]
        outputs = [probe.communicate()[0] for probe in probes]
        if any(probe.returncode for probe in probes):
            raise BenchError("the parallel-ceiling probe failed")
        return max(float(out.split()[-1]) for out in outputs)

    return processes * timed(1) / timed(processes)


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("prepare", __doc__, reps=1)
    add_config_arguments(parser, "squad")
    parser.add_argument(
        "--sizes", type=int_list, default=[13_000, 130_000, 1_300_000], help="training questions per size"
    )
    parser.add_argument("--workers", type=int_list, default=[1, 2], help="tokenising workers (default 1,2)")
    parser.add_argument(
        "--format", choices=["json", "parquet"], default="json", help="input files (default json: SQuAD JSON)"
    )
    parser.add_argument(
        "--start-reps", type=positive_int, default=3, help="first-step timings per size (default 3)"
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one build or start may take")
    return parser


def tree_rss(root: int) -> int:
    """Resident bytes of a process and all its descendants, now."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as handle:
                stat = handle.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ..., rss at 21
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        rss[pid] = int(fields[21]) * PAGE
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total


def timed_tree(command: list[str], log: Path, timeout: float) -> dict[str, float]:
    """Run `command` to its end: wall seconds, CPU seconds and peak resident bytes of its process tree.

    CPU seconds (user + system of the command and every worker it waited for) barely move with the
    machine's load, unlike wall seconds: they show how the work grows with the data on a shared host.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "wb") as out:
        started = time.perf_counter()
        process = start_tied(command, out)
        peak = 0
        try:
            while process.poll() is None:
                peak = max(peak, tree_rss(process.pid))
                if time.perf_counter() - started > timeout:
                    raise BenchError(f"{command[3]} ran past {timeout:.0f} s (output: {log})")
                time.sleep(SAMPLE_S)
        finally:
            end_process(process, STOP_GRACE_S)  # done, timed out or interrupted: it stops with the bench
        seconds = time.perf_counter() - started
    if process.returncode != 0:
        raise BenchError(f"exit {process.returncode} (output: {log})")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_rss_bytes": float(peak)}


def first_step_s(command: list[str], run_dir: Path, timeout: float) -> tuple[float, float]:
    """Popen -> the `train_start` and the first `step` events' timestamps; the run is killed then."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    output = run_dir / "output.log"
    with open(output, "wb") as out:
        started = time.time()
        process = start_tied(command, out)
        try:
            follower = LogFollower(run_dir / "logs")
            seen: list[dict[str, Any]] = []
            while not (steps := records(seen, StepProgressRecord)):
                seen += follower.new_events()
                if process.poll() is not None:
                    raise BenchError(f"training exited with {process.returncode} (output: {output})")
                if time.time() - started > timeout:
                    raise BenchError(f"no step within {timeout:.0f} s (output: {output})")
                time.sleep(0.02)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            process.wait()
    loop = records(seen, TrainStartRecord)
    if not loop:
        raise BenchError(f"no train_start event before the first step (output: {output})")
    return loop[0]["ts"] - started, steps[0]["ts"] - started


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _builds(args: argparse.Namespace, work: Path, size: int) -> tuple[dict[str, Any], list[str], Path]:
    """Write one size's files and build its cache with each worker count: the figures, the data
    overrides and the one cache kept for the start runs."""
    data = work / f"data-{size}"
    data.mkdir(parents=True, exist_ok=True)
    train, dev = data / f"train.{args.format}", data / f"dev.{args.format}"
    print(f"[prepare] writing {size:,} + {max(1, size // 10):,} questions ...", flush=True)
    started = time.perf_counter()
    questions = write_squad_file(str(train), size, seed=1)
    write_squad_file(str(dev), max(1, size // 10), seed=2)
    entry: dict[str, Any] = {
        "questions": questions,
        "file_bytes": train.stat().st_size,
        "write_s": time.perf_counter() - started,
        "workers": {},
    }
    data_overrides = [f"data.source={train}", f"data.eval_source={dev}"]
    builds: dict[int, list[dict[str, float]]] = {w: [] for w in args.workers}
    ceilings: list[float] = []
    kept: Path | None = None
    for rep, workers in alternate(args.reps, args.workers):
        if workers == args.workers[0] and max(args.workers) > 1:  # once per rep, between its builds
            ceilings.append(parallel_ceiling(max(args.workers), train, args.config, args.overrides))
        print(f"[prepare] {size:,} questions, {workers} worker(s), rep {rep + 1}/{args.reps} ...", flush=True)
        cache = work / f"cache-{size}-w{workers}-{rep}"
        command = [
            sys.executable,
            "-m",
            "elastic_qa.cli",
            "prepare",
            "--config",
            args.config,
            "--workers",
            str(workers),
            *args.overrides,
            *data_overrides,
            f"data.cache_dir={cache}",
        ]
        figures = timed_tree(command, work / f"prepare-{size}-w{workers}-{rep}.log", args.timeout)
        figures["cache_bytes"] = float(directory_bytes(cache))
        builds[workers].append(figures)
        if kept is None:
            kept = cache
        else:
            shutil.rmtree(cache, ignore_errors=True)  # same bytes as the kept one (tested): save disk
    assert kept is not None
    if ceilings:
        entry["parallel_ceiling"] = summary(ceilings)
    for workers, runs in builds.items():
        seconds = summary([r["seconds"] for r in runs])
        entry["workers"][workers] = {
            "seconds": seconds,
            "cpu_seconds": summary([r["cpu_seconds"] for r in runs]),
            "questions_per_s": questions / seconds["median"],
            "peak_rss_bytes": summary([r["peak_rss_bytes"] for r in runs]),
            "cache_bytes": runs[0]["cache_bytes"],
        }
    return entry, data_overrides, kept


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    kept: dict[int, tuple[list[str], Path]] = {}
    for size in args.sizes:
        results[str(size)], overrides, cache = _builds(args, work, size)
        kept[size] = (overrides, cache)
    # Start runs alternate over the sizes, so that a busy spell on the machine hits every size alike.
    loops: dict[int, list[float]] = {size: [] for size in args.sizes}
    steps: dict[int, list[float]] = {size: [] for size in args.sizes}
    for rep, size in alternate(args.start_reps, args.sizes):
        print(f"[prepare] {size:,} questions: start to first step, rep {rep + 1} ...", flush=True)
        run_dir = work / f"start-{size}-{rep}"
        data_overrides, cache = kept[size]
        command = [
            sys.executable,
            "-m",
            "elastic_qa.train",
            "--config",
            args.config,
            *args.overrides,
            *START_OVERRIDES,
            *data_overrides,
            f"data.cache_dir={cache}",
            f"run.dir={run_dir}",
            "train.eval_every=0",
            "checkpoint.interval=1000h",
            "log.every_steps=1",
            "log.console=none",
        ]
        loop, step = first_step_s(command, run_dir, args.timeout)
        loops[size].append(loop)
        steps[size].append(step)
    rows = []
    for size in args.sizes:
        entry = results[str(size)]
        entry["train_start_s"], entry["first_step_s"] = summary(loops[size]), summary(steps[size])
        shutil.rmtree(kept[size][1], ignore_errors=True)
        shutil.rmtree(work / f"data-{size}", ignore_errors=True)
        for workers, figures in entry["workers"].items():
            rows.append(
                [
                    f"{entry['questions']:,}",
                    str(workers),
                    show(figures["seconds"], ".1f"),
                    show(figures["cpu_seconds"], ".1f"),
                    f"{figures['questions_per_s']:,.0f}",
                    f"{figures['peak_rss_bytes']['median'] / 2**20:,.0f}",
                    f"{figures['cache_bytes'] / 2**20:,.0f}",
                    show(entry["train_start_s"], ".2f"),
                    show(entry["first_step_s"], ".2f"),
                ]
            )
    print_table(
        [
            "questions",
            "workers",
            "seconds",
            "CPU s",
            "questions/s",
            "peak RSS MiB",
            "cache MiB",
            "start -> loop s",
            "start -> first step s",
        ],
        rows,
    )
    _goals(results, args.workers)
    return {
        "benchmark": "prepare",
        "settings": {
            "config": args.config,
            "overrides": args.overrides,
            "reps": args.reps,
            "start_reps": args.start_reps,
            "start_overrides": START_OVERRIDES,
            "sizes": args.sizes,
            "workers": args.workers,
            "format": args.format,
            "load_average": os.getloadavg(),
            "cpus": os.cpu_count(),
        },
        "sizes": results,
    }


def _goals(results: dict[str, Any], workers: list[int]) -> None:
    """The ratios the goals are stated in (printed, not judged: the machine may be loaded)."""
    sizes = sorted(results, key=int)
    for size in sizes:
        by = results[size]["workers"]
        most = max(by, key=int)
        if 1 in by and most != 1:
            speedup = by[1]["seconds"]["median"] / by[most]["seconds"]["median"]
            ceiling = results[size].get("parallel_ceiling")
            limit = (
                f" (the machine's ceiling for {most} processes: {show(ceiling, '.2f')}x)" if ceiling else ""
            )
            print(f"{int(size):,} questions: {most} workers / 1 worker throughput {speedup:.2f}x{limit}")
    if len(sizes) > 1:
        small, large = results[sizes[0]], results[sizes[-1]]
        w = workers[0]
        scale = large["questions"] / small["questions"]
        for figure in ("seconds", "cpu_seconds", "peak_rss_bytes"):
            growth = large["workers"][w][figure]["median"] / small["workers"][w][figure]["median"]
            print(
                f"{figure} {sizes[-1]} / {sizes[0]} questions ({w} worker): {growth:.1f}x "
                f"for {scale:.0f}x the data"
            )
        for name in ("train_start_s", "first_step_s"):
            ratio = large[name]["median"] / small[name]["median"]
            print(f"{name}, {sizes[-1]} / {sizes[0]} questions: {ratio:.3f}")
    load = os.getloadavg()
    print(f"load average at the end (1/5/15 min): {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
