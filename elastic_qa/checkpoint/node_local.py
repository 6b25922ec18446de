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

Trust (checked by the session at restore, session/restore.py): a copy is used only when it verifies, its
manifest names the run the durable store belongs to (`run`) and the newest attempt registered there
(fencing: a copy written by a stale group is never used), and every rank holds it at the same step.

Another user of the machine: /dev/shm is writable by all, and `<key>` is predictable. So every level used
under it (the root, `<key>/`, `<key>.lock`) must be this user's own, not a symlink, and writable by no one
else, checked at every use (lstat; the lock file opened with O_NOFOLLOW and checked by fstat); the root's
parent must let no one else replace its entries (owned by root or this user, sticky when others may
write). A root that fails (say another user created /dev/shm/elastic_qa first, mode 0777) is not used:
the copies go to `<root>-<uid>` instead, checked the same way, and when that fails too the copy is off;
either is said in one warning (`node_local_root_unsafe`).

Waiting on the lock is bounded: LOCK_WAIT_S, and URGENT_LOCK_WAIT_S once a stop or an emergency save is
under way (`urgent`), so that neither ever waits behind a stuck writer for the durable save; once a holder
has outlasted such a wait, the saves until the stop only try the lock (a 1-process run that waited 5 s at
each save of the steps before the ranks agreed on the stop took 35 s to stop, past torchrun's 30 s).

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
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.store import CheckpointError, CheckpointStore, Verification
from elastic_qa.config import CheckpointConfig, Config
from elastic_qa.observe.log import get_logger

ROOT_ENV = "ELASTIC_QA_NODE_LOCAL_DIR"  # the default root when checkpoint.node_local_dir is empty
DEFAULT_ROOT = "/dev/shm/elastic_qa"
# A writer holds the lock while it writes one copy to node memory: seconds for a base-size model
# (docs/benchmarks.md, "Emergency save and restart").
# A holder past a minute is stuck (say a stopped process of an older job): the copy goes off instead.
LOCK_WAIT_S = 60.0
# Once a stop or an emergency save is under way: torchrun's SIGKILL follows its SIGTERM after 30 s, and
# the durable save needs the rest of them.
URGENT_LOCK_WAIT_S = 5.0
_LOCK_POLL_S = 0.05
_warned_roots: set[str] = set()  # roots found unsafe, warned about once per process


class NodeLocalBusy(CheckpointError):
    """Another process held the copy's lock for longer than this writer may wait."""


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


def not_private(info: os.stat_result, path: str) -> str:
    """Why the entry `info` (from lstat) at `path` is not this user's own and writable by it alone; ''
    when it is."""
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if info.st_uid != os.geteuid():
        return f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})"
    if info.st_mode & 0o022:
        return f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return ""


def check_private_dir(path: str) -> None:
    """CheckpointError unless `path` is a directory of this user, not a symlink, that nobody else can
    write into (FileNotFoundError when there is none)."""
    info = os.lstat(path)
    problem = not_private(info, path) or ("" if stat.S_ISDIR(info.st_mode) else f"{path} is not a directory")
    if problem:
        raise CheckpointError(problem)


