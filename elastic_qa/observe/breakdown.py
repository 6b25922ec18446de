"""Where a step's time goes: data wait, forward+backward, optimizer, checkpoint stall, the rest.

Phases are wall-clock marks taken by the training loop. On CUDA the marks synchronise the device, which
costs overlap, so they are only taken on steps that will be reported (every `log.breakdown_every`).
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from typing import Any

import torch

PHASES = ("data", "forward_backward", "optimizer", "checkpoint")


class StepTimer:
    def __init__(self, device: torch.device, breakdown_every: int) -> None:
        self.device = device
        self.every = breakdown_every
        self.totals: dict[str, float] = defaultdict(float)
        self.steps_in_window = 0
        self.window_started = time.perf_counter()
        self.rate_window: list[float] = []  # end times of the recent steps
        self._last = self._step_start = time.perf_counter()
        self._detailed = False
        self._stall = 0.0
        self.step = 0

    def start_step(self, step: int) -> None:
        self.step = step
        self._detailed = self.device.type != "cuda" or (self.every and step % self.every == 0)
        self._last = self._step_start = time.perf_counter()

    def mark(self, phase: str) -> None:
        if not self._detailed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now

    def add_stall(self, seconds: float) -> None:
        self._stall += seconds

    def samples_per_s(self, global_count: int) -> float:
        """Global samples per second over the recent steps (a sliding window of 20)."""
        if len(self.rate_window) < 2:
            return 0.0
        steps = len(self.rate_window) - 1
        return steps * global_count / max(self.rate_window[-1] - self.rate_window[0], 1e-9)

    def finish_step(self, ctx: Any, log: Any, console: Any) -> None:
        now = time.perf_counter()
        self.steps_in_window += 1
        self.rate_window.append(now)
        self.rate_window = self.rate_window[-21:]
        if not self.every or self.step % self.every:
            return
        window = now - self.window_started
        measured = sum(self.totals.values())
        shares = {phase: self.totals.get(phase, 0.0) for phase in PHASES}
        fields = {f"{phase}_s": round(seconds / self.steps_in_window, 6) for phase, seconds in shares.items()}
        log.info(
            "step_breakdown",
            step=self.step,
            steps=self.steps_in_window,
            step_s=round(window / self.steps_in_window, 6),
            other_s=round(max(0.0, window - measured) / self.steps_in_window, 6),
            checkpoint_stall_s=round(self._stall, 6),
            data_share=round(shares["data"] / window, 4) if window else 0.0,
            peak_memory_mb=round(peak_memory_mb(self.device), 1),
            **fields,
        )
        self.totals.clear()
        self.steps_in_window = 0
        self._stall = 0.0
        self.window_started = now


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
