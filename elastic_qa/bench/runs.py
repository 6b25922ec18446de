"""Running real training processes for the benchmarks and reading back what they logged.

The product is measured from its own logs (rank 0's `step` events carry `ts`), never by wrapping it, so the
benchmark adds nothing to the loop it measures. Every process a benchmark starts is tied to it
(launcher.processes.tied_to_this_process) and ended when it stops, however it stops: an interrupted
benchmark leaves nothing training.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, TypeVar

from elastic_qa.bench.common import BenchError, UsageError
from elastic_qa.config import Config, ConfigError, format_duration, resolve_config
from elastic_qa.data.examples import DataError
from elastic_qa.launcher.processes import end_process, tied_to_this_process
from elastic_qa.models import family_for
from elastic_qa.observe.events import CheckpointCommittedRecord, Event, StepProgressRecord, records
from elastic_qa.observe.follow import read_events
from elastic_qa.prep import prepare

REPO = Path(__file__).resolve().parents[2]
NO_CHECKPOINTS = "checkpoint.interval=1000h"  # the final checkpoint still happens, after the last step
# How long a run told to stop (SIGTERM) may take before it is killed: torchrun gives its workers 30 s.
STOP_GRACE_S = 40.0


def bench_config(name: str, overrides: list[str]) -> Config:
    """The resolved config, with its feature cache built now so that no measured run pays for it."""
    try:
        cfg = resolve_config(name, overrides)
        prepare(cfg, family_for(cfg.model))
    except (ConfigError, DataError) as err:
        raise UsageError(f"config: {err}") from None
    return cfg


def default_threads(processes: int) -> int:
    """Intra-op threads per process when `processes` share this host (the product's own default)."""
    return max(1, (os.cpu_count() or 1) // processes)


def worker_env(threads: int | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # torchrun would set 1 for us otherwise; be explicit
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def torchrun(world_size: int, module: str, args: list[str]) -> list[str]:
    """The one torchrun form every throughput-type run uses, product and baseline alike."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
        "-m",
        module,
        *args,
    ]


def start_tied(
    command: list[str], out: IO[bytes], env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """Start `command` with its output in `out`, told to stop (SIGTERM) if this process dies."""
    return subprocess.Popen(
        command,
        stdout=out,
        stderr=subprocess.STDOUT,
        env=worker_env() if env is None else env,
        cwd=cwd,
        preexec_fn=tied_to_this_process(),
    )


def run_logged(
    name: str, command: list[str], log_path: Path, env: dict[str, str], timeout: float, check: bool = True
) -> None:
    """Run to completion with all output in `log_path`; a failure (a non-zero exit when `check`, or a
    timeout) names its last line and the log. Stopped any other way (Ctrl-C, SIGTERM), the run is told to
    stop before this returns: a torchrun stops its workers first (a SIGKILL would orphan them)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        process = start_tied(command, out, env, REPO)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{name} did not finish within {timeout:.0f} s (output: {log_path})") from None
        finally:
            end_process(process, STOP_GRACE_S)
    if check and code != 0:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
        raise BenchError(f"{name} exited with {code}: {lines[-1] if lines else ''} (output: {log_path})")


R = TypeVar("R")


def events_of(run_dir: Path, event: Event, rank: int | None = 0) -> list[dict[str, Any]]:
    """One kind of event from a run's logs, oldest first, from one rank (None: all). For an event with a
    record in observe/events.py, `records_of` reads it typed."""
    return [
        row
        for row in read_events(run_dir)
        if row.get("event") == event and (rank is None or row.get("rank") == rank)
    ]


def records_of(run_dir: Path, kind: type[R], rank: int | None = 0) -> list[R]:
    """The lines of a run's logs that are `kind` records (observe/events.py; others passed over), oldest
    first, from one rank (None: all)."""
    return records([row for row in read_events(run_dir) if rank is None or row.get("rank") == rank], kind)


def window_steps(total: int, every: int, skip: float) -> tuple[int, int]:
    """The steady-state window: from the first logged step past `skip` of the run to the last step.

    Only every `every`-th step is logged, so the window starts on such a step; the last step is always
    logged. Every variant is timed over the same steps.
    """
    first = max(every, math.ceil(skip * total / every) * every)
    if first >= total:
        raise UsageError(f"too few steps ({total}) for a steady-state window with log.every_steps={every}")
    return first, total


def steps_per_s(stamps: dict[int, float], window: tuple[int, int]) -> float:
    first, last = window
    missing = [step for step in window if step not in stamps]
    if missing:
        raise BenchError(f"no timestamp for step {missing[0]} (steps logged: {len(stamps)})")
    return (last - first) / max(stamps[last] - stamps[first], 1e-9)


def median_chunk_step_s(stamps: dict[int, float], window: tuple[int, int], every: int) -> float:
    """Median step time over the window's `every`-step chunks (the product logs every `every` steps).

    A burst of outside load on a shared machine moves a few chunks, not the median; neither does a
    checkpoint, so the gap between this and 1 / steps_per_s is what the periodic stalls cost.
    """
    first, last = window
    edges = [*range(first, last, every), last]
    return statistics.median((stamps[b] - stamps[a]) / (b - a) for a, b in itertools.pairwise(edges))


def product_overrides(
    user: list[str], run_dir: Path, steps: int, threads: int, checkpoint_interval: timedelta | None
) -> list[str]:
    """Eval and periodic checkpoints out of the measured window unless checkpoints are what is measured."""
    every = (
        [f"checkpoint.interval={format_duration(checkpoint_interval)}", "checkpoint.async=true"]
        if checkpoint_interval
        else [NO_CHECKPOINTS]
    )
    return [
        *user,
        f"run.dir={run_dir}",
        f"train.max_steps={steps}",
        f"train.threads={threads}",
        "train.eval_every=0",
        "log.console=none",
        *every,
    ]


@dataclass(frozen=True)
class Spec:
    """What a throughput-type run trains: the same for every variant it is compared with."""

    config: str
    overrides: list[str]
    steps: int
    every: int  # the config's log.every_steps: the product logs only those steps
    skip: float = 0.2

    @property
    def window(self) -> tuple[int, int]:
        return window_steps(self.steps, self.every, self.skip)


@dataclass
class ProductRun:
    steps_per_s: float
    chunk_step_s: float  # median_chunk_step_s
    window: tuple[int, int]
    window_s: tuple[float, float]  # ts of the window's first and last step
    breakdowns: list[dict[str, Any]] = field(default_factory=list)  # rank 0, inside the window
    checkpoints: list[CheckpointCommittedRecord] = field(default_factory=list)  # committed inside the window


def run_product(
    spec: Spec, world_size: int, threads: int, run_dir: Path, checkpoint_interval: timedelta | None = None
) -> ProductRun:
    """`torchrun --standalone -m elastic_qa.train` to completion, timed from rank 0's step events."""
    overrides = product_overrides(spec.overrides, run_dir, spec.steps, threads, checkpoint_interval)
    run_logged(
        f"product run {run_dir.name}",
        torchrun(world_size, "elastic_qa.train", ["--config", spec.config, *overrides]),
        run_dir / "output.log",
        worker_env(threads),
        timeout=300 + 2 * spec.steps,
    )
    window = spec.window
    stamps = {row["step"]: row["ts"] for row in records_of(run_dir, StepProgressRecord)}
    rate = steps_per_s(stamps, window)
    start, end = stamps[window[0]], stamps[window[1]]
    # Breakdowns whose whole averaging window lies in the steady state (else the last one there is).
    breakdowns = events_of(run_dir, Event.STEP_BREAKDOWN)
    steady = [row for row in breakdowns if row["step"] - row["steps"] >= window[0]] or breakdowns[-1:]
    checkpoints = [
        row
        for row in records_of(run_dir, CheckpointCommittedRecord)
        if row.get("reason") == "periodic" and start < row["ts"] <= end
    ]
    chunk = median_chunk_step_s(stamps, window, spec.every)
    return ProductRun(rate, chunk, window, (start, end), steady, checkpoints)
