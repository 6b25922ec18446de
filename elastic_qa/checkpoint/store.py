"""Checkpoint commit protocol over fsspec: write aside, manifest with sha256, publish atomically, verify.

Layout: `<root>/step-00000420/` holding the tensor files and `manifest.json` (each file's size and sha256,
step, epoch, world size, attempt, creation time, config hash, versions). A directory counts as a
checkpoint only once it holds a manifest, and only as a *valid* one once every file matches it.

- Local storage: files and manifest go into `<root>/.tmp-...` first, which is renamed to its final name
  in one atomic act. Renaming onto an existing checkpoint fails, so a second writer of the same step
  discards its copy and never touches the first.
- Stores without rename (memory://, object stores): files are written into the final directory under
  names unique to the writer, and `manifest.json` last. A second writer sees the manifest and stops; its
  own files are never referenced and are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import stat
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from elastic_qa.observe.log import get_logger

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 2**20  # a manifest lists a handful of files: anything bigger is not one of ours
_READ_CHUNK = 2**22
_SHA256 = re.compile(r"[0-9a-f]{64}")
_foreign_logged: set[str] = set()  # symlinks etc. named like step directories, warned about once each
_STEP_DIR = re.compile(r"^step-([0-9]{8,30})$")  # 30: int() of a hostile 5000-digit name would raise
_TMP_PREFIX = ".tmp-"
# Staging of attempt N (`.tmp-a00000007-step-00000420-<token>`), a directory set aside by an interrupted
# delete (`.tmp-step-00000420-deleted-<token>`), and staging named before attempts were part of the name.
_STAGING = re.compile(
    r"^\.tmp-(?:a(?P<attempt>\d{8,})-step-\d{8,}-[0-9a-f]{8}"
    r"|step-\d{8,}-deleted-[0-9a-f]{8}"
    r"|step-\d{8,}-[0-9a-f]{8})$"
)
REJECTED_DIR = "rejected"
REJECTED_NOTE = "REJECTED.json"
MANIFEST_FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message says which and why."""


