"""The checkpointer the trainer talks to: save (async or not), rotate, and load the newest valid state.

Saving: the live state is copied to CPU memory at a step boundary (the only time training waits), then a
background thread serialises, writes, commits and prunes. At most one save is in flight; when the next one
falls due first, the caller waits and the wait is logged. The checkpoint a committed manifest names as the
best (checkpoint/best.py) is kept beside the rotation. Storage errors are logged and training goes on:
a short outage costs nothing (the trainer retries sooner while saves fail). Only when no save has succeeded
for `checkpoint.give_up_after` since the first failure does training stop, rather than run on unprotected.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Set
from dataclasses import dataclass
from typing import Any

from elastic_qa.checkpoint.best import best_record, best_step
from elastic_qa.checkpoint.node_local import NodeLocalCopy
from elastic_qa.checkpoint.payload import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE, check_safe, cpu_copy
from elastic_qa.checkpoint.policy import retained_steps
from elastic_qa.checkpoint.store import (
    CheckpointError,
    CheckpointStore,
    StaleWriterError,
    Verification,
    serialize,
)
from elastic_qa.config import CheckpointConfig, format_duration
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger

STATE_FILES = (MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE)


@dataclass
class LoadedCheckpoint:
    step: int
    path: str
    manifest: dict[str, Any]
    model: dict[str, Any]
    optimizer: dict[str, Any]
    trainer: dict[str, Any]


@dataclass
class SaveResult:
    step: int
    blocking_seconds: float
    waited_seconds: float


@dataclass
class Rejection:
    """A checkpoint that failed verification or loading at resume: to be quarantined, never loaded."""

    step: int
    path: str
    reason: str


class Checkpointer:
    def __init__(
        self,
        cfg: CheckpointConfig,
        store: CheckpointStore,
        may_commit: Callable[[], None] = lambda: None,
        before_file: Callable[[str], None] = lambda name: None,
        clock: Callable[[], float] = time.monotonic,
        node_local: NodeLocalCopy | None = None,
    ) -> None:
        self.cfg = cfg
        self.node_local = node_local  # this node's copy of the newest checkpoint (node_local.py), if on
        self.clock = clock
        self.store = store
        self.may_commit = may_commit
        self.before_file = before_file
        self.log = get_logger()
        self._thread: threading.Thread | None = None
        self._failures = 0
        self._failing_since: float | None = None
        self._fatal: BaseException | None = None
        self.last_committed_step: int | None = None
        self.last_error: str = ""

    # ---- saving -------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: dict[str, Any],
        manifest_fields: dict[str, Any],
        blocking: bool = False,
        reason: str = "periodic",
        ignore_failures: bool = False,
        durable: bool = True,
        node_local: bool = True,
    ) -> SaveResult:
        """Snapshot `state` ({file: state dict}) now and commit it as checkpoint `step`: to the node-local
        copy first (when on and `node_local`), then to the store (when `durable`).

        `ignore_failures`: save even when earlier failures were fatal (an emergency save is the last chance).
        """
        if not ignore_failures:
            self.raise_if_failed()
        started = time.perf_counter()
        waited = self.wait()
        if not ignore_failures:
            self.raise_if_failed()  # the save just waited for may have failed fatally
        if waited > 0.001:
            self.log.warning(Event.CHECKPOINT_WAIT, step=step, seconds=round(waited, 4))
        snapshot = cpu_copy(state)
        blocking_seconds = time.perf_counter() - started
        job = threading.Thread(
            target=self._write,
            args=(step, snapshot, manifest_fields, started, blocking_seconds, reason, durable, node_local),
            name=f"checkpoint-{step}",
            daemon=False,
        )
        if self.cfg.async_ and not blocking:
            self._thread = job
            job.start()
        else:
            self._write(step, snapshot, manifest_fields, started, None, reason, durable, node_local)
            blocking_seconds = time.perf_counter() - started
        return SaveResult(step, blocking_seconds, waited)

    def copy_to_node_local(self, step: int, state: dict[str, Any], manifest_fields: dict[str, Any]) -> bool:
        """Commit `state` as this node's copy of `step` now, without waiting for a save in flight (an
        emergency: memory first, durable storage after); whether the copy stands."""
        if self.node_local is None:
            return False
        snapshot = cpu_copy(state, clone=False)  # training has stopped: no copy of CPU tensors needed
        check_safe(snapshot, "checkpoint")
        files = {name: serialize(snapshot[name]) for name in STATE_FILES}
        return self.node_local.commit(step, files, manifest_fields)

    def wait(self) -> float:
        """Block until the in-flight save (if any) has finished; return how long that took."""
        thread, self._thread = self._thread, None
        if thread is None:
            return 0.0
        started = time.perf_counter()
        thread.join()
        return time.perf_counter() - started

    def close(self) -> None:
        self.wait()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def _write(
        self,
        step: int,
        snapshot: dict[str, Any],
        manifest_fields: dict[str, Any],
        started: float,
        blocking_seconds: float | None,
        reason: str,
        durable: bool = True,
        node_local: bool = True,
    ) -> None:
        """Serialise, commit, verify, prune; `blocking_seconds` None means a synchronous save."""
        try:
            check_safe(snapshot, "checkpoint")
            files = {name: serialize(snapshot[name]) for name in STATE_FILES}
            if node_local and self.node_local is not None:  # memory first: fast, and the newest state
                self.node_local.commit(step, files, manifest_fields)
            if not durable:
                return
            wanted = best_step(manifest_fields)  # the tracker's best, which a peer may still be writing
            manifest_fields = self._standing_best(step, manifest_fields)
            path = self.store.commit(step, files, manifest_fields, self.may_commit, self.before_file)
            verdict = self.store.verify(path)
            if not verdict.ok:
                raise CheckpointError(f"{path} failed verification right after writing: {verdict.reason}")
            self.last_committed_step = step
            self._failures, self._failing_since = 0, None
            seconds = time.perf_counter() - started  # read once: a sync save's stall is all of it
            self.log.info(
                Event.CHECKPOINT_COMMITTED,
                step=step,
                path=self.store.display(path),
                reason=reason,
                attempt=(verdict.manifest or {}).get("attempt"),
                bytes=sum(len(b) for b in files.values()),
                seconds=round(seconds, 4),
                blocking_seconds=round(seconds if blocking_seconds is None else blocking_seconds, 4),
            )
            named = best_step(verdict.manifest or {})
            self.prune(keep=step, best={best for best in (named, wanted) if best is not None})
        except StaleWriterError as err:
            self.log.error(Event.CHECKPOINT_FENCED, step=step, reason=str(err))
            self.last_error = str(err)
            self._fatal = err
        except Exception as err:  # noqa: BLE001 - storage errors of any backend must not stop training
            self._failures += 1
            now = self.clock()
            self._failing_since = now if self._failing_since is None else self._failing_since
            self.last_error = f"{type(err).__name__}: {err}"
            failing_for = now - self._failing_since
            self.log.error(
                Event.CHECKPOINT_FAILED,
                step=step,
                reason=reason,
                error=self.last_error,
                consecutive_failures=self._failures,
                failing_for_s=round(failing_for, 3),
            )
            give_up = self.cfg.give_up_after.total_seconds()
            if failing_for >= give_up:
                self._fatal = CheckpointError(
                    f"no checkpoint could be saved for {failing_for:.0f} s ({self._failures} tries; last: "
                    f"{err}); checkpoint.give_up_after={format_duration(self.cfg.give_up_after)}"
                )

    def _standing_best(self, step: int, manifest_fields: dict[str, Any]) -> dict[str, Any]:
        """`manifest_fields` naming a best checkpoint that stands: when the save of the best named failed
        (storage errors; training went on), the best the store holds instead (checkpoint/best.py). The
        previous save has finished by now (one at a time), so a best not in the store never will be."""
        named = best_step(manifest_fields)
        if named is None or named == step or self.store.exists(named):
            return manifest_fields
        standing = best_record(self.store)
        self.log.warning(
            "best_checkpoint_missing",
            step=step,
            best_step=named,
            kept_step=None if standing is None else standing["step"],
        )
        fields = {key: value for key, value in manifest_fields.items() if key != "best"}
        return fields if standing is None else {**fields, "best": standing}

    @property
    def fenced(self) -> bool:
        """A newer attempt has registered: this writer may never commit again."""
        return isinstance(self._fatal, StaleWriterError)

    def forget_fence(self) -> None:
        """This writer now holds the newer attempt's state (the replica mode's heal from a peer of a newer
        lineage): the refusal of its old one no longer applies. Storage failures stay as they were."""
        if self.fenced:
            self._fatal = None

    @property
    def failing(self) -> bool:
        """The last save failed (a storage error): the caller may retry sooner than its timer says."""
        return self._failures > 0

    def prune(self, keep: int, best: Set[int] = frozenset()) -> None:
        """Delete checkpoints outside the rotation; `keep` (just committed and verified) always stays, and
        so do the steps in `best` (the best checkpoint its manifest names)."""
        committed = self.store.list_steps()
        retained = retained_steps([c.step for c in committed], self.cfg.keep_last, self.cfg.keep_every_steps)
        retained.add(keep)
        retained |= best
        for info in committed:
            if info.step in retained or info.step > keep:
                continue
            try:
                self.store.remove(info.path)
                self.log.info(Event.CHECKPOINT_PRUNED, step=info.step, path=self.store.display(info.path))
            except Exception as err:  # noqa: BLE001 - a failed delete is logged, never fatal
                self.log.warning("checkpoint_prune_failed", step=info.step, path=info.path, error=str(err))

    # ---- loading ------------------------------------------------------------------------------------
    def load_step(self, info_path: str, step: int) -> LoadedCheckpoint:
        """Verify and load one checkpoint; raises CheckpointError with the reason when it is not valid.

        Each file is read once: the state files' verified bytes are the ones unpickled (reading them again
        to load them doubled a restore's reading and hashing: 271 MB for MiniLM)."""
        try:
            verdict = self.store.verify(info_path, keep=STATE_FILES)
        except MemoryError:
            raise CheckpointError(f"{info_path}: too large to load into memory") from None
        return self.load_verified(info_path, step, verdict)

    def load_verified(self, info_path: str, step: int, verdict: Verification) -> LoadedCheckpoint:
        """Load one checkpoint from a verification of it that kept the state files' bytes
        (`store.verify(path, keep=STATE_FILES)`); the bytes are handed over, not copied."""
        if not verdict.ok:
            raise CheckpointError(verdict.reason)
        manifest = verdict.manifest
        assert manifest is not None  # an ok verdict always carries the manifest it verified
        missing = [name for name in STATE_FILES if name not in verdict.kept]
        if missing:
            raise CheckpointError(f"{info_path}: manifest.json lists no {missing[0]}")
        loaded = {name: self.store.unpickle(info_path, name, verdict.kept.pop(name)) for name in STATE_FILES}
        for name, value in loaded.items():
            if not isinstance(value, dict):
                raise CheckpointError(f"{name} does not hold a state dict")
        return LoadedCheckpoint(
            step, info_path, manifest, loaded[MODEL_FILE], loaded[OPTIMIZER_FILE], loaded[TRAINER_FILE]
        )

    def load_newest(self, rejected: list[Rejection] | None = None) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies and loads; rejected ones are logged with the reason.

        A checkpoint whose content is wrong (missing or damaged files, a refused pickle) is appended to
        `rejected` for the caller to quarantine; one that merely could not be read (an I/O error) is skipped
        and left in place, since the storage may be back on the next start.
        """
        for info in reversed(self.store.list_steps(committed_only=False)):
            try:
                return self.load_step(info.path, info.step)
            except (CheckpointError, OSError, ValueError, KeyError) as err:
                transient = isinstance(err, OSError) and not isinstance(err, FileNotFoundError)
                self.log.warning(
                    Event.CHECKPOINT_REJECTED,
                    step=info.step,
                    path=self.store.display(info.path),
                    reason=str(err),
                    transient=transient,
                )
                if rejected is not None and not transient:
                    rejected.append(Rejection(info.step, info.path, str(err)))
        return None
