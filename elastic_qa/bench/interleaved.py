"""The overhead benchmark's worker: the product's step and plain DDP steps, alternating in the same processes.

    torchrun --standalone --nproc_per_node=2 -m elastic_qa.bench.interleaved --config default \\
        --out blocks.json --sides skeleton,recipe,product --block 20 --rounds 30 run.dir=DIR ...

Each side keeps its own model, optimizer and data; all of them live in the same processes, threads and
process group. A round runs `--block` steps of every side, one side after the other, in an order that
rotates from round to round (so each side follows each other side and runs first equally often); rank 0
times each block with perf_counter (the sides' steps end in an all-reduce, so rank 0's time is the group's)
and writes the block times to --out. A slow spell of the machine lands on blocks of every side alike, which
back-to-back runs of seconds each cannot promise (elastic_qa/bench/overhead.py, which runs this).

Sides:
    skeleton   the tuned plain DDP loop (bench/plain_ddp.py --tuned): forward, backward, optimizer step
    skeleton2  a second, independent skeleton: an A/A control, to see what the method itself reads as noise
    recipe     the skeleton plus what a fine-tuning script does at every step with torch's own functions:
               gradient clipping at train.grad_clip and the LR schedule
    product    the product's own training step (Trainer.run_step): global-cursor batches, the control
               all-reduce, clipping, schedule, step timers, the step line, the save decision

The product side is the real trainer, started on its run directory as `elastic_qa.train` starts it, with its
step events logged there; eval and periodic checkpoints are out of its way (the benchmark's overrides).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_qa.config import Config, resolve_config
from elastic_qa.data.cache import PreparedData
from elastic_qa.dist import DistContext, exit_process, init_distributed, set_threads, shutdown
from elastic_qa.elastic.signals import StopRequest
from elastic_qa.elastic.watchdog import AgentWatchdog
from elastic_qa.models import family_for
from elastic_qa.observe.log import configure_logging
from elastic_qa.prep import prepare

SIDES = ("skeleton", "skeleton2", "recipe", "product")


def order(sides: list[str], round_index: int) -> list[str]:
    """The sides' order in a round: rotated by one each round."""
    shift = round_index % len(sides)
    return sides[shift:] + sides[:shift]


class ProductSide:
    """The real trainer, one step at a time; the time other sides ran in between is hidden from its step
    timer (its rate window decides how often the control all-reduce runs, and feeds the step line)."""

    def __init__(self, cfg: Config, ctx: DistContext, data: PreparedData, stop: StopRequest) -> None:
        from elastic_qa.trainer import Trainer

        self.trainer = Trainer(cfg, ctx, data, stop)
        self.trainer.start(benchmark="interleaved")
        self.batches = self.trainer.begin()
        self.paused_at: float | None = None

    def step(self) -> None:
        if self.trainer.run_step(self.batches).stop:
            raise SystemExit("the product side was asked to stop")

    def resume(self) -> None:
        if self.paused_at is not None:
            self.trainer.timer.leave_out(time.perf_counter() - self.paused_at)

    def pause(self) -> None:
        self.paused_at = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_qa.bench.interleaved", description=__doc__)
    parser.add_argument("--config", default="default")
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes the block times here")
    parser.add_argument("--sides", required=True, help=f"comma-separated, from {', '.join(SIDES)}")
    parser.add_argument("--block", type=int, required=True, help="steps per side per round")
    parser.add_argument("--rounds", type=int, required=True, help="measured rounds")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and not recorded")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    sides = args.sides.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown or len(set(sides)) != len(sides):
        parser.error(f"--sides {args.sides}: each of {', '.join(SIDES)} at most once")

    cfg = resolve_config(args.config, args.overrides)
    configure_logging(Path(cfg.run.dir) / "logs", cfg.log.level)
    data = prepare(cfg, family_for(cfg.model))
    ctx = init_distributed(cfg.dist)
    set_threads(cfg.train.threads, ctx)
    # As elastic_qa.train runs it: the watchdog's thread is part of what a product process carries, and it
    # asks the trainer to stop through the same StopRequest.
    stop = StopRequest()
    watchdog = AgentWatchdog(
        cfg.dist.agent_check_interval, cfg.dist.agent_lost_grace, stop, cfg.checkpoint.emergency_retry_for
    )
    watchdog.start()
    try:
        steps, product = build_sides(cfg, ctx, data, sides, stop)
        times: dict[str, list[float]] = {side: [] for side in sides}
        for round_index in range(args.warmup_rounds + args.rounds):
            for side in order(sides, round_index):
                if product and side == "product":
                    product.resume()
                began = time.perf_counter()
                for _ in range(args.block):
                    steps[side]()
                elapsed = time.perf_counter() - began
                if product and side == "product":
                    product.pause()
                if round_index >= args.warmup_rounds:
                    times[side].append(elapsed)
        if product:  # the step lines still carried, as the trainer does at its end (collective)
            product.trainer.control.flush()
        if ctx.is_main:
            result: dict[str, Any] = {
                "world_size": ctx.world_size,
                "block": args.block,
                "warmup_rounds": args.warmup_rounds,
                "orders": [
                    order(sides, r) for r in range(args.warmup_rounds, args.warmup_rounds + args.rounds)
                ],
                "block_s": times,
            }
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result))
        if product:
            product.trainer.stop_request.uninstall()
    finally:
        watchdog.stop()
        shutdown()
    return 0


def build_sides(
    cfg: Config, ctx: DistContext, data: PreparedData, sides: list[str], stop: StopRequest
) -> tuple[dict[str, Callable[[], Any]], ProductSide | None]:
    """Each side's one-step function, built in the order given (the product's trainer among them)."""
    from elastic_qa.bench.plain_ddp import Skeleton

    steps: dict[str, Callable[[], Any]] = {}
    product = None
    for side in sides:
        if side == "product":
            product = ProductSide(cfg, ctx, data, stop)
            steps[side] = product.step
        else:
            steps[side] = Skeleton(cfg, data, tuned=True, recipe_math=side == "recipe").step
    return steps, product


if __name__ == "__main__":
    exit_process(main())
