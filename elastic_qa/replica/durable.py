"""The durable rotation in the replica-group mode: lineages, fenced by the product's own attempt counter.

A lineage is one unbroken chain of committed steps. Its number is an attempt number claimed in the checkpoint
store (checkpoint/fencing.py, the same counter today's mode registers its worker groups with), so numbers are
unique across every group, host and restarted Lighthouse, and a newer one is always larger:

- A new quorum (torchft formed it with other members: a group died, joined, or the Lighthouse restarted)
  starts a new lineage: its quorum rank 0 group claims the number before the quorum's first step, and every
  member adopts it when that step commits. Two quorums that form at once (a restarted Lighthouse gives each
  side its own, a partition) therefore train in two lineages, and only the newer can still commit a durable
  checkpoint: a save first checks that no newer lineage is registered (the fence), so the older side's writer
  is refused. When the sides meet, torchft heals whoever is behind from whoever is ahead, and the product's
  position (ReplicaPosition below) puts the lineage above the step: the older lineage's replicas heal from
  the newer one, cursor included, and its steps are discarded.
- A group that holds no state (it started or restarted, and no live peer healed it) claims a lineage only
  when no peer can hold one: every group of the job is in its quorum (all at step 0 after a whole-job start
  or restart), or it waited `replica.quorum_timeout` for one. It then restores the newest checkpoint that
  verifies (today's restore path: node-local copy, durable rotation, checkpoint.resume_from) and its new
  lineage continues from that step; the other groups of its quorum heal from it at the next quorum.

Every lineage is recorded in the sample ledger with its parent and the step it continues from, so the ledger
check follows the final model's chain back to step 0 and counts the steps of discarded lineages (what a split
cost). A save also quarantines any checkpoint of a step past its lineage's start that another lineage wrote
(one written by the older side of a split before the newer side registered), so the rotation holds one
lineage's states only, once the newer lineage has saved.

Writers: the quorum rank 0 group's workers, on the time rotation of today's mode (checkpoint.interval,
checkpoint.every_steps), rank 0 of that group deciding for its workers. The final state is committed by the
last quorum's rank 0 group; the others commit it only when it does not stand within
checkpoint.final_retry_for (that group died writing it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch.distributed import ProcessGroup

from elastic_qa.checkpoint.manager import LoadedCheckpoint, Rejection
from elastic_qa.checkpoint.run_record import write_record
from elastic_qa.checkpoint.store import step_dir_name
from elastic_qa.config import Config
from elastic_qa.dist import DistContext, decide_on_rank0
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger, update_identity
from elastic_qa.session.checkpoints import CheckpointSession
from elastic_qa.train_state import TrainState

LINEAGE_BITS = 32  # a position is lineage << LINEAGE_BITS | step: torchft orders positions as one number


@dataclass(frozen=True)
class ReplicaPosition:
    """Where a replica group stands: its lineage, then its step. torchft compares positions as one integer
    (its step counter) and heals the groups behind from one ahead: a newer lineage is always ahead."""

    lineage: int
    step: int

    def encode(self) -> int:
        if not (0 <= self.step < 1 << LINEAGE_BITS and self.lineage >= 0):
            raise ValueError(f"no position for lineage {self.lineage}, step {self.step}")
        return self.lineage << LINEAGE_BITS | self.step

    @classmethod
    def decode(cls, value: int) -> ReplicaPosition:
        return cls(value >> LINEAGE_BITS, value & ((1 << LINEAGE_BITS) - 1))


@dataclass(frozen=True)
class Claimed:
    """Rank 0's claim, as every worker of the group receives it (dist.decide_on_rank0)."""

    lineage: int


@dataclass(frozen=True)
class SaveNow:
    due: bool


