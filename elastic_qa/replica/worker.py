"""One worker of one replica group: `python -m elastic_qa.replica.worker --config CFG [key=value ...]`.

Started by torchrun (one torchrun job per replica group, DDP over the group's workers; `elastic-qa replicas`
starts them), with ELASTIC_QA_REPLICA_GROUP and TORCHFT_LIGHTHOUSE set. Each step:

    join the quorum (torchft; a group that is behind heals first from a live peer: replica/heal.py)
    read the step's global batch at the cursor; train this worker's share of it (replica/shares.py)
    sum the gradients (and the loss) over the quorum's groups; vote
    committed: step the optimizer and the schedule, move the cursor and the step, write the step line
    not committed (a peer failed in the step): drop the gradients; the next quorum trains the same windows

A group that loses a peer keeps training with the others: the vote of the step the peer died in says no,
and the next quorum forms without it within about the Lighthouse's heartbeat timeout. torchrun restarts the
dead group's workers, which heal from a live peer and join the next quorum.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elastic_qa.checkpoint.manager import LoadedCheckpoint
from elastic_qa.checkpoint.payload import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE
from elastic_qa.config import Config, ConfigError, config_help, resolve_config
from elastic_qa.data.cache import PreparedData
from elastic_qa.data.cursor import GlobalBatch, GlobalBatchIterator
from elastic_qa.data.examples import DataError
from elastic_qa.dist import DistContext, init_distributed, set_threads, shutdown, unwrap
from elastic_qa.exits import EXIT_BAD_INPUT
from elastic_qa.loop.model import build_trained_model, new_train_state
from elastic_qa.loop.step import accumulate_gradients, autocast_dtype, optimizer_step
from elastic_qa.models import family_for
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import configure_logging, get_logger
from elastic_qa.prep import prepare
from elastic_qa.replica.ft import Quorum, ReplicaManager, require_torchft, safe_transport
from elastic_qa.replica.heal import HealError, HealServer, fetch, heal_key
from elastic_qa.replica.mark import CommitMark
from elastic_qa.replica.shares import ReplicaLedger, share_batch, share_of
from elastic_qa.step_holds import hold_after_step
from elastic_qa.train_state import ResumeError, seed_step_rng, step_seed

GROUP_ENV = "ELASTIC_QA_REPLICA_GROUP"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
HEAL_HOST_ENV = "ELASTIC_QA_HEAL_HOST"  # the address peers reach this group's heal server at


class JobDoneElsewhere(Exception):
    """The other groups finished the job while this one was behind: nothing is left for it to train."""


def params_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes, in order: equal digests are bitwise-equal replicas."""
    digest = hashlib.sha256()
    for name, tensor in unwrap(model).state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class ReplicaTrainer:
    """The replica loop of one worker: quorum, share, cross-group sum, vote, commit."""

    def __init__(
        self, cfg: Config, ctx: DistContext, data: PreparedData, group: int, lighthouse: str
    ) -> None:
        self.cfg, self.ctx, self.data, self.group = cfg, ctx, data, group
        self.log = get_logger()
        self.family = family_for(cfg.model)
        world = torch.distributed.group.WORLD if ctx.distributed else None
        built = build_trained_model(cfg, ctx, data, self.family, world)
        self.model, self.trained, self.draws_random = built.model, built.trained, built.draws_random
        self.state = new_train_state(cfg, ctx, data, built)
        self.dtype = autocast_dtype(cfg.train.precision, ctx.device)
        self.lengths = np.asarray(data.train.lengths)
        self.healed_from: int | None = None
        key = heal_key(cfg.run.dir)
        host = os.environ.get(HEAL_HOST_ENV, "127.0.0.1")
        self.server = HealServer(key, host=host, io_timeout=cfg.replica.collective_timeout.total_seconds())
        transport = safe_transport(self.server, lambda url, step, timeout: fetch(url, step, key, timeout))
        self.manager = ReplicaManager(
            cfg.replica, group, lighthouse, self._state_files, self._load_state, transport,
            ctx.rank, ctx.world_size,
        )  # fmt: skip
        self.ledger = ReplicaLedger(cfg.run.dir, group, ctx.rank) if cfg.debug.sample_ledger else None
        self.mark = CommitMark(cfg.run.dir)
        self._batches: GlobalBatchIterator | None = None  # the epoch's order from the cursor on
        self._batches_step = 0  # the step the iterator yields next
        self._next_batch: GlobalBatch | None = None  # the step in progress's (kept until it commits)
        self.waiting_since = 0.0  # when this group found its quorum behind the job (0: it is not)

    # ---- the heal: the whole training state, to and from a live peer --------------------------------
    def _state_files(self) -> dict[str, Any]:
        return self.state.state_dict({}, attempt=0)

    def _load_state(self, files: dict[str, Any]) -> None:
        """Apply a peer's state (fetched and checked by replica/heal.py); ResumeError when it does not fit."""
        before = self.state.step
        trainer = files[TRAINER_FILE]
        step = int(trainer["counters"]["step"])
        loaded = LoadedCheckpoint(step, "a live peer", {}, files[MODEL_FILE], files[OPTIMIZER_FILE], trainer)
        self.state.load_state_dict(loaded)
        self.healed_from = before
        self.log.info(Event.HEAL, step=step, from_step=before)

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        state, cfg = self.state, self.cfg
        self.log.info(
            Event.TRAIN_START, step=state.step, max_steps=state.end_step, train_windows=len(self.data.train),
            world_size=self.ctx.world_size, replica_group=self.group,
        )  # fmt: skip
        self.model.train()
        last_quorum: int | None = None
        while state.step < state.end_step:
            started = time.perf_counter()
            quorum = self.manager.start_step()
            if quorum.quorum_id != last_quorum:
                self.log.info(
                    Event.QUORUM, step=state.step, quorum=quorum.quorum_id, participants=quorum.participants,
                    replica_rank=quorum.rank,
                )  # fmt: skip
                last_quorum = quorum.quorum_id
            if self.manager.step != state.step:
                raise RuntimeError(
                    f"torchft is at step {self.manager.step}, the training state at {state.step}"
                )
            if self._behind_the_job(quorum):
                continue
            batch = self._batch()
            share = share_of(batch, quorum.participants, quorum.rank, self.ctx.world_size, self.ctx.rank)
            if self.ledger:
                self.ledger.share(
                    batch.step, batch.epoch, quorum.quorum_id, quorum.participants, quorum.rank, share
                )
            if self.draws_random:
                rank = quorum.rank * self.ctx.world_size + self.ctx.rank
                seed_step_rng(step_seed(cfg.run.seed, batch.step, rank), self.ctx.device)
            step_batch = share_batch(self.data.train, batch, share, self.lengths, self.family.full_width)
            loss_sum = accumulate_gradients(
                self.model,
                self.family,
                step_batch,
                self.ctx,
                cfg.train.micro_batch_size,
                self.dtype,
                state.scaler,
            )
            total_loss = self._sum_across_groups(loss_sum)
            committed = self.manager.commit()
            if self.ledger:
                self.ledger.commit(batch.step, quorum.quorum_id, committed)
            if not committed:
                state.optimizer.zero_grad(set_to_none=True)
                self.log.warning(
                    Event.STEP_NOT_COMMITTED, step=batch.step, quorum=quorum.quorum_id,
                    error=self.manager.errored() or "a peer of the quorum failed",
                )  # fmt: skip
                continue
            logged = self._logs_line(batch.step)  # else, unless it clips, no step needs the gradient norm
            grad_norm = optimizer_step(state, self.trained, cfg.train.grad_clip, norm_wanted=logged)
            state.complete_step(batch.step, batch.epoch, batch.global_count, int(step_batch.global_tokens))
            self._next_batch = None
            writer = quorum.rank == 0 and self.ctx.rank == 0
            if writer:
                self.mark.advance(batch.step, final=batch.step == state.end_step)
            if writer and logged:
                seconds = time.perf_counter() - started
                self.log.info(
                    Event.STEP, step=batch.step, epoch=batch.epoch, loss=total_loss / batch.global_count,
                    lr=state.scheduler.get_last_lr()[0], grad_norm=float(grad_norm or 0.0),
                    samples_per_s=batch.global_count / seconds if seconds > 0 else 0.0,
                    cursor=state.cursor.samples_consumed, quorum=quorum.quorum_id,
                    participants=quorum.participants, replica_group=self.group,
                )  # fmt: skip
            self._after_step(batch.step)
        digest = params_digest(self.model)
        self.log.info(Event.TRAIN_DONE, step=state.step, tokens_seen=state.tokens_seen, params_sha256=digest)
        return {"step": state.step, "params_sha256": digest}

    def _batch(self) -> GlobalBatch:
        """The global batch of the next step: the one a step that did not commit trained again, else the
        next of an iterator over the epoch's order (built again only when the state moved under it: a heal),
        so the epoch's permutation is drawn once per epoch, not once per step."""
        step = self.state.step + 1
        if self._next_batch is not None and self._next_batch.step == step:
            return self._next_batch
        if self._batches is None or self._batches_step != step:
            self._batches = self.state.cursor.batches(step)
        self._next_batch = next(self._batches)
        self._batches_step = step + 1
        return self._next_batch

    def _sum_across_groups(self, loss_sum: torch.Tensor) -> float:
        """Sum the gradients and the loss over the quorum's groups, in one all-reduce of one flat tensor; the
        global batch's loss sum."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.trained]
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [loss_sum.reshape(1).float()])
        self.manager.sum_across_groups(flat)
        offset = 0
        for param in self.trained:
            count = param.numel()
            param.grad = flat[offset : offset + count].view_as(param).to(param.dtype)  # a view: no copy
            offset += count
        return float(flat[offset])

    def _behind_the_job(self, quorum: Quorum) -> bool:
        """Whether this quorum must not train: it is behind the job's committed step (every member restarted
        and none healed), or it is the job's first and not every group is in it yet (else the late group
        heals at once). The next quorum is asked for after the join timeout, until one is right.
        JobDoneElsewhere when the job reached its end step without this group."""
        job_step, state = self.mark.read(), self.state
        if job_step >= state.end_step > state.step:
            raise JobDoneElsewhere(f"the job committed its last step {job_step} without this group")
        behind = state.step < job_step
        first = state.step == job_step == 0 and quorum.participants < self.cfg.replica.groups
        if not (behind or first):
            return False
        if not self.waiting_since:
            self.waiting_since = time.monotonic()
            if behind:
                self.log.info(
                    Event.QUORUM_BEHIND, step=state.step, job_step=job_step, quorum=quorum.quorum_id
                )
        if time.monotonic() - self.waiting_since > self.cfg.replica.quorum_timeout.total_seconds():
            if first:
                return False  # the groups that are here start without the others
            raise RuntimeError(
                f"no quorum with a replica group at the job's step {job_step} within replica.quorum_timeout"
            )
        time.sleep(self.cfg.replica.join_timeout.total_seconds())  # a back-off before the next request
        return True

    def _after_step(self, step: int) -> None:
        self.waiting_since = 0.0
        hold_after_step(self.cfg, step, lambda: False)

    def _logs_line(self, step: int) -> bool:
        return step % self.cfg.log.every_steps == 0 or step == self.state.end_step

    def close(self) -> None:
        self.manager.shutdown()
        if self.ledger:
            self.ledger.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_qa.replica.worker", description=__doc__)
    parser.add_argument("--config", default="default", help=config_help())
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    try:
        cfg = resolve_config(args.config, args.overrides)
        require_torchft()
        group, lighthouse = int(os.environ[GROUP_ENV]), os.environ[LIGHTHOUSE_ENV]
    except ConfigError as err:
        print(f"elastic-qa: config error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (KeyError, ValueError) as err:
        print(f"elastic-qa: a replica worker needs {GROUP_ENV} and {LIGHTHOUSE_ENV} ({err})", file=sys.stderr)
        return EXIT_BAD_INPUT
    configure_logging(Path(cfg.run.dir) / "logs", cfg.log.level, replica_group=group)
    log = get_logger()
    try:
        data = prepare(cfg, family_for(cfg.model))
        ctx = init_distributed(cfg.dist)
        set_threads(cfg.train.threads, ctx)
        log.info(Event.WORKER_START, backend=ctx.backend or "none", replica_group=group,
                 restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))  # fmt: skip
        trainer = ReplicaTrainer(cfg, ctx, data, group, lighthouse)
        try:
            trainer.train()
        except JobDoneElsewhere as done:
            log.info(Event.TRAIN_DONE_ELSEWHERE, reason=str(done))
        finally:
            trainer.close()
    except (DataError, ResumeError, ConfigError, HealError) as err:
        log.error(Event.BAD_INPUT, error=str(err))
        print(f"elastic-qa: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
