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
  1. control all-reduce (float64s: stop, timed save due, steps to the next control step, then the values
     carried since the last one: `ControlPlane.carry`), started before forward/backward and waited for
     after it, only on control steps (about every dist.control_period);
  2. the DDP gradient all-reduce (buckets, inside the last micro-batch's backward).
What a step carries rides on the next control all-reduce, overlapped with compute, so that no step waits
for a collective of its own: the loss sums of a logging step (every log.every_steps, and max_steps;
loop/step_log.py) and the figures of a breakdown step (every log.breakdown_every; observe/breakdown.py).
Where something must follow them before the next agreement (an evaluation, a checkpoint, a stop, the end),
`flush` sums them at once:
  3. carried all-reduce (`flush`), on such steps when values are carried, after the optimizer step;
On some steps, after the optimizer step, in this order:
  4. RNG all-gather (sizes, then payloads), on checkpoint steps (a save decided by 1., every_steps,
     milestones) and before a stop or final save;
  5. final-outcome broadcast from rank 0 (on its own group, whose timeout covers the final save's retries).
At start-up: the broadcast of the checkpoint rank 0 chose, then the broadcast of the attempt number.
Rank 0's decisions (the checkpoint chosen, the run's hold, the attempt, the final outcome, evaluation scores)
travel through dist.decide_on_rank0: one broadcast, and a second only for a refusal's text.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

COLLECTIVES = (
    "control_all_reduce",
    "gradient_all_reduce",
    "carried_all_reduce",
    "rng_all_gather",
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


# A value to sum over the ranks, and what is done with the sums once they arrive.
Carried = tuple[torch.Tensor, Callable[[torch.Tensor], None]]
_FLAGS = 3  # stop, timed save, steps to the next control step


class Agreement(NamedTuple):
    """A control step's all-reduce in flight: the flags and carried values, and its handle."""

    values: torch.Tensor
    work: Any
    carried: list[Carried]


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
        self._carried: list[Carried] = []  # to travel on the next agreement
        self._arrived: list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = []  # summed, not delivered
        self.agreements = 0  # how many sums have arrived (agreements and flushes): which one a delivery is of

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

    def carry(self, values: torch.Tensor, deliver: Callable[[torch.Tensor], None]) -> None:
        """Sum `values` over the ranks on the next agreement (at most about dist.control_period away), then
        `deliver(sums)` at the `deliver()` after it; alone, deliver them now. Every rank carries values of
        the same sizes at the same steps (or the sums are garbage): what to carry must follow from the step.
        """
        if self.all_reduce is None:
            deliver(values)
            return
        self._carried.append((values.to(torch.float64).flatten(), deliver))

    def start(
        self, step: int, stop_requested: bool, save_due: bool, step_s: float | None
    ) -> Agreement | None:
        """On a control step, start the agreement on (stop, timed save, steps to the next control step)
        and the sums of what was carried; it overlaps with the step's compute. Other steps have no
        collective of their own.

        Rank 0 proposes how many steps make dist.control_period from its own step time; the all-reduce
        (a sum: the other ranks add zero) hands every rank the same number, so all agree on the next one.
        """
        if not self.control_step(step):
            return None
        every = 1
        if self.is_main and step_s:
            every = max(1, min(_MAX_STEPS_BETWEEN_CONTROL, round(self.period_s / step_s)))
        flags = [float(stop_requested), float(self.is_main and save_due), float(every if self.is_main else 0)]
        carried, self._carried = self._carried, []
        values = torch.cat([torch.tensor(flags, dtype=torch.float64), *(v for v, _ in carried)])
        return Agreement(values, self.all_reduce(values) if self.all_reduce else None, carried)

    def finish(self, step: int, pending: Agreement | None) -> Decision:
        """Wait for the agreement started at `step` (the last collective before the optimizer step)."""
        if pending is None:
            return NO_DECISION
        values, work, carried = pending
        if work is not None:
            work.wait()
        stop, save, every = values[:_FLAGS].tolist()  # one conversion, not one .item() per flag
        self.next_control = step + int(every)
        self._arrive(values[_FLAGS:], carried)
        return Decision(stop=stop > 0, save=save > 0)

    def deliver(self) -> None:
        """Hand the sums that arrived with the last agreement to those who carried them."""
        arrived, self._arrived = self._arrived, []
        for sums, deliver in arrived:
            deliver(sums)

    def flush(self) -> None:
        """Sum what is carried now, in one blocking all-reduce (collective: on every rank at the same step,
        before anything that must come after the carried values' use: an evaluation, a save, the end), and
        deliver it."""
        carried, self._carried = self._carried, []
        if carried and self.all_reduce is not None:
            values = torch.cat([v for v, _ in carried])
            self.all_reduce(values).wait()
            self._arrive(values, carried)
        self.deliver()

    def _arrive(self, sums: torch.Tensor, carried: list[Carried]) -> None:
        self.agreements += 1
        offset = 0
        for values, deliver in carried:
            self._arrived.append((sums[offset : offset + values.numel()], deliver))
            offset += values.numel()


def gloo_all_reduce(group: ProcessGroup | None) -> Callable[[torch.Tensor], Any]:
    def all_reduce(flags: torch.Tensor) -> Any:
        return dist.all_reduce(flags, group=group, async_op=True)

    return all_reduce
