"""probe: what the loss-invariance probe costs at start-up (train.freeze_loss_invariant), per model.

Rank 0 of every (re)start runs one float64 forward and backward of a perturbed copy of the model
(models/invariance.py) before its first step. Each repetition is a fresh process that prepares the
trainer's probe windows (the first PROBE_WINDOWS of the feature cache, synthetic data), builds the model as
the trainer does, then times `loss_invariant_parameters`; peak memory is the process's maximum resident
set (getrusage) after the probe minus its resident set just before it, so it counts what the probe added
on top of the model it found, whatever torch's allocator did in between. The float64 copy alone is timed
after, in the same process. Models: transformers directories (model.kind=hf), e.g. a pretrained encoder
or `python -m elastic_qa.models.tiny DIR --size base`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import (
    BenchError,
    UsageError,
    new_parser,
    positive_int,
    print_table,
    show,
    summary,
)
from elastic_qa.bench.runs import bench_config, worker_env

CONFIG = "hf-tiny"


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("probe", __doc__, reps=3)
    parser.add_argument(
        "--model-dir",
        type=Path,
        action="append",
        required=True,
        help="a transformers model directory (save_pretrained) to probe; repeatable",
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per probe process")
    return parser


def overrides(model_dir: Path, work: Path) -> list[str]:
    return [f"model.name_or_path={model_dir.resolve()}", f"data.cache_dir={work / 'cache'}"]


def probe_in_this_process(config_overrides: list[str], threads: int) -> dict[str, Any]:
    """The probe's figures in this process (fresh: its peak resident set is the probe's and the model's)."""
    import numpy as np
    import torch

    from elastic_qa.config import resolve_config
    from elastic_qa.data.loader import collate
    from elastic_qa.loop.freeze import PROBE_WINDOWS
    from elastic_qa.models import family_for
    from elastic_qa.models.invariance import loss_invariant_parameters
    from elastic_qa.prep import prepare

    torch.set_num_threads(threads)
    cfg = resolve_config(CONFIG, config_overrides)
    family = family_for(cfg.model)
    data = prepare(cfg, family)
    windows = collate(data.train, np.arange(min(PROBE_WINDOWS, len(data.train))))
    torch.manual_seed(cfg.run.seed)
    model = family.build_model(cfg, data.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    rss_before = _current_rss_bytes()
    peak_before = _peak_rss_bytes()
    started = time.perf_counter()
    found = loss_invariant_parameters(model, windows, family.span_loss_per_window)
    seconds = time.perf_counter() - started
    peak_after = _peak_rss_bytes()
    started = time.perf_counter()
    copy.deepcopy(model).double()  # the probe's first act, alone: how much of its time is the copy
    copy_seconds = time.perf_counter() - started
    return {
        "parameters": params,
        "frozen": len(found),
        "seconds": seconds,
        "copy_seconds": copy_seconds,
        "rss_before_bytes": rss_before,
        "peak_before_bytes": peak_before,
        "peak_after_bytes": peak_after,
        "added_bytes": peak_after - rss_before,
    }


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _current_rss_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def probe_in_a_fresh_process(config_overrides: list[str], threads: int, timeout: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "elastic_qa.bench.probe", "--child", str(threads), *config_overrides]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=worker_env(threads), timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"the probe took more than {timeout:.0f} s: {' '.join(command)}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BenchError(f"the probe process exited with {done.returncode}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for model_dir in args.model_dir:
        if not model_dir.is_dir():
            raise UsageError(f"--model-dir {model_dir}: not a directory")
        settings = overrides(model_dir, work)
        bench_config(CONFIG, settings)  # a bad model is a usage error now; the cache is built once here
        print(f"[probe] {model_dir.name}: {args.reps} fresh process(es) ...", flush=True)
        runs = [probe_in_a_fresh_process(settings, args.threads, args.timeout) for _ in range(args.reps)]
        first = runs[0]
        results[model_dir.name] = {
            "model_dir": str(model_dir),
            "parameters": first["parameters"],
            "frozen": first["frozen"],
            "float64_copy_and_gradients_bytes": 16 * first["parameters"],
            **{key: summary([r[key] for r in runs]) for key in first if key not in ("parameters", "frozen")},
        }
    print_table(
        ["model", "params", "frozen", "probe s", "of which float64 copy s", "added peak MB", "16 B/param MB"],
        [
            [
                name,
                f"{r['parameters']:,}",
                str(r["frozen"]),
                show(r["seconds"], ".2f"),
                show(r["copy_seconds"], ".2f"),
                show(_mb(r["added_bytes"]), ",.0f"),
                f"{r['float64_copy_and_gradients_bytes'] / 1e6:,.0f}",
            ]
            for name, r in results.items()
        ],
    )
    return {
        "benchmark": "probe",
        "settings": {"reps": args.reps, "threads": args.threads, "config": CONFIG},
        "models": results,
    }


def _mb(stat: dict[str, Any]) -> dict[str, Any]:
    return {key: [v / 1e6 for v in value] if key == "values" else value / 1e6 for key, value in stat.items()}


if __name__ == "__main__":  # the measured process: `--child THREADS OVERRIDES...`, one JSON line out
    if sys.argv[1:2] != ["--child"]:
        print("elastic_qa.bench.probe: run it as `elastic-qa bench probe`", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(probe_in_this_process(sys.argv[3:], int(sys.argv[2]))))
