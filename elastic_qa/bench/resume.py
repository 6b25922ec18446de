"""resume: process start to the first trained step, resuming at 0%, 50% and 99% of an epoch.

The data position is one global cursor, so seeking should cost the same wherever it points: the times
should be flat across positions. One short single-process run makes a checkpoint; copies of it with the
cursor moved (trainer.pt: data.samples_consumed) are committed through
CheckpointStore.commit, so their manifests verify like any other. Each resume is
`python -m elastic_qa.train` with log.every_steps=1, timed from Popen to the first `step` event's `ts`,
then killed (it must not write a newer checkpoint over the copy). Positions alternate within each rep.
"""

from __future__ import annotations

import argparse
import io
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from elastic_qa.bench.common import (
    BenchError,
    UsageError,
    add_config_arguments,
    alternate,
    int_list,
    new_parser,
    print_table,
    show,
    summary,
)
from elastic_qa.bench.runs import bench_config, records_of, run_logged, start_tied, worker_env
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.payload import TRAINER_FILE
from elastic_qa.checkpoint.store import CheckpointStore, serialize
from elastic_qa.models import family_for
from elastic_qa.observe.events import ResumeRecord, StepProgressRecord, records
from elastic_qa.observe.follow import LogFollower
from elastic_qa.prep import prepare

BASE_STEPS = 3
# Fields commit() writes itself; the rest of the original manifest is carried over to the copies.
OWN_MANIFEST_FIELDS = ("format", "step", "created", "created_ts", "files")


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("resume", __doc__, reps=3)
    add_config_arguments(parser, "default")
    parser.add_argument(
        "--positions", type=int_list, default=[0, 50, 99], help="percent of an epoch (default 0,50,99)"
    )
    parser.add_argument("--timeout", type=float, default=180, help="seconds to wait for a first step")
    return parser


def base_checkpoint(config: str, overrides: list[str], run_dir: Path) -> tuple[CheckpointStore, str]:
    """A real checkpoint from a few single-process steps."""
    args = [
        "--config",
        config,
        *overrides,
        f"run.dir={run_dir}",
        f"train.max_steps={BASE_STEPS}",
        "train.eval_every=0",
        "log.console=none",
    ]
    command = [sys.executable, "-m", "elastic_qa.train", *args]
    run_logged("base run", command, run_dir / "output.log", worker_env(), timeout=600)
    store = open_store(str(run_dir / "checkpoints"))
    return store, store.list_steps()[-1].path


def moved_copy(store: CheckpointStore, path: str, samples: int, target: Path) -> None:
    """The checkpoint at `path` with its data cursor at `samples` (epoch 0), committed under `target`."""
    manifest = store.read_manifest(path)
    files = {name: store.fs.cat_file(f"{path}/{entry['name']}") for name, entry in manifest["files"].items()}
    trainer = torch.load(io.BytesIO(files[TRAINER_FILE]), weights_only=True)
    trainer["data"].update(epoch=0, samples_consumed=samples)  # the one data position
    files[TRAINER_FILE] = serialize(trainer)
    fields = {key: value for key, value in manifest.items() if key not in OWN_MANIFEST_FIELDS}
    copy = open_store(str(target))
    committed = copy.commit(manifest["step"], files, fields)
    if not copy.verify(committed).ok:
        raise BenchError(f"the moved checkpoint in {target} does not verify")


def time_to_first_step(command: list[str], run_dir: Path, timeout: float) -> dict[str, Any]:
    """Popen -> first `step` event; the process is killed once it has trained that step."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    output = run_dir / "output.log"
    with open(output, "wb") as out:
        started = time.time()
        process = start_tied(command, out)
        try:
            follower = LogFollower(run_dir / "logs")  # reads only what is new at each poll
            while not (steps := records(follower.new_events(), StepProgressRecord)):
                if process.poll() is not None:
                    raise BenchError(f"resume exited with {process.returncode} (output: {output})")
                if time.time() - started > timeout:
                    raise BenchError(f"no step within {timeout:.0f} s (output: {output})")
                time.sleep(0.02)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)  # no final checkpoint over the moved copy
            process.wait()
    resumed = records_of(run_dir, ResumeRecord)
    if not resumed:
        raise BenchError(f"the run did not resume (output: {output})")
    return {
        "first_step_s": steps[0]["ts"] - started,
        "resume_event_s": resumed[0]["ts"] - started,
        "cursor": resumed[0]["cursor"],
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    bad = [p for p in args.positions if not 0 <= p < 100]
    if bad:
        raise UsageError(f"--positions: {bad[0]} is not a percentage in [0, 100)")
    cfg = bench_config(args.config, args.overrides)
    samples = len(prepare(cfg, family_for(cfg.model)).train)
    print(f"[resume] base checkpoint: {BASE_STEPS} steps of {args.config} ...", flush=True)
    store, path = base_checkpoint(args.config, args.overrides, work / "base")
    step = int(store.read_manifest(path)["step"])
    cursors = {p: samples * p // 100 for p in args.positions}
    for position, cursor in cursors.items():
        moved_copy(store, path, cursor, work / f"at-{position}" / "checkpoints")
    figures: dict[int, list[dict[str, Any]]] = {p: [] for p in args.positions}
    for rep, position in alternate(args.reps, args.positions):
        print(f"[resume] rep {rep + 1}/{args.reps}: {position}% of the epoch ...", flush=True)
        run_dir = work / f"at-{position}" / f"run-{rep}"
        command = [
            sys.executable,
            "-m",
            "elastic_qa.train",
            "--config",
            args.config,
            *args.overrides,
            f"run.dir={run_dir}",
            # Read only: each rep starts its own run from the moved copy, which stays as it is.
            f"checkpoint.resume_from={work / f'at-{position}' / 'checkpoints'}",
            "checkpoint.require_resume=true",
            "checkpoint.interval=1000h",
            f"train.max_steps={step + 1000}",
            "train.eval_every=0",
            "log.every_steps=1",
            "log.console=none",
        ]
        timing = time_to_first_step(command, run_dir, args.timeout)
        if timing["cursor"] != cursors[position]:
            raise BenchError(f"resumed at cursor {timing['cursor']}, expected {cursors[position]}")
        figures[position].append(timing)
    results = {
        f"{p}%": {
            "cursor": cursors[p],
            "first_step_s": summary([t["first_step_s"] for t in rows]),
            "resume_event_s": summary([t["resume_event_s"] for t in rows]),
        }
        for p, rows in figures.items()
    }
    print_table(
        ["position", "cursor", "start -> resume event s", "start -> first step s"],
        [
            [name, str(r["cursor"]), show(r["resume_event_s"], ".2f"), show(r["first_step_s"], ".2f")]
            for name, r in results.items()
        ],
    )
    medians = [r["first_step_s"]["median"] for r in results.values()]
    spread = max(medians) / min(medians)
    print(f"slowest / fastest position (medians): {spread:.3f} (flat = 1.0)")
    return {
        "benchmark": "resume",
        "settings": {
            "config": args.config,
            "overrides": args.overrides,
            "reps": args.reps,
            "train_samples": samples,
            "checkpoint_step": step,
        },
        "positions": results,
        "max_over_min": spread,
    }
