"""The training loop: restore, then step / log / evaluate / checkpoint until max_steps, then finish.

    restore newest valid checkpoint (or start fresh)
    for each global batch from the cursor on:
        train one step (this rank's share, micro-batches under no_sync, loss / global count)
        advance the cursor; agree with all ranks on "save now?" and "stop now?"
        log, evaluate, checkpoint as due
    evaluate, final checkpoint, train_done

Failure handling is a small state machine around that loop:
    RUNNING --SIGTERM on any rank--> STOPPING: all ranks finish the step, rank 0 commits it, exit 75
    RUNNING --a collective fails (a peer died or froze)--> EMERGENCY: commit the last completed step, exit 1
    RUNNING --max_steps reached--> DONE: final eval and checkpoint, exit 0
Exit 75 (a peer is leaving) and 1 make the torchrun agents regroup; neither loses a completed step.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import sys
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_qa.checkpoint.manager import Checkpointer, LoadedCheckpoint, Rejection
from elastic_qa.checkpoint.policy import SaveSchedule
from elastic_qa.checkpoint.state import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    TRAINER_FILE,
    rng_state,
    set_rng_state,
    versions,
)
from elastic_qa.checkpoint.store import CheckpointError, CheckpointStore, step_dir_name
from elastic_qa.config import Config, ConfigError
from elastic_qa.data.cache import PreparedData
from elastic_qa.data.cursor import GlobalCursor
from elastic_qa.data.loader import build_train_loader
from elastic_qa.dist import CommTimer, DistContext, unwrap, wrap_model
from elastic_qa.elastic.fencing import Fence
from elastic_qa.elastic.signals import StopRequest
from elastic_qa.evaluate import evaluate
from elastic_qa.model import SpanQA, span_loss
from elastic_qa.observe.breakdown import StepTimer
from elastic_qa.observe.console import Console
from elastic_qa.observe.ledger import SampleLedger
from elastic_qa.observe.log import get_logger, update_identity
from elastic_qa.observe.tensorboard import TensorBoardScalars

EXIT_REGROUP = 75  # a peer is leaving (SIGTERM): this worker saved and wants the agents to regroup


class ResumeError(RuntimeError):
    """A checkpoint exists but does not fit this run (model shape, data); the message says what."""


class PeerFailure(RuntimeError):
    """A collective failed: a peer died, froze past dist.timeout, or its agent restarted the group."""


class FinalStateError(RuntimeError):
    """Training reached max_steps but its final state could not be committed: the job is not done."""


def lr_multiplier(warmup_steps: int, total_steps: int, min_ratio: float):
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_ratio` at `total_steps`."""

    def multiplier(completed: int) -> float:
        if completed < warmup_steps:
            return (completed + 1) / warmup_steps
        progress = min(1.0, (completed - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def step_seed(seed: int, step: int, rank: int) -> int:
    """Per-step randomness (dropout) from (seed, step, rank): identical after any resume."""
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63)


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        # Biases, norms and embeddings are not weight-decayed (standard for transformers).
        (
            no_decay
            if param.ndim < 2 or "tokens" in name or "segments" in name or "in_question" in name
            else decay
        ).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    try:
        # The fused kernel (CPU and CUDA since torch 2.4) is one pass over the parameters: measured 0.8 ms
        # per step for the default model on one CPU thread, against 3.9 ms for foreach, 4.4 ms for the loop.
        return torch.optim.AdamW(groups, lr=cfg.train.peak_lr, fused=True)
    except (RuntimeError, ValueError):  # a device or torch build without the fused kernel
        return torch.optim.AdamW(groups, lr=cfg.train.peak_lr, foreach=True)


@dataclass
class Decision:
    stop: bool  # some rank was asked to stop (SIGTERM): all stop after this step
    save: bool  # rank 0's timer says a periodic checkpoint is due


class Trainer:
    def __init__(
        self, cfg: Config, ctx: DistContext, data: PreparedData, stop_request: StopRequest | None = None
    ) -> None:
        self.cfg, self.ctx, self.data = cfg, ctx, data
        self.log = get_logger()
        self.device = ctx.device
        torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
        model = SpanQA(data.vocab_size, cfg.model).to(self.device)
        self.comm_timer = CommTimer()
        self.model = wrap_model(model, ctx, cfg.dist, self.comm_timer)
        self.optimizer = build_optimizer(model, cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lr_multiplier(cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.min_lr_ratio),
        )
        precision = cfg.train.precision
        if precision == "fp16" and self.device.type != "cuda":
            raise ConfigError("train.precision=fp16 needs CUDA (GradScaler); on CPU use train.precision=bf16")
        self.autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        self.cursor = GlobalCursor(len(data.train), cfg.train.global_batch_size, cfg.run.seed)
        self.step = 0
        self.resumed_step: int | None = None
        self.tokens_seen = 0
        self.store = CheckpointStore(cfg.checkpoint_dir)
        self.fence = Fence(self.store)
        self.checkpointer = Checkpointer(
            cfg.checkpoint, self.store, may_commit=self.fence.check, before_file=storage_fault_hook(cfg)
        )
        self.schedule = SaveSchedule(cfg.checkpoint)
        # Shared with the agent watchdog, which asks for a stop through it when the agent dies.
        self.stop_request = stop_request or StopRequest()
        # Control flags travel on a CPU (gloo) group, so reading them never syncs a GPU stream.
        self.control_group = None
        # The outcome of the final save travels on a group whose timeout covers its retries.
        self.final_group = None
        if ctx.distributed:
            self.control_group = dist.new_group(backend="gloo") if ctx.backend != "gloo" else dist.group.WORLD
            final_timeout = cfg.checkpoint.final_retry_for + cfg.dist.timeout + timedelta(minutes=1)
            self.final_group = dist.new_group(backend="gloo", timeout=final_timeout)
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"single-{uuid.uuid4().hex[:12]}"
        self.rejected: list[Rejection] = []
        self.restored: LoadedCheckpoint | None = None
        self.timer = StepTimer(self.device, cfg.log.breakdown_every, self.comm_timer)
        self.console = Console(cfg.log.console, cfg.train.max_steps, enabled=ctx.is_main)
        self.ledger: SampleLedger | None = None
        self.scalars = TensorBoardScalars(cfg.run.dir, ctx.rank) if cfg.log.tensorboard else None
        self.attempt = 0

    # ---- start-up: restore (reads only), then register (the first write) --------------------------------
    def restore(self) -> LoadedCheckpoint | None:
        """Load the newest checkpoint that verifies (chosen by rank 0, loaded by all) into this run.

        Nothing is written: a start that is refused here (a checkpoint of another model, another job's
        checkpoints under checkpoint.resume=false) leaves the store, and any job running on it, untouched.
        """
        verdict = torch.tensor([-1, 0], dtype=torch.int64)  # chosen step, refused
        loaded, refusal = None, ""
        if self.ctx.is_main:
            try:
                loaded = self._choose_checkpoint()
                verdict[0] = loaded.step if loaded else -1
            except ResumeError as err:
                refusal, verdict[1] = str(err), 1
        if self.ctx.distributed:
            dist.broadcast(verdict, src=0, group=self.control_group)
        if verdict[1]:
            raise ResumeError(refusal or "rank 0 refused to resume (its log says why)")
        if verdict[0] >= 0 and loaded is None:
            path = self.store.path(step_dir_name(int(verdict[0])))
            loaded = self.checkpointer.load_step(path, int(verdict[0]))
        if loaded is not None:
            self._apply(loaded)
        self.restored = loaded
        return loaded

    def _choose_checkpoint(self) -> LoadedCheckpoint | None:
        """Rank 0: the checkpoint to resume, or None to start fresh; ResumeError: the start must not go on."""
        cfg = self.cfg
        if not cfg.checkpoint.resume:
            foreign = [info for info in self.store.list_steps() if self._run_id_of(info.path) != self.run_id]
            if foreign:
                raise ResumeError(
                    f"checkpoint.resume=false, but {self.store.url} holds checkpoints of another job "
                    f"(newest: step {foreign[-1].step}); use a new run.dir or checkpoint.dir, or resume them"
                )
        self.rejected = []
        loaded = self.checkpointer.load_newest(self.rejected)
        if loaded is None and cfg.checkpoint.require_resume:
            raise ResumeError(
                f"checkpoint.require_resume=true but {self.store.url} holds no valid checkpoint"
            )
        if loaded is not None and loaded.step > cfg.train.max_steps:
            raise ResumeError(
                f"checkpoint {self.store.display(loaded.path)} is at step {loaded.step}, past "
                f"train.max_steps={cfg.train.max_steps}: nothing to train (raise train.max_steps to continue)"
            )
        return loaded

    def _run_id_of(self, path: str) -> str | None:
        try:
            return self.store.read_manifest(path).get("run_id")
        except (OSError, ValueError):
            return None

    def register_attempt(self) -> int:
        """Job-wide attempt number: rank 0 claims the next one in the checkpoint store, all ranks agree.

        Then rank 0 clears what older attempts left (their staging, the checkpoints rejected at restore) and
        checks that no checkpoint newer than the restored one was committed meanwhile by a group that was
        still running (it is fenced from now on); if one was, every rank restores again.
        """
        info = torch.zeros(2, dtype=torch.int64)  # attempt, restore again
        if self.ctx.is_main:
            info[0] = self.fence.register(self.ctx.world_size)
            self.store.clean_staging(int(info[0]))
            for rejection in self.rejected:
                self._quarantine(rejection)
            committed = self.store.list_steps()
            restored_step = self.restored.step if self.restored else -1
            info[1] = int(bool(committed) and committed[-1].step > restored_step)
        if self.ctx.distributed:
            dist.broadcast(info, src=0, group=self.control_group)
        self.attempt = self.fence.attempt = int(info[0])
        update_identity(attempt=self.attempt)
        if info[1]:
            self.log.warning("checkpoint_appeared", restored_step=self.step)
            self.restore()
        if self.cfg.debug.sample_ledger:
            self.ledger = SampleLedger(self.cfg.run.dir, self.attempt, self.ctx.rank, self.ctx.world_size)
        return self.attempt

    def _quarantine(self, rejection: Rejection) -> None:
        try:
            target = self.store.quarantine(rejection.path, rejection.reason)
            self.log.warning(
                "checkpoint_quarantined",
                step=rejection.step,
                path=self.store.display(target),
                reason=rejection.reason,
            )
        except (OSError, CheckpointError) as err:  # a replay of that step supersedes it all the same
            self.log.warning("checkpoint_quarantine_failed", step=rejection.step, error=str(err))

    def log_start(self) -> None:
        """Say where training starts: `resume` (with the checkpoint) or `start_fresh`."""
        loaded = self.restored
        if loaded is None:
            self.log.info("start_fresh", checkpoint_dir=self.store.url)
            return
        self.log.info(
            "resume",
            step=self.step,
            path=self.store.display(loaded.path),
            saved_world_size=loaded.trainer["trainer"]["world_size"],
            world_size=self.ctx.world_size,
            epoch=self.cursor.epoch,
            cursor=self.cursor.samples_consumed,
        )

    def _apply(self, loaded: LoadedCheckpoint) -> None:
        state = loaded.trainer
        try:
            unwrap(self.model).load_state_dict(loaded.model)
            self.optimizer.load_state_dict(loaded.optimizer)
            self.cursor.load_state_dict(state["data"])
        except (RuntimeError, ValueError, KeyError) as err:
            # load_state_dict lists every mismatch; the first two say enough on one line.
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            detail = "; ".join(lines[1:3] if len(lines) > 1 else lines)
            raise ResumeError(f"checkpoint {loaded.path} does not fit this run: {detail}") from None
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        # An explicit lr (the config may have changed it) wins over the saved base lr.
        self.scheduler.base_lrs = [self.cfg.train.peak_lr for _ in self.scheduler.base_lrs]
        self.step = self.resumed_step = int(state["trainer"]["step"])
        self.tokens_seen = int(state["trainer"]["tokens_seen"])
        rngs = state.get("rng", {})
        if str(self.ctx.rank) in rngs:
            set_rng_state(rngs[str(self.ctx.rank)])

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        self.stop_request.install()
        loader = build_train_loader(
            self.data.train,
            self.cursor,
            self.step + 1,
            cfg.train.max_steps,
            self.ctx.rank,
            self.ctx.world_size,
            cfg.data.num_workers,
            pin_memory=self.device.type == "cuda",
        )
        self.log.info(
            "train_start",
            step=self.step,
            max_steps=cfg.train.max_steps,
            train_windows=len(self.data.train),
            world_size=self.ctx.world_size,
        )
        self.schedule.saved()
        self.next_control = self.step + 1
        batches = iter(loader)
        try:
            while self.step < cfg.train.max_steps:
                self.timer.start_step(self.step + 1)
                batch = next(batches)
                self.timer.mark("data")
                control = self._start_control()
                self._check_batch(batch)
                if self.ledger:
                    self.ledger.record(batch["step"], batch["epoch"], batch["indices"])
                stats, decision = self._train_step(batch, control)
                self._after_step(batch, stats, decision)
                if decision.stop:
                    return self._stop_for_regroup()
            return self._finish()
        except (RuntimeError, dist.DistBackendError) as err:
            if not self.ctx.distributed or isinstance(err, CheckpointError | ResumeError | FinalStateError):
                raise
            self._emergency_save(f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
            raise PeerFailure(str(err)) from err
        finally:
            self.stop_request.uninstall()

    def _check_batch(self, batch: dict[str, Any]) -> None:
        if batch["step"] != self.step + 1:  # a loader bug would silently break exactly-once
            raise AssertionError(f"loader produced step {batch['step']}, expected {self.step + 1}")

    def _train_step(self, batch: dict[str, Any], control) -> tuple[dict[str, Any], Decision]:
        model, device = self.model, self.device
        model.train()
        if self.cfg.model.dropout > 0:  # re-seeding costs ~0.1 ms: only when a step draws random numbers
            torch.manual_seed(step_seed(self.cfg.run.seed, batch["step"], self.ctx.rank))
        rows = batch["input_ids"].shape[0]
        micro = self.cfg.train.micro_batch_size
        starts = list(range(0, rows, micro))
        # DDP averages gradients over ranks; scaling each rank's loss *sum* by world/global_count makes
        # the result the mean over the global batch, however unevenly it is split (seed article 3.4).
        scale = self.ctx.world_size / batch["global_count"]
        loss_sum = torch.zeros((), device=device)
        for i, lo in enumerate(starts):
            hi = lo + micro
            sync = i == len(starts) - 1 or not self.ctx.distributed
            with model.no_sync() if not sync else nullcontext():
                with torch.autocast(
                    device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
                ):
                    start_logits, end_logits = model(
                        batch["input_ids"][lo:hi].to(device, non_blocking=True),
                        batch["segment_ids"][lo:hi].to(device, non_blocking=True),
                    )
                loss = span_loss(
                    start_logits,
                    end_logits,
                    batch["start_positions"][lo:hi].to(device, non_blocking=True),
                    batch["end_positions"][lo:hi].to(device, non_blocking=True),
                    batch["weights"][lo:hi].to(device, non_blocking=True),
                )
                loss_sum += loss.detach()
                (self.scaler.scale(loss * scale) if self.scaler else loss * scale).backward()
        self.timer.mark("forward_backward")
        decision = self._finish_control(control)  # the last collective of the step
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), self.cfg.train.grad_clip or float("inf"), foreach=True
        )
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The step is complete: every piece of state moves together, with no collective in between.
        self.cursor.advance_to(batch["epoch"], batch["global_count"])
        self.step = batch["step"]
        self.tokens_seen += batch["global_tokens"]
        self.timer.mark("optimizer")
        return {"loss_sum": loss_sum, "count": len(batch["indices"]), "grad_norm": grad_norm}, decision

    def _start_control(self):
        """On a control step, start the agreement on (stop, timed save, steps to the next control step);
        the all-reduce overlaps with the step's compute. Other steps have no collective of their own.

        Control steps come about every dist.control_period: rank 0 proposes how many steps that is from
        its own step time, and the all-reduce hands every rank the same number.
        """
        if self.step + 1 < self.next_control:
            return None
        every = 1
        if self.ctx.is_main:
            step_s = self.timer.mean_step_s()
            period = self.cfg.dist.control_period.total_seconds()
            every = max(1, min(1000, round(period / step_s))) if step_s else 1
        flags = torch.tensor(
            [
                float(self.stop_request.notice(self.log)),
                float(self.ctx.is_main and self.schedule.time_due(self.checkpointer.failing)),
                float(every if self.ctx.is_main else 0),
            ],
            dtype=torch.float64,
        )
        if not self.ctx.distributed:
            return flags, None
        return flags, dist.all_reduce(flags, group=self.control_group, async_op=True)

    def _finish_control(self, control) -> Decision:
        if control is None:
            return Decision(stop=False, save=False)
        flags, work = control
        if work is not None:
            work.wait()
        self.next_control = self.step + 1 + int(flags[2].item())
        return Decision(stop=flags[0].item() > 0, save=flags[1].item() > 0)

    def _after_step(self, batch: dict[str, Any], stats: dict[str, Any], decision: Decision) -> None:
        cfg, step = self.cfg, self.step
        if step % cfg.log.every_steps == 0 or step == cfg.train.max_steps:
            self._log_step(batch, stats)
        due = decision.save or self.schedule.step_due(step)
        if due and not decision.stop and step < cfg.train.max_steps:
            self.save(reason="periodic")
        self.timer.mark("log_and_save")
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.max_steps:
            self.run_eval()
        self.timer.finish_step(
            self.ctx, self.control_group, self.log, self.console if self.ctx.is_main else None
        )
        self._debug_hooks(step)

    def _log_step(self, batch: dict[str, Any], stats: dict[str, Any]) -> None:
        local = torch.stack([stats["loss_sum"].float().cpu(), torch.tensor(float(stats["count"]))])
        totals = local.clone()
        if self.ctx.distributed:
            dist.all_reduce(totals, group=self.control_group)
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        local_loss = (local[0] / local[1].clamp(min=1)).item()
        rate = self.timer.samples_per_s(batch["global_count"])
        self.log.info(
            "step",
            step=self.step,
            epoch=batch["epoch"],
            loss=round(loss, 6),
            rank_loss=round(local_loss, 6),
            lr=self.scheduler.get_last_lr()[0],
            grad_norm=round(float(stats["grad_norm"]), 6),
            samples_per_s=round(rate, 2),
            world_size=self.ctx.world_size,
            cursor=self.cursor.samples_consumed,
        )
        self.console.progress(self.step, loss, rate)
        if self.scalars:
            self.scalars.add(
                self.step,
                loss=local_loss,
                grad_norm=float(stats["grad_norm"]),
                lr=self.scheduler.get_last_lr()[0],
                samples_per_s=rate,
            )

    def _debug_hooks(self, step: int) -> None:
        debug = self.cfg.debug
        if debug.step_delay.total_seconds() > 0:
            time.sleep(debug.step_delay.total_seconds())
        if debug.kill_at_step == step and debug.kill_rank == self.ctx.rank:
            marker = Path(self.cfg.run.dir) / "debug" / f"killed-step-{step}-rank-{self.ctx.rank}"
            if not marker.exists():  # once per run, however often the step is replayed
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
                self.log.warning("debug_kill", step=step)
                os.kill(os.getpid(), signal.SIGKILL)

    # ---- evaluation and saving ----------------------------------------------------------------------
    def run_eval(self) -> dict[str, float] | None:
        if self.data.eval is None:
            return None
        started = time.perf_counter()
        scores = evaluate(
            unwrap(self.model),
            self.data.eval,
            self.data.eval_examples,
            self.cfg.train.eval_batch_size,
            self.cfg.data.max_answer_len,
            self.device,
            self.autocast_dtype,
        )
        if scores is not None:
            self.log.info(
                "eval",
                step=self.step,
                em=round(scores["em"], 4),
                f1=round(scores["f1"], 4),
                loss=round(scores["loss"], 6),
                questions=scores["count"],
                seconds=round(time.perf_counter() - started, 3),
            )
            self.console.line(f"eval step {self.step}: EM {scores['em']:.3f}  F1 {scores['f1']:.3f}")
            if self.scalars:
                self.scalars.add(
                    self.step, eval_em=scores["em"], eval_f1=scores["f1"], eval_loss=scores["loss"]
                )
        return scores

    def _trainer_state(self, rngs: dict[str, Any]) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "trainer": {
                "step": self.step,
                "epoch": self.cursor.epoch,
                "samples_consumed": self.cursor.samples_consumed,
                "global_batch_size": self.cfg.train.global_batch_size,
                "world_size": self.ctx.world_size,
                "tokens_seen": self.tokens_seen,
                "attempt": self.attempt,
            },
            "data": self.cursor.state_dict(),
            "rng": rngs,
            "config": self.cfg.to_dict(),
            "versions": versions(),
        }

    def _manifest_fields(self) -> dict[str, Any]:
        return {
            "epoch": self.cursor.epoch,
            "world_size": self.ctx.world_size,
            "attempt": self.attempt,
            "run_id": self.run_id,
            "config_hash": self.cfg.digest(),
            "versions": versions(),
        }

    def save(
        self, reason: str, blocking: bool = False, gather_rng: bool = True, ignore_failures: bool = False
    ) -> None:
        """Checkpoint the last completed step. Collective unless gather_rng is False."""
        state = self._checkpoint_state(gather_rng)
        if state is not None:
            self._write_checkpoint(state, reason, blocking, ignore_failures)

    def _checkpoint_state(self, gather_rng: bool = True) -> dict[str, Any] | None:
        """The full training state as checkpoint files (None on ranks other than 0 when gathering)."""
        rngs = (
            gather_rng_states(self.ctx, self.control_group)
            if gather_rng
            else {str(self.ctx.rank): rng_state()}
        )
        if not self.ctx.is_main and gather_rng:
            return None
        return {
            MODEL_FILE: unwrap(self.model).state_dict(),
            OPTIMIZER_FILE: self.optimizer.state_dict(),
            TRAINER_FILE: self._trainer_state(rngs),
        }

    def _write_checkpoint(
        self, state: dict[str, Any], reason: str, blocking: bool, ignore_failures: bool = False
    ) -> None:
        result = self.checkpointer.save(
            self.step,
            state,
            self._manifest_fields(),
            blocking=blocking,
            reason=reason,
            ignore_failures=ignore_failures,
        )
        self.timer.add_stall(result.blocking_seconds)
        self.schedule.saved()

    def _save_until_committed(self, state: dict[str, Any], reason: str, retry_for: timedelta) -> bool:
        """Write `state` (blocking), retrying storage errors with back-off for `retry_for`; whether the
        step is committed and verified. A fenced writer (another group owns the run) stops at once."""
        deadline = time.monotonic() + retry_for.total_seconds()
        pause = 0.5
        while True:
            self._write_checkpoint(state, reason, blocking=True, ignore_failures=True)
            if self.checkpointer.last_committed_step == self.step:
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

    def _emergency_save(self, reason: str) -> None:
        """A collective failed: commit the last completed step from this replica (any survivor may).

        Storage errors are retried for `checkpoint.emergency_retry_for`: this replica may hold the only copy.
        """
        self.log.error("emergency_checkpoint", step=self.step, reason=reason)
        try:
            self.checkpointer.wait()
            if self.step == 0 or self._committed_by_us(self.step):
                return
            # Survivors all hold the same state; stagger them so that usually only one writes it.
            time.sleep(min(self.ctx.rank, 8) * 0.2)
            if self._committed_by_us(self.step):
                return
            state = self._checkpoint_state(gather_rng=False)
            if not self._save_until_committed(state, "emergency", self.cfg.checkpoint.emergency_retry_for):
                self._report_uncommitted("emergency")
        except Exception as err:  # noqa: BLE001 - already failing: report, never mask the cause
            self.log.error(
                "emergency_checkpoint_failed", step=self.step, error=f"{type(err).__name__}: {err}"
            )

    def _report_uncommitted(self, reason: str) -> None:
        if self.checkpointer.fenced:  # not a loss: a newer group owns the run and holds the newer state
            self.log.warning(
                "not_saved_stale", step=self.step, reason=reason, error=self.checkpointer.last_error
            )
            return
        message = (
            f"step {self.step} could not be committed ({reason} save; last error: "
            f"{self.checkpointer.last_error or 'none'}): work since the last checkpoint is lost"
        )
        self.log.error("checkpoint_lost", step=self.step, reason=reason, error=self.checkpointer.last_error)
        with contextlib.suppress(OSError):
            print(f"elastic-qa: {message}", file=sys.stderr, flush=True)

    def _stop_for_regroup(self) -> dict[str, Any]:
        self.log.warning("stopping", step=self.step, signal=self.stop_request.signal_name)
        if self.step > 0 and self.resumed_step != self.step:
            state = self._checkpoint_state()  # collective: every rank's RNG
            if state is not None and not self._save_until_committed(
                state, "sigterm", self.cfg.checkpoint.emergency_retry_for
            ):
                self._report_uncommitted("sigterm")
        self.checkpointer.wait()
        return {"stopped": True, "step": self.step}

    def _finish(self) -> dict[str, Any]:
        """Final evaluation and checkpoint. Done only once the final state is committed and verified."""
        scores = self.run_eval()
        committed = torch.ones(1, dtype=torch.int64)
        state = self._checkpoint_state() if self.resumed_step != self.step else None  # collective
        if self.ctx.is_main:
            if state is not None:
                ok = self._save_until_committed(state, "final", self.cfg.checkpoint.final_retry_for)
            else:  # resumed at max_steps: that checkpoint is the final state; it must still stand
                ok = self.store.verify(self.store.path(step_dir_name(self.step))).ok
            committed[0] = int(ok)
        if self.ctx.distributed:
            dist.broadcast(committed, src=0, group=self.final_group)
        if not committed[0]:
            if self.ctx.is_main:
                self._report_uncommitted("final")
            raise FinalStateError(
                f"training reached step {self.step} but its final state could not be committed to "
                f"{self.store.url} (last error: {self.checkpointer.last_error or 'see rank 0'})"
            )
        self.checkpointer.wait()
        if self.scalars:
            self.scalars.close()
        self.log.info(
            "train_done",
            step=self.step,
            tokens_seen=self.tokens_seen,
            **({"em": scores["em"], "f1": scores["f1"], "eval_loss": scores["loss"]} if scores else {}),
        )
        return {"stopped": False, "step": self.step, **(scores or {})}


