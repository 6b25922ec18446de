"""Commit by writing the manifest last: the protocol for stores without rename (memory://, object stores).

Object stores have no directories to rename and no atomic rename of many objects, but writing one object
is atomic: readers see the old object or the new one, never a mix. So a commit writes its files straight
into `<root>/step-00000420/`, under names unique to the writer (`model.<token>.pt`: two writers of one
step never overwrite each other's files), and then `manifest.json`, created exclusively where the store can
(`pipe_file(mode="create")`; older fsspec: look, then write).

Why it is atomic: a step directory counts as a checkpoint only once it holds a manifest, and the manifest
is one object naming every file by size and sha256. Before it lands nothing is committed (files without a
manifest are never read and are left alone by pruning); after it the checkpoint is complete, since every
file it names was written before it.

A second writer finds the manifest there and asks `_standing`: the checkpoint stays (this writer removes
its own files), or it is superseded: its manifest is copied to rejected/, overwritten by this writer's (one
atomic object write), and the files only the old manifest named are deleted. A failed commit removes its
own files, and its manifest only if the bytes there are its own. There is no staging to clean.
"""

from __future__ import annotations

import contextlib
import time
from typing import BinaryIO

from elastic_qa.checkpoint.confined import REJECTED_DIR, confined
from elastic_qa.checkpoint.errors import CheckpointError
from elastic_qa.checkpoint.store import (
    MANIFEST,
    CheckpointStore,
    Staging,
    is_plain_name,
    step_dir_name,
)


class ManifestLastStore(CheckpointStore):
    """A checkpoint directory on a store without rename: writer-unique file names, the manifest last."""

    # ---- looking and opening ------------------------------------------------------------------------
    def _kind(self, path: str) -> str:
        try:
            kind = self.fs.info(path).get("type")
        except FileNotFoundError:
            return "gone"
        return kind if kind in ("directory", "file") else "other"

    def _is_link(self, path: str) -> bool:
        return False  # these stores have no symbolic links

    def _open_plain(self, path: str) -> tuple[BinaryIO, int]:
        info = self.fs.info(path)
        if info.get("type") != "file" or type(info.get("size")) is not int:
            raise ValueError(f"{path.rsplit('/', 1)[-1]} is not a regular file ({info.get('type')})")
        return self.fs.open(path, "rb"), info["size"]

    # ---- committing ---------------------------------------------------------------------------------
    def _staging(self, step: int, attempt: int, token: str) -> Staging:
        final = self.path(step_dir_name(step))
        # Files go into the final directory: remove it again on failure when this writer created it and
        # it is left empty (never recursively: another writer may be writing there).
        return Staging(step, attempt, final, final, token, created=not self.fs.exists(final))

    def _file_name(self, logical: str, token: str) -> str:
        return f"{logical.rsplit('.', 1)[0]}.{token}.pt"

    def _write(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def _publish(self, staging: Staging, body: bytes) -> str:
        final, manifest_path = staging.final, f"{staging.final}/{MANIFEST}"
        staging.manifest = body  # from here on a failure may leave part of our manifest behind
        try:
            self._create(manifest_path, body)
            return final
        except FileExistsError:
            pass
        if self._standing(final, staging.attempt) == "keep":
            self._remove_quietly(staging.written)
            return final
        # Supersede: keep the old manifest for forensics, overwrite it with ours (one object write is
        # atomic on object stores), then delete the files only the old manifest referenced.
        try:
            old = self.read_manifest(final)
        except (OSError, ValueError, TypeError):
            old = {"files": {}}
        self._keep_rejected_manifest(final, f"superseded by attempt {staging.attempt}")
        self.fs.pipe_file(manifest_path, body)
        ours = {path.rsplit("/", 1)[-1] for path in staging.written}
        stale = [
            f"{final}/{entry['name']}"
            for entry in old.get("files", {}).values()
            if isinstance(entry, dict) and is_plain_name(entry.get("name")) and entry["name"] not in ours
        ]
        self._remove_quietly(stale)
        return final

    def _create(self, path: str, data: bytes) -> None:
        """Write a file that must not exist yet (FileExistsError): atomically where the store can."""
        try:
            self.fs.pipe_file(path, data, mode="create")
        except TypeError:  # fsspec before 2024.12: pipe_file has no mode; check, then write
            if self.fs.exists(path):
                raise FileExistsError(path) from None
            self.fs.pipe_file(path, data)

    def _keep_rejected_manifest(self, final: str, reason: str) -> None:
        name = final.rstrip("/").rsplit("/", 1)[-1]
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        with contextlib.suppress(OSError, CheckpointError):  # kept only inside the store, else not kept
            target = f"{confined(self.fs, self.root, REJECTED_DIR)}/{name}.{stamp}"
            self.fs.makedirs(target, exist_ok=True)
            self.fs.pipe_file(f"{target}/{MANIFEST}", self.fs.cat_file(f"{final}/{MANIFEST}"))
            self._note_rejected(target, name, reason)

    def _discard(self, staging: Staging) -> None:
        if staging.manifest is not None:  # a manifest cut short would make the step look committed
            self._remove_own_manifest(f"{staging.final}/{MANIFEST}", staging.manifest)
        self._remove_quietly(staging.written)
        if staging.created:
            self._remove_quietly([staging.directory])  # non-recursive: fails unless empty

    def _remove_own_manifest(self, path: str, body: bytes) -> None:
        """Remove what this writer's failed manifest write left; another writer's manifest differs."""
        with contextlib.suppress(OSError):
            if body.startswith(self.fs.cat_file(path)):
                self.fs.rm(path)

    # ---- moving and removing ------------------------------------------------------------------------
    def _move(self, path: str, target: str) -> None:
        self.fs.mv(path, target, recursive=True)

    def _detach(self, path: str) -> str:
        return path  # nothing to rename aside: deleting the manifest first is what un-commits it

    def clean_staging(self, attempt: int) -> list[str]:
        """Nothing to clean: there is no staging. Files a killed writer left in a step directory are named
        by no manifest, so they are never read; they go with the directory when that step is removed."""
        return []
