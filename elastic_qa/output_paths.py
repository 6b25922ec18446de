"""Where a command may write what a user asked for (`export --out`, `eval --out`, `report --out`).

Only where it can: a path under a regular file or in a directory this user cannot write is refused before
the work (an evaluation, a report), in one line, not with a traceback once the work is done.

Never where the trainer deletes or rewrites on its own: inside a checkpoint directory (rotation prunes step
directories with everything they hold, registration cleans staging, a rejected checkpoint is moved away) or
inside a run directory's logs/. A user's export written into `checkpoints/step-00000040/` used to vanish
with that checkpoint. The path is compared after resolving symlinks and `..`, so a link or a relative
spelling cannot smuggle it in.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from elastic_qa.checkpoint.store import MANIFEST, RUN_RECORD, step_of
from elastic_qa.exits import UsageError

RUN_CONFIG = "config.yaml"  # what marks a run directory (the trainer writes it there)
ATTEMPTS_DIR = "attempts"  # the attempt registry of a checkpoint directory (checkpoint/fencing.py)


def resolved(path: Path | str) -> Path:
    """`path` absolute, with every symlink of its existing part and every `..` resolved."""
    return Path(os.path.abspath(os.path.expanduser(path))).resolve()


def _is_checkpoint_dir(directory: Path) -> bool:
    """Whether `directory` is a checkpoint directory: it holds a run record, the attempt registry, or a
    step directory with a manifest (a directory of the user's exports named by step is none of these)."""
    with contextlib.suppress(OSError):
        if (directory / RUN_RECORD).is_file() or (directory / ATTEMPTS_DIR).is_dir():
            return True
        with os.scandir(directory) as entries:
            return any(
                step_of(e.name) is not None
                and e.is_dir(follow_symlinks=False)
                and (Path(e.path) / MANIFEST).is_file()
                for e in entries
            )
    return False


def _is_step_dir(directory: Path) -> bool:
    """Whether `directory` is a checkpoint's step directory (named like one, and a checkpoint or inside a
    checkpoint directory)."""
    if step_of(directory.name) is None:
        return False
    return (directory / MANIFEST).is_file() or _is_checkpoint_dir(directory.parent)


def refuse_managed_output(out: Path | str, flag: str, checkpoint_dirs: Iterable[str] = ()) -> None:
    """UsageError (one line, exit 2) when `out` lies inside a checkpoint directory (one of
    `checkpoint_dirs`, local ones, or any directory that looks like one), a step directory, or a run
    directory's logs/: the trainer would delete it, or it would mix with what the trainer writes."""
    target = resolved(out)
    for ancestor in (target, *target.parents):
        if _is_step_dir(ancestor):
            raise UsageError(
                f"{flag} {out}: inside the checkpoint step directory {ancestor}, which rotation deletes "
                "with everything in it; choose a directory outside checkpoint.dir"
            )
        if ancestor.name == "logs" and (ancestor.parent / RUN_CONFIG).is_file():
            raise UsageError(
                f"{flag} {out}: inside the run's logs {ancestor}, which belong to the trainer; choose "
                "another directory"
            )
        if _is_checkpoint_dir(ancestor):
            raise UsageError(
                f"{flag} {out}: inside the checkpoint directory {ancestor}, whose rotation and clean-up "
                "delete what it holds; choose a directory outside it"
            )
    for directory in checkpoint_dirs:
        if "://" in directory and not directory.startswith("file://"):
            continue  # an object store: no local path of ours can lie inside it
        root = resolved(directory.removeprefix("file://"))
        if target.is_relative_to(root):
            raise UsageError(
                f"{flag} {out}: inside the checkpoint directory {root}, whose rotation deletes what it "
                "holds; choose a directory outside it"
            )


def refuse_unwritable_output(out: Path | str, flag: str, *, in_parent: bool = False) -> None:
    """UsageError (one line, exit 2) when the directory `out` cannot be created or written (`in_parent`: when
    `out`'s parent cannot, where a file or an export is made and renamed into place): the nearest part of it
    that exists is not a directory, or cannot be written into."""
    path = Path(os.path.abspath(os.path.expanduser(out)))
    start = path.parent if in_parent else path
    nearest = next(p for p in (start, *start.parents) if os.path.lexists(p))
    if not nearest.is_dir():
        raise UsageError(f"{flag} {out}: cannot be written: {nearest} is not a directory")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise UsageError(
            f"{flag} {out}: cannot be written: {nearest} is not writable (permissions, read-only)"
        )
