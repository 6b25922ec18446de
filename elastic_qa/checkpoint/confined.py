"""The checkpoint directory's own subdirectories: used only when they are real directories inside it.

The trainer writes and deletes files in `attempts/` (fencing.py), `holders/` (session/hold.py) and
`rejected/` (store.py's quarantine). On local storage any of them may be a symbolic link to another
directory, and following it wrote claims and quarantined steps there and deleted every `*.json` there that
was not a hold record. So each is used only as a real directory (or created as one); anything else is
refused with one line before anything is written (the session checks them all at restore, and every
writer again at its write). Object stores and memory:// have no links: nothing to check there.

Standard library and fsspec only: the launcher checks the run's hold without importing torch.
"""

from __future__ import annotations

import os
import stat

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastic_qa.checkpoint.errors import CheckpointError

ATTEMPTS_DIR = "attempts"
HOLDERS_DIR = "holders"
REJECTED_DIR = "rejected"
SUBDIRS = (ATTEMPTS_DIR, HOLDERS_DIR, REJECTED_DIR)


def confined(fs: fsspec.AbstractFileSystem, root: str, name: str) -> str:
    """The path of subdirectory `name` of the checkpoint directory `root` (stripped of its protocol);
    CheckpointError, naming it, when it is there but not a real directory (a symlink, a file)."""
    path = f"{root.rstrip('/')}/{name}"
    if not isinstance(fs, LocalFileSystem):
        return path
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return path  # created as a real directory by its writer
    if stat.S_ISDIR(mode):
        return path
    what = f"a symbolic link to {os.readlink(path)}" if stat.S_ISLNK(mode) else "not a directory"
    raise CheckpointError(
        f"{path} is {what}: the trainer writes and deletes files there, so only a real directory inside "
        "the checkpoint directory is used; remove it (a new one is made)"
    )
