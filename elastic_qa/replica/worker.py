"""One worker of one replica group: `python -m elastic_qa.replica.worker --config CFG [key=value ...]`.

Started by torchrun (one torchrun job per replica group, DDP over the group's workers; `elastic-qa replicas`
starts them), with ELASTIC_QA_REPLICA_GROUP and TORCHFT_LIGHTHOUSE set. Each step:

    ask for the step's quorum (torchft forms it in the background)
    read the step's global batch at the cursor; meanwhile train this worker's share of it in the last
        step's quorum (replica/shares.py); once the quorum is known, if it differs, train its share instead
    sum the gradients (and the loss) over the quorum's groups; vote
    committed: step the optimizer and the schedule, move the cursor and the step, write the step line
    not committed (a peer failed in the step): drop the gradients; the next quorum trains the same windows

A group that loses a peer keeps training with the others: the vote of the step the peer died in says no,
and the next quorum forms without it within about the Lighthouse's heartbeat timeout. torchrun restarts the
dead group's workers, which heal from a live peer and join the next quorum. A group that heals
(replica/heal.py) sits its heal step out: its peers split the step's batch, the peer's state is applied at
the vote, and the group then takes the step with its peers' summed gradients, leaving it where they are.

Durable state (replica/durable.py): each quorum trains in a lineage claimed in the checkpoint store, which
fences the saves of the quorum rank 0 group; a group that holds no state and finds no peer that can hold one
restores the newest verified checkpoint and starts a lineage from it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from elastic_qa.checkpoint.errors import StaleWriterError
from elastic_qa.checkpoint.manager import LoadedCheckpoint
from elastic_qa.checkpoint.payload import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE
from elastic_qa.config import Config, ConfigError, config_help, resolve_config
from elastic_qa.data.cache import PreparedData
from elastic_qa.data.cursor import GlobalBatch, GlobalBatchIterator
from elastic_qa.data.examples import DataError
from elastic_qa.dist import (
    DistContext,
    init_distributed,
    set_denormals,
    set_threads,
    shutdown,
    unwrap,
    usable_cores,
)
from elastic_qa.elastic.signals import StopRequest
from elastic_qa.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_REGROUP
from elastic_qa.loop.model import build_trained_model, new_train_state
from elastic_qa.loop.step import accumulate_gradients, autocast_dtype, optimizer_step
from elastic_qa.models import family_for
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import configure_logging, get_logger
from elastic_qa.prep import prepare
from elastic_qa.replica.durable import ReplicaCheckpoints, ReplicaPosition
from elastic_qa.replica.ft import INCARNATION_ENV, Quorum, ReplicaManager, require_torchft, safe_transport
from elastic_qa.replica.heal import HealError, HealServer, fetch, heal_key
from elastic_qa.replica.reports import ReplicaReports
from elastic_qa.replica.shares import ReplicaLedger, share_batch, share_of
from elastic_qa.step_holds import hold_after_step, hold_before_heal
from elastic_qa.train_state import ResumeError, seed_step_rng, step_seed

GROUP_ENV = "ELASTIC_QA_REPLICA_GROUP"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
HEAL_HOST_ENV = "ELASTIC_QA_HEAL_HOST"  # the address peers reach this group's heal server at
GROUPS_HERE_ENV = "ELASTIC_QA_GROUPS_ON_HOST"  # groups sharing this host's cores (default replica.groups)
LINEAGE_FILE = "lineage"  # beside the checkpoint's files in a heal: where the sender's lineage began


DIGIT = 1 << 12  # a lineage travels as base-4096 digits in float32 slots: every sum of them stays exact


def lineage_slots(claimed: int, mine: int, rank0: bool) -> torch.Tensor:
    """What this group adds to the cross-group sum about lineages: rank 0's lineage for the step and its
    current one (zeros from the others), and every member's current one; each as three base-4096 digits,
    so that each slot's sum over up to 4096 groups is an exact float32 integer (lineages below 2**36)."""
    if not 0 <= claimed < DIGIT**3 or not 0 <= mine < DIGIT**3:
        raise ValueError(f"lineage {max(claimed, mine)} is past what the cross-group sum carries exactly")
    values = [claimed, mine] if rank0 else [0, 0]
    digits = [(value >> shift) % DIGIT for value in [*values, mine] for shift in (0, 12, 24)]
    return torch.tensor(digits, dtype=torch.float32)


