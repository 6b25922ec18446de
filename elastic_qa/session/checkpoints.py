"""CheckpointSession: the trainer's one handle on its checkpoints for one attempt.

Order at start-up, so that a start refused as bad input writes nothing:
    restore()   the restore plan (restore.py): rank 0 picks the newest state that verifies, every rank
                loads it (reads only)
    register()  registration (registration.py): the run's hold, the attempt number, the run record; then
                restore again if a checkpoint newer than the restored one was committed meanwhile by a
                group that was still running, or commit a state restored from node memory only
then, each step, the saver (saver.py): whether a save is due, and every kind of save.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed import ProcessGroup

from elastic_qa.checkpoint.manager import Checkpointer, LoadedCheckpoint
from elastic_qa.checkpoint.node_local import NodeLocalCopy
from elastic_qa.checkpoint.store import CheckpointStore
from elastic_qa.config import Config
from elastic_qa.debug import Faults
from elastic_qa.dist import DistContext
from elastic_qa.observe.log import get_logger
from elastic_qa.session.context import SessionContext
from elastic_qa.session.hold import RunHold
from elastic_qa.session.registration import Registrar
from elastic_qa.session.restore import RestorePlan
from elastic_qa.session.saver import FinalStateError, Saver
from elastic_qa.train_state import TrainState

__all__ = ["CheckpointSession", "FinalStateError"]


class CheckpointSession:
    """Restore, register, whether a save is due, and the saves.

    `faults` are the debug settings' injections (debug.py: a checkpoint asked for at a step, a slow or full
    disk); `on_stall(seconds)` hears how long each save blocked the training process (the step timer's stall);
    `stop_asked()` says a stop was asked (a signal, the watchdog): from then on no save waits long on the
    node-local copy's lock, nor does a stop or an emergency save.
    """

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        state: TrainState,
        control_group: ProcessGroup | None,
        faults: Faults | None = None,
        on_stall: Callable[[float], None] | None = None,
        stop_asked: Callable[[], bool] = lambda: False,
    ) -> None:
        faults = faults or Faults(cfg, ctx.rank)
        self.context = SessionContext.open(cfg, ctx, state, control_group, faults.before_file, stop_asked)
        self.plan = RestorePlan(self.context)
        self.registrar = Registrar(self.context)
        self.saver = Saver(self.context, lambda: self.plan.resumed_step, on_stall, self.registrar.release)
        self.saver.asked_by_faults = faults.save_due
        self.log = get_logger()
        # What the trainer asks of each part, by name.
        self.log_start = self.plan.log_start
        self.start_schedule, self.time_due = self.saver.start_schedule, self.saver.time_due
        self.save_due, self.save = self.saver.save_due, self.saver.save
        self.save_emergency, self.save_for_stop = self.saver.save_emergency, self.saver.save_for_stop
        self.save_final = self.saver.save_final

    # ---- start-up -----------------------------------------------------------------------------------
    def restore(self) -> LoadedCheckpoint | None:
        """Load the newest state that verifies (restore.py); writes nothing."""
        return self.plan.restore()

    def register(self) -> int:
        """Job-wide attempt number: rank 0 claims it in the checkpoint store, all ranks agree."""
        registration = self.registrar.register(self.plan)
        if registration.restore_again:
            self.log.warning("checkpoint_appeared", restored_step=self.context.state.step)
            self.plan.restore()
        elif registration.make_durable:
            # The restored state exists only in node memory: commit it to the store now (in the
            # background), so that losing the node loses nothing more than it would have without the copy.
            self.log.info("node_local_made_durable", step=self.context.state.step)
            self.saver.save("node_local")
        return registration.attempt

    # ---- what the trainer, the tests and the benchmarks read ----------------------------------------
    @property
    def resumed_step(self) -> int | None:
        return self.plan.resumed_step

    @property
    def run_uuid(self) -> str:
        return self.context.run_uuid

    @property
    def attempt(self) -> int:
        return self.context.attempt

    @property
    def store(self) -> CheckpointStore:
        return self.context.store

    @property
    def checkpointer(self) -> Checkpointer:
        return self.context.checkpointer

    @property
    def node_local(self) -> NodeLocalCopy | None:
        return self.context.node_local

    @property
    def hold(self) -> RunHold:
        return self.registrar.hold
