"""Rank-0 console output: a one-line progress bar on a TTY, plain lines otherwise.

Output is a courtesy, never a reason to stop: a terminal that went away (EIO after the SSH session
closed) or a pipe whose reader quit (EPIPE, e.g. `train | head`) would otherwise raise out of the step
logging and end the run without a save. Such writes are dropped.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TextIO


class Console:
    def __init__(self, mode: str, total_steps: int, enabled: bool, stream: TextIO = sys.stdout) -> None:
        self.enabled = enabled and mode != "none"
        self.stream = stream
        self.bar = mode == "progress" or (mode == "auto" and _isatty(stream))
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
            self._write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\033[K")
        else:
            self._write(text + "\n")

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        self._write(("\r\033[K" if self.bar else "") + text + "\n")

    def _write(self, text: str) -> None:
        print_safely(text, self.stream, end="")


def print_safely(text: str, stream: TextIO | None = None, end: str = "\n") -> bool:
    """Write and flush `text`; False, and nothing raised, when the stream is gone (EPIPE, EIO, closed)."""
    stream = stream if stream is not None else sys.stdout
    with contextlib.suppress(OSError, ValueError):
        stream.write(text + end)
        stream.flush()
        return True
    return False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):
        return False
