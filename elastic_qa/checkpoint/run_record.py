"""Which run a checkpoint directory belongs to, so that one run never resumes, extends or prunes another's.

`<checkpoint.dir>/run.json` (RUN_RECORD) is written once, when the first start of a run registers:

    {"format": 1, "run": "<uuid>", "run_dir": "<run.dir, resolved>", "job": "<torchrun run id>",
     "host": "<hostname>", "created": <unix time>}

and every checkpoint's manifest carries `"run": "<uuid>"`. A start belongs to the recorded run when
(`belongs`):

- its run.dir, resolved (symlinks, `..`), is the recorded one: the run restarted (`make run` twice, a job
  whose agents all died started again), on this host or on another sharing that path;
- or the checkpoint directory, resolved, is `<its run.dir>/checkpoints` (the default, resolved): the run's
  own directory, moved or copied as a whole;
- or it is part of the torchrun job (TORCHELASTIC_RUN_ID) that created the record or wrote one of the run's
  checkpoints: a regroup, or hosts that share one checkpoint.dir URL under run.dir paths of their own
  (which need one `--rdzv-id` anyway to form a job).

Anything else, a new run.dir whose checkpoint.dir is (or links to) another run's, is refused before
anything is written; `checkpoint.resume_from` starts a run from another's state instead. A checkpoint
directory without a record (written before records existed, or never registered) is adopted by the first
start that registers: its checkpoints stay resumable.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeGuard

from fsspec.implementations.local import LocalFileSystem

from elastic_qa.checkpoint.store import MAX_MANIFEST_BYTES, RUN_RECORD, CheckpointStore

RECORD_FORMAT = 1


@dataclass(frozen=True)
class RunRecord:
    run: str  # a uuid, also in every checkpoint's manifest
    run_dir: str  # the run.dir (resolved) the run was created for
    job: str  # the torchrun run id (or single-<id>) of the start that created it
    host: str
    created: float
    format: int = RECORD_FORMAT


def is_run_id(text: object) -> TypeGuard[str]:
    return isinstance(text, str) and len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def new_record(run: str, run_dir: str, job: str) -> RunRecord:
    return RunRecord(
        run or uuid.uuid4().hex, resolved_run_dir(run_dir), job, socket.gethostname(), time.time()
    )


def resolved_run_dir(run_dir: str) -> str:
    return str(Path(os.path.abspath(os.path.expanduser(run_dir))).resolve())


def read_record(store: CheckpointStore) -> RunRecord | None:
    """The store's run record; None when there is none. ValueError when it is not one (says why)."""
    path = store.path(RUN_RECORD)
    try:
        handle, size = store._open_plain(path)  # a plain file only: never through a symlink
    except FileNotFoundError:
        return None
    with handle:
        if size > MAX_MANIFEST_BYTES:
            raise ValueError(f"{store.display(path)} is {size} bytes: not a run record")
        data = handle.read(MAX_MANIFEST_BYTES)
    try:
        tree = json.loads(data.decode("utf-8"))
        record = RunRecord(**{key: tree[key] for key in ("run", "run_dir", "job", "host", "created")})
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise ValueError(f"{store.display(path)} is not a run record ({type(err).__name__}: {err})") from None
    if not all(isinstance(value, str) and value for value in (record.run_dir, record.job)):
        raise ValueError(f"{store.display(path)} is not a run record (empty or non-text fields)")
    if not is_run_id(record.run):
        raise ValueError(f"{store.display(path)} is not a run record (its run is not a uuid)")
    return record


def write_record(store: CheckpointStore, record: RunRecord) -> None:
    """Write `record` unless the store has one; in one step (a rename on local storage, one object
    elsewhere), so that a reader never sees half of it."""
    path = store.path(RUN_RECORD)
    if store._kind(path) != "gone":
        return
    body = (json.dumps(asdict(record), indent=1, sort_keys=True) + "\n").encode()
    store.fs.makedirs(store.root, exist_ok=True)
    if isinstance(store.fs, LocalFileSystem):
        staging = store.path(f".{RUN_RECORD}.{uuid.uuid4().hex[:8]}")
        store.fs.pipe_file(staging, body)
        os.replace(staging, path)
    else:
        store.fs.pipe_file(path, body)


def belongs(record: RunRecord, run_dir: str, store: CheckpointStore, job: str) -> bool:
    """Whether a start with `run_dir` under torchrun job `job` is the recorded run (module docstring)."""
    here = resolved_run_dir(run_dir)
    if record.run_dir == here or is_default_store_of(store, here):
        return True
    return job == record.job or job in checkpoint_jobs(store, record.run)


def is_default_store_of(store: CheckpointStore, run_dir: str) -> bool:
    """Whether `store`, resolved, is `<run_dir>/checkpoints` (run_dir resolved)."""
    return isinstance(store.fs, LocalFileSystem) and Path(store.root).resolve() == Path(
        run_dir, "checkpoints"
    )


def other_run_dir(store: CheckpointStore, run_dir: str) -> str | None:
    """For a store without a record: the run directory whose own `checkpoints/` it is, when that is not
    `run_dir` (its parent, resolved, holds a run's config.yaml); else None."""
    if not isinstance(store.fs, LocalFileSystem):
        return None
    where = Path(store.root).resolve()
    owner = where.parent
    if where.name != "checkpoints" or not (owner / "config.yaml").is_file():
        return None
    return None if str(owner) == resolved_run_dir(run_dir) else str(owner)


def checkpoint_jobs(store: CheckpointStore, run: str) -> set[str]:
    """The torchrun run ids that wrote checkpoints of run `run` in `store` (unreadable ones skipped)."""
    jobs = set()
    for info in store.list_steps():
        try:
            manifest = store.read_manifest(info.path)
        except (OSError, ValueError):
            continue
        if manifest.get("run") == run and isinstance(manifest.get("run_id"), str):
            jobs.add(manifest["run_id"])
    return jobs


def newest_run_of_checkpoints(store: CheckpointStore) -> str:
    """The run id the newest checkpoint carries ("" when none does): a store whose record was lost
    keeps its run's identity."""
    for info in reversed(store.list_steps()):
        try:
            run = store.read_manifest(info.path).get("run")
        except (OSError, ValueError):
            continue
        if is_run_id(run):
            return run
    return ""