class StaleWriterError(CheckpointError):
    """A newer worker group has started: this (stale) group may not commit."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a step directory name, or None: only names that step_dir_name writes (8 or more digits,
    no extra leading zeros) count, so that a step is listed, resumed and pruned under one name only."""
    match = _STEP_DIR.match(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dir_name(step) == name else None


def staging_dir_name(attempt: int, step: int, token: str) -> str:
    return f"{_TMP_PREFIX}a{attempt:08d}-{step_dir_name(step)}-{token}"


def is_plain_name(name: Any) -> bool:
    """A file name directly inside a step directory: no path separators, no parent, not the manifest."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..", MANIFEST)
        and not any(c in name for c in "/\\\0")
    )


@dataclass
class CheckpointInfo:
    step: int
    path: str  # full path of the step directory (without the protocol)
    committed: bool  # holds a manifest.json


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    manifest: dict[str, Any] | None = field(default=None)
    vanished: bool = False  # deleted while being verified (a concurrent prune): gone, not damaged


def serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class CheckpointStore:
    """One checkpoint directory tree (a local path or any fsspec URL)."""

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem | None = None) -> None:
        if fs is None:
            fs, root = fsspec.core.url_to_fs(url)
        else:
            root = fs._strip_protocol(url)
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.atomic_rename = isinstance(fs, LocalFileSystem)
        self.log = get_logger()

    # ---- naming -------------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def display(self, path: str) -> str:
        """Path as the user wrote it (with the protocol for non-local stores)."""
        if self.atomic_rename:
            return path
        return self.fs.unstrip_protocol(path)

    # ---- listing ------------------------------------------------------------------------------------
    def list_steps(self, committed_only: bool = True) -> list[CheckpointInfo]:
        """Step directories, oldest first; by default only committed ones (holding a manifest).

        Temporary directories are never listed. A step directory without a manifest is either being
        written (stores without rename) or damaged (local storage, where the manifest arrives by rename).
        Only real directories count: a symlink or a file named like a step directory is not ours (another
        run's checkpoint, say), so it is never read, resumed from or pruned; it is logged once per name.
        """
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            step = step_of(name)
            if step is None:
                continue
            path = self.path(name)
            kind = self._kind(path)
            if kind == "gone":  # removed since the listing (a concurrent prune)
                continue
            if kind != "directory":
                self._warn_foreign(path, kind)
                continue
            committed = self._kind(f"{path}/{MANIFEST}") != "gone"
            if committed or not committed_only:
                found.append(CheckpointInfo(step, path, committed))
        return sorted(found, key=lambda info: info.step)

    def exists(self, step: int) -> bool:
        """Whether checkpoint `step` is committed: a real step directory (never a link) with a manifest."""
        path = self.path(step_dir_name(step))
        return self._kind(path) == "directory" and self._kind(f"{path}/{MANIFEST}") != "gone"

    def vanished(self, info: CheckpointInfo) -> bool:
        """Whether a listed checkpoint has gone since it was listed: its directory deleted or, listed as
        committed, its manifest deleted. That is a concurrent prune (manifest first), not damage."""
        kind = self._kind(info.path)
        if kind == "gone":
            return True
        return info.committed and kind == "directory" and self._kind(f"{info.path}/{MANIFEST}") == "gone"

    def _kind(self, path: str) -> str:
        """What is at `path`, never following a symlink: directory, file, link, other (FIFO, device,
        socket) or gone."""
        if self.atomic_rename:
            try:
                mode = os.lstat(path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return "gone"
            if stat.S_ISLNK(mode):
                return "link"
            return "directory" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
        try:
            kind = self.fs.info(path).get("type")
        except FileNotFoundError:
            return "gone"
        return kind if kind in ("directory", "file") else "other"

    def _warn_foreign(self, path: str, kind: str) -> None:
        if path not in _foreign_logged:
            _foreign_logged.add(path)
            self.log.warning("checkpoint_foreign_entry", path=self.display(path), kind=kind)

    # ---- reading and verifying -----------------------------------------------------------------------
    def read_manifest(self, path: str) -> dict[str, Any]:
        """The manifest of step directory `path`: a regular file of at most MAX_MANIFEST_BYTES holding a
        JSON object with a 'files' table. FileNotFoundError when there is none; ValueError for anything
        else that is not such a manifest (a link, a FIFO, a huge or deeply nested file, garbage)."""
        if self.atomic_rename and self._kind(path) == "link":
            raise ValueError(f"{path} is a symbolic link, not a step directory of this store")
        handle, size = self._open_plain(f"{path}/{MANIFEST}")
        with handle:
            if size > MAX_MANIFEST_BYTES:
                raise ValueError(f"{MANIFEST} is {size} bytes, more than {MAX_MANIFEST_BYTES}")
            data = handle.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError(f"{MANIFEST} grew past {MAX_MANIFEST_BYTES} bytes while being read")
        try:
            manifest = json.loads(data.decode("utf-8"))
        except RecursionError:
            raise ValueError(f"{MANIFEST} nests too deeply") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("manifest has no 'files' table")
        return manifest

    def verify(self, path: str) -> Verdict:
        """Every file in the manifest present with the recorded size and sha256.

        Only regular files directly inside the step directory are read, each at most its recorded size
        (+1 byte), in chunks. A checkpoint deleted while being verified (pruned by a concurrent writer) is
        reported as `vanished`: gone, not damaged.
        """
        try:
            manifest = self.read_manifest(path)
        except FileNotFoundError:
            if self._kind(path) == "gone":
                return Verdict(False, "pruned while verifying", vanished=True)
            return Verdict(False, "manifest.json missing")
        except (OSError, ValueError) as err:
            return Verdict(False, f"manifest.json unreadable: {err}")
        entries = [entry for entry in manifest["files"].values() if isinstance(entry, dict)]
        names = [entry["name"] for entry in entries if isinstance(entry.get("name"), str)]
        if len(set(names)) != len(names):  # each file hashed once: not 1000 times one 10 GB file
            return Verdict(False, "manifest.json names a file more than once", manifest)
        for logical, entry in manifest["files"].items():
            label = self._shown(logical)
            try:
                self._read_entry(path, entry, keep=False)
            except FileNotFoundError:
                if self._replaced(path, manifest):
                    return Verdict(False, "pruned while verifying", manifest, vanished=True)
                return Verdict(False, f"{label}: file {self._shown(entry['name'])} missing", manifest)
            except ValueError as err:
                return Verdict(False, f"{label}: {err}", manifest)
            except OSError as err:
                return Verdict(False, f"{label}: unreadable ({err})", manifest)
        return Verdict(True, "", manifest)

    def load_file(self, path: str, manifest: Mapping[str, Any], logical: str) -> Any:
        """Load one tensor file with weights_only=True (never runs code from the file).

        The file is read once, with the same checks as verify (a plain file of the step directory, its
        recorded size, its sha256), and unpickled from those very bytes.
        """
        try:
            data = self._read_entry(path, manifest["files"][logical], keep=True)
        except ValueError as err:
            reason = f"changed since it was verified or refused: {err}"
            raise CheckpointError(f"{path}: {logical} {reason}") from None
        except MemoryError:
            raise CheckpointError(f"{path}: {logical} is too large to load into memory") from None
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unpickling failure means: refuse this file
            raise CheckpointError(f"{path}: {logical} refused by weights_only loading: {err}") from None

    def _read_entry(self, path: str, entry: Any, keep: bool) -> bytes:
        """Read the file of one manifest entry, checking its name, size and sha256 (ValueError says which
        is wrong; FileNotFoundError when it is missing). Returns the bytes when `keep`, else b""."""
        if not isinstance(entry, dict):
            raise ValueError("manifest entry is not a table")
        name, size, digest = entry.get("name"), entry.get("size"), entry.get("sha256")
        if not is_plain_name(name):
            raise ValueError(f"file name {name!r} is not a plain name inside the step directory")
        if type(size) is not int or size < 0:
            raise ValueError(f"manifest size {size!r} is not a byte count")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ValueError(f"manifest sha256 {digest!r} is not a sha256 digest")
        handle, actual = self._open_plain(f"{path}/{name}")
        hasher, data, read = hashlib.sha256(), b"", 0
        with handle:
            if actual != size:  # before reading: a wrong size is never read into memory
                raise ValueError(f"size {actual} != manifest {size}")
            # At most size + 1 bytes: a file that grows while being read is caught, not followed.
            if keep:  # the caller needs every byte: one read, one copy in memory
                data = handle.read(size + 1)
                read = len(data)
                hasher.update(data)
            while not keep and read <= size:  # verifying: chunk by chunk, never the whole file at once
                chunk = handle.read(min(_READ_CHUNK, size + 1 - read))
                if not chunk:
                    break
                read += len(chunk)
                hasher.update(chunk)
        if read != size:
            raise ValueError(f"size {read} != manifest {size}")
        if hasher.hexdigest() != digest:
            raise ValueError("sha256 mismatch")
        return data

    def _open_plain(self, path: str) -> tuple[BinaryIO, int]:
        """Open `path` for reading, and its size, only if it is a regular file: a symlink (which may lead
        out of the checkpoint directory), FIFO (would block), device or directory is refused (ValueError)
        before it is opened."""
        if not self.atomic_rename:
            info = self.fs.info(path)
            if info.get("type") != "file" or type(info.get("size")) is not int:
                raise ValueError(f"{path.rsplit('/', 1)[-1]} is not a regular file ({info.get('type')})")
            return self.fs.open(path, "rb"), info["size"]
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

    def _replaced(self, path: str, manifest: dict[str, Any]) -> bool:
        """Whether step directory `path` no longer holds `manifest` (deleted, or re-committed)."""
        try:
            return self.read_manifest(path) != manifest
        except FileNotFoundError:
            return True
        except (OSError, ValueError):
            return False

    @staticmethod
    def _shown(text: str) -> str:
        """A name from a manifest, fit for a one-line message (control characters escaped)."""
        return text if text.isprintable() else repr(text)

    # ---- writing ------------------------------------------------------------------------------------
    def commit(
        self,
        step: int,
        files: Mapping[str, bytes],
        manifest_fields: Mapping[str, Any],
        may_commit: Callable[[], None] = lambda: None,
        before_file: Callable[[str], None] = lambda name: None,
    ) -> str:
        """Write `files` as checkpoint `step` and return the path of the checkpoint now standing there.

        A checkpoint of the same step found in the store is judged by the attempt that wrote it (manifest
        `attempt`), never taken on trust: one of this attempt that verifies (a peer survivor wrote the same
        step) stands and this copy is dropped; one of an older attempt, or one that does not verify, is
        superseded (moved to rejected/) by this write; one of a newer attempt means this writer is stale
        (StaleWriterError). So a replay across a step always ends with its own state committed.

        `may_commit` is called just before the checkpoint becomes visible and raises to refuse (fencing).
        `before_file` is called before each file is written (fault injection: delays, storage errors).
        On any error the partial write is removed and the error propagates; nothing else is touched.
        """
        attempt = int(manifest_fields.get("attempt", 0))
        final = self.path(step_dir_name(step))
        token = uuid.uuid4().hex[:8]
        staging = self.path(staging_dir_name(attempt, step, token)) if self.atomic_rename else final
        entries = {}
        written: list[str] = []
        manifest_started = False
        # Stores without rename write into the final directory: remove it again on failure when this
        # writer created it and it is left empty (never recursively: another writer may be writing there).
        created = not self.atomic_rename and not self.fs.exists(staging)
        try:
            self.fs.makedirs(staging, exist_ok=True)
            for logical, data in files.items():
                name = logical if self.atomic_rename else f"{logical.rsplit('.', 1)[0]}.{token}.pt"
                written.append(f"{staging}/{name}")  # before writing: a failed write can leave a part
                before_file(name)
                self._write(f"{staging}/{name}", data)
                entries[logical] = {
                    "name": name,
                    "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            manifest = {
                "format": MANIFEST_FORMAT,
                "step": step,
                **manifest_fields,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "created_ts": time.time(),
                "files": entries,
            }
            body = json.dumps(manifest, indent=1, sort_keys=True).encode()
            may_commit()
            if self.atomic_rename:
                self._write(f"{staging}/{MANIFEST}", body)
                return self._publish_by_rename(staging, final, attempt)
            manifest_started = True
            return self._publish_manifest_last(final, body, written, attempt)
        except BaseException:
            if self.atomic_rename:
                self._remove_tree_quietly(staging)
            else:
                if manifest_started:  # a manifest cut short would make the step look committed
                    self._remove_own_manifest(f"{final}/{MANIFEST}", body)
                self._remove_quietly(written)
                if created:
                    self._remove_quietly([staging])  # non-recursive: fails unless empty
            raise

    def _standing(self, final: str, attempt: int) -> str:
        """What to do about a checkpoint already at `final`: 'keep' it, 'replace' it, or raise (stale)."""
        try:
            theirs = int(self.read_manifest(final).get("attempt", 0))
        except FileNotFoundError:
            return "replace"  # no manifest: not a checkpoint (the remains of an interrupted write or delete)
        except (OSError, ValueError, TypeError):
            theirs = -1  # unreadable: certainly not a checkpoint to keep
        if theirs > attempt:
            raise StaleWriterError(f"step directory {final} was committed by attempt {theirs} > {attempt}")
        if theirs == attempt and self.verify(final).ok:
            return "keep"
        return "replace"

    def _publish_by_rename(self, staging: str, final: str, attempt: int) -> str:
        if os.path.islink(final):
            raise CheckpointError(f"{final} is a symbolic link, not a checkpoint of this store")
        for _ in range(3):  # a peer may publish or move the same step between our look and our rename
            try:
                os.rename(staging, final)
                break
            except OSError:
                if not os.path.lexists(final):
                    continue
                if self._standing(final, attempt) == "keep":
                    self._remove_tree_quietly(staging)
                    return final
                self._set_aside(final, f"superseded by attempt {attempt}")
        else:
            raise CheckpointError(f"could not publish {staging} as {final}: it keeps changing")
        directory = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself must survive a power cut
        finally:
            os.close(directory)
        return final

    def _publish_manifest_last(self, final: str, body: bytes, written: list[str], attempt: int) -> str:
        """Stores without rename: the manifest, created last, is the commit."""
        manifest_path = f"{final}/{MANIFEST}"
        try:
            self._create(manifest_path, body)
            return final
        except FileExistsError:
            pass
        if self._standing(final, attempt) == "keep":
            self._remove_quietly(written)
            return final
        # Supersede: keep the old manifest for forensics, overwrite it with ours (one object write is
        # atomic on object stores), then delete the files only the old manifest referenced.
        try:
            old = self.read_manifest(final)
        except (OSError, ValueError, TypeError):
            old = {"files": {}}
        self._keep_rejected_manifest(final, f"superseded by attempt {attempt}")
        self.fs.pipe_file(manifest_path, body)
        ours = {path.rsplit("/", 1)[-1] for path in written}
        stale = [
            f"{final}/{entry['name']}"
            for entry in old.get("files", {}).values()
            if isinstance(entry, dict) and is_plain_name(entry.get("name")) and entry["name"] not in ours
        ]
        self._remove_quietly(stale)
        return final

    def _write(self, path: str, data: bytes) -> None:
        if self.atomic_rename:
            with open(path, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        else:
            self.fs.pipe_file(path, data)

    def _create(self, path: str, data: bytes) -> None:
        """Write a file that must not exist yet (FileExistsError): atomically where the store can."""
        try:
            self.fs.pipe_file(path, data, mode="create")
        except TypeError:  # fsspec before 2024.12: pipe_file has no mode; check, then write
            if self.fs.exists(path):
                raise FileExistsError(path) from None
            self.fs.pipe_file(path, data)

    # ---- removing -----------------------------------------------------------------------------------
    def remove(self, path: str) -> None:
        """Delete a checkpoint: its manifest first, so a half-deleted directory is never 'committed'.

        Local storage first renames the directory aside, in one atomic act: a crash mid-delete then leaves
        a temporary directory (removed by clean_staging), never a step directory without a manifest.
        Only a real step directory directly under the root is deleted, never anything through a link:
        anything else raises CheckpointError (a symlinked step directory may be another run's checkpoint).
        """
        self._check_removable(path)
        if self.atomic_rename:
            name = path.rstrip("/").rsplit("/", 1)[-1]
            aside = self.path(f"{_TMP_PREFIX}{name}-deleted-{uuid.uuid4().hex[:8]}")
            os.rename(path, aside)
            if self._kind(aside) != "directory":  # swapped for a link between the look and the rename
                with contextlib.suppress(OSError):
                    os.rename(aside, path)
                raise CheckpointError(f"{path} changed into a {self._kind(path)} while being removed")
            path = aside
        manifest = f"{path}/{MANIFEST}"
        kind = self._kind(manifest)
        if kind != "gone":  # a link is removed itself, never what it points to
            self.fs.rm(manifest, recursive=kind == "directory")
        self.fs.rm(path, recursive=True)

    def _check_removable(self, path: str) -> None:
        parent, _, name = path.rstrip("/").rpartition("/")
        if parent != self.root or step_of(name) is None:
            raise CheckpointError(f"{path} is not a step directory directly under {self.root}: not removed")
        kind = self._kind(path)
        if kind == "gone":
            raise FileNotFoundError(path)
        if kind != "directory":
            raise CheckpointError(f"{path} is a {kind}, not a checkpoint directory: not removed")

    def clean_staging(self, attempt: int) -> list[str]:
        """Remove what writers of attempts older than `attempt` left in flight: their staging directories
        (they can never commit: fencing) and directories set aside by an interrupted delete.

        Only entries named exactly as this module names them, and only real directories (never a link) are
        touched: anything else in the checkpoint directory is not ours to delete.
        """
        removed: list[str] = []
        if not self.atomic_rename:
            return removed
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

    def quarantine(self, path: str, reason: str) -> str:
        """Move a rejected checkpoint to `rejected/` with a note of why: kept for forensics, never listed,
        loaded, counted by rotation or pruned. Returns where it went."""
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if self.atomic_rename and os.path.islink(path):
            raise CheckpointError(f"{path} is a symbolic link, not a checkpoint of this store")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.path(REJECTED_DIR, f"{name}.{stamp}.{uuid.uuid4().hex[:8]}")
        self.fs.makedirs(self.path(REJECTED_DIR), exist_ok=True)
        if self.atomic_rename:
            os.rename(path, target)
        else:
            self.fs.mv(path, target, recursive=True)
        note = {"original": name, "reason": reason, "time": time.time()}
        with contextlib.suppress(OSError):  # the move is what matters; the note is a courtesy
            self.fs.pipe_file(f"{target}/{REJECTED_NOTE}", json.dumps(note, indent=1).encode())
        return target

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

    def _keep_rejected_manifest(self, final: str, reason: str) -> None:
        name = final.rstrip("/").rsplit("/", 1)[-1]
        target = self.path(REJECTED_DIR, f"{name}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        with contextlib.suppress(OSError):
            self.fs.makedirs(target, exist_ok=True)
            self.fs.pipe_file(f"{target}/{MANIFEST}", self.fs.cat_file(f"{final}/{MANIFEST}"))
            note = {"original": name, "reason": reason, "time": time.time()}
            self.fs.pipe_file(f"{target}/{REJECTED_NOTE}", json.dumps(note, indent=1).encode())

    def _remove_quietly(self, paths: list[str]) -> None:
        for path in paths:
            with contextlib.suppress(OSError):
                self.fs.rm(path)

    def _remove_own_manifest(self, path: str, body: bytes) -> None:
        """Remove what this writer's failed manifest write left; another writer's manifest differs."""
        with contextlib.suppress(OSError):
            if body.startswith(self.fs.cat_file(path)):
                self.fs.rm(path)

    def _remove_tree_quietly(self, path: str) -> None:
        with contextlib.suppress(OSError):
            self.fs.rm(path, recursive=True)