def storage_fault_hook(cfg: Config):
    """Debug fault injection before each checkpoint file write: a delay, and ENOSPC while a flag exists."""
    delay = cfg.debug.save_delay.total_seconds()
    flag = Path(cfg.debug.storage_fault_file) if cfg.debug.storage_fault_file else None

    def before_file(name: str) -> None:
        if delay:
            time.sleep(delay)
        if flag is not None and flag.exists():
            raise OSError(errno.ENOSPC, f"injected storage fault ({flag} exists)", name)

    return before_file


def gather_rng_states(ctx: DistContext, group) -> dict[str, Any]:
    """Every rank's RNG state on rank 0, moved as bytes in uint8 tensors and read with weights_only."""
    import io

    mine = rng_state()
    if not ctx.distributed:
        return {"0": mine}
    buffer = io.BytesIO()
    torch.save(mine, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, torch.tensor([payload.numel()]), group=group)
    widest = int(max(s.item() for s in sizes))
    padded = torch.zeros(widest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    parts = [torch.empty(widest, dtype=torch.uint8) for _ in range(ctx.world_size)]
    dist.all_gather(parts, padded, group=group)
    if not ctx.is_main:
        return {}
    return {
        str(rank): torch.load(io.BytesIO(part[: int(size.item())].numpy().tobytes()), weights_only=True)
        for rank, (part, size) in enumerate(zip(parts, sizes, strict=True))
    }
