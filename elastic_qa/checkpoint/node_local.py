"""The node-local copy of the newest checkpoint: a second store in memory (/dev/shm) on every node.

Why: an emergency save on a peer's death must finish inside torchrun's 30 s SIGTERM window, which a large
model on slow shared storage cannot. With a copy in node memory, the newest state is already on the node
(the background writer puts each periodic checkpoint there first), an emergency save writes the last
completed step there in well under a second before it tries durable storage, and a restarted worker on
the same node restores from memory instead of reading the durable store.

Layout: `<checkpoint.node_local_dir>/<key>/step-00000420/`, a store of its own with the same manifest,
commit (written aside, renamed into place) and verification as the durable one; `<key>` is a digest of
the durable checkpoint directory's URL, so every run (and a second job on the node) has its own. Only the
newest copy is kept. Writers on a node (the background writer, the survivors' emergency saves) take an
exclusive lock on `<key>.lock` first: one writes at a time, so at most one extra copy is in memory while a
new one is written, and a step already there is not written twice.

Trust (checked by the session at restore, elastic/session.py): a copy is used only when it verifies, its
manifest names the run the durable store belongs to (`run`) and the newest attempt registered there
(fencing: a copy written by a stale group is never used), and every rank holds it at the same step.

Errors here never stop training: the first one (a full /dev/shm: ENOSPC) is logged once, the copy is
removed and turned off for the rest of the process, and the durable checkpoints carry on as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import sys
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.store import CheckpointError, CheckpointStore, Verification
from elastic_qa.config import CheckpointConfig, Config
from elastic_qa.observe.log import get_logger

ROOT_ENV = "ELASTIC_QA_NODE_LOCAL_DIR"  # the default root when checkpoint.node_local_dir is empty
DEFAULT_ROOT = "/dev/shm/elastic_qa"


@dataclass(frozen=True)
class NodeLocalState:
    """The newest copy on this node, verified: what a rank reports at restore (`report`), and the
    verification itself, with the bytes of the files asked for, for the load that may follow."""

    step: int
    attempt: int
    run: str
    path: str
    verdict: Verification | None = field(default=None, repr=False, compare=False)

    def report(self) -> dict[str, Any]:
        return {"step": self.step, "attempt": self.attempt, "run": self.run, "path": self.path}


def node_local_root(cfg: CheckpointConfig) -> str:
    return cfg.node_local_dir or os.environ.get(ROOT_ENV) or DEFAULT_ROOT


class NodeLocalCopy:
    """This node's copy of the newest checkpoint of the run whose durable store is at `checkpoint_url`."""

    def __init__(self, root: str, checkpoint_url: str) -> None:
        key = hashlib.sha256(checkpoint_url.encode()).hexdigest()[:16]
        self.root = root
        self.directory = os.path.join(root, key)
        self.lock_path = f"{self.directory}.lock"
        self.store: CheckpointStore = open_store(self.directory)
        self.enabled = True
        self.log = get_logger()

    @classmethod
    def open(cls, cfg: CheckpointConfig, checkpoint_url: str) -> NodeLocalCopy | None:
        """The copy for this run, or None: turned off, or no place for it (the root's parent, e.g. /dev/shm,
        does not exist on this machine)."""
        root = node_local_root(cfg)
        if not cfg.node_local or not os.path.isdir(os.path.dirname(root.rstrip("/")) or "/"):
            return None
        return cls(root, checkpoint_url)

    @classmethod
    def for_run(cls, cfg: Config) -> NodeLocalCopy | None:
        """The copy of the run `cfg` trains (durable store: `cfg.checkpoint_dir`), or None as in open."""
        store = open_store(cfg.checkpoint_dir)
        return cls.open(cfg.checkpoint, store.display(store.root))

    # ---- writing ------------------------------------------------------------------------------------
    def commit(self, step: int, files: Mapping[str, bytes], manifest_fields: Mapping[str, Any]) -> bool:
        """Write `files` as the node's copy of `step` and drop every older copy; whether the copy of `step`
        (or a newer one of the same attempt) stands. Never raises: the first failure turns the copy off."""
        if not self.enabled:
            return False
        attempt = int(manifest_fields.get("attempt", 0))
        try:
            with self._locked():
                if self._holds(step, attempt):
                    return True
                self.store.clean_staging(sys.maxsize)  # under the lock: only a dead writer's remains
                path = self.store.commit(step, files, manifest_fields)
                verdict = self.store.verify(path)
                if not verdict.ok:
                    raise CheckpointError(f"{path} failed verification right after writing: {verdict.reason}")
                for info in self.store.list_steps(committed_only=False):
                    if info.step != step:
                        self.store.remove(info.path)
            return True
        except (OSError, CheckpointError, ValueError) as err:
            self.enabled = False
            self.log.warning(
                "node_local_off",
                step=step,
                directory=self.directory,
                error=f"{type(err).__name__}: {err}",
                effect="durable checkpoints only from here on",
            )
            self.remove()
            return False

    def _holds(self, step: int, attempt: int) -> bool:
        """A copy of `step` or newer, written by `attempt`, stands here already (another survivor's)."""
        for info in reversed(self.store.list_steps()):
            if info.step < step:
                return False
            with contextlib.suppress(OSError, ValueError):
                if self.store.read_manifest(info.path).get("attempt") == attempt:
                    return True
        return False

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._check_owned(self.directory)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel should this process die holding it
            yield
        finally:
            os.close(fd)

    @staticmethod
    def _check_owned(directory: str) -> None:
        """/dev/shm is shared by every user of the machine: use only a directory of ours nobody else can
        write into (a planted copy would otherwise be restored)."""
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise CheckpointError(f"{directory} is not a directory of this user that only it can write")

    # ---- reading ------------------------------------------------------------------------------------
    def newest(self, keep: Collection[str] = ()) -> NodeLocalState | None:
        """The newest copy on this node that verifies, or None (none, not ours, damaged: logged); with the
        verified bytes of the files in `keep` (a restore loads them, not reading and hashing them again)."""
        if not self.enabled or not os.path.isdir(self.directory):
            return None
        try:
            self._check_owned(self.directory)
            steps = self.store.list_steps()
        except (OSError, CheckpointError) as err:
            self.log.warning("node_local_rejected", directory=self.directory, reason=str(err))
            return None
        if not steps:
            return None
        info = steps[-1]
        try:
            verdict = self.store.verify(info.path, keep=keep)
        except MemoryError:
            verdict = Verification(False, "too large to hold in memory")
        manifest = verdict.manifest or {}
        if not verdict.ok:
            self.log.warning("node_local_rejected", step=info.step, path=info.path, reason=verdict.reason)
            return None
        attempt, run = int(manifest.get("attempt", -1)), str(manifest.get("run", ""))
        return NodeLocalState(info.step, attempt, run, info.path, verdict if keep else None)

    # ---- removing -----------------------------------------------------------------------------------
    def remove(self) -> None:
        """Remove this run's copy and its lock (the job is done, or the copy is off)."""
        with contextlib.suppress(OSError):
            if os.path.isdir(self.directory) and not os.path.islink(self.directory):
                shutil.rmtree(self.directory)
        with contextlib.suppress(OSError):
            os.unlink(self.lock_path)
