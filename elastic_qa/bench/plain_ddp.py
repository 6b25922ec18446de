"""The baseline of the throughput benchmark: a plain DDP loop and nothing else.

    torchrun --standalone --nproc_per_node=2 -m elastic_qa.bench.plain_ddp --config default \\
        --out stamps.json train.max_steps=300

Same model (the config's model family, same seed), same memory-mapped cached features and collate, same
global batch, DDP bucket size, AdamW lr and weight decay, threads per process as the product; none of the
product's machinery: no global cursor, control all-reduce, grad clipping, LR schedule, step timer, logging
or checkpoints. Rank 0 records the wall-clock time at the end of every step, and how long the step's data,
forward+backward and optimizer phases took (perf_counter, as the product's step timer), in --out.

--tuned gives the loop the product's own optimizer (trainer.build_optimizer: its parameter groups and AdamW
implementation), DDP gradient_as_bucket_view=True and no buffer broadcast for a model whose buffers never
change (dist.has_running_statistics), free speed-ups that are not per-step machinery, so a
comparison against it isolates what the product's step adds (control all-reduce, clipping, LR schedule,
timers, logging, data cursor).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from elastic_qa.config import Config, resolve_config
from elastic_qa.data.cache import PreparedData
from elastic_qa.data.features import Features
from elastic_qa.data.loader import collate
from elastic_qa.dist import buffer_sync, exit_process, has_running_statistics
from elastic_qa.models import family_for, model_inputs
from elastic_qa.optim import build_optimizer, build_scheduler
from elastic_qa.prep import prepare


class Indices(Dataset):
    """Item i is just i: the collate function gathers a whole batch from the memory map at once."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


class Collate:
    """A picklable collate (loader workers) over the product's own `collate`."""

    def __init__(self, features: Features, full_width: bool) -> None:
        self.features = features
        self.full_width = full_width

    def __call__(self, indices: list[int]) -> dict[str, Any]:
        return collate(self.features, np.asarray(indices), full_width=self.full_width)


class Skeleton:
    """The plain loop's state and one step of it: the model under DDP, its optimizer, an endless loader.

    `tuned`: the product's optimizer, gradient_as_bucket_view and no constant-buffer broadcast (see the
    module's docstring). `recipe_math`: also what a plain fine-tuning script does at every step, with
    torch's own functions: clip the gradient norm at train.grad_clip (when set) and step the product's LR
    schedule. Used alone (main) and beside the product in the same processes (bench/interleaved.py).
    """

    def __init__(
        self, cfg: Config, data: PreparedData, tuned: bool = False, recipe_math: bool = False
    ) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        cuda = torch.cuda.is_available()
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        self.family = family_for(cfg.model)
        self.per_rank = cfg.train.global_batch_size // world
        self.sampler: DistributedSampler[int] = DistributedSampler(
            Indices(len(data.train)), world, rank, shuffle=True, seed=cfg.run.seed
        )
        self.loader = DataLoader(
            Indices(len(data.train)),
            batch_size=self.per_rank,
            sampler=self.sampler,
            num_workers=cfg.data.num_workers,
            collate_fn=Collate(data.train, self.family.full_width),
            drop_last=True,
            pin_memory=cuda,
        )
        torch.manual_seed(cfg.run.seed)
        module = self.family.build_model(cfg, data.vocab_size).to(self.device)
        self.model = DistributedDataParallel(
            module,
            device_ids=[local_rank] if cuda else None,
            bucket_cap_mb=cfg.dist.bucket_cap_mb,
            gradient_as_bucket_view=tuned,
            **buffer_sync(not tuned or has_running_statistics(module)),
        )
        self.model.train()  # as the product does: transformers' from_pretrained returns a model in eval mode
        if tuned:
            self.optimizer = build_optimizer(self.model.module, cfg)
        else:  # torch's defaults: on CPU, the for-loop implementation
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=cfg.train.peak_lr, weight_decay=cfg.train.weight_decay
            )
        self.grad_clip = cfg.train.grad_clip if recipe_math else 0.0
        self.scheduler = build_scheduler(self.optimizer, cfg) if recipe_math else None
        self.epoch = 0
        self.batches = self._epoch()

    def _epoch(self) -> Iterator[dict[str, Any]]:
        self.sampler.set_epoch(self.epoch)
        return iter(self.loader)

    def _next_batch(self) -> dict[str, Any]:
        try:
            return next(self.batches)
        except StopIteration:
            self.epoch += 1
            self.batches = self._epoch()
            return next(self.batches)

    def step(self) -> tuple[float, float, float]:
        """One training step; how long its data, forward+backward and optimizer phases took (seconds)."""
        began = time.perf_counter()
        batch = self._next_batch()
        fetched = time.perf_counter()
        self.optimizer.zero_grad()
        start, end = self.model(**model_inputs(batch, self.device))
        count = start.shape[0]
        loss = (
            self.family.span_loss(
                start,
                end,
                batch["start_positions"].to(self.device),
                batch["end_positions"].to(self.device),
                torch.ones(count, device=self.device),
            )
            / count
        )
        loss.backward()
        computed = time.perf_counter()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        if self.scheduler:
            self.scheduler.step()
        return fetched - began, computed - fetched, time.perf_counter() - computed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_qa.bench.plain_ddp", description=__doc__)
    parser.add_argument("--config", default="default")
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes its step timestamps here")
    parser.add_argument(
        "--tuned", action="store_true", help="the product's optimizer and DDP gradient_as_bucket_view"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    cfg = resolve_config(args.config, args.overrides)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local_world))
    skeleton = Skeleton(cfg, prepare(cfg, family_for(cfg.model)), tuned=args.tuned)

    stamps: list[float] = []
    phases: list[tuple[float, float, float]] = []  # data, forward_backward, optimizer (the product's names)
    while len(stamps) < cfg.train.max_steps:
        phases.append(skeleton.step())
        stamps.append(time.time())  # the same clock as the product's `ts`
    if dist.get_rank() == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        out = {"world_size": world, "per_rank_batch": skeleton.per_rank, "ts": stamps, "phases": phases}
        args.out.write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())
