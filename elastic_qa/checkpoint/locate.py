"""Where a user's checkpoint path points: a run directory, its checkpoints directory, or one step directory.

Every command that takes a checkpoint (`ckpt list|verify|show`, `eval`, `ask`, `export`, the launcher's
resume check) goes through `resolve_checkpoint_path`, so the same three spellings work everywhere:

    runs/job                           the run directory (its checkpoint.dir, from its config.yaml)
    runs/job/checkpoints               the checkpoints directory
    runs/job/checkpoints/step-00000420 one checkpoint

A path that holds none of these is bad input (CheckpointError: one sentence, exit code 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.best import best_record
from elastic_qa.checkpoint.manager import Checkpointer, LoadedCheckpoint
from elastic_qa.checkpoint.payload import TRAINER_FILE
from elastic_qa.checkpoint.store import MANIFEST, CheckpointError, CheckpointStore, step_dir_name, step_of
from elastic_qa.config import CheckpointConfig

RUN_CONFIG = "config.yaml"  # the resolved config a run directory holds
FORMS = "a run directory, its checkpoints directory or one step-N directory"


@dataclass(frozen=True)
class CheckpointLocation:
    """A resolved checkpoint path: the checkpoints directory, and the one step directory if one was named."""

    given: str
    directory: str  # the checkpoints directory (a path or URL)
    step_path: str | None = None  # one step directory (in the store's own spelling), or None: all of them
    step: int | None = None

    def store(self) -> CheckpointStore:
        return open_store(self.directory)

    def checkpointer(self) -> Checkpointer:
        return Checkpointer(CheckpointConfig(), self.store())


def resolve_checkpoint_path(path: str, must_hold_checkpoints: bool = True) -> CheckpointLocation:
    """Resolve a run directory, a checkpoints directory or one step directory (a path or fsspec URL).

    CheckpointError (bad input) when the path does not exist, or, with `must_hold_checkpoints`, when it
    holds no checkpoint directory at all (no step-N entry, committed or not).
    """
    given = path
    probe = open_store(path.rstrip("/") or "/")
    fs, root = probe.fs, probe.root
    if not fs.exists(root):
        raise CheckpointError(f"{given} does not exist (expected {FORMS})")
    if not fs.isdir(root):
        raise CheckpointError(f"{given} is not a directory (expected {FORMS})")
    parent, _, name = root.rpartition("/")
    if fs.exists(f"{root}/{MANIFEST}") or step_of(name) is not None:  # one checkpoint (maybe damaged)
        return CheckpointLocation(given, _url(probe, parent or "/"), root, step_of(name))
    if probe.list_steps(committed_only=False):
        return CheckpointLocation(given, path.rstrip("/") or "/")
    directory = _run_checkpoint_dir(probe)
    if directory is not None:
        inner = open_store(directory)
        if inner.list_steps(committed_only=False) or not must_hold_checkpoints:
            return CheckpointLocation(given, directory)
        raise CheckpointError(f"{given}: the run has no checkpoints yet (in {inner.url})")
    if not must_hold_checkpoints:
        return CheckpointLocation(given, path.rstrip("/") or "/")
    raise CheckpointError(f"{given}: no checkpoints here (expected {FORMS})")


def load_checkpoint(path: str) -> LoadedCheckpoint:
    """The checkpoint a user named: that step directory, or the newest valid one of a run or checkpoints
    directory (verified, loaded with weights_only). CheckpointError when there is none."""
    location = resolve_checkpoint_path(path)
    checkpointer = location.checkpointer()
    if location.step_path is not None:
        return checkpointer.load_step(location.step_path, location.step or 0)
    loaded = checkpointer.load_newest()
    if loaded is None:
        raise CheckpointError(f"{path}: no valid checkpoint (see `elastic-qa ckpt verify {path}`)")
    return loaded


def load_best_checkpoint(path: str) -> LoadedCheckpoint:
    """The best checkpoint of a run or checkpoints directory (verified, loaded with weights_only);
    CheckpointError when the run has none or it does not verify."""
    location = resolve_checkpoint_path(path)
    if location.step_path is not None:
        raise CheckpointError(f"{path}: --best takes a run or checkpoints directory, not one checkpoint")
    checkpointer = location.checkpointer()
    store = checkpointer.store
    best = best_record(store)
    if best is None:
        raise CheckpointError(
            f"{path}: the run has no best checkpoint (trained without checkpoint.keep_best, or not evaluated "
            "since it was set)"
        )
    step = int(best["step"])
    try:
        return checkpointer.load_step(store.path(step_dir_name(step)), step)
    except (OSError, ValueError, KeyError, CheckpointError) as err:
        raise CheckpointError(f"{path}: the best checkpoint (step {step}) is not valid: {err}") from None


def newest_saved_trainer(checkpoint_dir: str) -> tuple[int, dict[str, Any]] | None:
    """(step, trainer.pt's contents) of the newest checkpoint whose trainer.pt verifies, loads and holds
    a config; None when there is none."""
    store = open_store(checkpoint_dir)
    try:
        infos = store.list_steps()
    except OSError:  # unreadable: the worker's own restore says so, with the reason
        return None
    for info in reversed(infos):
        try:
            manifest = store.read_manifest(info.path)
            trainer = store.load_file(info.path, manifest, TRAINER_FILE)
        except (CheckpointError, OSError, ValueError, KeyError):
            continue  # the worker's own restore rejects (and quarantines) it and tries the next
        if isinstance(trainer, dict) and isinstance(trainer.get("config"), dict):
            return info.step, trainer
    return None


def _url(store: CheckpointStore, path: str) -> str:
    """`path` (in the store's own spelling) as a URL for a new store on the same file system."""
    return path if store.fs.protocol in ("file", ("file", "local")) else store.fs.unstrip_protocol(path)


def _run_checkpoint_dir(run: CheckpointStore) -> str | None:
    """The checkpoints directory of run directory `run`: checkpoint.dir from its config.yaml, else
    <run>/checkpoints; None when `run` does not look like a run directory."""
    config = f"{run.root}/{RUN_CONFIG}"
    if run.fs.exists(config):
        try:
            with run.fs.open(config, "rb") as handle:
                tree = yaml.safe_load(handle.read(2**20)) or {}
            configured = tree.get("checkpoint", {}).get("dir", "")
        except (OSError, ValueError, AttributeError, yaml.YAMLError):
            configured = ""
        if isinstance(configured, str) and configured:
            return configured
        return _url(run, f"{run.root}/checkpoints")
    if run.fs.isdir(f"{run.root}/checkpoints"):
        return _url(run, f"{run.root}/checkpoints")
    return None
