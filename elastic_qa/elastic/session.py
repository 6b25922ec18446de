"""A worker's checkpoints for one attempt: restore, register, and every kind of save.

Order at start-up, so that a start refused as bad input writes nothing:
    restore()   rank 0 picks the newest checkpoint that verifies, every rank loads it (reads only)
    register()  rank 0 takes the run's hold (hold.py: refused while another live job holds it, so that a
                second job never fences a live one), claims the next attempt number (fencing), clears
                what older attempts left (their staging, the checkpoints rejected at restore) and restores
                again if a checkpoint newer than the restored one was committed meanwhile by a group that
                was still running
Whether to save, asked by the trainer after each step: time_due (rank 0's timer, shared by the control
plane), save_due (the reason, "best" or "periodic", or None).
Saves: periodic (async, storage errors tolerated for checkpoint.give_up_after), stop and emergency (retried
for checkpoint.emergency_retry_for), final (retried for checkpoint.final_retry_for; the job is done only
once it is committed and verified).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elastic_qa import debug
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.confined import SUBDIRS, confined
from elastic_qa.checkpoint.fencing import Fence
from elastic_qa.checkpoint.locate import CheckpointLocation, resolve_checkpoint_path
from elastic_qa.checkpoint.manager import STATE_FILES, Checkpointer, LoadedCheckpoint, Rejection
from elastic_qa.checkpoint.node_local import NodeLocalCopy, NodeLocalState
from elastic_qa.checkpoint.payload import rng_state, versions
from elastic_qa.checkpoint.policy import SaveSchedule
from elastic_qa.checkpoint.run_record import (
    RunRecord,
    belongs,
    new_record,
    newest_run_of_checkpoints,
    other_run_dir,
    read_record,
    resolved_run_dir,
    write_record,
)
from elastic_qa.checkpoint.store import CheckpointError, step_dir_name
from elastic_qa.config import Config
from elastic_qa.config_changes import config_changes, refusal
from elastic_qa.debug import storage_fault_hook
from elastic_qa.dist import DistContext, all_gather_bytes, decide_on_rank0
from elastic_qa.elastic.hold import RunHeldError, RunHold, local_processes, unique
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger, update_identity
from elastic_qa.observe.startup import STARTUP
from elastic_qa.run_length import end_step, length_text
from elastic_qa.train_state import ResumeError, TrainState, gather_rng_states


class FinalStateError(RuntimeError):
    """Training reached max_steps but its final state could not be committed: the job is not done."""


# Rank 0's decisions, as every rank receives them (dist.decide_on_rank0).
@dataclass(frozen=True)
class RestoreChoice:
    step: int  # the checkpoint to load; -1: none, a fresh start
    from_source: bool  # it is in checkpoint.resume_from, not in this run's store
    node_local: bool  # every rank loads it from its node's copy (checkpoint/node_local.py)
    run_high: int  # the run's uuid (checkpoint/run_record.py) as two signed 64-bit words
    run_low: int


@dataclass(frozen=True)
class HoldTaken:
    """Rank 0 holds the run for this job: nothing more to say (a refusal travels as RunHeldError)."""


@dataclass(frozen=True)
class Registration:
    attempt: int  # the job-wide attempt number rank 0 claimed
    restore_again: bool  # a checkpoint newer than the restored one was committed meanwhile
    make_durable: bool  # restored from the node-local copies, a step the store does not hold: save it


@dataclass(frozen=True)
class FinalOutcome:
    committed: bool  # the final state is committed and verified


class CheckpointSession:
    """What the trainer asks of its checkpoints: restore, register, whether a save is due, and the saves.

    `on_stall(seconds)` hears how long each save blocked the training process (the step timer's stall);
    `stop_asked()` says a stop was asked (a signal, the watchdog): from then on no save waits long on the
    node-local copy's lock, nor does a stop or an emergency save.
    """

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        state: TrainState,
        control_group: Any,
        on_stall: Callable[[float], None] | None = None,
        stop_asked: Callable[[], bool] = lambda: False,
    ) -> None:
        self.cfg, self.ctx, self.state = cfg, ctx, state
        self.control_group = control_group
        self.log = get_logger()
        self.store = open_store(cfg.checkpoint_dir)
        self.fence = Fence(self.store)
        self._stopping = False  # a stop or an emergency save is under way
        self.node_local = NodeLocalCopy.open(
            cfg.checkpoint,
            self.store.display(self.store.root),
            urgent=lambda: self._stopping or stop_asked(),
        )
        self.checkpointer = Checkpointer(
            cfg.checkpoint,
            self.store,
            may_commit=self.fence.check,
            before_file=storage_fault_hook(cfg),
            node_local=self.node_local,
        )
        self.schedule = SaveSchedule(cfg.checkpoint)
        # The outcome of the final save travels on a group whose timeout covers its retries.
        self.final_group = None
        if ctx.distributed:
            final_timeout = cfg.checkpoint.final_retry_for + cfg.dist.timeout + timedelta(minutes=1)
            self.final_group = dist.new_group(backend="gloo", timeout=final_timeout)
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"single-{uuid.uuid4().hex[:12]}"
        self.hold = RunHold(cfg.checkpoint_dir, self.run_id, cfg.run.dir, fs=self.store.fs)
        self.attempt = 0
        self.rejected: list[Rejection] = []
        self.restored: LoadedCheckpoint | None = None
        self.run_uuid = ""  # the run this start belongs to (checkpoint/run_record.py), agreed at restore
        self._new_record: RunRecord | None = None  # rank 0: written at registration (a store without one)
        self.source: CheckpointLocation | None = None  # restored from checkpoint.resume_from, not our store
        self.from_node_local = False  # restored from the node-local copies, not from the store
        self._in_node_memory = -1  # the step an emergency save put in node memory
        self._node_local_held: NodeLocalState | None = None  # this node's copy, verified at restore
        self.on_stall: Callable[[float], None] = on_stall or (lambda seconds: None)

    # ---- start-up -----------------------------------------------------------------------------------
    def restore(self) -> LoadedCheckpoint | None:
        """Load the newest checkpoint that verifies (chosen by rank 0, loaded by all); writes nothing.
        A refusal (ResumeError) is raised on every rank with rank 0's message."""
        loaded: LoadedCheckpoint | None = None  # rank 0 loads it while choosing
        # Verified once, here, with the state files' bytes kept: a restore from this copy loads them.
        newest = self.node_local.newest(keep=STATE_FILES) if self.node_local else None
        self._node_local_held = newest
        mine = None if newest is None else newest.report()
        copies = self._gather_json(mine) if self.ctx.distributed else [mine]

        def choose() -> RestoreChoice:
            nonlocal loaded
            loaded = self._choose(copies)
            high, low = _uuid_words(self.run_uuid)
            step = loaded.step if loaded else -1
            return RestoreChoice(step, self.source is not None, self.from_node_local, high, low)

        choice = decide_on_rank0(self.ctx, self.control_group, choose, RestoreChoice, (ResumeError,))
        self.run_uuid = _uuid_of(choice.run_high, choice.run_low)
        self.from_node_local = choice.node_local
        if not choice.node_local:
            self._node_local_held = None  # not chosen: its bytes must not double a load from the store
        if choice.step >= 0 and loaded is None:
            loaded = self._load_chosen(choice.step, choice.from_source, choice.node_local)
        self._node_local_held = None
        STARTUP.mark("restore_read")
        if loaded is not None:
            self.state.load_state_dict(loaded)
        STARTUP.mark("restore_apply")
        self.restored = loaded
        return loaded

    def _load_chosen(self, step: int, from_source: bool, node_local: bool) -> LoadedCheckpoint:
        """Ranks other than 0: load the checkpoint rank 0 chose, from our store, this node's copy or
        checkpoint.resume_from."""
        if node_local:
            return self._load_node_local(step)
        if not from_source:
            return self.checkpointer.load_step(self.store.path(step_dir_name(step)), step)
        self.source = resolve_checkpoint_path(self.cfg.checkpoint.resume_from)
        path = self.source.step_path or self.source.store().path(step_dir_name(step))
        return self.source.checkpointer().load_step(path, step)

    def _load_node_local(self, step: int) -> LoadedCheckpoint:
        assert self.node_local is not None  # chosen only when every rank reported a copy
        copies = Checkpointer(self.cfg.checkpoint, self.node_local.store)
        held, self._node_local_held = self._node_local_held, None
        if held is not None and held.step == step and held.verdict is not None:
            return copies.load_verified(held.path, step, held.verdict)  # verified by `newest` just now
        return copies.load_step(self.node_local.store.path(step_dir_name(step)), step)

    def _choose_node_local(self, copies: list[dict[str, Any] | None]) -> LoadedCheckpoint | None:
        """Rank 0: the node-local copies to restore, when every rank holds one that verifies at the same
        step, of this run (`run`) and of the newest attempt registered (fencing: a stale group's copy is
        never used), at least as new as the store's newest checkpoint; None: restore from the store."""
        if not copies or any(copy is None for copy in copies) or self.node_local is None:
            return None
        kinds = {(copy["step"], copy["attempt"], copy["run"]) for copy in copies if copy is not None}
        step, attempt, run = min(kinds)
        committed = self.store.list_steps()
        durable = committed[-1].step if committed else -1
        reason = ""
        if len(kinds) > 1:
            reason = "the ranks' copies differ"
        elif run != self.run_uuid:
            reason = "another run's"
        elif attempt != (newest_attempt := self.fence.newest()):
            reason = f"written by attempt {attempt}, not by the newest ({newest_attempt})"
        elif step < durable:
            reason = f"older than the store's newest (step {durable})"
        if reason:
            self.log.info("node_local_ignored", step=step, reason=reason)
            return None
        try:
            loaded = self._load_node_local(step)
        except (CheckpointError, OSError, ValueError, KeyError) as err:
            self.log.warning("node_local_rejected", step=step, reason=str(err))
            return None
        self.from_node_local = True
        self.log.info("node_local_restore", step=step, durable_step=durable, path=loaded.path)
        return loaded

    def _choose(self, copies: list[dict[str, Any] | None]) -> LoadedCheckpoint | None:
        """Rank 0: the checkpoint to resume, or None to start fresh; ResumeError: the start must not go on."""
        cfg = self.cfg
        self._claim_run()
        if not cfg.checkpoint.resume:
            foreign = [info for info in self.store.list_steps() if self._run_id_of(info.path) != self.run_id]
            if foreign:
                raise ResumeError(
                    f"checkpoint.resume=false, but {self.store.url} holds checkpoints of another job "
                    f"(newest: step {foreign[-1].step}); use a new run.dir or checkpoint.dir, or resume them"
                )
        self.rejected, self.source, self.from_node_local = [], None, False
        loaded = self._choose_node_local(copies)
        self._node_local_held = None  # loaded, or not chosen: its bytes must not double a load from the store
        loaded = loaded or self.checkpointer.load_newest(self.rejected)
        if loaded is None and cfg.checkpoint.resume_from:
            loaded = self._load_resume_from()
        elif loaded is not None and cfg.checkpoint.resume_from:  # a restart: its own work is newer
            self.log.info("resume_from_ignored", step=loaded.step, resume_from=cfg.checkpoint.resume_from)
        if loaded is None and cfg.checkpoint.require_resume:
            raise ResumeError(
                f"checkpoint.require_resume=true but {self.store.url} holds no valid checkpoint"
            )
        if loaded is None:
            return None
        self._check_config(loaded)
        end = end_step(cfg.train, self.state.cursor.num_samples, loaded.trainer.get("length"))
        if loaded.step > end:
            raise ResumeError(
                f"checkpoint {self.store.display(loaded.path)} is at step {loaded.step}, past "
                f"{length_text(cfg.train, end)}: nothing to train (raise it to continue)"
            )
        return loaded

    def _claim_run(self) -> None:
        """Rank 0: which run the store belongs to; ResumeError when that is another run (reads only: the
        record of a store without one is written at registration)."""
        here = resolved_run_dir(self.cfg.run.dir)
        try:
            for name in SUBDIRS:  # written and cleaned later: never through a link out of the store
                confined(self.store.fs, self.store.root, name)
            record = read_record(self.store)
        except (OSError, ValueError, CheckpointError) as err:
            raise ResumeError(f"checkpoint.dir={self.store.url}: {err}") from None
        if record is not None and not belongs(record, self.cfg.run.dir, self.store, self.run_id):
            raise self._foreign(record.run_dir, f"run {record.run[:8]}, ")
        if record is not None:
            self.run_uuid, self._new_record = record.run, None
            return
        # No record: written before records existed (adopted: its checkpoints stay resumable), or new;
        # unless it is another run directory's own checkpoints/ (see run_record.other_run_dir).
        steps = self.store.list_steps()
        owner = other_run_dir(self.store, self.cfg.run.dir) if steps else None
        if owner is not None:
            raise self._foreign(owner, "")
        self._new_record = new_record(newest_run_of_checkpoints(self.store), here, self.run_id)
        self.run_uuid = self._new_record.run
        if steps:
            self.log.info("checkpoint_run_adopted", checkpoint_dir=self.store.url, run_dir=here)

    def _foreign(self, their_dir: str, their_id: str) -> ResumeError:
        url = self.store.url
        return ResumeError(
            f"checkpoint.dir={url} holds the checkpoints of another run ({their_id}run.dir {their_dir}), "
            f"not of this one (run.dir {resolved_run_dir(self.cfg.run.dir)}): give this run a checkpoint.dir "
            f"of its own, or start it from that run's state with checkpoint.resume_from={url} (read only)"
        )

    def _load_resume_from(self) -> LoadedCheckpoint:
        """Rank 0: the checkpoint.resume_from state (a step directory, or the newest valid one of a
        checkpoint or run directory), read only: nothing there is quarantined, pruned or written."""
        given = self.cfg.checkpoint.resume_from
        try:
            location = resolve_checkpoint_path(given)
            checkpointer = location.checkpointer()
            if location.step_path is None:
                loaded = checkpointer.load_newest()
            else:
                step = location.step
                if step is None:  # a step directory under another name: its manifest says which
                    step = int(location.store().read_manifest(location.step_path)["step"])
                loaded = checkpointer.load_step(location.step_path, step)
        except (CheckpointError, OSError, ValueError, KeyError, TypeError) as err:
            raise ResumeError(f"checkpoint.resume_from={given}: {err}") from None
        if loaded is None:
            raise ResumeError(f"checkpoint.resume_from={given}: no valid checkpoint in {location.directory}")
        self.source = location
        self.log.info("resume_from", path=location.store().display(loaded.path), step=loaded.step)
        return loaded

    def _check_config(self, loaded: LoadedCheckpoint) -> None:
        """Refuse a checkpoint of another model shape; log every other change with its effect."""
        saved = loaded.trainer.get("config")
        if not isinstance(saved, dict):
            return
        changes = config_changes(saved, self.cfg)
        problem = refusal(changes, self.store.display(loaded.path))
        if problem:
            raise ResumeError(problem)
        if changes:
            self.log.info(
                Event.CONFIG_CHANGED,
                step=loaded.step,
                changes=[{"key": c.key, "old": c.old, "new": c.new, "effect": c.effect} for c in changes],
            )

    def _run_id_of(self, path: str) -> str | None:
        try:
            return self.store.read_manifest(path).get("run_id")
        except (OSError, ValueError):
            return None

    def _take_hold(self) -> None:
        """Rank 0 takes the run's hold for this job, naming every rank's worker and agent; raises
        RunHeldError on every rank when another live job holds it (nothing written, no one fenced)."""
        processes = local_processes()
        if self.ctx.distributed:
            processes = [process for rank in self._gather_json(processes) for process in rank]

        def take() -> HoldTaken:
            self.hold.acquire(unique(processes), self.log)
            self.hold.start_heartbeat(self.log)
            return HoldTaken()

        # Every rank fails with rank 0's line, as a refused restore does.
        decide_on_rank0(self.ctx, self.control_group, take, HoldTaken, (RunHeldError,))

    def _gather_json(self, mine: Any) -> list[Any]:
        """Every rank's `mine` (plain JSON values), read with json: never unpickled."""
        parts = all_gather_bytes(json.dumps(mine).encode(), self.ctx.world_size, self.control_group)
        return [json.loads(part) for part in parts]

    def register(self) -> int:
        """Job-wide attempt number: rank 0 claims it in the checkpoint store, all ranks agree."""
        self._take_hold()

        def claim() -> Registration:
            attempt = self.fence.register(self.ctx.world_size)
            if self._new_record is not None:  # the store's first registration (or one from before records)
                write_record(self.store, self._new_record)
            self.store.clean_staging(attempt)
            for rejection in self.rejected:
                self._quarantine(rejection)
            committed = self.store.list_steps()
            restored_step = self.restored.step if self.restored else -1
            newer = bool(committed) and committed[-1].step > restored_step
            make_durable = self.from_node_local and not self.store.exists(restored_step)
            return Registration(attempt, newer, make_durable)

        registration = decide_on_rank0(self.ctx, self.control_group, claim, Registration)
        self.attempt = self.fence.attempt = registration.attempt
        update_identity(attempt=self.attempt)
        if registration.restore_again:
            self.log.warning("checkpoint_appeared", restored_step=self.state.step)
            self.restore()
        elif registration.make_durable:
            # The restored state exists only in node memory: commit it to the store now (in the
            # background), so that losing the node loses nothing more than it would have without the copy.
            self.log.info("node_local_made_durable", step=self.state.step)
            self.save("node_local")
        return self.attempt

    def _quarantine(self, rejection: Rejection) -> None:
        try:
            target = self.store.quarantine(rejection.path, rejection.reason)
            self.log.warning(
                Event.CHECKPOINT_QUARANTINED,
                step=rejection.step,
                path=self.store.display(target),
                reason=rejection.reason,
            )
        except (OSError, CheckpointError) as err:  # a replay of that step supersedes it all the same
            self.log.warning("checkpoint_quarantine_failed", step=rejection.step, error=str(err))

    @property
    def resumed_step(self) -> int | None:
        """The step of the checkpoint restored from our own store (one from checkpoint.resume_from is not
        ours: this run saves that step again rather than count on it)."""
        if self.restored is None or self.source is not None:
            return None
        if self.from_node_local and not self.store.exists(self.restored.step):
            return None  # in node memory only (its save to the store may still be in flight)
        return self.restored.step

    def log_start(self, newly_initialized: list[str]) -> None:
        """Say where training starts: `resume` (with the checkpoint) or `start_fresh` (naming the
        parameters the model built new, e.g. a base model's QA head: a resume loads them)."""
        loaded, state = self.restored, self.state
        if loaded is None:
            new = {"newly_initialized": newly_initialized} if newly_initialized else {}
            self.log.info(Event.START_FRESH, checkpoint_dir=self.store.url, **new)
            return
        self.log.info(
            Event.RESUME,
            step=state.step,
            path=loaded.path if self.from_node_local else self.store.display(loaded.path),
            node_local=self.from_node_local,
            saved_world_size=loaded.manifest.get("world_size"),
            world_size=self.ctx.world_size,
            epoch=state.cursor.epoch,
            cursor=state.cursor.samples_consumed,
            # fp16: the loss scale and its growth count as restored (a fresh scaler would start over).
            **({"grad_scaler": state.scaler.state_dict()} if state.scaler else {}),
        )

    # ---- when to save -------------------------------------------------------------------------------
    def start_schedule(self) -> None:
        """Training starts: the save timer counts from now (restore and start-up are not unsaved work)."""
        self.schedule.saved()

    def time_due(self) -> bool:
        """Rank 0's timer says save now (backing off while saves fail); the control plane shares it."""
        return self.schedule.time_due(self.checkpointer.failing)

    def save_due(self, step: int, asked: bool, new_best: bool) -> str | None:
        """Why the step just completed is checkpointed now ("best", "periodic"), or None: `asked` is the
        ranks' agreed timed save, `new_best` an evaluation's new best at this step. The end step and an
        early stop are not: the final save commits them (save_final)."""
        due = asked or self.schedule.step_due(step) or debug.save_due(self.cfg, step)
        if not (due or new_best) or step >= self.state.end_step or self.state.best.exhausted:
            return None
        return "best" if new_best else "periodic"

    # ---- saving -------------------------------------------------------------------------------------
    def save(self, reason: str) -> None:
        """A periodic checkpoint of the last completed step (async). Collective: every rank's RNG.
        Rank 0 writes it to the store; the first rank of each node to its node's copy (when on)."""
        node_writer = self.node_local is not None and self.ctx.local_rank == 0
        files = self._files(node_writer)
        if files is not None:
            self._write(files, reason, blocking=False, durable=self.ctx.is_main)

    def _files(self, node_writer: bool = False) -> dict[str, Any] | None:
        """The checkpoint files with every rank's RNG state (collective; None on ranks other than 0 and,
        when `node_writer`, this one: rank 0 writes, and each node's writer of its copy)."""
        rngs = gather_rng_states(self.ctx, self.control_group, everywhere=node_writer)
        if not (self.ctx.is_main or node_writer):
            return None
        return self.state.state_dict(rngs, self.attempt)

    def _own_files(self) -> dict[str, Any]:
        """The checkpoint files with this rank's RNG state only (no collective: any rank may write)."""
        return self.state.state_dict({str(self.ctx.rank): rng_state()}, self.attempt)

    def _write(
        self,
        files: dict[str, Any],
        reason: str,
        blocking: bool,
        ignore_failures: bool = False,
        durable: bool = True,
    ) -> None:
        result = self.checkpointer.save(
            self.state.step,
            files,
            self._manifest_fields(),
            blocking=blocking,
            reason=reason,
            ignore_failures=ignore_failures,
            durable=durable,
            node_local=reason != "final",  # the job is done: its node-local copy is removed
        )
        self.on_stall(result.blocking_seconds)
        self.schedule.saved()

    def _manifest_fields(self) -> dict[str, Any]:
        return {
            "epoch": self.state.cursor.epoch,
            "world_size": self.ctx.world_size,
            "attempt": self.attempt,
            "run_id": self.run_id,
            "run": self.run_uuid,
            "config_hash": self.cfg.digest(),
            "versions": versions(),
            **self.state.best.manifest_fields(self.state.step),  # its scores, and which one is the best
        }

    def _save_until_committed(self, files: dict[str, Any], reason: str, retry_for: timedelta) -> bool:
        """Write `files` (blocking), retrying storage errors with back-off for `retry_for`; whether the
        step is committed and verified. A fenced writer (another group owns the run) stops at once."""
        deadline = time.monotonic() + retry_for.total_seconds()
        pause = 0.5
        while True:
            self._write(files, reason, blocking=True, ignore_failures=True)
            if self.checkpointer.last_committed_step == self.state.step:
                return True
            if self.checkpointer.fenced or time.monotonic() + pause > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 30.0)

    def _committed_by_us(self, step: int) -> bool:
        """A checkpoint of `step` written by this attempt stands in the store and verifies."""
        path = self.store.path(step_dir_name(step))
        try:
            if self.store.read_manifest(path).get("attempt") != self.attempt:
                return False
        except (OSError, ValueError):
            return False
        return self.store.verify(path).ok

    def save_emergency(self, reason: str) -> None:
        """A collective failed: commit the last completed step from this replica (any survivor may).

        Storage errors are retried for `checkpoint.emergency_retry_for`: this replica may hold the only copy.
        """
        step = self.state.step
        self._stopping = True
        self.log.error(Event.EMERGENCY_CHECKPOINT, step=step, reason=reason)
        try:
            if step > 0 and self.node_local is not None:  # memory first: done in well under the window
                started = time.perf_counter()
                if self.checkpointer.copy_to_node_local(step, self._own_files(), self._manifest_fields()):
                    seconds = round(time.perf_counter() - started, 4)
                    self.log.info("node_local_emergency", step=step, seconds=seconds)
                    self._in_node_memory = step
            self.checkpointer.wait()
            if step == 0 or self._committed_by_us(step):
                return
            # Survivors all hold the same state; stagger them so that usually only one writes it.
            time.sleep(min(self.ctx.rank, 8) * 0.2)
            if self._committed_by_us(step):
                return
            files = self._own_files()
            if not self._save_until_committed(files, "emergency", self.cfg.checkpoint.emergency_retry_for):
                self._report_uncommitted("emergency")
        except Exception as err:  # noqa: BLE001 - already failing: report, never mask the cause
            self.log.error("emergency_checkpoint_failed", step=step, error=f"{type(err).__name__}: {err}")

    def save_for_stop(self) -> None:
        """All ranks stop after this step: rank 0 commits it (collective: every rank's RNG)."""
        self._stopping = True
        if self.state.step > 0 and self.resumed_step != self.state.step:
            files = self._files()
            if files is not None and not self._save_until_committed(
                files, "sigterm", self.cfg.checkpoint.emergency_retry_for
            ):
                self._report_uncommitted("sigterm")
        self.checkpointer.wait()

    def save_final(self) -> None:
        """The final checkpoint; raises FinalStateError on every rank unless it is committed and verified."""
        step = self.state.step
        files = self._files() if self.resumed_step != step else None  # collective

        def commit() -> FinalOutcome:
            if files is not None:
                ok = self._save_until_committed(files, "final", self.cfg.checkpoint.final_retry_for)
            else:  # resumed at max_steps: that checkpoint is the final state; it must still stand
                ok = self.store.verify(self.store.path(step_dir_name(step))).ok
            if ok:
                self._quarantine_damaged()
            return FinalOutcome(ok)

        if not decide_on_rank0(self.ctx, self.final_group, commit, FinalOutcome).committed:
            if self.ctx.is_main:
                self._report_uncommitted("final")
            raise FinalStateError(
                f"training reached step {step} but its final state could not be committed to "
                f"{self.store.url} (last error: {self.checkpointer.last_error or 'see rank 0'})"
            )
        self.checkpointer.wait()
        if self.node_local is not None and self.ctx.local_rank == 0:  # done: the durable state is final
            self.node_local.remove()
        if self.ctx.is_main:  # done: the run is free for the next start without any liveness check
            self.hold.release()

    def _quarantine_damaged(self) -> None:
        """Leave a store in which every listed checkpoint verifies: one damaged since it was written (bit
        rot, a bad disk, a chaos fault) is found here rather than at some later resume, and quarantined."""
        for info in self.store.list_steps(committed_only=False):
            verification = self.store.verify(info.path)
            if not verification.ok and not verification.vanished:
                reason = f"damaged at the end: {verification.reason}"
                self._quarantine(Rejection(info.step, info.path, reason))

    def _report_uncommitted(self, reason: str) -> None:
        step, error = self.state.step, self.checkpointer.last_error
        if self.checkpointer.fenced:  # not a loss: a newer group owns the run and holds the newer state
            self.log.warning("not_saved_stale", step=step, reason=reason, error=error)
            return
        if self._in_node_memory == step:  # a restart on this node resumes it (and then commits it)
            self.log.error("checkpoint_node_local_only", step=step, reason=reason, error=error)
            loss = "it is kept in this node's memory only (lost with the node)"
        else:
            self.log.error("checkpoint_lost", step=step, reason=reason, error=error)
            loss = "work since the last checkpoint is lost"
        with contextlib.suppress(OSError):
            print(
                f"elastic-qa: step {step} could not be committed ({reason} save; last error: "
                f"{error or 'none'}): {loss}",
                file=sys.stderr,
                flush=True,
            )


def _uuid_words(run: str) -> tuple[int, int]:
    """A 32-hex-digit run uuid as two signed 64-bit integers (to travel in an int64 tensor)."""
    high, low = (int.from_bytes(bytes.fromhex(run[i : i + 16]), "big", signed=True) for i in (0, 16))
    return high, low


def _uuid_of(high: int, low: int) -> str:
    return b"".join(word.to_bytes(8, "big", signed=True) for word in (high, low)).hex()
