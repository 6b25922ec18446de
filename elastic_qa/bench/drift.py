"""`elastic-qa bench drift`: does the trajectory depend on the world size? How does the gap grow?

The same job (global batch fixed, dropout off) runs at each world size, and once with a mid-run resize
(killed at one size, resumed at another); milestone checkpoints every `--every` steps are compared with the
1-rank run: relative L2 difference of all parameters. Data parallelism is exact; what remains is float
summation order (all-reduce of partial sums instead of one sum), which compounds slowly through AdamW.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from chaos.evidence import parameter_difference
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.checkpoint.store import CheckpointStore
from elastic_qa.config import CheckpointConfig


def train(run_dir: Path, world: int, args: argparse.Namespace, *extra: str, check: bool = True) -> None:
    overrides = [
        f"run.dir={run_dir}",
        f"train.max_steps={args.steps}",
        "model.dropout=0.0",
        f"checkpoint.every_steps={args.every}",
        f"checkpoint.keep_every_steps={args.every}",
        "log.console=none",
        "train.eval_every=0",
        f"train.threads={args.threads}",
        *args.overrides,
        *extra,
    ]
    entry = ["-m", "elastic_qa.train", "--config", args.config, *overrides]
    if world == 1:
        command = [sys.executable, *entry]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world}",
            *entry,
        ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"world {world} failed ({result.returncode}): {result.stderr[-1500:]}")


def milestones(run_dir: Path) -> dict[int, dict]:
    store = CheckpointStore(str(run_dir / "checkpoints"))
    checkpointer = Checkpointer(CheckpointConfig(), store)
    return {info.step: checkpointer.load_step(info.path, info.step).model for info in store.list_steps()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="elastic-qa bench drift",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--world-sizes", default="1,2,3,4", help="comma-separated (1 is the baseline)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=100, help="milestone interval (steps)")
    parser.add_argument("--resize", default="2:3", help="FROM:TO world sizes of the resized run ('' to skip)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("overrides", nargs="*", help="config overrides")
    args = parser.parse_args(argv)
    try:
        worlds = [int(w) for w in args.world_sizes.split(",")]
    except ValueError:
        parser.error(f"--world-sizes {args.world_sizes!r}: expected e.g. 1,2,3,4")
    if 1 not in worlds:
        worlds.insert(0, 1)
    with tempfile.TemporaryDirectory(prefix="eqa-drift-") as tmp:
        cache = f"data.cache_dir={Path(tmp) / 'cache'}"
        args.overrides = [cache, *args.overrides]
        runs: dict[str, dict[int, dict]] = {}
        for world in worlds:
            run_dir = Path(tmp) / f"w{world}"
            train(run_dir, world, args)
            runs[f"{world}"] = milestones(run_dir)
        if args.resize:
            first, second = (int(w) for w in args.resize.split(":"))
            run_dir = Path(tmp) / "resize"
            # SIGKILL (debug.kill_at_step) half-way at one size, resume from the newest checkpoint at another
            train(run_dir, first, args, f"debug.kill_at_step={args.steps // 2}", check=False)
            train(run_dir, second, args)
            runs[f"{first}->{second}"] = milestones(run_dir)
    baseline = runs["1"]
    steps = sorted(baseline)
    table = {
        name: {
            step: parameter_difference(params[step], baseline[step])["relative"]
            for step in steps
            if step in params
        }
        for name, params in runs.items()
        if name != "1"
    }
    print(f"relative parameter difference vs 1 rank ({args.config}, global batch fixed, dropout 0)")
    print("step  " + "".join(f"{name:>12}" for name in table))
    for step in steps:
        print(f"{step:<6}" + "".join(f"{table[name].get(step, float('nan')):>12.2e}" for name in table))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"config": args.config, "steps": args.steps, "relative_difference": table}, indent=1)
        )
    return 0
