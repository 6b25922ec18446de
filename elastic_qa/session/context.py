"""What the parts of a checkpoint session share: the store and its fencing, this node's copy, the
checkpointer, and the run's identity as the ranks agreed it (its uuid at restore, the attempt at
registration)."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed import ProcessGroup

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.fencing import Fence
from elastic_qa.checkpoint.manager import Checkpointer, Rejection
from elastic_qa.checkpoint.node_local import NodeLocalCopy
from elastic_qa.checkpoint.store import CheckpointError, CheckpointStore
from elastic_qa.config import Config
from elastic_qa.dist import DistContext, all_gather_bytes
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger
from elastic_qa.train_state import TrainState


@dataclass
class SessionContext:
    cfg: Config
    ctx: DistContext
    state: TrainState
    control_group: ProcessGroup | None  # gloo: rank 0's decisions and the small gathers travel on it
    store: CheckpointStore
    fence: Fence
    node_local: NodeLocalCopy | None
    checkpointer: Checkpointer
    run_id: str  # torchrun's run id (the job), or a fresh one for a single process
    run_uuid: str = ""  # the run this start belongs to (checkpoint/run_record.py), agreed at restore
    attempt: int = 0  # the job-wide attempt number, agreed at registration
    stopping: bool = False  # a stop or an emergency save is under way: node-local lock waits shrink

    @classmethod
    def open(
        cls,
        cfg: Config,
        ctx: DistContext,
        state: TrainState,
        control_group: ProcessGroup | None,
        before_file: Callable[[str], None] = lambda name: None,
        stop_asked: Callable[[], bool] = lambda: False,
    ) -> SessionContext:
        """The shared parts for this attempt; `before_file(name)` runs before each checkpoint file is
        written (a fault injection hook); `stop_asked()` says a stop was asked (a signal, the watchdog):
        from then on no save waits long on the node-local copy's lock."""
        store = open_store(cfg.checkpoint_dir)
        fence = Fence(store)
        holder: list[SessionContext] = []  # the lock's urgency reads the context built below
        node_local = NodeLocalCopy.open(
            cfg.checkpoint,
            store.display(store.root),
            urgent=lambda: stop_asked() or bool(holder and holder[0].stopping),
        )
        checkpointer = Checkpointer(
            cfg.checkpoint,
            store,
            may_commit=fence.check,
            before_file=before_file,
            node_local=node_local,
        )
        run_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"single-{uuid.uuid4().hex[:12]}"
        context = cls(cfg, ctx, state, control_group, store, fence, node_local, checkpointer, run_id)
        holder.append(context)
        return context

    def gather_json(self, mine: Any) -> list[Any]:
        """Every rank's `mine` (plain JSON values), read with json: never unpickled."""
        parts = all_gather_bytes(json.dumps(mine).encode(), self.ctx.world_size, self.control_group)
        return [json.loads(part) for part in parts]

    def quarantine(self, rejection: Rejection) -> None:
        """Move a checkpoint that failed its checks out of the rotation (rank 0), saying so."""
        log = get_logger()
        try:
            target = self.store.quarantine(rejection.path, rejection.reason)
            log.warning(
                Event.CHECKPOINT_QUARANTINED,
                step=rejection.step,
                path=self.store.display(target),
                reason=rejection.reason,
            )
        except (OSError, CheckpointError) as err:  # a replay of that step supersedes it all the same
            log.warning("checkpoint_quarantine_failed", step=rejection.step, error=str(err))
