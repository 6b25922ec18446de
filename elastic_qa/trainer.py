"""The training loop: restore, then step / log / evaluate / checkpoint until the end step, then finish.

    restore the newest valid checkpoint (or start fresh); register this attempt
    for each global batch from the cursor on:
        train one step (this rank's share, micro-batches under no_sync, loss / global count)
        advance the cursor; agree with all ranks on "save now?" and "stop now?" (the control plane)
        log, evaluate, checkpoint as due (evaluation first: a new best is saved at its own step)
        stop early once evaluations stop improving (checkpoint.early_stop_patience)
    evaluate, final checkpoint (committed and verified), train_done

What every rank must agree on and the phases a worker goes through (running, stopping, emergency, done)
are in elastic/control.py; what a checkpoint holds in train_state.py; how it is saved in
session/; the model's build, one step's micro-batches and optimizer step, the step line and
evaluation with the best tracker in loop/.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from elastic_qa.checkpoint.store import CheckpointError
from elastic_qa.config import Config
from elastic_qa.data.cache import PreparedData
from elastic_qa.data.loader import StepBatch, build_train_loader
from elastic_qa.debug import Faults
from elastic_qa.dist import DistContext, forked_worker, unwrap
from elastic_qa.elastic.control import (
    Agreement,
    ControlPlane,
    Decision,
    PeerFailure,
    Phase,
    failure_reason,
    gloo_all_reduce,
)
from elastic_qa.elastic.signals import StopRequest
from elastic_qa.loop.model import build_trained_model, new_train_state
from elastic_qa.loop.scoring import Scoring
from elastic_qa.loop.step import accumulate_gradients, autocast_dtype, optimizer_step
from elastic_qa.loop.step_log import StepLog, StepStats
from elastic_qa.models import family_for
from elastic_qa.observe.breakdown import StepTimer
from elastic_qa.observe.console import Console
from elastic_qa.observe.events import Event
from elastic_qa.observe.ledger import SampleLedger
from elastic_qa.observe.log import get_logger
from elastic_qa.observe.startup import STARTUP
from elastic_qa.observe.tensorboard import TensorBoardScalars
from elastic_qa.observe.trackers import Trackers, check_installed
from elastic_qa.session.checkpoints import CheckpointSession, FinalStateError
from elastic_qa.train_state import ResumeError, seed_step_rng, step_seed

OTHER_RANK_STOP = "asked on another rank"


class Trainer:
    def __init__(
        self, cfg: Config, ctx: DistContext, data: PreparedData, stop_request: StopRequest | None = None
    ) -> None:
        self.cfg, self.ctx, self.data = cfg, ctx, data
        self.log = get_logger()
        self.device = ctx.device
        # Control flags travel on a CPU (gloo) group, so reading them never syncs a GPU stream.
        self.control_group: ProcessGroup | None = None
        if ctx.distributed:
            self.control_group = dist.new_group(backend="gloo") if ctx.backend != "gloo" else dist.group.WORLD
        STARTUP.mark("process_group")
        self.family = family_for(cfg.model)
        built = build_trained_model(cfg, ctx, data, self.family, self.control_group)
        self.model, self.trained, self.draws_random = built.model, built.trained, built.draws_random
        self.compile_watch, self.comm_timer = built.compile_watch, built.comm_timer
        self.autocast_dtype = autocast_dtype(cfg.train.precision, self.device)
        self.state = new_train_state(cfg, ctx, data, built)
        STARTUP.mark("optimizer")
        self.control = ControlPlane(
            ctx.is_main,
            cfg.dist.control_period.total_seconds(),
            gloo_all_reduce(self.control_group) if ctx.distributed else None,
        )
        self.timer = StepTimer(self.device, cfg.log.breakdown_every, self.comm_timer)
        # Shared with the agent watchdog, which asks for a stop through it when the agent dies.
        stop = self.stop_request = stop_request or StopRequest()
        self.faults = Faults(cfg, ctx.rank)  # debug.*: none unless a test or a chaos run sets them
        hooks = (self.faults, self.timer.add_stall, lambda: stop.requested)
        self.session = CheckpointSession(cfg, ctx, self.state, self.control_group, *hooks)
        self.console = Console(cfg.log.console, self.state.end_step, enabled=ctx.is_main)
        self.ledger: SampleLedger | None = None
        tensorboard = "tensorboard" in cfg.log.tracker_names
        self.scalars = TensorBoardScalars(cfg.run.dir, ctx.rank) if tensorboard else None
        check_installed(cfg)  # on every rank: any of them may be rank 0 after a regroup
        self.trackers: Trackers | None = None  # started once the run is registered
        self.step_log = StepLog(ctx, self.console, self.scalars, lambda: self.control.agreements)
        self.state.unwritten_lines = self.step_log.unwritten  # an emergency save carries them
        parts = (self.control_group, self.family, data, self.state, self.autocast_dtype, self.console)
        self.scoring = Scoring(cfg, ctx, *parts, self.scalars)
        STARTUP.mark("trainer_init")

    # ---- start-up -----------------------------------------------------------------------------------
    def start(self, **worker_fields: Any) -> int:
        """Restore, register this attempt and say so, in the one order a start may take: the restore reads
        only, so a start refused as bad input (exit 2) writes nothing and fences no job running on this run.
        `worker_fields` go into the `worker_start` line; returns the attempt number."""
        self.session.restore()  # reads only: a refused start writes nothing
        self.console.total = self.state.end_step
        attempt = self._register_attempt()
        STARTUP.mark("register")
        ctx = self.ctx
        self.log.info(
            Event.WORKER_START,
            attempt=attempt,
            world_size=ctx.world_size,
            backend=ctx.backend,
            device=str(ctx.device),
            **worker_fields,
        )
        # e.g. a base model's QA head, said once here (a resume loads it from the checkpoint)
        self.session.log_start(list(getattr(unwrap(self.model), "newly_initialized", ())))
        return attempt

    def _register_attempt(self) -> int:
        attempt = self.session.register()
        # The run's uuid is in its checkpoint directory's record from here on.
        backlog = self.state.metrics_backlog
        self.trackers = Trackers.start(self.cfg, self.session.run_uuid, backlog, self.ctx.is_main)
        if self.trackers:
            self.state.tracker_backlog = self.trackers.backlog
        # The lines its attempt could not write (the group failed while their sums were on the way).
        logs = Path(self.cfg.run.dir) / "logs"
        self.step_log.recover(self.state.recovered_lines, self.state.saved_attempt, self.trackers, logs)
        self.state.recovered_lines = []
        if self.cfg.debug.sample_ledger:
            self.ledger = SampleLedger(self.cfg.run.dir, attempt, self.ctx.rank, self.ctx.world_size)
        return attempt

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        state = self.state
        batches = self.begin()
        try:
            while state.step < state.end_step and not state.best.exhausted:
                if self.run_step(batches).stop:
                    return self._stop()
            return self._finish()
        except (RuntimeError, dist.DistBackendError) as err:
            if not self.ctx.distributed or isinstance(err, CheckpointError | ResumeError | FinalStateError):
                raise
            self.control.enter(Phase.EMERGENCY)
            with self.stop_request.saving():  # a SIGTERM or the agent watchdog waits for it
                self.session.save_emergency(failure_reason(err))
            raise PeerFailure(failure_reason(err)) from err
        finally:
            self.stop_request.uninstall()
            if self.trackers:  # a no-op after _finish or _stop closed them
                self.trackers.close(finished=False)

    def begin(self) -> Iterator[StepBatch]:
        """What the loop does once before its first step (signal handlers, loader, schedule); its batches.
        Called by `train`, and by the interleaved overhead benchmark, which drives `run_step` itself."""
        cfg, state = self.cfg, self.state
        self.stop_request.install()
        loader = build_train_loader(
            self.data.train,
            state.cursor,
            state.step + 1,
            state.end_step,
            self.ctx.rank,
            self.ctx.world_size,
            cfg.data.num_workers,
            pin_memory=self.device.type == "cuda",
            full_width=self.family.full_width,
        )
        self.log.info(
            Event.TRAIN_START,
            step=state.step,
            max_steps=state.end_step,
            **({"epochs": cfg.train.epochs} if cfg.train.epochs else {}),
            train_windows=len(self.data.train),
            world_size=self.ctx.world_size,
        )
        self.session.start_schedule()
        self.control.begin(state.step + 1)
        self.model.train()  # once: evaluation puts it back (walking every module each step costs time)
        return iter(loader)

    def run_step(self, batches: Iterator[StepBatch]) -> Decision:
        """One step of the loop: train the next batch; log, evaluate and checkpoint as due; what the ranks
        agreed (stop now?)."""
        state = self.state
        self.timer.start_step(state.step + 1)
        batch = next(batches)
        self.timer.mark("data")
        if batch.step != state.step + 1:  # a loader bug would silently break exactly-once
            raise AssertionError(f"loader produced step {batch.step}, expected {state.step + 1}")
        # Rank 0's timer is asked only on control steps: while saves fail, asking moves its back-off.
        pending = self.control.start(
            batch.step,
            self.stop_request.notice(self.log),
            self.control.control_step(batch.step) and self.session.time_due(),
            self.timer.mean_step_s(),
        )
        if self.ledger:
            self.ledger.record(batch.step, batch.epoch, batch.indices)
        if self.compile_watch:
            self.compile_watch.step_started()
        stats, decision = self._train_step(batch, pending)
        self._after_step(batch, stats, decision)
        return decision

    def _train_step(self, batch: StepBatch, pending: Agreement | None) -> tuple[StepStats, Decision]:
        state, micro = self.state, self.cfg.train.micro_batch_size
        if self.draws_random:
            seed_step_rng(step_seed(self.cfg.run.seed, batch.step, self.ctx.rank), self.device)
        model, family, dtype = self.model, self.family, self.autocast_dtype
        loss_sum = accumulate_gradients(model, family, batch, self.ctx, micro, dtype, state.scaler)
        self.timer.mark("forward_backward")
        decision = self.control.finish(batch.step, pending)  # the last collective of the step
        logged = self._logs_line(batch.step)  # else, unless it clips, no step needs the gradient norm
        grad_norm = optimizer_step(state, self.trained, self.cfg.train.grad_clip, norm_wanted=logged)
        # With no collective in between: every piece of state moves together.
        state.complete_step(batch.step, batch.epoch, batch.global_count, batch.global_tokens)
        self.timer.mark("optimizer")
        return StepStats(loss_sum, len(batch.indices), grad_norm), decision

    def _after_step(self, batch: StepBatch, stats: StepStats, decision: Decision) -> None:
        cfg, step, end = self.cfg, self.state.step, self.state.end_step
        if self.compile_watch and (news := self.compile_watch.news()):
            self.log.info(Event.COMPILE, step=step, **news)
        self.control.deliver()  # earlier steps' lines (and diagnosis), summed on this step's agreement
        if self._logs_line(step):
            rate = self.timer.samples_per_s(batch.global_count)
            self.step_log.step(self.state, batch.epoch, stats, rate, self.trackers, self.control.carry)
        self.timer.mark("log_and_save")
        new_best = False
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < end:
            self.control.flush()  # the lines carried so far before the evaluation's
            new_best = self._evaluate() is not None and self.state.best.step == step
            self.timer.mark(None)  # evaluation is none of the step's phases
        # A stop commits this step as its own checkpoint instead (_stop).
        reason = self.session.save_due(step, decision.save, new_best)
        if reason and not decision.stop:
            self.control.flush()  # the lines carried so far before the checkpoint's
            self.session.save(reason)
        self.timer.mark("log_and_save")
        console = self.console if self.ctx.is_main else None
        self.timer.finish_step(self.ctx, self.control_group, self.log, console, self.control.carry)
        if not STARTUP.reported:  # warm: a fork of the agent's forkserver (launcher/warm_start.py)
            STARTUP.log_first_step(self.log, step, warm=forked_worker())
        if self.faults.pauses:  # else after_step has nothing to do
            self.faults.after_step(step, lambda: self.stop_request.requested, self.control.flush)

    def _logs_line(self, step: int) -> bool:
        """Whether `step` gets a `step` line (log.every_steps, and the last step)."""
        return step % self.cfg.log.every_steps == 0 or step == self.state.end_step

    def _evaluate(self) -> dict[str, float] | None:
        return self.scoring.run(unwrap(self.model), self.trackers)

    # ---- the end ------------------------------------------------------------------------------------
    def _stop(self) -> dict[str, Any]:
        self.control.flush()  # no next agreement: the lines carried so far now
        self.control.enter(Phase.STOPPING)
        # The control all-reduce carries that some rank was asked to stop, not by what: a rank that was not
        # signalled itself (rank 0 when `leave` stopped another agent) names the stop generically.
        reason = self.stop_request.signal_name or OTHER_RANK_STOP
        self.log.warning(Event.STOPPING, step=self.state.step, signal=reason)
        with self.stop_request.saving():
            self.session.save_for_stop()
        if self.trackers:
            self.trackers.close(finished=False)
        return {"stopped": True, "step": self.state.step}

    def _finish(self) -> dict[str, Any]:
        """Final evaluation and checkpoint. Done only once the final state is committed and verified."""
        self.control.flush()  # no next agreement: the lines carried so far now
        self.control.enter(Phase.DONE)
        step = self.state.step
        early = self.state.best.exhausted and step < self.state.end_step
        if early and self.ctx.is_main and self.session.resumed_step == step:
            self.scoring.log_early_stop()  # resumed from an early stop: its final checkpoint stands
        # Evaluated at this step already (an early stop): the same state scores the same.
        scores = self.state.best.scores_at(step) or self._evaluate()
        self.session.save_final()
        if self.scalars:
            self.scalars.close()
        if self.trackers:
            self.trackers.close(finished=True)
        self.log.info(
            Event.TRAIN_DONE,
            step=self.state.step,
            tokens_seen=self.state.tokens_seen,
            **({"em": scores["em"], "f1": scores["f1"], "eval_loss": scores["loss"]} if scores else {}),
        )
        return {"stopped": False, "step": self.state.step, **(scores or {})}
