"""The job's committed step, on disk: a group that restarted must not train alone behind the job.

torchft forms a quorum of whoever asks within the join timeout, so a replica group that restarted fresh
(step 0) while its peers are held up for a moment (an evaluation, a slow save, a stall) could form a quorum
of its own and commit step 1 again: two lineages, windows trained twice. Every committed step is recorded
here by the one worker that writes the step lines (quorum rank 0, group rank 0); a group whose quorum has no
member at that step does not train in it and asks for the next quorum instead, until a peer that holds the
job's state is in it (torchft then heals it from that peer). The mark is written at the first committed
step, then at most once a second, and at the last (`advance`): it may lag, never lead.

One small file, replaced atomically (write, fsync-free rename: losing the newest mark in a power cut only
lets a restarted group wait less, the durable checkpoint stays the truth). A mark that is not a plain number
reads as 0: it can make a group wait, never train twice.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

MAX_BYTES = 32
WRITE_EVERY_S = 1.0


class CommitMark:
    def __init__(self, run_dir: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.directory = Path(run_dir) / "replica"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "committed-step"
        self._written = 0  # the newest step this process recorded
        self._written_at = 0.0  # when (time.monotonic)

    def read(self) -> int:
        """The newest step the job committed (0: none, or a mark that is not a number)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return 0
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a directory in its place
                return 0
            text = os.read(fd, MAX_BYTES + 1)
        except OSError:
            return 0
        finally:
            os.close(fd)
        if len(text) > MAX_BYTES:
            return 0
        text = text.strip()
        return int(text) if text.isascii() and text.isdigit() else 0

    def advance(self, step: int, final: bool = False) -> None:
        """Record that `step` committed (never moves the mark back). Called at every committed step by the
        step lines' writer, it writes at the first step, the final one and then at most every WRITE_EVERY_S
        (a write and a rename cost ~0.12 ms on a local disk, more on a shared one): a restarted group starts
        at step 0, so any mark past it keeps it waiting, and the final step tells a late group the job is
        done."""
        now = self.clock()
        if self._written and not final and now - self._written_at < WRITE_EVERY_S:
            return
        if step <= max(self._written, self.read()):
            return
        staging = self.directory / f".committed-step.{os.getpid()}"
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, str(step).encode())
        finally:
            os.close(fd)
        os.replace(staging, self.path)
        self._written, self._written_at = step, now
