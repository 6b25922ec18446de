"""Where a step's time goes, per rank, and a one-line diagnosis (data-bound, communication-bound, straggler).

Every `log.breakdown_every` steps each rank logs `step_breakdown`: data wait, forward+backward,
communication (gradient all-reduce, from the timing DDP comm hook), optimizer, logging and saving (of
which the checkpoint stall), the rest, and peak memory. The ranks' figures are gathered (they ride on the
next step's control all-reduce, each rank's in its own slot of a sum, so no step waits for them) and
rank 0 prints a diagnosis when a share crosses a threshold: data wait > 10% (data-bound), communication
> 20% (communication-bound), or one rank busier than the median by > 20% in two windows running
(straggler).

Phases are wall-clock marks. On CUDA a mark synchronises the device, which costs overlap, so there they are
taken on the reporting step only; on CPU they cost nothing and every step is timed.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from elastic_qa.dist import CommTimer, DistContext
from elastic_qa.observe.events import Event

if TYPE_CHECKING:  # the console reads the breakdown's figures: a type only here
    from elastic_qa.observe.console import Console
    from elastic_qa.observe.log import EventLog

# Sums the ranks' values (ControlPlane.carry): `carry(values, deliver)` calls `deliver(sums)` later.
Carry = Callable[[torch.Tensor, Callable[[torch.Tensor], None]], None]
PHASES = ("data", "forward_backward", "optimizer", "log_and_save")
RATE_WINDOW = 20  # steps the step rate is measured over
DATA_BOUND, COMM_BOUND, STRAGGLER = 0.10, 0.20, 0.20


class StepTimer:
    def __init__(self, device: torch.device, breakdown_every: int, comm: CommTimer | None = None) -> None:
        self.device = device
        self.every = breakdown_every
        self.comm = comm or CommTimer()
        self.totals: dict[str, float] = defaultdict(float)
        self.steps_in_window = 0
        self.window_started = time.perf_counter()
        self.rate_window: deque[float] = deque(maxlen=RATE_WINDOW + 1)  # end times of the recent steps
        self._last = time.perf_counter()
        self._detailed = False
        self._stall = 0.0
        self._suspects: dict[int, int] = {}
        self._shown: set[str] = set()  # kinds of finding the console was told of
        self.step = 0

    def start_step(self, step: int) -> None:
        self.step = step
        self._detailed = self.device.type != "cuda" or bool(self.every and step % self.every == 0)
        if self._detailed and self.device.type == "cuda":
            # The CPU runs ahead of the GPU: without this, the previous step's queued kernels would be
            # timed as this step's data wait (and could read as a data-bound run).
            torch.cuda.synchronize(self.device)
        self._last = time.perf_counter()

    def mark(self, phase: str | None) -> None:
        """The time since the previous mark was spent in `phase` (None: in none of them, other_s)."""
        if not self._detailed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a sync point: only on reported steps
        now = time.perf_counter()
        if phase is not None:
            self.totals[phase] += now - self._last
        self._last = now

    def leave_out(self, seconds: float) -> None:
        """Time that was none of this loop's steps (another loop ran in this process: the interleaved
        overhead benchmark): left out of the step rate and the breakdown window, as if it had not passed."""
        self.rate_window = deque((t + seconds for t in self.rate_window), maxlen=RATE_WINDOW + 1)
        self.window_started += seconds

    def add_stall(self, seconds: float) -> None:
        self._stall += seconds

    def mean_step_s(self) -> float:
        """Mean wall time of the recent steps (0 before two steps have finished)."""
        if len(self.rate_window) < 2:
            return 0.0
        return (self.rate_window[-1] - self.rate_window[0]) / (len(self.rate_window) - 1)

    def samples_per_s(self, global_count: int) -> float:
        """Global samples per second over the recent steps (a sliding window of RATE_WINDOW)."""
        if len(self.rate_window) < 2:
            return 0.0
        steps = len(self.rate_window) - 1
        return steps * global_count / max(self.rate_window[-1] - self.rate_window[0], 1e-9)

    def finish_step(
        self,
        ctx: DistContext,
        group: ProcessGroup | None,
        log: EventLog,
        console: Console | None,
        carry: Carry | None = None,
    ) -> None:
        """Close the step; on a reporting step, log this rank's breakdown and (rank 0) the diagnosis, from
        every rank's figures: gathered now on `group`, or summed where `carry` takes them (the next step's
        control all-reduce: ControlPlane.carry), each rank's in its own slot."""
        now = time.perf_counter()
        self.steps_in_window += 1
        self.rate_window.append(now)
        if not self.every or self.step % self.every:
            return
        steps = self.steps_in_window
        window = now - self.window_started
        per_step = {phase: self.totals.get(phase, 0.0) / steps for phase in PHASES}
        if self.device.type == "cuda":  # only the reported step was timed
            per_step = {phase: self.totals.get(phase, 0.0) for phase in PHASES}
        comm = self.comm.take() / steps
        step_s = window / steps
        figures = {
            "step_s": step_s,
            "data_s": per_step["data"],
            "forward_backward_s": per_step["forward_backward"],
            "comm_s": comm,
            "optimizer_s": per_step["optimizer"],
            "log_and_save_s": per_step["log_and_save"],
            "checkpoint_stall_s": self._stall / steps,
            "other_s": max(0.0, step_s - sum(per_step.values())),
        }
        log.info(
            Event.STEP_BREAKDOWN,
            step=self.step,
            steps=steps,
            **{key: round(value, 6) for key, value in figures.items()},
            data_share=round(figures["data_s"] / step_s, 4),
            comm_share=round(comm / step_s, 4),
            peak_memory_mb=round(peak_memory_mb(self.device), 1),
        )
        self._share(ctx, group, figures, log, console, carry)
        self.totals.clear()
        self.steps_in_window = 0
        self._stall = 0.0
        self.window_started = now

    def _share(
        self,
        ctx: DistContext,
        group: ProcessGroup | None,
        figures: dict[str, float],
        log: EventLog,
        console: Console | None,
        carry: Carry | None,
    ) -> None:
        # busy: time this rank spent on its own work, not waiting for its peers inside the all-reduce
        busy = figures["data_s"] + figures["forward_backward_s"] + figures["optimizer_s"] - figures["comm_s"]
        mine = torch.tensor(
            [figures["step_s"], figures["data_s"], figures["comm_s"], max(busy, 0.0)], dtype=torch.float64
        )
        step = self.step
        if carry is not None:  # a sum of rows that are zero but for each rank's own: an all-gather
            slots = torch.zeros(ctx.world_size, len(mine), dtype=torch.float64)
            slots[ctx.rank if ctx.distributed else 0] = mine
            carry(slots, lambda sums: self._diagnose(ctx, step, list(sums.view(-1, len(mine))), log, console))
            return
        rows = [mine]
        if ctx.distributed:
            rows = [torch.empty_like(mine) for _ in range(ctx.world_size)]
            dist.all_gather(rows, mine, group=group)
        self._diagnose(ctx, step, rows, log, console)

    def _diagnose(
        self, ctx: DistContext, step: int, rows: list[torch.Tensor], log: EventLog, console: Console | None
    ) -> None:
        """Rank 0 names what bounds the run from every rank's (step_s, data_s, comm_s, busy_s) at `step`."""
        if not ctx.is_main:
            return
        step_s = statistics.median(float(r[0]) for r in rows)
        data_share = max(float(r[1]) for r in rows) / step_s
        comm_share = statistics.median(float(r[2]) for r in rows) / step_s
        busy_s = [float(r[3]) for r in rows]
        findings = []
        if data_share > DATA_BOUND:
            findings.append(
                f"data-bound: data wait {data_share:.0%} of step time: raise data.num_workers / "
                "check the feature cache"
            )
        if comm_share > COMM_BOUND:
            findings.append(
                f"communication-bound: the gradient all-reduce takes {comm_share:.0%} of step time (usual "
                "for a small model); more work per rank and step (a larger train.global_batch_size) or "
                "dist.comm_hook=bf16 raises samples/s"
            )
        if len(busy_s) >= 2:
            median = statistics.median(busy_s)
            slow = {rank for rank, b in enumerate(busy_s) if median > 0 and b > (1 + STRAGGLER) * median}
            self._suspects = {rank: self._suspects.get(rank, 0) + 1 for rank in slow}
            for rank, windows in self._suspects.items():
                if windows >= 2:
                    findings.append(
                        f"straggler: rank {rank} busy {busy_s[rank] / median - 1:.0%} longer than the "
                        "median rank"
                    )
        for finding in findings:
            log.warning(Event.DIAGNOSIS, step=step, finding=finding)
            kind = finding.split(":")[0]
            if console is not None and kind not in self._shown:  # the console hears of each once
                self._shown.add(kind)
                console.line(f"diagnosis at step {step}: {finding}")


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