class ReplicaCheckpoints:
    """One replica group's handle on the durable rotation: bootstrap, lineages, saves (collective within
    the group: every worker of it calls each method with the same arguments)."""

    def __init__(self, cfg: Config, ctx: DistContext, state: TrainState, group: ProcessGroup | None) -> None:
        self.cfg, self.ctx, self.state, self.group = cfg, ctx, state, group
        self.log = get_logger()
        self.session = CheckpointSession(cfg, ctx, state, group)
        self.context = self.session.context
        self.lineage = 0  # 0: this group holds no lineage's state yet
        self.began_at = 0  # the step the lineage continues from
        self._said_fenced = False

    # ---- lineages -----------------------------------------------------------------------------------
    def bootstrap(self) -> tuple[int, int, int]:
        """No live peer holds the job's state: restore the newest that verifies and claim a lineage that
        continues from it. Returns (lineage, parent lineage, step); ResumeError as today's restore."""
        loaded: LoadedCheckpoint | None = self.session.restore()
        plan = self.session.plan
        parent = self.state.saved_attempt if loaded is not None else 0
        c = self.context

        def claim() -> Claimed:
            lineage = c.fence.register(self.ctx.world_size)
            if plan.new_record is not None:  # the store's first registration
                write_record(c.store, plan.new_record)
            c.store.clean_staging(lineage)
            for rejection in plan.rejected:
                c.quarantine(rejection)
            return Claimed(lineage)

        lineage = decide_on_rank0(self.ctx, self.group, claim, Claimed).lineage
        self.adopt(lineage, self.state.step)
        self.session.log_start([])
        return lineage, parent, self.state.step

    def claim(self) -> int:
        """A new quorum's lineage, claimed by this group's rank 0 for every worker of the group."""
        return decide_on_rank0(
            self.ctx, self.group, lambda: Claimed(self.context.fence.register(self.ctx.world_size)), Claimed
        ).lineage

    def adopt(self, lineage: int, began_at: int) -> None:
        """This group now trains in `lineage` (claimed, or healed from a peer), continuing from `began_at`."""
        if lineage > self.lineage:  # a save of the older lineage refused by the fence is no fault of this one
            self.context.checkpointer.forget_fence()
        self.lineage, self.began_at = lineage, began_at
        self.context.attempt = self.context.fence.attempt = lineage
        update_identity(attempt=lineage)

    # ---- saves --------------------------------------------------------------------------------------
    def start_schedule(self) -> None:
        """Training starts: every group's save timer counts from now, so a group that becomes the writer
        after the interval has passed saves at once rather than a whole interval later."""
        self.session.start_schedule()

    def save_due(self, step: int, new_best: bool = False) -> str | None:
        """Why the writer group checkpoints the step it just committed ("best": its evaluation set a new
        best, checkpoint.keep_best; "periodic": rank 0's timer or checkpoint.every_steps), or None."""
        saver = self.session.saver

        def decide() -> SaveNow:
            return SaveNow(saver.save_due(step, saver.time_due(), new_best) is not None)

        due = decide_on_rank0(self.ctx, self.group, decide, SaveNow).due
        return ("best" if new_best else "periodic") if due else None

    def save(self, reason: str = "periodic") -> None:
        """A checkpoint of the committed step, periodic or a new best (async; fenced at commit by the
        lineage). Once the fence refused one, this lineage has lost to a newer one: it saves no more and
        trains on until its groups meet the newer lineage's and heal from it (adopt forgets the refusal)."""
        if self.context.checkpointer.fenced:
            if not self._said_fenced:
                self._said_fenced = True
                self.log.warning(Event.LINEAGE_FENCED, lineage=self.lineage, step=self.state.step)
            return
        self._said_fenced = False
        self._drop_other_lineages()
        self.session.save(reason)

    def save_final(self, wait_s: float) -> None:
        """Commit the final state unless a peer of this lineage already did within `wait_s` (the quorum
        rank 0 group passes 0 and writes at once); FinalStateError when it cannot be committed."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self._committed_here():
                self.context.checkpointer.wait()
                return
            time.sleep(0.1)
        self._drop_other_lineages()
        self.session.save_final()

    def save_emergency(self, group: int, reason: str) -> None:
        """No quorum formed within replica.quorum_timeout (the Lighthouse unreachable past its retries): this
        group commits the state it holds, as today's emergency save does (node memory first, storage errors
        retried), before its workers exit and torchrun starts them again; the restarted groups then restore
        the newest verified state. Groups of one lineage hold the same state: staggered by group, usually one
        writes it and the others find it committed. Nothing to save without a lineage or once fenced."""
        if not self.lineage or self.context.checkpointer.fenced:
            return
        time.sleep(min(group, 8) * 0.2)
        self._drop_other_lineages()
        self.session.save_emergency(reason)

    def save_for_stop(self, group: int) -> None:
        """A stop signal (a node drained, the job preempted, Ctrl-C): commit the step this group completed
        last, as today's mode does at a stop (storage errors retried for checkpoint.emergency_retry_for),
        unless a checkpoint of it by this lineage stands already: every group of a stopped job holds the
        same state, and staggered by group, usually one writes it and the others find it committed. Nothing
        to save without a lineage or once fenced."""
        if not self.lineage or self.context.checkpointer.fenced:
            return
        time.sleep(min(group, 8) * 0.2)
        if self._committed_here():
            self.context.checkpointer.wait()
            return
        self._drop_other_lineages()
        self.session.save_for_stop()

    def _committed_here(self) -> bool:
        """A verified checkpoint of the current step written by this lineage stands (agreed in the group)."""
        store, step = self.context.store, self.state.step

        def check() -> SaveNow:
            path = store.path(step_dir_name(step))
            try:
                if store.read_manifest(path).get("attempt") != self.lineage:
                    return SaveNow(False)
            except (OSError, ValueError):
                return SaveNow(False)
            return SaveNow(store.verify(path).ok)

        return decide_on_rank0(self.ctx, self.group, check, SaveNow).due

    def _drop_other_lineages(self) -> None:
        """Rank 0: quarantine the checkpoints of steps past this lineage's start that an older lineage
        wrote (the older side of a split, before this side registered): the rotation keeps one chain. A
        newer lineage's are never touched: this one has lost to it, and its own save will be refused."""
        if not self.ctx.is_main:
            return
        store = self.context.store
        for info in store.list_steps():
            if info.step <= self.began_at:
                continue
            try:
                writer = store.read_manifest(info.path).get("attempt")
            except (OSError, ValueError):
                continue
            if isinstance(writer, int) and writer < self.lineage:
                reason = f"written by lineage {writer}, discarded for lineage {self.lineage}"
                self.log.warning(Event.LINEAGE_DISCARDED, step=info.step, lineage=writer, by=self.lineage)
                self.context.quarantine(Rejection(info.step, info.path, reason))

    def close(self) -> None:
        self.context.checkpointer.wait()
