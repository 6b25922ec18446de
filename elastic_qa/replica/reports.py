"""What the replica mode reports beside its step lines: the trackers' records, the evaluations and the best
checkpoint's tracker, with today's pieces (observe/trackers, loop/scoring.py, checkpoint/best.py).

Trackers (`log.trackers`: MLflow, W&B). Every worker of every group keeps the record of each committed step
that has a step line (loss, grad_norm, lr, samples_per_s, world_size) and of each evaluation, as today's
ranks other than 0 do (the newest STANDBY_RECORDS of them); rank 0 of the writer group (the quorum's rank 0
group, which also writes the step lines and the checkpoints) alone sends them. The records travel in the
training state (`metrics_backlog` in trainer.pt): in each durable checkpoint and in each heal, so that a
group that restores or heals holds the records its source had not seen stored. Exactly once, though the
writer changes:

- The writer's tracker runs open (`Trackers.start`) with the records this worker holds: each tracker reads
  its high-water mark per metric and skips what the run holds already, as a resumed start does today.
- A worker that was sending and is no longer the writer (the quorum changed) flushes and closes its tracker
  runs before the step's cross-group sum; the new writer opens its own only after that step commits. The
  sum waits for every member, so the old writer's last records are stored before the new writer reads the
  marks: nothing is sent twice. A writer that died sends nothing more, and what it had not stored is in the
  others' records.

Evaluation (`train.eval_every`, and at the end). Every group evaluates the committed state of the step
(its workers split the evaluation set, rank 0 scores, as today's ranks do), so every group's best tracker
and early-stop count observe the same scores at the same step: any group may serve a heal, write the next
checkpoint or become the writer. The writer group writes the `eval` line (and `eval_best`, `early_stop`);
the others only keep the scores. Groups hold bitwise-equal parameters, so they score alike.

keep_best: the writer group saves the step of a new best (reason `best`) even when no save was due, after
its evaluation, exactly as today (session/saver.py); the manifests name it and the rotation keeps it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from elastic_qa.config import Config
from elastic_qa.data.cache import PreparedData
from elastic_qa.dist import DistContext
from elastic_qa.loop.scoring import Scoring
from elastic_qa.models import ModelFamily
from elastic_qa.observe.console import Console
from elastic_qa.observe.trackers import STANDBY_RECORDS, Trackers, check_installed
from elastic_qa.observe.trackers.background import Record
from elastic_qa.train_state import TrainState

SENT_BY_RANK_0 = ("mlflow", "wandb")  # the trackers of today's rank 0 (observe/trackers)


class ReplicaReports:
    """One worker's tracker records, evaluations and best tracker (collective within the group where it
    evaluates: every worker of the group calls each method at the same step)."""

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        data: PreparedData,
        family: ModelFamily,
        state: TrainState,
        group: ProcessGroup | None,
        dtype: torch.dtype | None,
        run_uuid: Callable[[], str],
    ) -> None:
        self.cfg, self.ctx, self.state, self.run_uuid = cfg, ctx, state, run_uuid
        check_installed(cfg)  # on every worker: any group may become the writer
        console = Console(cfg.log.console, state.end_step, enabled=False)  # the launcher owns the terminal
        self.scoring = Scoring(cfg, ctx, group, family, data, state, dtype, console, None)
        self.tracked = any(name in cfg.log.tracker_names for name in SENT_BY_RANK_0)
        self.trackers: Trackers | None = None  # sending (rank 0 of the writer group) or keeping records
        self.sending = False
        self._kept = 0  # records logged since the standby records were last cut to the newest
        state.tracker_backlog = self.backlog  # every checkpoint and every heal carries them

    # ---- the records --------------------------------------------------------------------------------
    def backlog(self) -> list[Record]:
        """The records a checkpoint or a heal carries: those no live tracker of this worker holds for
        certain (sending), else the newest STANDBY_RECORDS."""
        return self.trackers.backlog() if self.trackers else []

    def restored(self) -> None:
        """The training state was restored from a checkpoint or healed from a peer: its records replace this
        worker's (a group healed out of an older lineage drops that lineage's)."""
        backlog, self.state.metrics_backlog = self.state.metrics_backlog, []
        if not self.tracked:
            return
        if self.sending:  # not met: a group that heals sits its step out, and stops sending before the sum
            self.hand_over(writer=False)
        self.trackers = self._start(backlog, main=False)

    def hand_over(self, writer: bool) -> None:
        """Before the step's cross-group sum: a worker that was sending and is not the writer of this quorum
        flushes and closes its tracker runs (at most log.tracker_timeout), and keeps records from then on."""
        if not self.sending or writer:
            return
        assert self.trackers is not None
        self.trackers.close(finished=False)
        self.trackers = self._start(self.trackers.backlog(), main=False)
        self.sending = False

    def step(self, step: int, writer: bool, metrics: dict[str, float]) -> None:
        """Step `step` committed: its record, sent by rank 0 of the writer group, which opens its tracker
        runs first when it has just become the writer (after the old writer's were closed: hand_over)."""
        if not self.tracked:
            return
        if writer and self.ctx.is_main and not self.sending:
            held = self.trackers.backlog() if self.trackers else []
            self.trackers = self._start(held, main=True)
            self.sending = True
        if self.trackers is None:  # not met: a committed step follows a restore or a heal
            self.trackers = self._start([], main=False)
        self.trackers.log(step, **metrics)
        self._kept += 1
        if not self.sending and self._kept >= STANDBY_RECORDS:  # else only checkpoints and heals cut them
            self._kept = 0
            self.trackers.backlog()

    def _start(self, backlog: list[Record], main: bool) -> Trackers:
        """This worker's Trackers (sending when `main`), holding `backlog` first."""
        trackers = Trackers.start(self.cfg, self.run_uuid(), backlog, main)
        assert trackers is not None  # log.trackers names MLflow or W&B (self.tracked)
        return trackers

    # ---- evaluation ---------------------------------------------------------------------------------
    def evaluate_due(self, model: torch.nn.Module, step: int, writer: bool) -> bool:
        """Evaluate at `step` when train.eval_every says so (not at the end step: `final` does); whether
        the step is a new best (the writer then saves it)."""
        every, end = self.cfg.train.eval_every, self.state.end_step
        if not every or step % every or step >= end:
            return False
        return (
            self.scoring.run(model, self.trackers, announce=writer) is not None
            and self.state.best.step == step
        )

    def final(self, model: torch.nn.Module, writer: bool) -> dict[str, float] | None:
        """The final evaluation (none when the last one scored this very state: an early stop)."""
        step = self.state.step
        return self.state.best.scores_at(step) or self.scoring.run(model, self.trackers, announce=writer)

    def finish(self, writer: bool) -> None:
        """Training is done and its final state committed: the group that wrote it sends what it holds, were
        it not sending yet (a job started again at its final step: its checkpoint's records), and ends its
        tracker runs as finished."""
        if self.tracked and writer and self.ctx.is_main and not self.sending:
            self.trackers = self._start(self.trackers.backlog() if self.trackers else [], main=True)
            self.sending = True
        self.close(finished=True)

    def close(self, finished: bool) -> None:
        """Flush and end this worker's tracker runs (nothing when it keeps records only)."""
        if self.trackers is not None:
            self.trackers.close(finished)
