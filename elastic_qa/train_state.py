"""The training state: everything a checkpoint holds and a resume restores, in one place, under constant keys.

    model.pt      the unwrapped model's state dict
    optimizer.pt  the optimizer's
    trainer.pt    {"format": 2,
                   "lr_scheduler", "grad_scaler" (None without one),
                   "data":     the cursor (epoch, samples consumed): the one data position,
                   "counters": step, tokens_seen,
                   "rng":      every rank's generators, by rank,
                   "saved_by": world_size, global_batch_size, attempt (facts about the save, never restored),
                   "best":     the best evaluation so far and the early-stop count (checkpoint/best.py;
                               absent in checkpoints written before it existed),
                   "length":   the epochs asked for and the step they resolved to (run_length.py),
                   "config", "versions",
                   "vocabulary": the tokenizer.json text (data.tokenizer=wordpiece; absent otherwise),
                   "metrics_backlog": [[step, {metric: value}], ...]: what rank 0's trackers are given
                                      again on resume (observe/trackers; absent without trackers),
                   "unwritten_lines": [{figure: value}, ...]: the `step` lines still waiting for their
                                      loss sums when the checkpoint was taken (an emergency save after a
                                      peer died), with the saving rank's share, and those written from
                                      the last sums (rank 0 may have died before writing its own); the
                                      resumed group writes those rank 0 did not (loop/step_log.py; absent
                                      when there are none),
                   "loss_invariant": {"identity", "frozen": [names]}: the freeze probe's answer, which a
                                     restart of the same model takes instead of probing again
                                     (loop/freeze.py; absent without train.freeze_loss_invariant)}

`state_dict()` and `load_state_dict()` are the only code that knows this layout. Checkpoints written before
the layout had a format number (format 1: a "trainer" table that repeated the data position) still load;
a newer format is refused with exit 2, naming the version.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ProcessGroup

from elastic_qa.checkpoint.best import BestTracker
from elastic_qa.checkpoint.manager import LoadedCheckpoint
from elastic_qa.checkpoint.payload import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    TRAINER_FILE,
    rng_state,
    set_rng_state,
    versions,
)
from elastic_qa.config import Config
from elastic_qa.data.cursor import GlobalCursor
from elastic_qa.dist import DistContext, all_gather_bytes, unwrap
from elastic_qa.optim import retarget_schedule
from elastic_qa.run_length import end_step, length_record

STATE_FORMAT = 2

# The figures of a `step` line that a checkpoint carries ("unwritten_lines", loop/step_log.py): their types.
LINE_FIELDS = {
    "step": int,
    "epoch": int,
    "lr": float,
    "grad_norm": float,
    "samples_per_s": float,
    "cursor": int,
    "ts": float,
    "world_size": int,
    "rank": int,
    "loss_sum": float,  # this rank's share of the global batch: its loss sum and samples (the whole
    "samples": float,  # batch's for a line already written: `written`)
}
# And "written" (a bool, False when absent): a line this rank wrote from the last sums that arrived, which
# rank 0, dead before writing its own, may not have written.


class ResumeError(RuntimeError):
    """A checkpoint exists but does not fit this run (model shape, data, format); the message says what."""


def step_seed(seed: int, step: int, rank: int) -> int:
    """Per-step randomness (dropout) from (seed, step, rank): identical after any resume."""
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63)


def seed_step_rng(seed: int, device: torch.device) -> None:
    """Seed the generators a training step draws from: the CPU's and, on a GPU, that device's. The same
    streams as torch.manual_seed, without its visit to every other backend (~0.1 ms, paid every step)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)  # the current device: the one this rank trains on