def private_dir(path: str) -> None:
    """Create directory `path` (mode 0700) unless it exists, then `check_private_dir` it."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_private_dir(path)


def root_problem(root: str) -> str:
    """Why `root` may not hold this user's copies ('' when it may; created, mode 0700, when missing): it
    must be private (`private_dir`) in a parent where no one else can replace it."""
    parent = os.path.dirname(root.rstrip("/")) or "/"
    try:
        above = os.stat(parent)  # the shared directory itself (/dev/shm may be a link to /run/shm)
        shared = above.st_mode & 0o022 and not above.st_mode & stat.S_ISVTX
        if above.st_uid not in (0, os.geteuid()) or shared:
            mode = stat.S_IMODE(above.st_mode)
            return f"{parent} lets others replace its entries (uid {above.st_uid}, mode {mode:o})"
        private_dir(root)
    except (OSError, CheckpointError) as err:
        return str(err)
    return ""


def usable_root(root: str) -> str | None:
    """Where this user's copies go: `root`, else `<root>-<uid>`, else None (off); a root passed over is
    said in one warning per process."""
    problem = root_problem(root)
    if not problem:
        return root
    fallback = f"{root.rstrip('/')}-{os.geteuid()}"
    second = root_problem(fallback)
    if root not in _warned_roots:
        _warned_roots.add(root)
        get_logger().warning(
            "node_local_root_unsafe",
            root=root,
            reason=problem,
            effect=f"copies in {fallback}" if not second else f"node-local copy off ({second})",
        )
    return None if second else fallback


class NodeLocalCopy:
    """This node's copy of the newest checkpoint of the run whose durable store is at `checkpoint_url`.

    `urgent()` says a stop or an emergency save is under way: lock waits shrink to URGENT_LOCK_WAIT_S."""

    def __init__(self, root: str, checkpoint_url: str, urgent: Callable[[], bool] = lambda: False) -> None:
        key = hashlib.sha256(checkpoint_url.encode()).hexdigest()[:16]
        self.root = root
        self.directory = os.path.join(root, key)
        self.lock_path = f"{self.directory}.lock"
        self.store: CheckpointStore = open_store(self.directory)
        self.enabled = True
        self.urgent = urgent
        self._held_through_stop = False  # a holder outlasted an urgent wait: the next ones do not wait
        self.log = get_logger()

    @classmethod
    def open(
        cls, cfg: CheckpointConfig, checkpoint_url: str, urgent: Callable[[], bool] = lambda: False
    ) -> NodeLocalCopy | None:
        """The copy for this run, or None: turned off, no place for it (the root's parent, e.g. /dev/shm,
        does not exist on this machine), or no safe place for it (`usable_root`)."""
        root = node_local_root(cfg)
        if not cfg.node_local or not os.path.isdir(os.path.dirname(root.rstrip("/")) or "/"):
            return None
        usable = usable_root(root)
        return None if usable is None else cls(usable, checkpoint_url, urgent)

    @classmethod
    def for_run(cls, cfg: Config) -> NodeLocalCopy | None:
        """The copy of the run `cfg` trains (durable store: `cfg.checkpoint_dir`), or None as in open."""
        store = open_store(cfg.checkpoint_dir)
        return cls.open(cfg.checkpoint, store.display(store.root))

    # ---- writing ------------------------------------------------------------------------------------
    def commit(self, step: int, files: Mapping[str, bytes], manifest_fields: Mapping[str, Any]) -> bool:
        """Write `files` as the node's copy of `step` and drop every older copy; whether the copy of `step`
        (or a newer one of the same attempt) stands. Never raises: the first failure turns the copy off
        (a lock held too long during a stop or an emergency save only skips this copy)."""
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
        except NodeLocalBusy as err:
            if self.urgent():  # the process is stopping: this save goes to durable storage alone
                self.log.warning("node_local_skipped", step=step, directory=self.directory, error=str(err))
                return False
            self._turn_off(step, err)  # not removed: the copy is the lock holder's
            return False
        except (OSError, CheckpointError, ValueError) as err:
            self._turn_off(step, err)
            self.remove()
            return False

    def _turn_off(self, step: int, err: Exception) -> None:
        self.enabled = False
        self.log.warning(
            "node_local_off",
            step=step,
            directory=self.directory,
            error=f"{type(err).__name__}: {err}",
            effect="durable checkpoints only from here on",
        )

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
        private_dir(self.root)
        private_dir(self.directory)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            info = os.fstat(fd)  # the file opened, not the path looked at
            problem = not_private(info, self.lock_path)
            if problem or not stat.S_ISREG(info.st_mode):
                raise CheckpointError(problem or f"{self.lock_path} is not a regular file")
            self._wait_for_lock(fd)  # released by the kernel should this process die holding it
            yield
        finally:
            os.close(fd)

    def _wait_for_lock(self, fd: int) -> None:
        """Take the exclusive lock on `fd`, waiting at most LOCK_WAIT_S (URGENT_LOCK_WAIT_S from the moment
        `urgent()` says so, and not at all once a holder has outlasted one such wait: a stop goes on
        saving every few steps until the ranks agree on it); NodeLocalBusy past that."""
        started = time.monotonic()
        limit = started + LOCK_WAIT_S
        urgent, said = False, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._held_through_stop = False
                return
            except BlockingIOError:
                pass
            now = time.monotonic()
            if not urgent and self.urgent():
                urgent, said = True, self._held_through_stop  # said already, for an earlier save
                limit = min(limit, now + (0.0 if self._held_through_stop else URGENT_LOCK_WAIT_S))
            if not said:  # once, and once more when the wait is cut short
                self.log.info("node_local_lock_wait", lock=self.lock_path, urgent=urgent)
                said = True
            if now >= limit:
                self._held_through_stop = urgent
                raise NodeLocalBusy(f"{self.lock_path} was held by another process for {now - started:.0f} s")
            time.sleep(_LOCK_POLL_S)

    # ---- reading ------------------------------------------------------------------------------------
    def newest(self, keep: Collection[str] = ()) -> NodeLocalState | None:
        """The newest copy on this node that verifies, or None (none, not ours, damaged: logged); with the
        verified bytes of the files in `keep` (a restore loads them, not reading and hashing them again)."""
        if not self.enabled or not os.path.lexists(self.directory):
            return None
        try:
            check_private_dir(self.root)
            check_private_dir(self.directory)
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
        """Remove this run's copy and its lock (the job is done, or the copy is off): only from a root of
        this user's own, never anything another user made."""
        try:
            if not_private(os.lstat(self.root), self.root):
                return
            if not not_private(os.lstat(self.directory), self.directory):
                shutil.rmtree(self.directory)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.unlink(self.lock_path)
