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
elastic/session.py.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_qa import debug
from elastic_qa.checkpoint.store import CheckpointError
from elastic_qa.compile import CompileWatch, compile_model, use_compile_cache
from elastic_qa.config import Config, ConfigError
from elastic_qa.data.cache import PreparedData
from elastic_qa.data.cursor import GlobalCursor
from elastic_qa.data.loader import StepBatch, build_train_loader, collate
from elastic_qa.dist import CommTimer, DistContext, decide_on_rank0, unwrap, wrap_model
from elastic_qa.elastic.control import (
    ControlPlane,
    Decision,
    PeerFailure,
    Phase,
    failure_reason,
    gloo_all_reduce,
)
from elastic_qa.elastic.session import CheckpointSession, FinalStateError
from elastic_qa.elastic.signals import StopRequest
from elastic_qa.evaluation import evaluate
from elastic_qa.metrics import em_f1_text
from elastic_qa.models import family_for, model_inputs
from elastic_qa.models.invariance import freeze, loss_invariant_parameters
from elastic_qa.observe.breakdown import StepTimer
from elastic_qa.observe.console import Console
from elastic_qa.observe.ledger import SampleLedger
from elastic_qa.observe.log import get_logger
from elastic_qa.observe.tensorboard import TensorBoardScalars
from elastic_qa.observe.trackers import Trackers, check_installed
from elastic_qa.optim import build_optimizer, build_scheduler
from elastic_qa.run_length import end_step
from elastic_qa.train_state import ResumeError, TrainState, seed_step_rng, step_seed

# What the loss compares the logits with, per window (weights: 0 for the padding rows of an empty share).
TARGETS = ("start_positions", "end_positions", "weights")
# Windows the start-up probe for loss-invariant parameters reads (a float64 forward and backward).
PROBE_WINDOWS = 4


@dataclass(frozen=True)
class SharedScores:
    """Rank 0's evaluation scores, as every rank receives them (dist.decide_on_rank0)."""

    scored: bool  # rank 0 evaluated at this step
    em: float
    f1: float
    loss: float


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of `train.precision` on `device` (None: fp32); ConfigError where it cannot run."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16 needs CUDA (GradScaler); on CPU use train.precision=bf16")
    # autocast would refuse at the first step, in every worker torchrun restarts: say it once, at start-up.
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"train.precision=bf16: {torch.cuda.get_device_name(device)} cannot compute in bf16; "
            "use train.precision=fp16 or fp32"
        )
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


OTHER_RANK_STOP = "asked on another rank"


def _tracked(scores: dict[str, float]) -> dict[str, float]:
    """Evaluation scores under the names trackers give them."""
    return {"eval_em": scores["em"], "eval_f1": scores["f1"], "eval_loss": scores["loss"]}


