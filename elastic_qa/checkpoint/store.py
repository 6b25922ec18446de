"""Checkpoints over fsspec: layout, manifest, verification, and the commit skeleton all stores share.

Layout: `<root>/step-00000420/` holding the tensor files and `manifest.json` (each file's size and sha256,
step, epoch, world size, attempt, run, creation time, config hash, versions), and `<root>/run.json`, the
run the directory belongs to (run_record.py). A directory counts as a checkpoint only once it holds a
manifest, and only as a *valid* one once every file matches it.

`open_store(url)` (backends.py) opens the store at a path or URL with the backend for its commit protocol,
the one thing that differs between stores:

- Local storage, `RenameCommitStore` (store_rename.py): files and manifest are staged in a private
  directory and published by one atomic rename, so a checkpoint appears complete or not at all.
- Stores without rename (memory://, object stores), `ManifestLastStore` (store_manifest.py): files are
  written into the final directory under writer-unique names and the manifest, one object, last: the
  checkpoint exists from the moment that single write lands.

Everything else lives here, once, in their abstract base `CheckpointStore`: naming, listing, reading and
verifying manifests and files (plain names only, bounded reads, never through a symlink), loading, the
commit skeleton (write the files, build the manifest, ask `may_commit`, publish), and the `_standing` rule
for a step that is already committed.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import io
import json
import re
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import fsspec
import torch

from elastic_qa.checkpoint.confined import REJECTED_DIR, confined
from elastic_qa.checkpoint.errors import CheckpointError, StaleWriterError
from elastic_qa.observe.log import get_logger

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 2**20  # a manifest lists a handful of files: anything bigger is not one of ours
_READ_CHUNK = 2**22
_SHA256 = re.compile(r"[0-9a-f]{64}")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # torch's messages carry terminal bold
_foreign_logged: set[str] = set()  # symlinks etc. named like step directories, warned about once each
_STEP_DIR = re.compile(r"^step-([0-9]{8,30})$")  # 30: int() of a hostile 5000-digit name would raise
_TMP_PREFIX = ".tmp-"
REJECTED_NOTE = "REJECTED.json"
MANIFEST_FORMAT = 1
EMPTY_LISTINGS = 3  # listings that must all find no step directory before a store is taken as empty
RUN_RECORD = "run.json"  # the run the directory belongs to (checkpoint/run_record.py)


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
    """Where attempt `attempt` stages step `step` on local storage (see store_rename.py)."""
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
class Verification:
    ok: bool
    reason: str = ""
    manifest: dict[str, Any] | None = field(default=None)
    vanished: bool = False  # deleted while being verified (a concurrent prune): gone, not damaged
    kept: dict[str, bytes] = field(default_factory=dict)  # the bytes of the files asked for (`keep`)


@dataclass
class Staging:
    """One commit in progress: where its files go and what it has written so far."""

    step: int
    attempt: int
    final: str  # the step directory the checkpoint will stand in
    directory: str  # where the files are written (a private directory, or `final` itself)
    token: str  # unique to this writer
    written: list[str] = field(default_factory=list)  # each path before its write: a failed one counts
    created: bool = False  # this writer created `directory`
    manifest: bytes | None = None  # set once the manifest write has started


def refusal(err: BaseException) -> str:
    """What torch.load refused, on one line: its message wraps the reason (for a pickle, the global that is
    not allowed) in a page of advice to load with weights_only=False, which is never done here."""
    text = " ".join(line.strip() for line in _ANSI.sub("", str(err)).splitlines() if line.strip())
    detail = text.partition("WeightsUnpickler error:")[2] or text or type(err).__name__
    return detail.split(" Please use", 1)[0].split(" Check the documentation", 1)[0].strip()[:300]


def serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class CheckpointStore(abc.ABC):
    """One checkpoint directory tree (a local path or any fsspec URL): the abstract base of the backends.

    Open one with `open_store(url)` (backends.py), which picks the backend the storage needs. Backends
    implement the abstract methods below: how a path is looked at and opened, how files are written, how a
    checkpoint is published, moved, detached for deletion, and what staging is cleaned.
    """

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem | None = None) -> None:
        if fs is None:
            fs, root = fsspec.core.url_to_fs(url)
        else:
            root = fs._strip_protocol(url)
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.log = get_logger()

    # ---- what each backend implements ---------------------------------------------------------------
    @abc.abstractmethod
    def _kind(self, path: str) -> str:
        """What is at `path`, never following a symlink: directory, file, link, other (FIFO, device,
        socket) or gone."""

    @abc.abstractmethod
    def _is_link(self, path: str) -> bool:
        """Whether `path` is a symbolic link (never read, moved or deleted through)."""

    @abc.abstractmethod
    def _open_plain(self, path: str) -> tuple[BinaryIO, int]:
        """Open `path` for reading, and its size, only if it is a regular file: a symlink (which may lead
        out of the checkpoint directory), FIFO (would block), device or directory is refused (ValueError)
        before it is opened."""

    @abc.abstractmethod
    def _staging(self, step: int, attempt: int, token: str) -> Staging:
        """Where a commit of `step` writes its files (the directory is created by the caller)."""

    @abc.abstractmethod
    def _file_name(self, logical: str, token: str) -> str:
        """The stored name of logical file `logical` written by the writer holding `token`."""

    @abc.abstractmethod
    def _write(self, path: str, data: bytes) -> None:
        """Write one file durably (it may exist: overwritten)."""

    @abc.abstractmethod
    def _publish(self, staging: Staging, body: bytes) -> str:
        """Make the staged files, with manifest `body`, checkpoint `staging.step`; resolve a checkpoint
        already standing there by `_standing`. Returns the path of the checkpoint now standing."""

    @abc.abstractmethod
    def _discard(self, staging: Staging) -> None:
        """Remove what a failed or refused commit wrote, touching nothing any other writer wrote."""

    @abc.abstractmethod
    def _move(self, path: str, target: str) -> None:
        """Move step directory `path` (and all it holds) to `target`."""

    @abc.abstractmethod
    def _detach(self, path: str) -> str:
        """First act of deleting step directory `path`; returns the directory to delete from then on."""

    @abc.abstractmethod
    def clean_staging(self, attempt: int) -> list[str]:
        """Remove what writers of attempts older than `attempt` left in flight; returns what went."""

    # ---- naming -------------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def display(self, path: str) -> str:
        """Path as the user wrote it (with the protocol for non-local stores)."""
        return self.fs.unstrip_protocol(path)

    # ---- listing ------------------------------------------------------------------------------------
    def list_steps(self, committed_only: bool = True) -> list[CheckpointInfo]:
        """Step directories, oldest first; by default only committed ones (holding a manifest).

        Temporary directories are never listed. A step directory without a manifest is either being
        written (stores without rename) or damaged (local storage, where the manifest arrives by rename).
        Only real directories count: a symlink or a file named like a step directory is not ours (another
        run's checkpoint, say), so it is never read, resumed from or pruned; it is logged once per name.

        A listing is not a snapshot: a local readdir that runs while a checkpoint is renamed into place and
        the oldest one is pruned can return neither (ext4 reads in hash order, so the new name may land
        behind the cursor and the old one be gone before it), which told `ckpt verify` and a restore that
        a directory holding checkpoints held none (2 of 60 runs of the racing-writer test). So "none" is
        believed only once EMPTY_LISTINGS listings in a row say it.
        """
        for _ in range(EMPTY_LISTINGS - 1):
            if found := self._list_steps_once(committed_only):
                return found
        return self._list_steps_once(committed_only)

    def _list_steps_once(self, committed_only: bool) -> list[CheckpointInfo]:
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

    def _warn_foreign(self, path: str, kind: str) -> None:
        if path not in _foreign_logged:
            _foreign_logged.add(path)
            self.log.warning("checkpoint_foreign_entry", path=self.display(path), kind=kind)

    # ---- reading and verifying -----------------------------------------------------------------------
    def read_manifest(self, path: str) -> dict[str, Any]:
        """The manifest of step directory `path`: a regular file of at most MAX_MANIFEST_BYTES holding a
        JSON object with a 'files' table. FileNotFoundError when there is none; ValueError for anything
        else that is not such a manifest (a link, a FIFO, a huge or deeply nested file, garbage)."""
        if self._is_link(path):
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

    def verify(self, path: str, keep: Collection[str] = ()) -> Verification:
        """Every file in the manifest present with the recorded size and sha256; the bytes of the logical
        files named in `keep` in `kept` (read once: a restore unpickles them without reading them again).

        Only regular files directly inside the step directory are read, each at most its recorded size
        (+1 byte), in chunks (kept files in one read). A checkpoint deleted while being verified (pruned by
        a concurrent writer) is reported as `vanished`: gone, not damaged.
        """
        try:
            manifest = self.read_manifest(path)
        except FileNotFoundError:
            if self._kind(path) == "gone":
                return Verification(False, "pruned while verifying", vanished=True)
            return Verification(False, "manifest.json missing")
        except (OSError, ValueError) as err:
            return Verification(False, f"manifest.json unreadable: {err}")
        entries = [entry for entry in manifest["files"].values() if isinstance(entry, dict)]
        names = [entry["name"] for entry in entries if isinstance(entry.get("name"), str)]
        if len(set(names)) != len(names):  # each file hashed once: not 1000 times one 10 GB file
            return Verification(False, "manifest.json names a file more than once", manifest)
        kept: dict[str, bytes] = {}
        for logical, entry in manifest["files"].items():
            label = self._shown(logical)
            try:
                data = self._read_entry(path, entry, keep=logical in keep)
            except FileNotFoundError:
                if self._replaced(path, manifest):
                    return Verification(False, "pruned while verifying", manifest, vanished=True)
                return Verification(False, f"{label}: file {self._shown(entry['name'])} missing", manifest)
            except ValueError as err:
                return Verification(False, f"{label}: {err}", manifest)
            except OSError as err:
                return Verification(False, f"{label}: unreadable ({err})", manifest)
            if logical in keep:
                kept[logical] = data
        return Verification(True, "", manifest, kept=kept)

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
        return self.unpickle(path, logical, data)

    @staticmethod
    def unpickle(path: str, logical: str, data: bytes) -> Any:
        """A tensor file's bytes (read and checked against its manifest entry) loaded with weights_only."""
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unpickling failure means: refuse this file
            raise CheckpointError(
                f"{path}: {logical} refused by weights_only loading: {refusal(err)}"
            ) from None

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
        staging = self._staging(step, attempt, uuid.uuid4().hex[:8])
        try:
            self.fs.makedirs(staging.directory, exist_ok=True)
            entries = {}
            for logical, data in files.items():
                name = self._file_name(logical, staging.token)
                target = f"{staging.directory}/{name}"
                staging.written.append(target)  # before writing: a failed write can leave a part
                before_file(name)
                self._write(target, data)
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
            return self._publish(staging, body)
        except BaseException:
            self._discard(staging)
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

    # ---- removing -----------------------------------------------------------------------------------
    def remove(self, path: str) -> None:
        """Delete a checkpoint: its manifest first, so a half-deleted directory is never 'committed'.

        The backend acts first (`_detach`: local storage renames the directory aside in one atomic act, so
        a crash mid-delete leaves a temporary directory for clean_staging, never a step directory without
        a manifest). Only a real step directory directly under the root is deleted, never anything through
        a link: anything else raises CheckpointError (a symlinked step directory may be another run's).
        """
        self._check_removable(path)
        path = self._detach(path)
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

    def quarantine(self, path: str, reason: str) -> str:
        """Move a rejected checkpoint to `rejected/` with a note of why: kept for forensics, never listed,
        loaded, counted by rotation or pruned. Returns where it went."""
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if self._is_link(path):
            raise CheckpointError(f"{path} is a symbolic link, not a checkpoint of this store")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        rejected = confined(self.fs, self.root, REJECTED_DIR)  # never through a link out of the store
        target = f"{rejected}/{name}.{stamp}.{uuid.uuid4().hex[:8]}"
        self.fs.makedirs(rejected, exist_ok=True)
        self._move(path, target)
        self._note_rejected(target, name, reason)
        return target

    def _note_rejected(self, target: str, name: str, reason: str) -> None:
        note = {"original": name, "reason": reason, "time": time.time()}
        with contextlib.suppress(OSError):  # the move is what matters; the note is a courtesy
            self.fs.pipe_file(f"{target}/{REJECTED_NOTE}", json.dumps(note, indent=1).encode())

    def _remove_quietly(self, paths: list[str]) -> None:
        for path in paths:
            with contextlib.suppress(OSError):
                self.fs.rm(path)

    def _remove_tree_quietly(self, path: str) -> None:
        with contextlib.suppress(OSError):
            self.fs.rm(path, recursive=True)
