"""The control plane: what every rank must agree on, when, and the phases a worker goes through.

Phases (`Phase`) and their transitions:

    RUNNING --a stop request on any rank (SIGTERM/SIGINT/SIGHUP, or the agent watchdog)--> STOPPING
        every rank learns it at the same control step, finishes that step, rank 0 commits it; then the
        worker exits 75 (torchrun regroups), 76 (its agent died) or 128+signal (a lone process)
    RUNNING --a collective fails (a peer died, froze past dist.timeout, or its agent restarted)--> EMERGENCY
        each survivor may commit the last completed step (staggered); exit 1, the agents regroup
    RUNNING --max_steps reached--> DONE
        final evaluation and checkpoint; exit 0 only once the final state is committed and verified
    STOPPING and DONE can still fail a collective --> EMERGENCY.

The collectives of a step, in the order every rank reaches them (a rank that skips one, or reaches them in
another order, hangs the group until dist.timeout). `COLLECTIVES` names them in that order.

Per step, on every rank:
  1. control all-reduce (3 float64s: stop, timed save due, steps to the next control step), started before
     forward/backward and waited for after it, only on control steps (about every dist.control_period);
  2. the DDP gradient all-reduce (buckets, inside the last micro-batch's backward).
On some steps, after the optimizer step, in this order:
  3. loss all-reduce, on logging steps (every log.every_steps, and max_steps);
  4. RNG all-gather (sizes, then payloads), on checkpoint steps (a save decided by 1., every_steps,
     milestones) and before a stop or final save;
  5. step-breakdown all-gather, every log.breakdown_every steps (observe/breakdown.py);
  6. final-outcome broadcast from rank 0 (on its own group, whose timeout covers the final save's retries).
At start-up: the broadcast of the checkpoint rank 0 chose, then the broadcast of the attempt number.
Rank 0's decisions (the checkpoint chosen, the run's hold, the attempt, the final outcome, evaluation scores)
travel through dist.decide_on_rank0: one broadcast, and a second only for a refusal's text.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVES = (
    "control_all_reduce",
    "gradient_all_reduce",
    "loss_all_reduce",
    "rng_all_gather",
    "breakdown_all_gather",
    "final_broadcast",
)

_MAX_STEPS_BETWEEN_CONTROL = 1000


class Phase(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"
    EMERGENCY = "emergency"
    DONE = "done"


_ALLOWED = {
    Phase.RUNNING: {Phase.STOPPING, Phase.EMERGENCY, Phase.DONE},
    Phase.STOPPING: {Phase.EMERGENCY},
    Phase.DONE: {Phase.EMERGENCY},
    Phase.EMERGENCY: set(),
}


class PeerFailure(RuntimeError):
    """A collective failed: a peer died, froze past dist.timeout, or its agent restarted the group."""


# What torch's futures put before an error raised in a `.then` callback: a DDP comm hook's bucket passes
# through two (the hook's own and the timing one of dist.wrap_model), so the cause came nested twice.
_CALLBACK = re.compile(r"Got the following error when running the callback: (?:(\w+): )?")
_REASON_CHARS = 300


def failure_reason(err: BaseException) -> str:
    """`Type: message` of the innermost error, once, on one line: what a failed collective's log says."""
    kind, message = type(err).__name__, str(err)
    while match := _CALLBACK.match(message):
        kind, message = match.group(1) or kind, message[match.end() :]
    first = message.strip().splitlines()[0] if message.strip() else ""
    return f"{kind}: {first[:_REASON_CHARS]}" if first else kind


@dataclass
class Decision:
    stop: bool  # some rank was asked to stop: all stop after this step
    save: bool  # rank 0's timer says a periodic checkpoint is due


NO_DECISION = Decision(stop=False, save=False)


class ControlPlane:
    """The per-step agreement and the worker's phase.

    `all_reduce(tensor) -> handle with .wait()` is the collective (a gloo group in training, a fake in
    tests); None for a single process.
    """

    def __init__(
        self,
        is_main: bool,
        period_s: float,
        all_reduce: Callable[[torch.Tensor], Any] | None,
    ) -> None:
        self.is_main = is_main
        self.period_s = period_s
        self.all_reduce = all_reduce
        self.phase = Phase.RUNNING
        self.next_control = 1

    def begin(self, step: int) -> None:
        """The loop starts at `step`: the first agreement runs there (a resume starts past step 1)."""
        self.next_control = step

    def control_step(self, step: int) -> bool:
        """At `step` the ranks agree (start/finish exchange flags); between control steps they do not."""
        return step >= self.next_control

    def enter(self, phase: Phase) -> None:
        if phase not in _ALLOWED[self.phase]:
            raise RuntimeError(f"control plane: {self.phase.value} -> {phase.value} is not a transition")
        self.phase = phase

    def start(
        self, step: int, stop_requested: bool, save_due: bool, step_s: float | None
    ) -> tuple[torch.Tensor, Any] | None:
        """On a control step, start the agreement on (stop, timed save, steps to the next control step);
        it overlaps with the step's compute. Other steps have no collective of their own.

        Rank 0 proposes how many steps make dist.control_period from its own step time; the all-reduce
        (a sum: the other ranks add zero) hands every rank the same number, so all agree on the next one.
        """
        if not self.control_step(step):
            return None
        every = 1
        if self.is_main and step_s:
            every = max(1, min(_MAX_STEPS_BETWEEN_CONTROL, round(self.period_s / step_s)))
        flags = torch.tensor(
            [float(stop_requested), float(self.is_main and save_due), float(every if self.is_main else 0)],
            dtype=torch.float64,
        )
        return flags, self.all_reduce(flags) if self.all_reduce else None

    def finish(self, step: int, pending: tuple[torch.Tensor, Any] | None) -> Decision:
        """Wait for the agreement started at `step` (the last collective before the optimizer step)."""
        if pending is None:
            return NO_DECISION
        flags, work = pending
        if work is not None:
            work.wait()
        self.next_control = step + int(flags[2].item())
        return Decision(stop=flags[0].item() > 0, save=flags[1].item() > 0)


def gloo_all_reduce(group: Any) -> Callable[[torch.Tensor], Any]:
    def all_reduce(flags: torch.Tensor) -> Any:
        return dist.all_reduce(flags, group=group, async_op=True)

    return all_reduce