class TrainState:
    """Model, optimizer, LR schedule, grad scaler, data cursor, counters and RNG of one rank."""

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LambdaLR,  # optim.build_scheduler's (retarget_schedule needs it)
        scaler: torch.amp.GradScaler | None,
        cursor: GlobalCursor,
        vocabulary: str | None = None,
        end: int | None = None,
        loss_invariant: dict[str, Any] | None = None,
    ) -> None:
        self.cfg, self.ctx = cfg, ctx
        # The step training ends at (run_length.end_step; default train.max_steps); a resume may keep the
        # one its checkpoint recorded.
        self.end_step = cfg.train.max_steps if end is None else end
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.cursor = cursor
        self.vocabulary = vocabulary  # the tokenizer's, when it has one of its own (PreparedData.vocabulary)
        self.loss_invariant = loss_invariant  # the freeze's answer (loop/freeze.py), saved for restarts
        self.step = 0  # optimizer steps completed
        self.tokens_seen = 0
        self.best = BestTracker(cfg.checkpoint)
        # Metric records replayed to the trackers on resume, so that a tracker running behind the checkpoint
        # still gets every step (observe/trackers).
        self.metrics_backlog: list[tuple[int, dict[str, float]]] = []
        self.tracker_backlog: Callable[[], list[tuple[int, dict[str, float]]]] = list
        # The step lines not written yet (StepLog.unwritten), and those a restored checkpoint carried.
        self.unwritten_lines: Callable[[], list[dict[str, Any]]] = list
        self.recovered_lines: list[dict[str, Any]] = []
        self.saved_attempt = 0  # the attempt that wrote the restored checkpoint (0: none restored)

    def complete_step(self, step: int, epoch: int, global_count: int, global_tokens: int) -> None:
        """Step `step` (`global_count` samples, `global_tokens` tokens, of `epoch`) is applied: the counters
        and the data position move together."""
        self.cursor.advance_to(epoch, global_count)
        self.step = step
        self.tokens_seen += global_tokens

    # ---- saving -------------------------------------------------------------------------------------
    def state_dict(self, rngs: dict[str, Any], attempt: int) -> dict[str, Any]:
        """The checkpoint files ({file name: state}); `rngs` holds every rank's generators (rank 0 saves)."""
        trainer = {
            "format": STATE_FORMAT,
            "lr_scheduler": self.scheduler.state_dict(),
            "grad_scaler": self.scaler.state_dict() if self.scaler else None,
            "data": self.cursor.state_dict(),
            "counters": {"step": self.step, "tokens_seen": self.tokens_seen},
            "rng": rngs,
            "saved_by": {
                "world_size": self.ctx.world_size,
                "global_batch_size": self.cfg.train.global_batch_size,
                "attempt": attempt,
            },
            "length": length_record(self.cfg.train, self.end_step),
            "config": self.cfg.to_dict(),
            "versions": versions(),
            "best": self.best.state_dict(),
        }
        if self.vocabulary is not None:  # the model's ids mean nothing without it: it travels with them
            trainer["vocabulary"] = self.vocabulary
        if self.loss_invariant is not None:
            trainer["loss_invariant"] = self.loss_invariant
        backlog = self.tracker_backlog()
        if backlog:
            trainer["metrics_backlog"] = [[step, metrics] for step, metrics in backlog]
        lines = self.unwritten_lines()
        if lines:
            trainer["unwritten_lines"] = lines
        return {
            MODEL_FILE: unwrap(self.model).state_dict(),
            OPTIMIZER_FILE: self.optimizer.state_dict(),
            TRAINER_FILE: trainer,
        }

    # ---- restoring ----------------------------------------------------------------------------------
    def load_state_dict(self, loaded: LoadedCheckpoint) -> None:
        """Restore every piece from a verified checkpoint; ResumeError when it does not fit this run."""
        trainer = upgrade(loaded.trainer, loaded.path)
        saved = trainer.get("vocabulary")
        if saved is not None and self.vocabulary is not None and saved != self.vocabulary:
            # Same size, other ids: the weights would load and mean something else.
            raise ResumeError(
                f"checkpoint {loaded.path} was trained with another wordpiece vocabulary than this run's "
                "(its training data or data.vocab_file changed): resume with the data it was trained on, or "
                "with data.vocab_file set to the tokenizer.json that `elastic-qa export` writes of it"
            )
        try:
            unwrap(self.model).load_state_dict(loaded.model)
            self.optimizer.load_state_dict(loaded.optimizer)
            self.cursor.load_state_dict(trainer["data"])
        except (RuntimeError, ValueError, KeyError) as err:
            # load_state_dict lists every mismatch; the first two say enough on one line.
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            detail = "; ".join(lines[1:3] if len(lines) > 1 else lines)
            raise ResumeError(f"checkpoint {loaded.path} does not fit this run: {detail}") from None
        self.scheduler.load_state_dict(trainer["lr_scheduler"])
        # Another shape, max_steps, warm-up or floor re-aims the schedule from where it stands (optim.py).
        saved_train = trainer["config"].get("train", {}) if isinstance(trainer["config"], dict) else {}
        self.end_step = end_step(self.cfg.train, self.cursor.num_samples, trainer.get("length"))
        retarget_schedule(self.scheduler, self.cfg, trainer["lr_scheduler"], saved_train, self.end_step)
        if self.scaler is not None and trainer["grad_scaler"]:
            self.scaler.load_state_dict(trainer["grad_scaler"])
        # An explicit lr (the config may have changed it) wins over the saved base lr.
        self.scheduler.base_lrs = [self.cfg.train.peak_lr for _ in self.scheduler.base_lrs]
        self.step = int(trainer["counters"]["step"])
        self.tokens_seen = int(trainer["counters"]["tokens_seen"])
        self.best.load_state_dict(trainer.get("best"))
        self.metrics_backlog = metrics_backlog(trainer.get("metrics_backlog", []), loaded.path)
        self.recovered_lines = unwritten_lines(trainer.get("unwritten_lines", []), loaded.path)
        self.saved_attempt = int(trainer["saved_by"].get("attempt") or 0)
        mine = trainer["rng"].get(str(self.ctx.rank))
        if mine is not None:  # a rank the saved world did not have keeps its fresh generators
            set_rng_state(mine)


