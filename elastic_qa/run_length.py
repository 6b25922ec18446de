"""How long a run trains: `train.max_steps`, or `train.epochs` resolved to steps once and kept.

Every step takes the next global batch of an epoch's order and the last step of an epoch takes what is
left (data/cursor.py), so an epoch is ceil(training windows / global_batch_size) steps. `train.epochs` is
resolved to that many steps per epoch at the run's first start, and the resolution is recorded in every
checkpoint (trainer.pt's "length"): a resume with the same `train.epochs` ends at the recorded step, whatever
its world size or global batch. A different `train.epochs` (or switching to `train.max_steps`) is a change
on purpose and is resolved anew, like a changed `train.max_steps`.
"""

from __future__ import annotations

import math
from typing import Any

from elastic_qa.config import TrainConfig


def steps_per_epoch(train_windows: int, global_batch_size: int) -> int:
    return math.ceil(train_windows / global_batch_size)


def end_step(train: TrainConfig, train_windows: int, recorded: Any = None) -> int:
    """The step training ends at: train.max_steps, or train.epochs in steps; `recorded` is a checkpoint's
    `length` record (length_record), whose resolution a resume with the same train.epochs keeps."""
    if not train.epochs:
        return train.max_steps
    if isinstance(recorded, dict) and recorded.get("epochs") == train.epochs:
        return int(recorded["end_step"])
    return train.epochs * steps_per_epoch(train_windows, train.global_batch_size)


def length_record(train: TrainConfig, end: int) -> dict[str, int]:
    """What a checkpoint records of the run's length: the epochs asked for (0: max_steps) and the end step."""
    return {"epochs": train.epochs, "end_step": end}


def length_text(train: TrainConfig, end: int) -> str:
    """The setting that ends the run at `end`, as errors name it: `train.max_steps=600`, or
    `train.epochs=2 (250 steps)`."""
    if train.epochs:
        return f"train.epochs={train.epochs} ({end} steps)"
    return f"train.max_steps={end}"
