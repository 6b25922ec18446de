"""Registration: the run's hold, the attempt number and the run record, in one place.

Before a start writes anything, the worker (train.py), the local launcher and the node command ask
`check_before_start`: another live job holding the run refuses it (RunHeldError), and so does a `holders/`
that is no real directory of the checkpoint directory (CheckpointError); other storage trouble is left to
the worker's own registration. At registration, after the restore (which reads only), rank 0 takes the
run's hold for this job (session/hold.py: refused while another live job holds it, so that a second job
never fences a live one), claims the next attempt number (checkpoint/fencing.py), writes the run record of
a store without one, clears what older attempts left (their staging, the checkpoints rejected at restore)
and says whether a checkpoint newer than the restored one was committed meanwhile (restore again) or the
restored state exists in node memory only (make it durable).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_qa.checkpoint.run_record import write_record
from elastic_qa.dist import decide_on_rank0
from elastic_qa.observe.log import get_logger, update_identity
from elastic_qa.session.context import SessionContext
from elastic_qa.session.hold import RunHeldError, RunHold, check_before_start, local_processes, unique
from elastic_qa.session.restore import RestorePlan

__all__ = ["Registrar", "Registration", "check_before_start"]


@dataclass(frozen=True)
class HoldTaken:
    """Rank 0 holds the run for this job: nothing more to say (a refusal travels as RunHeldError)."""


# Rank 0's decision, as every rank receives it (dist.decide_on_rank0).
@dataclass(frozen=True)
class Registration:
    attempt: int  # the job-wide attempt number rank 0 claimed
    restore_again: bool  # a checkpoint newer than the restored one was committed meanwhile
    make_durable: bool  # restored from the node-local copies, a step the store does not hold: save it


class Registrar:
    """Registers this attempt of the job (`register`) and holds the run until the job is done (`release`)."""

    def __init__(self, context: SessionContext) -> None:
        self.c = context
        self.log = get_logger()
        cfg = context.cfg
        self.hold = RunHold(cfg.checkpoint_dir, context.run_id, cfg.run.dir, fs=context.store.fs)

    def register(self, plan: RestorePlan) -> Registration:
        """Take the hold, claim the attempt number (rank 0), agree on it everywhere: what `plan` restored
        decides whether to restore again or make the restored state durable."""
        self._take_hold()
        c = self.c

        def claim() -> Registration:
            attempt = c.fence.register(c.ctx.world_size)
            if plan.new_record is not None:  # the store's first registration (or one from before records)
                write_record(c.store, plan.new_record)
            c.store.clean_staging(attempt)
            for rejection in plan.rejected:
                c.quarantine(rejection)
            committed = c.store.list_steps()
            restored_step = plan.restored.step if plan.restored else -1
            newer = bool(committed) and committed[-1].step > restored_step
            make_durable = plan.from_node_local and not c.store.exists(restored_step)
            return Registration(attempt, newer, make_durable)

        registration = decide_on_rank0(c.ctx, c.control_group, claim, Registration)
        c.attempt = c.fence.attempt = registration.attempt
        update_identity(attempt=c.attempt)
        return registration

    def release(self) -> None:
        """The job is done (rank 0): the run is free for the next start without any liveness check."""
        self.hold.release()

    def _take_hold(self) -> None:
        """Rank 0 takes the run's hold for this job, naming every rank's worker and agent; raises
        RunHeldError on every rank when another live job holds it (nothing written, no one fenced)."""
        c = self.c
        processes = local_processes()
        if c.ctx.distributed:
            processes = [process for rank in c.gather_json(processes) for process in rank]

        def take() -> HoldTaken:
            self.hold.acquire(unique(processes), self.log)
            self.hold.start_heartbeat(self.log)
            return HoldTaken()

        # Every rank fails with rank 0's line, as a refused restore does.
        decide_on_rank0(c.ctx, c.control_group, take, HoldTaken, (RunHeldError,))
