"""Helpers shared by the checkpoint tests: a small training state; look at and damage what a store holds."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from elastic_qa.checkpoint.payload import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE, rng_state, versions
from elastic_qa.checkpoint.store import MANIFEST, CheckpointStore, serialize, step_dir_name


def snapshot(store: CheckpointStore, path: str) -> dict[str, bytes]:
    """Every file under `path` with its bytes."""
    store.fs.invalidate_cache()
    return {name: store.fs.cat_file(name) for name in sorted(store.fs.find(path))}


def entries(store: CheckpointStore) -> list[str]:
    """Names directly under the store root (step dirs, temporary dirs, attempts/)."""
    store.fs.invalidate_cache()
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in store.fs.ls(store.root, detail=False))
    except FileNotFoundError:
        return []


def file_path(store: CheckpointStore, step: int, logical: str) -> str:
    """The stored path of one logical file of a committed checkpoint (names differ per store)."""
    directory = store.path(step_dir_name(step))
    manifest = store.read_manifest(directory)
    return f"{directory}/{manifest['files'][logical]['name']}"


def truncate(store: CheckpointStore, path: str) -> None:
    data = store.fs.cat_file(path)
    store.fs.pipe_file(path, data[: len(data) // 2])


def flip_byte(store: CheckpointStore, path: str) -> None:
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    store.fs.pipe_file(path, bytes(data))


def remove_manifest(store: CheckpointStore, step: int) -> None:
    store.fs.rm(f"{store.path(step_dir_name(step))}/{MANIFEST}")


def garble_manifest(store: CheckpointStore, step: int) -> None:
    store.fs.pipe_file(f"{store.path(step_dir_name(step))}/{MANIFEST}", b"\x00{not json\xff")


def remove_file(store: CheckpointStore, step: int, logical: str) -> None:
    store.fs.rm(file_path(store, step, logical))


class TouchOnUnpickle:
    """Unpickling this runs `pathlib.Path(marker).touch()`: a stand-in for arbitrary code execution."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def crafted_tensor_file(marker: str) -> bytes:
    """A torch.save file whose unpickling would create `marker` (a malicious checkpoint file)."""
    buffer = io.BytesIO()
    torch.save({"weight": torch.ones(2), "payload": TouchOnUnpickle(marker)}, buffer)
    return buffer.getvalue()


def crafted_plain_pickle(marker: str) -> bytes:
    """The same payload as a bare (non-zip) pickle: torch.load's legacy format."""
    return pickle.dumps({"payload": TouchOnUnpickle(marker)}, protocol=2)


HER = 65534  # another user of the machine (nobody); the tests run as root, so they can act as her


@contextlib.contextmanager
def lock_held(path: Path, at_most_s: float | None = None) -> Iterator[None]:
    """Another process holds the flock on `path` (created if missing) until the block ends, or for
    `at_most_s` (a writer that is slow, not stuck: what waits on it without a bound ends all the same)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, select, sys\n"
            f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT, 0o666)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            f"select.select([sys.stdin], [], [], {at_most_s!r})\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield
    finally:
        holder.kill()
        holder.wait()


def hers(path: Path, mode: int = 0o777) -> Path:
    """`path` (a directory, made if missing) as another user made it, with `mode`."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, HER, HER)
    os.chmod(path, mode)
    return path


def age(path: str, seconds: float) -> None:
    """Set a local path's mtime `seconds` into the past."""
    then = time.time() - seconds
    os.utime(path, (then, then))


# ---- a small but real training state ------------------------------------------------------------------


class Trainee:
    """A small model + AdamW + LambdaLR, trained a few steps so that every state is non-trivial."""

    def __init__(self, seed: int = 0, width: int = 16) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 2)
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + s))
        self.width = width
        self.step = 0

    def train(self, steps: int = 1) -> None:
        for _ in range(steps):
            x = torch.randn(8, self.width)
            loss = self.model(x).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1

    def state(self) -> dict[str, Any]:
        """What the trainer hands to Checkpointer.save: {file: state dict}."""
        return {
            MODEL_FILE: self.model.state_dict(),
            OPTIMIZER_FILE: self.optimizer.state_dict(),
            TRAINER_FILE: trainer_state(self.step, self.scheduler.state_dict()),
        }


def trainer_state(step: int, scheduler: dict[str, Any] | None = None, epoch: int = 1) -> dict[str, Any]:
    """The shape of elastic_qa.trainer.Trainer._trainer_state."""
    return {
        "scheduler": scheduler if scheduler is not None else {"_last_lr": [0.001], "last_epoch": step},
        "scaler": None,
        "trainer": {
            "step": step,
            "epoch": epoch,
            "samples_consumed": 64 * step,
            "global_batch_size": 64,
            "world_size": 2,
            "tokens_seen": 4096 * step,
            "attempt": 1,
        },
        "data": {"epoch": epoch, "samples_consumed": 64 * step, "num_samples": 1000, "seed": 17},
        "rng": {"0": rng_state(), "1": rng_state()},
        "config": {"run": {"name": "t"}, "train": {"peak_lr": 0.001, "max_steps": 100}},
        "versions": versions(),
    }


def manifest_fields(epoch: int = 1, world_size: int = 2, attempt: int = 1) -> dict[str, Any]:
    return {
        "epoch": epoch,
        "world_size": world_size,
        "attempt": attempt,
        "config_hash": "c0ffee" * 10,
        "versions": versions(),
    }


def small_files(step: int, size: int = 4096) -> dict[str, bytes]:
    """Serialised state files for CheckpointStore.commit (distinct contents per step)."""
    generator = torch.Generator().manual_seed(step)
    return {
        MODEL_FILE: serialize({"w": torch.randn(size // 4, generator=generator)}),
        OPTIMIZER_FILE: serialize({"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": []}),
        TRAINER_FILE: serialize(trainer_state(step)),
    }


def event_names(events: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in events]
