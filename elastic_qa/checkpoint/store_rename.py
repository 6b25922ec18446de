"""Commit by atomic rename: the protocol for local storage (a POSIX file system under the process).

A commit writes its files and then its manifest into a staging directory private to the writer,
`<root>/.tmp-a<attempt>-step-00000420-<token>`, fsyncing each, and publishes it with one `os.rename` onto
`<root>/step-00000420`, then fsyncs the checkpoint directory so the rename itself survives a power cut.

Why it is atomic: rename(2) of a directory is one act of the file system. Before it the step directory does
not exist (the staging name is never listed); after it the directory holds every file and the manifest.
Renaming onto an existing, non-empty step directory fails instead of merging, so a checkpoint standing
there is never half-overwritten: `_standing` decides whether it stays (this copy is dropped) or is moved
to rejected/ (again by rename) before this one is published.

Deleting renames the step directory aside first (`.tmp-step-...-deleted-<token>`), so a crash mid-delete
leaves staging, never a step directory without a manifest. `clean_staging` removes the staging of older
attempts (fenced: they can never publish) and what interrupted deletes left.

This store reads the local file system directly, never through a symlink: lstat before open, O_NOFOLLOW,
and the opened file must be the one looked at.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import uuid
from typing import BinaryIO

from elastic_qa.checkpoint.errors import CheckpointError
from elastic_qa.checkpoint.store import (
    _TMP_PREFIX,
    MANIFEST,
    CheckpointStore,
    Staging,
    staging_dir_name,
    step_dir_name,
)

# Staging of attempt N (`.tmp-a00000007-step-00000420-<token>`), a directory set aside by an interrupted
# delete (`.tmp-step-00000420-deleted-<token>`), and staging named before attempts were part of the name.
_STAGING = re.compile(
    r"^\.tmp-(?:a(?P<attempt>\d{8,})-step-\d{8,}-[0-9a-f]{8}"
    r"|step-\d{8,}-deleted-[0-9a-f]{8}"
    r"|step-\d{8,}-[0-9a-f]{8})$"
)


class RenameCommitStore(CheckpointStore):
    """A checkpoint directory on local disk: stage privately, publish by one atomic rename."""

    def display(self, path: str) -> str:
        return path

    # ---- looking and opening ------------------------------------------------------------------------
    def _kind(self, path: str) -> str:
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return "gone"
        if stat.S_ISLNK(mode):
            return "link"
        return "directory" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"

    def _is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def _open_plain(self, path: str) -> tuple[BinaryIO, int]:
        before = os.lstat(path)
        if not stat.S_ISREG(before.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(before.st_mode) else "not a regular file"
            raise ValueError(f"{path.rsplit('/', 1)[-1]} is {kind}")
        # O_NOFOLLOW and O_NONBLOCK: should it be swapped for a link or a FIFO after the look, the open
        # fails or returns at once instead of following or blocking; fstat then catches the swap.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            after = os.fstat(fd)
            same = (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
            if not stat.S_ISREG(after.st_mode) or not same:
                raise ValueError(f"{path.rsplit('/', 1)[-1]} was replaced while being opened")
            return os.fdopen(fd, "rb"), after.st_size
        except BaseException:
            os.close(fd)
            raise

    # ---- committing ---------------------------------------------------------------------------------
    def _staging(self, step: int, attempt: int, token: str) -> Staging:
        directory = self.path(staging_dir_name(attempt, step, token))
        return Staging(step, attempt, self.path(step_dir_name(step)), directory, token)

    def _file_name(self, logical: str, token: str) -> str:
        return logical  # the staging directory is private: plain names cannot collide

    def _write(self, path: str, data: bytes) -> None:
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    def _publish(self, staging: Staging, body: bytes) -> str:
        self._write(f"{staging.directory}/{MANIFEST}", body)
        final = staging.final
        if os.path.islink(final):
            raise CheckpointError(f"{final} is a symbolic link, not a checkpoint of this store")
        for _ in range(3):  # a peer may publish or move the same step between our look and our rename
            try:
                os.rename(staging.directory, final)
                break
            except OSError:
                if not os.path.lexists(final):
                    continue
                if self._standing(final, staging.attempt) == "keep":
                    self._remove_tree_quietly(staging.directory)
                    return final
                self._set_aside(final, f"superseded by attempt {staging.attempt}")
        else:
            raise CheckpointError(f"could not publish {staging.directory} as {final}: it keeps changing")
        directory = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself must survive a power cut
        finally:
            os.close(directory)
        return final

    def _set_aside(self, final: str, reason: str) -> None:
        """Clear a step directory for a new commit: quarantine a checkpoint, delete mere remains."""
        try:
            self.read_manifest(final)
        except FileNotFoundError:
            self._remove_tree_quietly(final)
            return
        except (OSError, ValueError, TypeError):
            pass
        with contextlib.suppress(FileNotFoundError):  # a peer may have moved it first
            self.quarantine(final, reason)

    def _discard(self, staging: Staging) -> None:
        self._remove_tree_quietly(staging.directory)  # private to this writer: all of it is ours

    # ---- moving and removing ------------------------------------------------------------------------
    def _move(self, path: str, target: str) -> None:
        os.rename(path, target)

    def _detach(self, path: str) -> str:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        aside = self.path(f"{_TMP_PREFIX}{name}-deleted-{uuid.uuid4().hex[:8]}")
        os.rename(path, aside)
        if self._kind(aside) != "directory":  # swapped for a link between the look and the rename
            with contextlib.suppress(OSError):
                os.rename(aside, path)
            raise CheckpointError(f"{path} changed into a {self._kind(path)} while being removed")
        return aside

    def clean_staging(self, attempt: int) -> list[str]:
        """Remove what writers of attempts older than `attempt` left in flight: their staging directories
        (they can never commit: fencing) and directories set aside by an interrupted delete.

        Only entries named exactly as this module names them, and only real directories (never a link) are
        touched: anything else in the checkpoint directory is not ours to delete.
        """
        removed: list[str] = []
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return removed
        for name in names:
            match = _STAGING.match(name)
            if not match or (match.group("attempt") is not None and int(match.group("attempt")) >= attempt):
                continue
            path = os.path.join(self.root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                self._remove_tree_quietly(path)
                removed.append(path)
        return removed
