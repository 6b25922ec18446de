"""The restore plan: which state a start resumes from, chosen by rank 0 and loaded by every rank (reads only).

The sources, best first: this node's copy in memory (checkpoint/node_local.py: every rank holds one that
verifies, at the same step, of this run and of the newest attempt, at least as new as the store's newest),
the durable store's newest checkpoint that verifies (the ones that do not are quarantined at registration),
then checkpoint.resume_from (another run's state, read only). A live peer would be one more source here.
Rank 0 also claims the run (the store's run record: a store of another run is refused) and refuses a
checkpoint of another model shape or past the run's end; every refusal is a ResumeError on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_qa.checkpoint.confined import SUBDIRS, confined
from elastic_qa.checkpoint.locate import CheckpointLocation, resolve_checkpoint_path
from elastic_qa.checkpoint.manager import STATE_FILES, Checkpointer, LoadedCheckpoint, Rejection
from elastic_qa.checkpoint.node_local import NodeLocalState
from elastic_qa.checkpoint.run_record import (
    RunRecord,
    belongs,
    new_record,
    newest_run_of_checkpoints,
    other_run_dir,
    read_record,
    resolved_run_dir,
)
from elastic_qa.checkpoint.store import CheckpointError, step_dir_name
from elastic_qa.config_changes import config_changes, refusal
from elastic_qa.dist import decide_on_rank0
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger
from elastic_qa.observe.startup import STARTUP
from elastic_qa.run_length import end_step, length_text
from elastic_qa.session.context import SessionContext
from elastic_qa.train_state import ResumeError


# Rank 0's decision, as every rank receives it (dist.decide_on_rank0).
@dataclass(frozen=True)
class RestoreChoice:
    step: int  # the checkpoint to load; -1: none, a fresh start
    from_source: bool  # it is in checkpoint.resume_from, not in this run's store
    node_local: bool  # every rank loads it from its node's copy (checkpoint/node_local.py)
    run_high: int  # the run's uuid (checkpoint/run_record.py) as two signed 64-bit words
    run_low: int


class RestorePlan:
    """What this start resumes from; `restore()` loads it into the training state on every rank."""

    def __init__(self, context: SessionContext) -> None:
        self.c = context
        self.log = get_logger()
        self.rejected: list[Rejection] = []  # rank 0: checkpoints that failed, quarantined at registration
        self.restored: LoadedCheckpoint | None = None
        self.new_record: RunRecord | None = None  # rank 0: written at registration (a store without one)
        self.source: CheckpointLocation | None = None  # restored from checkpoint.resume_from, not our store
        self.from_node_local = False  # restored from the node-local copies, not from the store
        self._node_local_held: NodeLocalState | None = None  # this node's copy, verified at restore

    def restore(self) -> LoadedCheckpoint | None:
        """Load the newest checkpoint that verifies (chosen by rank 0, loaded by all); writes nothing.
        A refusal (ResumeError) is raised on every rank with rank 0's message."""
        c = self.c
        loaded: LoadedCheckpoint | None = None  # rank 0 loads it while choosing
        # Verified once, here, with the state files' bytes kept: a restore from this copy loads them.
        newest = c.node_local.newest(keep=STATE_FILES) if c.node_local else None
        self._node_local_held = newest
        mine = None if newest is None else newest.report()
        copies = c.gather_json(mine) if c.ctx.distributed else [mine]

        def choose() -> RestoreChoice:
            nonlocal loaded
            loaded = self._choose(copies)
            high, low = uuid_words(c.run_uuid)
            step = loaded.step if loaded else -1
            return RestoreChoice(step, self.source is not None, self.from_node_local, high, low)

        choice = decide_on_rank0(c.ctx, c.control_group, choose, RestoreChoice, (ResumeError,))
        c.run_uuid = uuid_of(choice.run_high, choice.run_low)
        self.from_node_local = choice.node_local
        if not choice.node_local:
            self._node_local_held = None  # not chosen: its bytes must not double a load from the store
        if choice.step >= 0 and loaded is None:
            loaded = self._load_chosen(choice.step, choice.from_source, choice.node_local)
        self._node_local_held = None
        STARTUP.mark("restore_read")
        if loaded is not None:
            c.state.load_state_dict(loaded)
        STARTUP.mark("restore_apply")
        self.restored = loaded
        return loaded

    @property
    def resumed_step(self) -> int | None:
        """The step of the checkpoint restored from our own store (one from checkpoint.resume_from is not
        ours: this run saves that step again rather than count on it)."""
        if self.restored is None or self.source is not None:
            return None
        if self.from_node_local and not self.c.store.exists(self.restored.step):
            return None  # in node memory only (its save to the store may still be in flight)
        return self.restored.step

    def log_start(self, newly_initialized: list[str]) -> None:
        """Say where training starts: `resume` (with the checkpoint) or `start_fresh` (naming the
        parameters the model built new, e.g. a base model's QA head: a resume loads them)."""
        loaded, state, store = self.restored, self.c.state, self.c.store
        if loaded is None:
            new = {"newly_initialized": newly_initialized} if newly_initialized else {}
            self.log.info(Event.START_FRESH, checkpoint_dir=store.url, **new)
            return
        self.log.info(
            Event.RESUME,
            step=state.step,
            path=loaded.path if self.from_node_local else store.display(loaded.path),
            node_local=self.from_node_local,
            saved_world_size=loaded.manifest.get("world_size"),
            world_size=self.c.ctx.world_size,
            epoch=state.cursor.epoch,
            cursor=state.cursor.samples_consumed,
            # fp16: the loss scale and its growth count as restored (a fresh scaler would start over).
            **({"grad_scaler": state.scaler.state_dict()} if state.scaler else {}),
        )

    # ---- loading what rank 0 chose ------------------------------------------------------------------
    def _load_chosen(self, step: int, from_source: bool, node_local: bool) -> LoadedCheckpoint:
        """Ranks other than 0: load the checkpoint rank 0 chose, from our store, this node's copy or
        checkpoint.resume_from."""
        c = self.c
        if node_local:
            return self._load_node_local(step)
        if not from_source:
            return c.checkpointer.load_step(c.store.path(step_dir_name(step)), step)
        self.source = resolve_checkpoint_path(c.cfg.checkpoint.resume_from)
        path = self.source.step_path or self.source.store().path(step_dir_name(step))
        return self.source.checkpointer().load_step(path, step)

    def _load_node_local(self, step: int) -> LoadedCheckpoint:
        node_local = self.c.node_local
        assert node_local is not None  # chosen only when every rank reported a copy
        copies = Checkpointer(self.c.cfg.checkpoint, node_local.store)
        held, self._node_local_held = self._node_local_held, None
        if held is not None and held.step == step and held.verdict is not None:
            return copies.load_verified(held.path, step, held.verdict)  # verified by `newest` just now
        return copies.load_step(node_local.store.path(step_dir_name(step)), step)

    # ---- rank 0's choice ----------------------------------------------------------------------------
    def _choose(self, copies: list[dict[str, Any] | None]) -> LoadedCheckpoint | None:
        """Rank 0: the checkpoint to resume, or None to start fresh; ResumeError: the start must not go on."""
        c = self.c
        cfg = c.cfg
        self._claim_run()
        if not cfg.checkpoint.resume:
            foreign = [info for info in c.store.list_steps() if self._run_id_of(info.path) != c.run_id]
            if foreign:
                raise ResumeError(
                    f"checkpoint.resume=false, but {c.store.url} holds checkpoints of another job "
                    f"(newest: step {foreign[-1].step}); use a new run.dir or checkpoint.dir, or resume them"
                )
        self.rejected, self.source, self.from_node_local = [], None, False
        loaded = self._choose_node_local(copies)
        self._node_local_held = None  # loaded, or not chosen: its bytes must not double a load from the store
        loaded = loaded or c.checkpointer.load_newest(self.rejected)
        if loaded is None and cfg.checkpoint.resume_from:
            loaded = self._load_resume_from()
        elif loaded is not None and cfg.checkpoint.resume_from:  # a restart: its own work is newer
            self.log.info("resume_from_ignored", step=loaded.step, resume_from=cfg.checkpoint.resume_from)
        if loaded is None and cfg.checkpoint.require_resume:
            raise ResumeError(f"checkpoint.require_resume=true but {c.store.url} holds no valid checkpoint")
        if loaded is None:
            return None
        self._check_config(loaded)
        end = end_step(cfg.train, c.state.cursor.num_samples, loaded.trainer.get("length"))
        if loaded.step > end:
            raise ResumeError(
                f"checkpoint {c.store.display(loaded.path)} is at step {loaded.step}, past "
                f"{length_text(cfg.train, end)}: nothing to train (raise it to continue)"
            )
        return loaded

    def _choose_node_local(self, copies: list[dict[str, Any] | None]) -> LoadedCheckpoint | None:
        """Rank 0: the node-local copies to restore, when every rank holds one that verifies at the same
        step, of this run (`run`) and of the newest attempt registered (fencing: a stale group's copy is
        never used), at least as new as the store's newest checkpoint; None: restore from the store."""
        c = self.c
        if not copies or any(copy is None for copy in copies) or c.node_local is None:
            return None
        kinds = {(copy["step"], copy["attempt"], copy["run"]) for copy in copies if copy is not None}
        step, attempt, run = min(kinds)
        committed = c.store.list_steps()
        durable = committed[-1].step if committed else -1
        reason = ""
        if len(kinds) > 1:
            reason = "the ranks' copies differ"
        elif run != c.run_uuid:
            reason = "another run's"
        elif attempt != (newest_attempt := c.fence.newest()):
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

    def _claim_run(self) -> None:
        """Rank 0: which run the store belongs to; ResumeError when that is another run (reads only: the
        record of a store without one is written at registration)."""
        c = self.c
        here = resolved_run_dir(c.cfg.run.dir)
        try:
            for name in SUBDIRS:  # written and cleaned later: never through a link out of the store
                confined(c.store.fs, c.store.root, name)
            record = read_record(c.store)
        except (OSError, ValueError, CheckpointError) as err:
            raise ResumeError(f"checkpoint.dir={c.store.url}: {err}") from None
        if record is not None and not belongs(record, c.cfg.run.dir, c.store, c.run_id):
            raise self._foreign(record.run_dir, f"run {record.run[:8]}, ")
        if record is not None:
            c.run_uuid, self.new_record = record.run, None
            return
        # No record: written before records existed (adopted: its checkpoints stay resumable), or new;
        # unless it is another run directory's own checkpoints/ (see run_record.other_run_dir).
        steps = c.store.list_steps()
        owner = other_run_dir(c.store, c.cfg.run.dir) if steps else None
        if owner is not None:
            raise self._foreign(owner, "")
        self.new_record = new_record(newest_run_of_checkpoints(c.store), here, c.run_id)
        c.run_uuid = self.new_record.run
        if steps:
            self.log.info("checkpoint_run_adopted", checkpoint_dir=c.store.url, run_dir=here)

    def _foreign(self, their_dir: str, their_id: str) -> ResumeError:
        url = self.c.store.url
        return ResumeError(
            f"checkpoint.dir={url} holds the checkpoints of another run ({their_id}run.dir {their_dir}), "
            f"not of this one (run.dir {resolved_run_dir(self.c.cfg.run.dir)}): give this run a "
            f"checkpoint.dir of its own, or start it from that run's state with checkpoint.resume_from={url} "
            "(read only)"
        )

    def _load_resume_from(self) -> LoadedCheckpoint:
        """Rank 0: the checkpoint.resume_from state (a step directory, or the newest valid one of a
        checkpoint or run directory), read only: nothing there is quarantined, pruned or written."""
        given = self.c.cfg.checkpoint.resume_from
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
        changes = config_changes(saved, self.c.cfg)
        problem = refusal(changes, self.c.store.display(loaded.path))
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
            return self.c.store.read_manifest(path).get("run_id")
        except (OSError, ValueError):
            return None


def uuid_words(run: str) -> tuple[int, int]:
    """A 32-hex-digit run uuid as two signed 64-bit integers (to travel in an int64 tensor)."""
    high, low = (int.from_bytes(bytes.fromhex(run[i : i + 16]), "big", signed=True) for i in (0, 16))
    return high, low


def uuid_of(high: int, low: int) -> str:
    return b"".join(word.to_bytes(8, "big", signed=True) for word in (high, low)).hex()
