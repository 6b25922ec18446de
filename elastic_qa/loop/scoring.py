"""Evaluation during training and the best tracker's view of it, alike on every rank."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from elastic_qa.config import Config
from elastic_qa.data.cache import PreparedData
from elastic_qa.dist import DistContext, decide_on_rank0
from elastic_qa.evaluation import evaluate
from elastic_qa.metrics import em_f1_text
from elastic_qa.models import ModelFamily
from elastic_qa.observe.console import Console
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger
from elastic_qa.observe.tensorboard import TensorBoardScalars
from elastic_qa.observe.trackers import Trackers
from elastic_qa.train_state import TrainState


@dataclass(frozen=True)
class SharedScores:
    """Rank 0's evaluation scores, as every rank receives them (dist.decide_on_rank0)."""

    scored: bool  # rank 0 evaluated at this step
    em: float
    f1: float
    loss: float


def tracked(scores: dict[str, float]) -> dict[str, float]:
    """Evaluation scores under the names trackers give them."""
    return {"eval_em": scores["em"], "eval_f1": scores["f1"], "eval_loss": scores["loss"]}


class Scoring:
    """Evaluates the model at the state's step (rank 0 scores) and shows every rank's best tracker the same
    scores: any rank may write an emergency checkpoint, and all must stop early together."""

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        control_group: ProcessGroup | None,
        family: ModelFamily,
        data: PreparedData,
        state: TrainState,
        dtype: torch.dtype | None,
        console: Console,
        scalars: TensorBoardScalars | None,
    ) -> None:
        self.cfg, self.ctx, self.control_group = cfg, ctx, control_group
        self.family, self.data, self.state, self.dtype = family, data, state, dtype
        self.console, self.scalars = console, scalars
        self.log = get_logger()

    def run(
        self, model: torch.nn.Module, trackers: Trackers | None, announce: bool = True
    ) -> dict[str, float] | None:
        """Evaluate `model` (unwrapped) at the current step; its scores (on every rank) are observed by the
        best tracker. None without evaluation data. `announce` false: rank 0 writes no `eval`, `eval_best`
        or `early_stop` line (the replica mode's groups other than the writer score the same state)."""
        if self.data.eval is None:
            return None
        started = time.perf_counter()
        scores = evaluate(
            model,
            self.family,
            self.data.eval,
            self.data.eval_examples,
            self.cfg.train.eval_batch_size,
            self.cfg.data.max_answer_len,
            self.ctx.device,
            self.dtype,
            n_best=self.cfg.eval.n_best,
            null_threshold=self.cfg.eval.null_threshold,
            cjk=self.cfg.eval.cjk_tokens,
        )
        if scores is not None and announce:
            step = self.state.step
            self.log.info(
                Event.EVAL,
                step=step,
                em=round(scores["em"], 4),
                f1=round(scores["f1"], 4),
                loss=round(scores["loss"], 6),
                questions=scores["count"],
                seconds=round(time.perf_counter() - started, 3),
            )
            self.console.line(f"eval step {step}: {em_f1_text(scores['em'], scores['f1'])}")
            if self.scalars:
                self.scalars.add(step, **tracked(scores))
        shared = self._shared(scores)
        if shared is not None:
            self._observe(shared, announce)
            if trackers:
                trackers.log(self.state.step, **tracked(shared))
        return shared if scores is None else scores

    def _shared(self, scores: dict[str, float] | None) -> dict[str, float] | None:
        """Rank 0's scores on every rank (evaluate scores on rank 0 only)."""
        if not self.ctx.distributed:
            return scores

        def share() -> SharedScores:
            if scores is None:
                return SharedScores(False, 0.0, 0.0, 0.0)
            return SharedScores(True, scores["em"], scores["f1"], scores["loss"])

        shared = decide_on_rank0(self.ctx, self.control_group, share, SharedScores)
        return {"em": shared.em, "f1": shared.f1, "loss": shared.loss} if shared.scored else None

    def _observe(self, scores: dict[str, float], announce: bool = True) -> None:
        best, step = self.state.best, self.state.step
        says = announce and self.ctx.is_main
        if best.observe(step, scores) and says:
            self.log.info("eval_best", step=step, metric=best.metric, value=round(scores[best.metric], 4))
        if best.exhausted and says and step < self.state.end_step:  # else: the end anyway
            self.log_early_stop()

    def log_early_stop(self) -> None:
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
