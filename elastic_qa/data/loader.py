"""This rank's share of each global batch: a StatefulDataLoader with workers, or built inline without.

The sampler yields one key per optimizer step (the rank's sample indices for that step) and the dataset
turns a key into a ready batch by fancy-indexing the memory-mapped columns, so loader workers (when
data.num_workers is set) do all the gathering and the training process receives tensors. The loader's own
position is deliberately *not* what a checkpoint records: workers prefetch ahead, so the resumable position
is the trainer's GlobalCursor after the last completed optimizer step, and a resumed loader is simply built
at that cursor.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from elastic_qa.data.cursor import GlobalCursor, rank_slice
from elastic_qa.data.features import Features

# torchdata 0.11 calls a deprecated torch API on every loader start; the warning is not actionable.
warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)


@dataclass(frozen=True)
class RankBatchKey:
    step: int
    epoch: int
    global_count: int  # samples in the whole global batch (the loss normaliser)
    global_tokens: int  # non-pad tokens in the whole global batch (tokens seen, without a collective)
    indices: tuple[int, ...]  # this rank's samples
    empty: bool  # this rank has no sample this step: it trains on one sample with weight 0


class RankBatchSampler:
    """For each step from the cursor on: this rank's contiguous share of the global batch."""

    def __init__(
        self,
        cursor: GlobalCursor,
        first_step: int,
        last_step: int,
        rank: int,
        world_size: int,
        lengths: np.ndarray,
    ):
        self.cursor = copy.copy(cursor)  # a snapshot: the trainer advances its own cursor meanwhile
        self.first_step, self.last_step = first_step, last_step
        self.rank, self.world_size = rank, world_size
        self.lengths = lengths

    def __len__(self) -> int:
        return max(0, self.last_step - self.first_step + 1)

    def __iter__(self):
        batches = itertools.islice(self.cursor.batches(self.first_step), len(self))
        for batch in batches:
            start, stop = rank_slice(batch.global_count, self.world_size, self.rank)
            share = tuple(batch.global_indices[start:stop])
            empty = not share
            global_tokens = int(self.lengths[batch.global_indices].sum())
            yield RankBatchKey(
                batch.step,
                batch.epoch,
                batch.global_count,
                global_tokens,
                share or (batch.global_indices[0],),
                empty,
            )


@dataclass(frozen=True)
class StepBatch:
    """This rank's share of one optimizer step: its tensors and where in the run it is.

    Built in loader workers and sent to the training process, so it pickles; `pin_memory` is what the
    loader's pinning thread calls on an object of its own type.
    """

    tensors: dict[str, torch.Tensor]  # the model's inputs, the targets (collate) and "weights" (0: padding)
    step: int
    epoch: int
    global_count: int  # samples in the whole global batch (the loss normaliser)
    global_tokens: int  # non-pad tokens in the whole global batch
    indices: list[int]  # this rank's samples ([] for an empty share)

    @property
    def rows(self) -> int:
        """Windows in this share (1 for an empty share: one padding window of weight 0)."""
        return self.tensors["input_ids"].shape[0]

    def pin_memory(self) -> StepBatch:
        return replace(self, tensors={name: t.pin_memory() for name, t in self.tensors.items()})


class FeatureBatches(torch.utils.data.Dataset):
    """Key -> StepBatch; pads are trimmed to the longest sequence in the batch unless `full_width`."""

    def __init__(self, features: Features, full_width: bool = False) -> None:
        self.features = features
        self.full_width = full_width

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, key: RankBatchKey) -> StepBatch:
        return step_batch(self.features, key, full_width=self.full_width)


def collate(features: Features, rows: np.ndarray, full_width: bool = False) -> dict[str, torch.Tensor]:
    """Windows `rows` as a batch under the transformers names (the model's inputs, see models.MODEL_INPUTS):
    `attention_mask` is 1 for real tokens and 0 for padding, `token_type_ids` the cached `segment_ids`.
    The batch is trimmed to its longest window, or keeps every cached position with `full_width` (a family
    whose loss reads padding: see models.ModelFamily.full_width).
    """
    ids = features.input_ids[rows]
    lengths = np.asarray(features.lengths[rows])
    width = ids.shape[1] if full_width else int(lengths.max())
    real = np.arange(width)[None, :] < lengths[:, None]  # padding follows the real tokens
    return {
        "input_ids": torch.from_numpy(np.ascontiguousarray(ids[:, :width])).long(),
        "attention_mask": torch.from_numpy(real).long(),
        "token_type_ids": torch.from_numpy(np.ascontiguousarray(features.segment_ids[rows, :width])).long(),
        "start_positions": torch.from_numpy(features.start_positions[rows].astype(np.int64)),
        "end_positions": torch.from_numpy(features.end_positions[rows].astype(np.int64)),
    }


def step_batch(features: Features, key: RankBatchKey, full_width: bool = False) -> StepBatch:
    """The batch of a sampler key: its windows (collate), their loss weights and the step's bookkeeping."""
    tensors = collate(features, np.asarray(key.indices), full_width)
    tensors["weights"] = torch.full((len(key.indices),), 0.0 if key.empty else 1.0)
    indices = [] if key.empty else list(key.indices)
    return StepBatch(tensors, key.step, key.epoch, key.global_count, key.global_tokens, indices)


def _identity(batch: Any) -> Any:
    return batch


def build_train_loader(
    features: Features,
    cursor: GlobalCursor,
    first_step: int,
    last_step: int,
    rank: int,
    world_size: int,
    num_workers: int,
    pin_memory: bool = False,
    full_width: bool = False,
) -> StatefulDataLoader | InlineBatches:
    """This rank's batches for steps first_step..last_step: built in `num_workers` loader processes, or in
    this one (0: `InlineBatches`, the same batches without a DataLoader's per-batch bookkeeping)."""
    lengths = np.asarray(features.lengths)  # the cached column: no pass over the tokens at start-up
    sampler = RankBatchSampler(cursor, first_step, last_step, rank, world_size, lengths)
    if not num_workers:
        return InlineBatches(FeatureBatches(features, full_width), sampler, pin_memory)
    return StatefulDataLoader(
        FeatureBatches(features, full_width),
        batch_size=None,  # the sampler's keys are whole batches
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=_identity,
        pin_memory=pin_memory,
        prefetch_factor=4,
        persistent_workers=False,
        multiprocessing_context="fork",
    )


class InlineBatches:
    """The batches of `sampler`'s keys, built in the training process as it asks for them: what a
    DataLoader without workers yields, without its per-batch bookkeeping (a loader state the checkpoint
    does not use, the fetcher, the collate call), measured in docs/benchmarks.md ("piece by piece"): more
    inside training than alone, where the loop's Python runs on caches the step's compute has evicted."""

    def __init__(self, dataset: FeatureBatches, sampler: RankBatchSampler, pin_memory: bool) -> None:
        self.dataset, self.sampler, self.pin_memory = dataset, sampler, pin_memory

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[StepBatch]:
        for key in self.sampler:
            batch = self.dataset[key]
            yield batch.pin_memory() if self.pin_memory else batch
