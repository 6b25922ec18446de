"""`elastic-qa bench NAME [options]`: the benchmarks, one module each (USAGE is what users see).

A benchmark module provides build_parser() and run(args, work_dir) -> dict (its JSON); this file handles
argument errors, the work directory, logging of in-process work, the JSON file, and being stopped: SIGTERM
unwinds like Ctrl-C, so that every benchmark ends the jobs it started on its way out (exit 130 or 143).
"""

from __future__ import annotations

import importlib
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType

import structlog

from elastic_qa.bench.common import BenchError, write_json
from elastic_qa.exits import EXIT_BAD_INPUT, EXIT_FAILED, UsageError
from elastic_qa.observe.log import configure_logging

USAGE = """elastic-qa bench NAME [options]: measure this trainer (see docs/benchmarks.md).

    throughput   product loop vs a plain DDP loop (overhead ratio), optionally with async checkpoints
    overhead     the product's step vs plain DDP steps, alternating inside the same processes
    compile      the product eager vs train.compile=true: steady-state steps/s, cold compile time
    checkpoint   training stall of an async save vs a synchronous save, default and ~10x model
    emergency    emergency save and restore to first step, with and without the node-local copy
    resume       process start to first trained step when resuming at 0%, 50%, 99% of an epoch
    recovery     kill to first step of the new group (worker kill, node loss) vs bare torchrun
    goodput      effective training time under a steady failure rate: product, bare torchrun, torchft
    replicas     the replica-group mode under worker kills: survivors' next step, heal, rejoin; ledger
    scaling      samples/s, speed-up and communication share at 1, 2, ... ranks
    denormals    the optimizer step over a large vocabulary's embedding, train.flush_denormals off vs on
    probe        start-up cost of the loss-invariance probe (time, peak memory) for transformers models
    drift        how far final parameters at 2, 3, 4 ranks (and after a resize) drift from 1 rank, by step
    prepare      feature cache builds at 13k/130k/1.3M questions, 1 and 2 workers; start to first step
    recipe       fine-tuning a pretrained encoder: the product vs a plain transformers Trainer script
    gpu          one GPU: nccl, bf16/fp16, async saves, a killed worker resumed; checks pass or fail
    serve        `elastic-qa serve` under N concurrent clients: p50/p99, requests/s, RSS, batching vs none

Every benchmark takes --json PATH, --work-dir DIR and --help and prints a table; those that time things
take --reps N, report medians with their min..max spread and run compared variants alternately (drift is
deterministic: one run per world size). Exit codes: 0 done (whether or not a goal was met), 1 a measured
run failed, 2 bad arguments, 130/143 stopped by Ctrl-C/SIGTERM (the runs it had started are stopped too).
`elastic-qa bench NAME --help` for the options of one.
"""

BENCHMARKS = (
    "throughput",
    "overhead",
    "compile",
    "checkpoint",
    "emergency",
    "resume",
    "recovery",
    "goodput",
    "replicas",
    "scaling",
    "denormals",
    "probe",
    "drift",
    "prepare",
    "recipe",
    "gpu",
    "serve",
)


def main(argv: list[str]) -> int:
    if not argv:
        print(
            f"elastic-qa bench: name a benchmark ({', '.join(BENCHMARKS)}); --help for more",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    if argv[0] in ("-h", "--help"):
        print(USAGE.strip())
        return 0
    name, rest = argv[0], list(argv[1:])
    if name not in BENCHMARKS:
        print(
            f"elastic-qa bench: unknown benchmark {name!r} (choose from {', '.join(BENCHMARKS)})",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    module = importlib.import_module(f"elastic_qa.bench.{name}")
    try:
        args = module.build_parser().parse_args(rest)
    except UsageError as err:
        print(err, file=sys.stderr)
        return EXIT_BAD_INPUT
    except SystemExit as done:  # --help
        return int(done.code or 0)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix=f"eqa-bench-{name}-"))
    work.mkdir(parents=True, exist_ok=True)
    # In-process work (cache building, the checkpointer) logs to the work dir, not over the tables.
    previous = structlog.get_config()
    configure_logging(work / "bench-logs", "info")
    keep = args.work_dir is not None
    stopped_by: list[int] = []

    def stop(signum: int, _frame: FrameType | None) -> None:
        stopped_by.append(signum)
        if len(stopped_by) == 1:
            raise KeyboardInterrupt  # the unwinding of Ctrl-C: each benchmark's `finally` ends its runs
        # A second signal (`timeout` and a Ctrl-C, a supervisor's SIGTERM sent twice) is noted, not raised:
        # raised, it broke off the first one's stopping of the runs, and left a SIGSTOPped agent and its
        # launcher running on after the benchmark had exited.

    in_main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous_term = signal.signal(signal.SIGTERM, stop) if in_main else None
    previous_int = signal.signal(signal.SIGINT, stop) if in_main else None
    try:
        result = module.run(args, work.resolve())
        if args.json:
            try:
                write_json(args.json, result)
            except OSError as err:
                raise BenchError(f"cannot write --json {args.json}: {err.strerror or err}") from None
            print(f"figures written to {args.json}")
        return 0
    except UsageError as err:
        print(f"elastic-qa bench {name}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BenchError as err:
        keep = True  # the failed run's output is in there
        print(f"elastic-qa bench {name}: {err} (work dir kept: {work})", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        signum = stopped_by[0] if stopped_by else signal.SIGINT
        print(
            f"elastic-qa bench {name}: stopped by {signal.Signals(signum).name}; the runs it started are "
            "stopped",
            file=sys.stderr,
        )
        return 128 + signum
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)
        structlog.configure(**previous)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