def metrics_backlog(saved: Any, where: str) -> list[tuple[int, dict[str, float]]]:
    """trainer.pt's metrics_backlog as (step, {metric: value}) records; ResumeError when it is not one."""
    try:
        return [(int(step), {str(k): float(v) for k, v in metrics.items()}) for step, metrics in saved]
    except (TypeError, ValueError, AttributeError):
        raise ResumeError(f"checkpoint {where}: metrics_backlog is not a list of [step, metrics]") from None


def unwritten_lines(saved: Any, where: str) -> list[dict[str, Any]]:
    """trainer.pt's unwritten_lines, each with every figure of LINE_FIELDS in its type; ResumeError when it
    is not that."""
    try:
        return [
            {
                **{key: kind(line[key]) for key, kind in LINE_FIELDS.items()},
                "written": line.get("written") is True,
            }
            for line in saved
        ]
    except (TypeError, ValueError, KeyError, OverflowError):
        raise ResumeError(f"checkpoint {where}: unwritten_lines is not a list of step lines") from None


def upgrade(trainer: dict[str, Any], where: str = "checkpoint") -> dict[str, Any]:
    """trainer.pt in the current layout, whatever format wrote it; ResumeError for a newer format."""
    version = trainer.get("format", 1)
    if version == STATE_FORMAT:
        return trainer
    if version != 1:
        raise ResumeError(
            f"{where}: trainer state format {version} is newer than this version reads ({STATE_FORMAT})"
        )
    counters = trainer["trainer"]
    return {
        "format": STATE_FORMAT,
        "lr_scheduler": trainer["scheduler"],
        "grad_scaler": trainer.get("scaler"),
        "data": trainer["data"],
        "counters": {"step": counters["step"], "tokens_seen": counters["tokens_seen"]},
        "rng": trainer.get("rng", {}),
        "saved_by": {
            "world_size": counters.get("world_size"),
            "global_batch_size": counters.get("global_batch_size"),
            "attempt": counters.get("attempt"),
        },
        "config": trainer.get("config", {}),
        "versions": trainer.get("versions", {}),
    }


def gather_rng_states(
    ctx: DistContext, group: ProcessGroup | None, everywhere: bool = False
) -> dict[str, Any]:
    """Every rank's RNG state on rank 0 (and on this rank too when `everywhere`), moved as bytes in uint8
    tensors and read with weights_only.

    Collective: every rank calls it at the same step (a checkpoint step).
    """
    mine = rng_state()
    if not ctx.distributed:
        return {"0": mine}
    buffer = io.BytesIO()
    torch.save(mine, buffer)
    parts = all_gather_bytes(buffer.getvalue(), ctx.world_size, group)
    if not (ctx.is_main or everywhere):
        return {}
    return {str(rank): torch.load(io.BytesIO(part), weights_only=True) for rank, part in enumerate(parts)}
