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
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from elastic_qa.config import resolve_config
from elastic_qa.data.features import Features
from elastic_qa.data.loader import collate
from elastic_qa.dist import buffer_sync, exit_process, has_running_statistics
from elastic_qa.models import family_for, model_inputs
from elastic_qa.optim import build_optimizer
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
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local_world))

    family = family_for(cfg.model)
    data = prepare(cfg, family)
    per_rank = cfg.train.global_batch_size // world
    sampler: DistributedSampler[int] = DistributedSampler(
        Indices(len(data.train)), world, rank, shuffle=True, seed=cfg.run.seed
    )
    loader = DataLoader(
        Indices(len(data.train)),
        batch_size=per_rank,
        sampler=sampler,
        num_workers=cfg.data.num_workers,
        collate_fn=Collate(data.train, family.full_width),
        drop_last=True,
        pin_memory=cuda,
    )
    torch.manual_seed(cfg.run.seed)
    module = family.build_model(cfg, data.vocab_size).to(device)
    model = DistributedDataParallel(
        module,
        device_ids=[local_rank] if cuda else None,
        bucket_cap_mb=cfg.dist.bucket_cap_mb,
        gradient_as_bucket_view=args.tuned,
        **buffer_sync(not args.tuned or has_running_statistics(module)),
    )
    model.train()  # as the product does: transformers' from_pretrained returns a model in eval mode
    if args.tuned:
        optimizer = build_optimizer(model.module, cfg)
    else:  # torch's defaults: on CPU, the for-loop implementation
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.train.peak_lr, weight_decay=cfg.train.weight_decay
        )

    stamps: list[float] = []
    phases: list[tuple[float, float, float]] = []  # data, forward_backward, optimizer (the product's names)
    epoch = 0
    last = time.perf_counter()
    while len(stamps) < cfg.train.max_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            fetched = time.perf_counter()
            optimizer.zero_grad()
            start, end = model(**model_inputs(batch, device))
            count = start.shape[0]
            loss = (
                family.span_loss(
                    start,
                    end,
                    batch["start_positions"].to(device),
                    batch["end_positions"].to(device),
                    torch.ones(count, device=device),
                )
                / count
            )
            loss.backward()
            computed = time.perf_counter()
            optimizer.step()
            stamps.append(time.time())  # the same clock as the product's `ts`
            phases.append((fetched - last, computed - fetched, time.perf_counter() - computed))
            last = time.perf_counter()
            if len(stamps) == cfg.train.max_steps:
                break
        epoch += 1
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        out = {"world_size": world, "per_rank_batch": per_rank, "ts": stamps, "phases": phases}
        args.out.write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())
