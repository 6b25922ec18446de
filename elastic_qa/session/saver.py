"""When to save and every kind of save, with their retries and the report of a step that was not saved.

Whether to save, asked by the trainer after each step: time_due (rank 0's timer, shared by the control
plane), save_due (the reason, "best" or "periodic", or None).
Saves: periodic and best (async, storage errors tolerated for checkpoint.give_up_after), stop and emergency
(retried for checkpoint.emergency_retry_for), final (retried for checkpoint.final_retry_for; the job is done
only once it is committed and verified). An emergency save puts the step in node memory first (well within
torchrun's window), then commits it from any survivor.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elastic_qa.checkpoint.manager import Rejection
from elastic_qa.checkpoint.payload import rng_state, versions
from elastic_qa.checkpoint.policy import SaveSchedule
from elastic_qa.checkpoint.store import step_dir_name
from elastic_qa.dist import decide_on_rank0
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger
from elastic_qa.session.context import SessionContext
from elastic_qa.train_state import gather_rng_states


class FinalStateError(RuntimeError):
    """Training reached max_steps but its final state could not be committed: the job is not done."""


# Rank 0's outcome of the final save, as every rank receives it (dist.decide_on_rank0).
@dataclass(frozen=True)
class FinalOutcome:
    committed: bool  # the final state is committed and verified


class Saver:
    """The saves of one attempt. `resumed_step()` is the step restored from this run's own store (None:
    none); `on_stall(seconds)` hears how long each save blocked the training process; `on_done()` runs
    once the final state is committed (the run's hold released)."""

    def __init__(
        self,
        context: SessionContext,
        resumed_step: Callable[[], int | None],
        on_stall: Callable[[float], None] | None = None,
        on_done: Callable[[], None] = lambda: None,
    ) -> None:
        self.c = context
        self.log = get_logger()
        self.resumed_step = resumed_step
        self.on_stall: Callable[[float], None] = on_stall or (lambda seconds: None)
        self.on_done = on_done
        self.schedule = SaveSchedule(context.cfg.checkpoint)
        self.asked_by_faults: Callable[[int], bool] = lambda step: False  # a chaos run's save at a step
        self._in_node_memory = -1  # the step an emergency save put in node memory
        # The outcome of the final save travels on a group whose timeout covers its retries.
        self.final_group = None
        cfg = context.cfg
        if context.ctx.distributed:
            final_timeout = cfg.checkpoint.final_retry_for + cfg.dist.timeout + timedelta(minutes=1)
            self.final_group = dist.new_group(backend="gloo", timeout=final_timeout)

    # ---- when to save -------------------------------------------------------------------------------
    def start_schedule(self) -> None:
        """Training starts: the save timer counts from now (restore and start-up are not unsaved work)."""
        self.schedule.saved()

    def time_due(self) -> bool:
        """Rank 0's timer says save now (backing off while saves fail); the control plane shares it."""
        return self.schedule.time_due(self.c.checkpointer.failing)

    def save_due(self, step: int, asked: bool, new_best: bool) -> str | None:
        """Why the step just completed is checkpointed now ("best", "periodic"), or None: `asked` is the
        ranks' agreed timed save, `new_best` an evaluation's new best at this step. The end step and an
        early stop are not: the final save commits them (save_final)."""
        state = self.c.state
        due = asked or self.schedule.step_due(step) or self.asked_by_faults(step)
        if not (due or new_best) or step >= state.end_step or state.best.exhausted:
            return None
        return "best" if new_best else "periodic"

    # ---- the saves ----------------------------------------------------------------------------------
    def save(self, reason: str) -> None:
        """A periodic checkpoint of the last completed step (async). Collective: every rank's RNG.
        Rank 0 writes it to the store; the first rank of each node to its node's copy (when on)."""
        c = self.c
        node_writer = c.node_local is not None and c.ctx.local_rank == 0
        files = self._files(node_writer)
        if files is not None:
            self._write(files, reason, blocking=False, durable=c.ctx.is_main)

    def save_emergency(self, reason: str) -> None:
        """A collective failed: commit the last completed step from this replica (any survivor may).

        Storage errors are retried for `checkpoint.emergency_retry_for`: this replica may hold the only copy.
        """
        c = self.c
        step = c.state.step
        c.stopping = True
        self.log.error(Event.EMERGENCY_CHECKPOINT, step=step, reason=reason)
        try:
            if step > 0 and c.node_local is not None:  # memory first: done in well under the window
                started = time.perf_counter()
                if c.checkpointer.copy_to_node_local(step, self._own_files(), self._manifest_fields()):
                    seconds = round(time.perf_counter() - started, 4)
                    self.log.info("node_local_emergency", step=step, seconds=seconds)
                    self._in_node_memory = step
            c.checkpointer.wait()
            if step == 0 or self._committed_by_us(step):
                return
            # Survivors all hold the same state; stagger them so that usually only one writes it.
            time.sleep(min(c.ctx.rank, 8) * 0.2)
            if self._committed_by_us(step):
                return
            files = self._own_files()
            if not self._save_until_committed(files, "emergency", c.cfg.checkpoint.emergency_retry_for):
                self._report_uncommitted("emergency")
        except Exception as err:  # noqa: BLE001 - already failing: report, never mask the cause
            self.log.error("emergency_checkpoint_failed", step=step, error=f"{type(err).__name__}: {err}")

    def save_for_stop(self) -> None:
        """All ranks stop after this step: rank 0 commits it (collective: every rank's RNG)."""
        c = self.c
        c.stopping = True
        if c.state.step > 0 and self.resumed_step() != c.state.step:
            files = self._files()
            if files is not None and not self._save_until_committed(
                files, "sigterm", c.cfg.checkpoint.emergency_retry_for
            ):
                self._report_uncommitted("sigterm")
        c.checkpointer.wait()

    def save_final(self) -> None:
        """The final checkpoint; raises FinalStateError on every rank unless it is committed and verified."""
        c = self.c
        step = c.state.step
        files = self._files() if self.resumed_step() != step else None  # collective

        def commit() -> FinalOutcome:
            if files is not None:
                ok = self._save_until_committed(files, "final", c.cfg.checkpoint.final_retry_for)
            else:  # resumed at max_steps: that checkpoint is the final state; it must still stand
                ok = c.store.verify(c.store.path(step_dir_name(step))).ok
            if ok:
                self._quarantine_damaged()
            return FinalOutcome(ok)

        if not decide_on_rank0(c.ctx, self.final_group, commit, FinalOutcome).committed:
            if c.ctx.is_main:
                self._report_uncommitted("final")
            raise FinalStateError(
                f"training reached step {step} but its final state could not be committed to "
                f"{c.store.url} (last error: {c.checkpointer.last_error or 'see rank 0'})"
            )
        c.checkpointer.wait()
        if c.node_local is not None and c.ctx.local_rank == 0:  # done: the durable state is final
            c.node_local.remove()
        if c.ctx.is_main:
            self.on_done()

    # ---- the pieces ---------------------------------------------------------------------------------
    def _files(self, node_writer: bool = False) -> dict[str, Any] | None:
        """The checkpoint files with every rank's RNG state (collective; None on ranks other than 0 and,
        when `node_writer`, this one: rank 0 writes, and each node's writer of its copy)."""
        c = self.c
        rngs = gather_rng_states(c.ctx, c.control_group, everywhere=node_writer)
        if not (c.ctx.is_main or node_writer):
            return None
        return c.state.state_dict(rngs, c.attempt)

    def _own_files(self) -> dict[str, Any]:
        """The checkpoint files with this rank's RNG state only (no collective: any rank may write)."""
        return self.c.state.state_dict({str(self.c.ctx.rank): rng_state()}, self.c.attempt)

    def _write(
        self,
        files: dict[str, Any],
        reason: str,
        blocking: bool,
        ignore_failures: bool = False,
        durable: bool = True,
    ) -> None:
        result = self.c.checkpointer.save(
            self.c.state.step,
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
        c = self.c
        return {
            "epoch": c.state.cursor.epoch,
            "world_size": c.ctx.world_size,
            "attempt": c.attempt,
            "run_id": c.run_id,
            "run": c.run_uuid,
            "config_hash": c.cfg.digest(),
            "versions": versions(),
            **c.state.best.manifest_fields(c.state.step),  # its scores, and which one is the best
        }

    def _save_until_committed(self, files: dict[str, Any], reason: str, retry_for: timedelta) -> bool:
        """Write `files` (blocking), retrying storage errors with back-off for `retry_for`; whether the
        step is committed and verified. A fenced writer (another group owns the run) stops at once."""
        checkpointer = self.c.checkpointer
        deadline = time.monotonic() + retry_for.total_seconds()
        pause = 0.5
        while True:
            self._write(files, reason, blocking=True, ignore_failures=True)
            if checkpointer.last_committed_step == self.c.state.step:
                return True
            if checkpointer.fenced or time.monotonic() + pause > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 30.0)

    def _committed_by_us(self, step: int) -> bool:
        """A checkpoint of `step` written by this attempt stands in the store and verifies."""
        store = self.c.store
        path = store.path(step_dir_name(step))
        try:
            if store.read_manifest(path).get("attempt") != self.c.attempt:
                return False
        except (OSError, ValueError):
            return False
        return store.verify(path).ok

    def _quarantine_damaged(self) -> None:
        """Leave a store in which every listed checkpoint verifies: one damaged since it was written (bit
        rot, a bad disk, a chaos fault) is found here rather than at some later resume, and quarantined."""
        store = self.c.store
        for info in store.list_steps(committed_only=False):
            verification = store.verify(info.path)
            if not verification.ok and not verification.vanished:
                reason = f"damaged at the end: {verification.reason}"
                self.c.quarantine(Rejection(info.step, info.path, reason))

    def _report_uncommitted(self, reason: str) -> None:
        checkpointer = self.c.checkpointer
        step, error = self.c.state.step, checkpointer.last_error
        if checkpointer.fenced:  # not a loss: a newer group owns the run and holds the newer state
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