def read_lineage_slots(slots: torch.Tensor) -> tuple[int, int, int]:
    """The summed slots back as (rank 0's lineage for the step, rank 0's current, the members' sum)."""
    values = [round(float(v)) for v in slots]
    claimed, first, every = (
        values[i] + values[i + 1] * DIGIT + values[i + 2] * DIGIT * DIGIT for i in (0, 3, 6)
    )
    return claimed, first, every


_Result = TypeVar("_Result")


@dataclass
class Trained:
    """A share trained for a quorum of `participants` groups at `rank`: its windows and their loss sum (the
    gradients are in the parameters' .grad)."""

    participants: int
    rank: int
    share: list[int]
    loss_sum: torch.Tensor


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
            ctx.rank, ctx.world_size, incarnation_file=os.environ.get(INCARNATION_ENV),
            hostname=os.environ.get(HEAL_HOST_ENV),
        )  # fmt: skip
        self.ledger = ReplicaLedger(cfg.run.dir, group, ctx.rank) if cfg.debug.sample_ledger else None
        self.durable = ReplicaCheckpoints(cfg, ctx, self.state, world)
        self.reports = ReplicaReports(
            cfg, ctx, data, self.family, self.state, world, self.dtype, lambda: self.durable.context.run_uuid
        )  # tracker records, evaluations, the best checkpoint's tracker
        self._batches: GlobalBatchIterator | None = None  # the epoch's order from the cursor on
        self._batches_step = 0  # the step the iterator yields next
        self._next_batch: GlobalBatch | None = None  # the step in progress's (kept until it commits)
        self.waiting_since = 0.0  # when this group, holding no state, began to wait for a peer (0: it is not)
        self._quorum_key: tuple[int, int] | None = None  # (quorum id, members) of the last step tried
        self._claimed: int | None = None  # the lineage this group claimed for the current quorum
        self.stop = StopRequest()  # SIGTERM, SIGINT, SIGHUP: finish the step, save, leave
        self._last_rank = 0  # this group's quorum rank at its last committed step

    # ---- the heal: the whole training state, to and from a live peer --------------------------------
    def _state_files(self) -> dict[str, Any]:
        """The state a peer heals from (torchft asks for it when it sends this group's state)."""
        hold_before_heal(self.cfg, self.state.step)  # a chaos run's kill-during-heal (debug.hold_dir)
        files = self.state.state_dict({}, attempt=self.durable.lineage)
        files[LINEAGE_FILE] = {"began_at": self.durable.began_at, "run": self.durable.context.run_uuid}
        return files

    def _load_state(self, files: dict[str, Any]) -> None:
        """Apply a peer's state (fetched and checked by replica/heal.py); ResumeError when it does not fit."""
        before = self.state.step
        trainer = files[TRAINER_FILE]
        step = int(trainer["counters"]["step"])
        loaded = LoadedCheckpoint(step, "a live peer", {}, files[MODEL_FILE], files[OPTIMIZER_FILE], trainer)
        self.state.load_state_dict(loaded)
        lineage = self.state.saved_attempt
        if lineage <= 0:
            raise ResumeError(f"a live peer sent the state of step {step} without its lineage")
        sender = files.get(LINEAGE_FILE, {})
        self.durable.adopt(lineage, int(sender.get("began_at", step)))
        self.durable.context.run_uuid = str(sender.get("run") or self.durable.context.run_uuid)
        self.reports.restored()  # the peer's tracker records and best tracker
        self._batches = self._next_batch = None  # the state moved: the next batch is read at its cursor
        self.healed_from = before
        self.log.info(Event.HEAL, step=step, from_step=before, lineage=lineage)

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        state, cfg = self.state, self.cfg
        self.log.info(
            Event.TRAIN_START, step=state.step, max_steps=state.end_step, train_windows=len(self.data.train),
            world_size=self.ctx.world_size, replica_group=self.group,
        )  # fmt: skip
        self.model.train()
        self.durable.start_schedule()
        self.stop.install()
        last: Quorum | None = None  # the last step's quorum: the next step trains its share while it forms
        while (state.step < state.end_step and not state.best.exhausted) or not self.durable.lineage:
            if self._stop_requested():
                return self._stop()
            started = time.perf_counter()
            self._quorum_or_save(self.manager.begin_step)
            trained = None
            if last is not None and not last.heals and self.durable.lineage:
                trained = self._train(self._batch(), last)  # speculatively: the quorum rarely changes
            quorum = self._quorum_or_save(self.manager.quorum)
            if quorum.quorum_id != (last.quorum_id if last else None):
                self.log.info(
                    Event.QUORUM, step=state.step, quorum=quorum.quorum_id, participants=quorum.participants,
                    replica_rank=quorum.rank, lineage=self.durable.lineage,
                )  # fmt: skip
            last = quorum
            if quorum.rank is None:  # behind the quorum: its state arrives at the vote
                self._sit_out(quorum, started)
                continue
            position = ReplicaPosition.decode(self.manager.position)
            if position != ReplicaPosition(self.durable.lineage, state.step):
                raise RuntimeError(
                    f"torchft is at {position}, the training state at step {state.step} of lineage "
                    f"{self.durable.lineage}"
                )
            if not self.durable.lineage:
                self._without_state(quorum)
                continue
            lineage = self._lineage_for(quorum)
            batch = self._batch()
            if trained is None or trained.participants != quorum.participants or trained.rank != quorum.rank:
                state.optimizer.zero_grad(set_to_none=True)  # the quorum changed: train this one's share
                trained = self._train(batch, quorum)
            if self.ledger:
                self.ledger.share(
                    batch.step, batch.epoch, quorum.quorum_id, trained.participants, trained.rank,
                    trained.share, held=self.durable.lineage,
                )  # fmt: skip
            loss_sum = trained.loss_sum
            if self.ctx.world_size > 1 and self._logs_line(batch.step):
                # The cross-group sum adds the same rank of every group: the group's own workers' shares are
                # summed first, on the steps whose loss is logged only (DDP sums their gradients already).
                torch.distributed.all_reduce(loss_sum)
            total_loss, agreed = self._sum_across_groups(loss_sum, quorum, lineage)
            committed = self.manager.commit()
            if self.ledger:
                self.ledger.commit(batch.step, quorum.quorum_id, committed, agreed)
            if not committed:
                self._not_committed(batch.step, quorum)
                continue
            self._complete(batch, quorum, agreed, total_loss, started)
        # The last quorum's rank 0 group commits the final state; the others commit it only when it does not
        # stand within the final save's retry window (that group died writing it).
        writes_final = self._last_rank == 0
        scores = self.reports.final(unwrap(self.model), writes_final)  # evaluated before it is saved
        self.durable.save_final(0.0 if writes_final else cfg.checkpoint.final_retry_for.total_seconds())
        self.reports.finish(writes_final)
        digest = params_digest(self.model)
        self.log.info(
            Event.TRAIN_DONE, step=state.step, tokens_seen=state.tokens_seen, params_sha256=digest,
            lineage=self.durable.lineage,
            **({"em": scores["em"], "f1": scores["f1"], "eval_loss": scores["loss"]} if scores else {}),
        )  # fmt: skip
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

    def _quorum_or_save(self, call: Callable[[], _Result]) -> _Result:
        """A quorum call; when torchft gives up on the quorum (the Lighthouse unreachable past its retries),
        this group saves what it holds and fails, and its torchrun restarts it."""
        try:
            return call()
        except Exception as err:
            self.log.error(Event.NO_QUORUM, step=self.state.step, error=f"{type(err).__name__}: {err}")
            self.durable.save_emergency(self.group, "no quorum")
            raise

    def _train(self, batch: GlobalBatch, quorum: Quorum) -> Trained:
        """Forward and backward over this worker's share of `batch` in `quorum` (gradients left in .grad)."""
        assert quorum.rank is not None
        share = share_of(batch, quorum.participants, quorum.rank, self.ctx.world_size, self.ctx.rank)
        if self.draws_random:
            rank = quorum.rank * self.ctx.world_size + self.ctx.rank
            seed_step_rng(step_seed(self.cfg.run.seed, batch.step, rank), self.ctx.device)
        step_batch = share_batch(self.data.train, batch, share, self.lengths, self.family.full_width)
        loss_sum = accumulate_gradients(
            self.model, self.family, step_batch, self.ctx, self.cfg.train.micro_batch_size, self.dtype,
            self.state.scaler,
        )  # fmt: skip
        return Trained(quorum.participants, quorum.rank, share, loss_sum)

    def _sit_out(self, quorum: Quorum, started: float) -> None:
        """A step this group takes no part in: it heals from a peer. Its gradients count as zeros in the sum
        (torchft zeroes them), the peer's state is applied at the vote, and a committed step is then taken
        with the peers' summed gradients, so that the group leaves the step where its peers do. The quorum's
        lineage is the one its rank 0 claimed for this step: the healed group adopts it at the commit and
        claims none of its own for the quorum's next steps."""
        self._quorum_key, self._claimed = (quorum.quorum_id, quorum.members), None
        self.state.optimizer.zero_grad(set_to_none=True)
        total_loss, agreed = self._sum_across_groups(torch.zeros(()), quorum, self.durable.lineage)
        committed = self.manager.commit()  # applies the peer's state (self._load_state) first
        if not committed:
            self._not_committed(self.state.step + 1, quorum)
            return
        self._complete(self._batch(), quorum, agreed, total_loss, started)

    def _not_committed(self, step: int, quorum: Quorum) -> None:
        self.state.optimizer.zero_grad(set_to_none=True)
        self.log.warning(
            Event.STEP_NOT_COMMITTED, step=step, quorum=quorum.quorum_id,
            error=self.manager.errored() or "a peer of the quorum failed",
        )  # fmt: skip

    def _complete(
        self, batch: GlobalBatch, quorum: Quorum, agreed: int, total_loss: float, started: float
    ) -> None:
        """The step committed: step the optimizer and the schedule, move the cursor, log, checkpoint."""
        state, cfg = self.state, self.cfg
        logged = self._logs_line(batch.step)  # else, unless it clips, no step needs the gradient norm
        grad_norm = optimizer_step(state, self.trained, cfg.train.grad_clip, norm_wanted=logged)
        state.complete_step(
            batch.step, batch.epoch, batch.global_count, int(self.lengths[batch.global_indices].sum())
        )
        self._next_batch = None
        if agreed != self.durable.lineage:
            self.durable.adopt(agreed, batch.step - 1)
            self.manager.set_position(ReplicaPosition(agreed, batch.step).encode())
        writer = quorum.rank == 0
        self._last_rank = -1 if quorum.rank is None else quorum.rank
        seconds = time.perf_counter() - started
        rate = batch.global_count / seconds if seconds > 0 else 0.0
        if writer and self.ctx.rank == 0 and logged:
            self.log.info(
                Event.STEP, step=batch.step, epoch=batch.epoch, loss=total_loss / batch.global_count,
                lr=state.scheduler.get_last_lr()[0], grad_norm=float(grad_norm or 0.0),
                samples_per_s=rate,
                cursor=state.cursor.samples_consumed, quorum=quorum.quorum_id,
                participants=quorum.participants, replica_group=self.group, lineage=agreed,
            )  # fmt: skip
        if logged:  # every worker keeps the step's tracker record; rank 0 of the writer group sends it
            self.reports.step(
                batch.step, writer, {
                    "loss": total_loss / batch.global_count, "grad_norm": float(grad_norm or 0.0),
                    "lr": float(state.scheduler.get_last_lr()[0]), "samples_per_s": rate,
                    "world_size": float(quorum.participants * self.ctx.world_size),
                },
            )  # fmt: skip
        # Evaluated before any save of the step: a new best is saved at its own step (reason "best").
        new_best = self.reports.evaluate_due(unwrap(self.model), batch.step, writer)
        if writer and batch.step < state.end_step and (reason := self.durable.save_due(batch.step, new_best)):
            self.durable.save(reason)
        self._after_step(batch.step)

    def _sum_across_groups(self, loss_sum: torch.Tensor, quorum: Quorum, lineage: int) -> tuple[float, int]:
        """Sum the gradients, the loss and the lineage slots over the quorum's groups, in one all-reduce of
        one flat tensor; the global batch's loss sum and the lineage the step commits in."""
        self.reports.hand_over(writer=quorum.rank == 0)  # an old writer's tracker runs flushed before the sum
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.trained]
        slots = lineage_slots(
            lineage, self.durable.lineage, quorum.rank == 0
        )  # zeros from a group that heals
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [loss_sum.reshape(1).float(), slots])
        self.manager.sum_across_groups(flat)
        offset = 0
        for param in self.trained:
            count = param.numel()
            param.grad = flat[offset : offset + count].view_as(param).to(param.dtype)  # a view: no copy
            offset += count
        agreed, first, every = read_lineage_slots(flat[offset + 1 :])
        # Every member must hold rank 0's lineage (the heal put them at one position): else the step must not
        # commit. A sum that failed says nothing: the vote says no anyway.
        if self.manager.errored() is None and (every != first * quorum.participants or agreed < first):
            self.manager.refuse_step(
                f"the quorum's members hold different lineages (sum {every}, rank 0's {first} x "
                f"{quorum.participants})"
            )
        return float(flat[offset]), agreed

    def _without_state(self, quorum: Quorum) -> None:
        """This group holds no lineage's state, and no member of its quorum does (torchft would have healed
        it from one). Once no peer can hold one (every group of the job is in the quorum, or none joined it
        within replica.quorum_timeout), the quorum's rank 0 group restores the newest verified checkpoint and
        claims a lineage continuing from it; the quorum then trains nothing, and at the next one the others
        heal from that group. Until then, the next quorum is asked for after the join timeout."""
        now = time.monotonic()
        if not self.waiting_since:
            self.waiting_since = now
            self.log.info(
                Event.QUORUM_WITHOUT_STATE, quorum=quorum.quorum_id, participants=quorum.participants
            )
        waited = now - self.waiting_since
        everyone = quorum.participants >= self.cfg.replica.groups
        if quorum.rank == 0 and (everyone or waited > self.cfg.replica.quorum_timeout.total_seconds()):
            lineage, parent, step = self.durable.bootstrap()
            self.reports.restored()  # the checkpoint's tracker records and best tracker
            self.manager.set_position(ReplicaPosition(lineage, step).encode())
            self._quorum_key, self._claimed = (quorum.quorum_id, quorum.members), lineage
            if self.ledger:
                self.ledger.lineage(lineage, parent, step)
            self.log.info(Event.LINEAGE, lineage=lineage, parent=parent, step=step, restored=step > 0)
            return
        time.sleep(self.cfg.replica.join_timeout.total_seconds())  # a back-off before the next request

    def _lineage_for(self, quorum: Quorum) -> int:
        """The lineage this quorum trains in, as this group sees it: a quorum that differs from the one of the
        last step this group tried (another id or another number of members) starts a new lineage, which its
        rank 0 group claims now; any other group proposes the lineage it holds (only rank 0's counts)."""
        key = (quorum.quorum_id, quorum.members)
        if key != self._quorum_key:
            self._quorum_key, self._claimed = key, None
            if quorum.rank == 0:
                self._claimed = self.durable.claim()
                if self.ledger:
                    self.ledger.lineage(self._claimed, self.durable.lineage, self.state.step)
                self.log.info(
                    Event.LINEAGE, lineage=self._claimed, parent=self.durable.lineage, step=self.state.step,
                    quorum=quorum.quorum_id, participants=quorum.participants,
                )  # fmt: skip
        return self._claimed if self._claimed is not None else self.durable.lineage

    def _stop_requested(self) -> bool:
        """Whether this group stops before its next step: a stop signal reached one of its workers (torchrun
        signals them all, not at one instant: the group's workers agree, so that they leave at one step)."""
        requested = self.stop.notice(self.log)
        if self.ctx.world_size > 1:
            flag = torch.tensor([int(requested)])
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            requested = bool(flag.item())
        return requested

    def _stop(self) -> dict[str, Any]:
        """Leave at a step boundary, the step this group completed last committed (a node drained, the job
        preempted or Ctrl-C'd: every group of a stopped job is signalled, and the groups still training go
        on without this one). The group's peers may hold the same state: a checkpoint of it by this
        lineage that stands already is not written again."""
        self.log.warning(Event.STOPPING, step=self.state.step, signal=self.stop.signal_name)
        with self.stop.saving():
            self.durable.save_for_stop(self.group)
        self.reports.close(finished=False)
        return {"stopped": True, "step": self.state.step}

    def _after_step(self, step: int) -> None:
        self.waiting_since = 0.0
        hold_after_step(self.cfg, step, lambda: self.stop.requested)

    def _logs_line(self, step: int) -> bool:
        return step % self.cfg.log.every_steps == 0 or step == self.state.end_step

    def close(self) -> None:
        self.stop.uninstall()
        self.reports.close(finished=False)  # a no-op once train() closed them
        self.durable.close()
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
        # Before torch's first parallel operation: a pool thread keeps the flag it started with.
        denormals = set_denormals(
            cfg.train.flush_denormals, lambda said: log.warning(Event.DIAGNOSIS, finding=said)
        )
        data = prepare(cfg, family_for(cfg.model))
        ctx = init_distributed(cfg.dist, per_attempt_store=True)  # the group's workers: one torchrun agent
        # Every group of the job runs on this host (the local launcher): the cores are shared by all their
        # workers, not only this group's (two groups of one worker each on 2 cores, 2 threads each: forward
        # and backward p90 185 ms against 10 ms at the median). `elastic-qa node --replicas`: one group.
        here = int(os.environ.get(GROUPS_HERE_ENV) or cfg.replica.groups)
        set_threads(cfg.train.threads or max(1, usable_cores() // (here * ctx.ranks_on_host)), ctx)
        log.info(Event.WORKER_START, backend=ctx.backend or "none", replica_group=group,
                 restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                 flush_denormals=denormals)  # fmt: skip
        trainer = ReplicaTrainer(cfg, ctx, data, group, lighthouse)
        try:
            result = trainer.train()
        finally:
            trainer.close()
        if result.get("stopped"):  # saved: torchrun starts the group again (it heals), unless it is stopping
            return EXIT_REGROUP
    except (DataError, ResumeError, ConfigError, HealError) as err:
        log.error(Event.BAD_INPUT, error=str(err))
        print(f"elastic-qa: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except StaleWriterError as err:  # this group's lineage lost to a newer one: torchrun starts it again
        log.error(Event.LINEAGE_FENCED, error=str(err))
        print(f"elastic-qa: {err}; this group restarts and heals from the newer lineage", file=sys.stderr)
        return EXIT_FAILED
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
