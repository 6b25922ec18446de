"""Rank-0 console output: a one-line progress bar on a TTY, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Console:
    def __init__(self, mode: str, total_steps: int, enabled: bool, stream: TextIO = sys.stdout) -> None:
        self.enabled = enabled and mode != "none"
        self.stream = stream
        self.bar = mode == "progress" or (mode == "auto" and stream.isatty())
        self.total = total_steps
        self.started = time.monotonic()
        self.first_step: int | None = None

    def progress(self, step: int, loss: float, samples_per_s: float) -> None:
        if not self.enabled:
            return
        if self.first_step is None:
            self.first_step, self.started = step, time.monotonic()
        done = step - self.first_step
        rate = done / max(time.monotonic() - self.started, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        text = f"step {step}/{self.total}  loss {loss:.4f}  {samples_per_s:,.0f} samples/s  eta {eta:,.0f}s"
        if self.bar:
            width = 24
            filled = int(width * step / max(self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\033[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()
