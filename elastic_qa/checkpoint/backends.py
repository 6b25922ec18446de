"""Opening a checkpoint store: `open_store(url)` picks the backend the storage at `url` needs.

The backends share one abstract base (`CheckpointStore`, store.py) and differ only in how a checkpoint is
committed: local storage publishes by one atomic rename (`RenameCommitStore`, store_rename.py), stores
without rename (memory://, object stores) write the manifest last (`ManifestLastStore`, store_manifest.py).
This module is the only one that knows both, so store.py imports neither.
"""

from __future__ import annotations

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastic_qa.checkpoint.store import CheckpointStore
from elastic_qa.checkpoint.store_manifest import ManifestLastStore
from elastic_qa.checkpoint.store_rename import RenameCommitStore


def store_class(fs: fsspec.AbstractFileSystem) -> type[CheckpointStore]:
    """The backend for `fs`: atomic rename on local disk, manifest-last everywhere else."""
    return RenameCommitStore if isinstance(fs, LocalFileSystem) else ManifestLastStore


def open_store(url: str, fs: fsspec.AbstractFileSystem | None = None) -> CheckpointStore:
    """The checkpoint store at `url` (a local path or any fsspec URL; `fs`, when given, is the file system
    it lives on), with the backend its storage needs."""
    if fs is None:
        fs, _ = fsspec.core.url_to_fs(url)
    return store_class(fs)(url, fs)
