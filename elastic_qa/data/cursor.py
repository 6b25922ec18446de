"""The world-size-free data position: one global order per epoch and one global cursor.

Every step takes the next `global_batch_size` samples of the epoch's permutation and splits them over the
ranks present. The position is just (epoch, samples consumed in the epoch), so a group of any size resumes
at the same sample, each sample is trained on exactly once per epoch across any sequence of restarts, and
seeking costs one permutation, whatever the position (no iterating over skipped batches).
The last step of an epoch takes what is left (fewer than a global batch); the loss is normalised by the
real global sample count, so that step is an exact, smaller batch rather than a biased one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def rank_slice(batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of a rank's share of a batch: sizes differ by at most one, lower ranks first."""
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass
class GlobalBatch:
    """The indices of one optimizer step's whole global batch, in order (each rank takes its `rank_slice`)."""

    step: int  # the optimizer step this batch is for (from 1)
    epoch: int
    global_indices: list[int]  # the whole global batch, in order
    global_count: int


class GlobalCursor:
    """Stateful: (epoch, samples_consumed) after the last completed optimizer step."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError("cannot train on an empty dataset")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.epoch = 0
        self.samples_consumed = 0

    def batches(self, first_step: int) -> GlobalBatchIterator:
        """Global batches from the current position on; does not move the cursor."""
        return GlobalBatchIterator(self, first_step)

    def advance_to(self, epoch: int, global_count: int) -> None:
        """Record that a global batch of `epoch` was fully trained on (call after the optimizer step)."""
        if epoch != self.epoch:
            self.epoch, self.samples_consumed = epoch, 0
        self.samples_consumed += global_count
        if self.samples_consumed >= self.num_samples:
            self.epoch, self.samples_consumed = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "samples_consumed": self.samples_consumed,
            "num_samples": self.num_samples,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"checkpoint was trained on {state['num_samples']} samples, this data has {self.num_samples}"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.samples_consumed = int(state["samples_consumed"])


class GlobalBatchIterator:
    """Walks the global order from a cursor position; picklable, so loader workers can run it."""

    def __init__(self, cursor: GlobalCursor, first_step: int) -> None:
        self.num_samples = cursor.num_samples
        self.batch_size = cursor.global_batch_size
        self.seed = cursor.seed
        self.epoch = cursor.epoch
        self.position = cursor.samples_consumed
        self.step = first_step
        self._order = epoch_order(self.num_samples, self.seed, self.epoch)

    def __iter__(self) -> GlobalBatchIterator:
        return self

    def __next__(self) -> GlobalBatch:
        if self.position >= self.num_samples:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = epoch_order(self.num_samples, self.seed, self.epoch)
        stop = min(self.position + self.batch_size, self.num_samples)
        indices = self._order[self.position : stop].tolist()
        batch = GlobalBatch(self.step, self.epoch, indices, len(indices))
        self.position, self.step = stop, self.step + 1
        return batch