class Trainer:
    def __init__(
        self, cfg: Config, ctx: DistContext, data: PreparedData, stop_request: StopRequest | None = None
    ) -> None:
        self.cfg, self.ctx, self.data = cfg, ctx, data
        self.log = get_logger()
        self.device = ctx.device
        # Control flags travel on a CPU (gloo) group, so reading them never syncs a GPU stream.
        self.control_group = None
        if ctx.distributed:
            self.control_group = dist.new_group(backend="gloo") if ctx.backend != "gloo" else dist.group.WORLD
        torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
        self.family = family_for(cfg.model)
        model = self.family.build_model(cfg, data.vocab_size)
        if cfg.train.freeze_loss_invariant:
            self._freeze_loss_invariant(model)
        model = model.to(self.device)
        # Listed once: walking the modules for them at every step costs as much as the clipping.
        self.trained = [param for param in model.parameters() if param.requires_grad]
        # Re-seeded only when a step draws random numbers (a pretrained model keeps dropout of its own
        # when model.dropout is null).
        self.draws_random = (cfg.model.dropout or 0.0) > 0 or any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()
        )
        self.compile_watch: CompileWatch | None = None
        if cfg.train.compile:  # in place and before DDP wraps it: elastic_qa/compile.py says why
            self.compile_watch = CompileWatch(use_compile_cache(cfg))
            compile_model(model, cfg, self.family.full_width)
        self.comm_timer = CommTimer()
        self.model = wrap_model(model, ctx, cfg.dist, self.comm_timer)
        precision = cfg.train.precision
        self.autocast_dtype = autocast_dtype(precision, self.device)
        optimizer = build_optimizer(model, cfg)
        end = end_step(cfg.train, len(data.train))  # a resume may keep its checkpoint's (TrainState)
        self.state = TrainState(
            cfg,
            ctx,
            self.model,
            optimizer,
            build_scheduler(optimizer, cfg, end),
            torch.amp.GradScaler("cuda") if precision == "fp16" else None,
            GlobalCursor(len(data.train), cfg.train.global_batch_size, cfg.run.seed),
            vocabulary=data.vocabulary,
            end=end,
        )
        self.control = ControlPlane(
            ctx.is_main,
            cfg.dist.control_period.total_seconds(),
            gloo_all_reduce(self.control_group) if ctx.distributed else None,
        )
        self.timer = StepTimer(self.device, cfg.log.breakdown_every, self.comm_timer)
        self.session = CheckpointSession(cfg, ctx, self.state, self.control_group, self.timer.add_stall)
        # Shared with the agent watchdog, which asks for a stop through it when the agent dies.
        self.stop_request = stop_request or StopRequest()
        self.console = Console(cfg.log.console, end, enabled=ctx.is_main)
        self.ledger: SampleLedger | None = None
        tensorboard = "tensorboard" in cfg.log.tracker_names
        self.scalars = TensorBoardScalars(cfg.run.dir, ctx.rank) if tensorboard else None
        check_installed(cfg)  # on every rank: any of them may be rank 0 after a regroup
        self.trackers: Trackers | None = None  # started once the run is registered

    # ---- start-up -----------------------------------------------------------------------------------
    def _freeze_loss_invariant(self, model: torch.nn.Module) -> None:
        """Freeze the parameters the span loss cannot see (models/invariance.py), the same on every rank.

        Rank 0 probes and the others take its answer: the probe's float64 copy of the model is its largest
        cost (measured on a random bert-base: ~2.5 GB and seconds), which a node of 8 ranks should not pay
        8 times over at every restart.
        """
        names = [name for name, param in model.named_parameters() if param.requires_grad]
        flags = torch.zeros(len(names), dtype=torch.uint8)
        if self.ctx.rank == 0:
            rows = np.arange(min(PROBE_WINDOWS, len(self.data.train)))
            probe = collate(self.data.train, rows, full_width=self.family.full_width)
            found = set(loss_invariant_parameters(model, probe, self.family.span_loss_per_window))
            flags = torch.tensor([name in found for name in names], dtype=torch.uint8)
        if self.ctx.distributed:
            dist.broadcast(flags, src=0, group=self.control_group)
        frozen = [name for name, flag in zip(names, flags.tolist(), strict=True) if flag]
        freeze(model, frozen)
        if self.ctx.is_main:
            self.log.info("frozen_parameters", count=len(frozen), names=frozen)

    def start(self, **worker_fields: Any) -> int:
        """Restore, register this attempt and say so, in the one order a start may take: the restore reads
        only, so a start refused as bad input (exit 2) writes nothing and fences no job running on this run.
        `worker_fields` go into the `worker_start` line; returns the attempt number."""
        self._restore()
        attempt = self._register_attempt()
        ctx = self.ctx
        self.log.info(
            "worker_start",
            attempt=attempt,
            world_size=ctx.world_size,
            backend=ctx.backend,
            device=str(ctx.device),
            **worker_fields,
        )
        self._log_start()
        return attempt

    def _restore(self) -> None:
        """Load the newest valid checkpoint into this run; reads only (a refused start writes nothing)."""
        self.session.restore()
        self.console.total = self.state.end_step

    def _register_attempt(self) -> int:
        attempt = self.session.register()
        # The run's uuid is in its checkpoint directory's record from here on.
        backlog = self.state.metrics_backlog
        self.trackers = Trackers.start(self.cfg, self.session.run_uuid, backlog, self.ctx.is_main)
        if self.trackers:
            self.state.tracker_backlog = self.trackers.backlog
        if self.cfg.debug.sample_ledger:
            self.ledger = SampleLedger(self.cfg.run.dir, attempt, self.ctx.rank, self.ctx.world_size)
        return attempt

    def _log_start(self) -> None:
        """Say where training starts: `resume` (with the checkpoint) or `start_fresh`."""
        loaded, state = self.session.restored, self.state
        if loaded is None:
            # e.g. a base model's QA head, said once here (a resume loads it from the checkpoint)
            new = list(getattr(unwrap(self.model), "newly_initialized", ()))
            self.log.info(
                "start_fresh",
                checkpoint_dir=self.session.checkpoint_url,
                **({"newly_initialized": new} if new else {}),
            )
            return
        self.log.info(
            "resume",
            step=state.step,
            path=self.session.restored_path,
            saved_world_size=loaded.manifest.get("world_size"),
            world_size=self.ctx.world_size,
            epoch=state.cursor.epoch,
            cursor=state.cursor.samples_consumed,
            # fp16: the loss scale and its growth count as restored (a fresh scaler would start over).
            **({"grad_scaler": state.scaler.state_dict()} if state.scaler else {}),
        )

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
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
            "train_start",
            step=state.step,
            max_steps=state.end_step,
            **({"epochs": cfg.train.epochs} if cfg.train.epochs else {}),
            train_windows=len(self.data.train),
            world_size=self.ctx.world_size,
        )
        self.session.start_schedule()
        self.control.begin(state.step + 1)
        self.model.train()  # once: evaluation puts it back (walking every module costs ~0.1 ms a step)
        batches = iter(loader)
        try:
            while state.step < state.end_step and not state.best.exhausted:
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
                if decision.stop:
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

    def _train_step(self, batch: StepBatch, pending: Any) -> tuple[dict[str, Any], Decision]:
        model, device, state = self.model, self.device, self.state
        if self.draws_random:
            seed_step_rng(step_seed(self.cfg.run.seed, batch.step, self.ctx.rank), device)
        micro = self.cfg.train.micro_batch_size
        starts = list(range(0, batch.rows, micro))
        # DDP averages gradients over ranks; scaling each rank's loss *sum* by world/global_count makes
        # the result the mean over the global batch, however unevenly the ranks' shares are split.
        scale = self.ctx.world_size / batch.global_count
        loss_sum = torch.zeros((), device=device)
        for i, lo in enumerate(starts):
            rows = slice(lo, lo + micro)
            sync = i == len(starts) - 1 or not self.ctx.distributed
            # Not syncing means distributed: then wrap_model made the model a DistributedDataParallel.
            with cast(DistributedDataParallel, model).no_sync() if not sync else nullcontext():
                with torch.autocast(
                    device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
                ):
                    start_logits, end_logits = model(**model_inputs(batch.tensors, device, rows))
                loss = self.family.span_loss(
                    start_logits,
                    end_logits,
                    *(batch.tensors[k][rows].to(device, non_blocking=True) for k in TARGETS),
                )
                loss_sum += loss.detach()
                (state.scaler.scale(loss * scale) if state.scaler else loss * scale).backward()
        self.timer.mark("forward_backward")
        decision = self.control.finish(batch.step, pending)  # the last collective of the step
        if state.scaler:
            state.scaler.unscale_(state.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.trained, self.cfg.train.grad_clip or float("inf"), foreach=True
        )
        if state.scaler:
            state.scaler.step(state.optimizer)
            state.scaler.update()
        else:
            state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
        # With no collective in between: every piece of state moves together.
        state.complete_step(batch.step, batch.epoch, batch.global_count, batch.global_tokens)
        self.timer.mark("optimizer")
        return {"loss_sum": loss_sum, "count": len(batch.indices), "grad_norm": grad_norm}, decision

    def _after_step(self, batch: StepBatch, stats: dict[str, Any], decision: Decision) -> None:
        cfg, step, end = self.cfg, self.state.step, self.state.end_step
        if self.compile_watch and (news := self.compile_watch.news()):
            self.log.info("compile", step=step, **news)
        if step % cfg.log.every_steps == 0 or step == end:
            self._log_step(batch, stats)
        self.timer.mark("log_and_save")
        new_best = False
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < end:
            new_best = self.run_eval() is not None and self.state.best.step == step
            self.timer.mark(None)  # evaluation is none of the step's phases
        # A stop commits this step as its own checkpoint instead (_stop).
        reason = self.session.save_due(step, decision.save, new_best)
        if reason and not decision.stop:
            self.session.save(reason)
        self.timer.mark("log_and_save")
        self.timer.finish_step(
            self.ctx, self.control_group, self.log, self.console if self.ctx.is_main else None
        )
        debug.after_step(cfg, self.ctx.rank, step, lambda: self.stop_request.requested)

    def _log_step(self, batch: StepBatch, stats: dict[str, Any]) -> None:
        state = self.state
        local = torch.stack([stats["loss_sum"].float().cpu(), torch.tensor(float(stats["count"]))])
        totals = local.clone()
        if self.ctx.distributed:
            dist.all_reduce(totals, group=self.control_group)
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        local_loss = (local[0] / local[1].clamp(min=1)).item()
        rate = self.timer.samples_per_s(batch.global_count)
        lr = float(state.scheduler.get_last_lr()[0])  # a float already; torch types it float | Tensor
        grad_norm = float(stats["grad_norm"])
        self.log.info(
            "step",
            step=state.step,
            epoch=batch.epoch,
            loss=round(loss, 6),
            rank_loss=round(local_loss, 6),
            lr=lr,
            grad_norm=round(grad_norm, 6),
            samples_per_s=round(rate, 2),
            world_size=self.ctx.world_size,
            cursor=state.cursor.samples_consumed,
        )
        self.console.progress(state.step, loss, rate)
        if self.scalars:
            self.scalars.add(state.step, loss=local_loss, grad_norm=grad_norm, lr=lr, samples_per_s=rate)
        if self.trackers:
            world = float(self.ctx.world_size)
            self.trackers.log(
                state.step, loss=loss, grad_norm=grad_norm, lr=lr, samples_per_s=rate, world_size=world
            )

    # ---- evaluation and the end ---------------------------------------------------------------------
    def run_eval(self) -> dict[str, float] | None:
        """Evaluate the current state; its scores (on every rank) are observed by the best tracker."""
        if self.data.eval is None:
            return None
        started = time.perf_counter()
        scores = evaluate(
            unwrap(self.model),
            self.family,
            self.data.eval,
            self.data.eval_examples,
            self.cfg.train.eval_batch_size,
            self.cfg.data.max_answer_len,
            self.device,
            self.autocast_dtype,
            n_best=self.cfg.eval.n_best,
            null_threshold=self.cfg.eval.null_threshold,
            cjk=self.cfg.eval.cjk_tokens,
        )
        if scores is not None:
            step = self.state.step
            self.log.info(
                "eval",
                step=step,
                em=round(scores["em"], 4),
                f1=round(scores["f1"], 4),
                loss=round(scores["loss"], 6),
                questions=scores["count"],
                seconds=round(time.perf_counter() - started, 3),
            )
            self.console.line(f"eval step {step}: {em_f1_text(scores['em'], scores['f1'])}")
            if self.scalars:
                self.scalars.add(step, **_tracked(scores))
        shared = self._shared_scores(scores)
        if shared is not None:
            self._observe(shared)
            if self.trackers:
                self.trackers.log(self.state.step, **_tracked(shared))
        return shared if scores is None else scores

    def _shared_scores(self, scores: dict[str, float] | None) -> dict[str, float] | None:
        """Rank 0's scores on every rank (evaluate scores on rank 0 only): every rank's best tracker must
        agree, as any rank may write an emergency checkpoint and all must stop early together."""
        if not self.ctx.distributed:
            return scores

        def share() -> SharedScores:
            if scores is None:
                return SharedScores(False, 0.0, 0.0, 0.0)
            return SharedScores(True, scores["em"], scores["f1"], scores["loss"])

        shared = decide_on_rank0(self.ctx, self.control_group, share, SharedScores)
        return {"em": shared.em, "f1": shared.f1, "loss": shared.loss} if shared.scored else None

    def _observe(self, scores: dict[str, float]) -> None:
        best, step = self.state.best, self.state.step
        if best.observe(step, scores) and self.ctx.is_main:
            self.log.info("eval_best", step=step, metric=best.metric, value=round(scores[best.metric], 4))
        if best.exhausted and self.ctx.is_main and step < self.state.end_step:  # else: the end anyway
            self._log_early_stop()

    def _log_early_stop(self) -> None:
        best = self.state.best
        self.log.info(
            "early_stop",
            step=self.state.step,
            metric=best.metric,
            best=best.value,
            best_step=best.step,
            evaluations_without_improvement=best.stale_evals,
            patience=best.patience,
            min_delta=best.min_delta,
        )
        self.console.line(
            f"early stop at step {self.state.step}: {best.stale_evals} evaluations in a row without "
            f"{best.metric} above {best.value:.4f} + {best.min_delta} (the best, at step {best.step})"
        )

    def _stop(self) -> dict[str, Any]:
        self.control.enter(Phase.STOPPING)
        # The control all-reduce carries that some rank was asked to stop, not by what: a rank that was not
        # signalled itself (rank 0 when `leave` stopped another agent) names the stop generically.
        reason = self.stop_request.signal_name or OTHER_RANK_STOP
        self.log.warning("stopping", step=self.state.step, signal=reason)
        with self.stop_request.saving():
            self.session.save_for_stop()
        if self.trackers:
            self.trackers.close(finished=False)
        return {"stopped": True, "step": self.state.step}

    def _finish(self) -> dict[str, Any]:
        """Final evaluation and checkpoint. Done only once the final state is committed and verified."""
        self.control.enter(Phase.DONE)
        step = self.state.step
        early = self.state.best.exhausted and step < self.state.end_step
        if early and self.ctx.is_main and self.session.resumed_step == step:
            self._log_early_stop()  # resumed from an early stop: its final checkpoint stands
        # Evaluated at this step already (an early stop): the same state scores the same.
        scores = self.state.best.scores_at(step) or self.run_eval()
        self.session.save_final()
        if self.scalars:
            self.scalars.close()
        if self.trackers:
            self.trackers.close(finished=True)
        self.log.info(
            "train_done",
            step=self.state.step,
            tokens_seen=self.state.tokens_seen,
            **({"em": scores["em"], "f1": scores["f1"], "eval_loss": scores["loss"]} if scores else {}),
        )
        return {"stopped": False, "step": self.state.step, **(scores or {})}
