"""Job-wide attempt numbers, so that a stale worker group can never commit over a newer one's work.

Every (re)start of the worker group registers the next attempt number in the checkpoint store
(`<checkpoint.dir>/attempts/attempt-00000007.json`), chosen by rank 0 and broadcast. Before a checkpoint
becomes visible the writer checks that no newer attempt is registered; a group that lost a split brain
(see TORCHRUN.md) finds one and is refused. The check and the publish are two operations, so a group that
registers in between can still see one last commit from the stale group, never a later one.
"""

from __future__ import annotations

import json
import re
import time

from elastic_qa.checkpoint.store import CheckpointStore, StaleWriterError

_ATTEMPT = re.compile(r"attempt-(\d{8})\.json$")


class Fence:
    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.directory = store.path("attempts")
        self.attempt = 0

    def newest(self) -> int:
        try:
            names = self.store.fs.ls(self.directory, detail=False)
        except FileNotFoundError:
            return 0
        finally:
            self.store.fs.invalidate_cache()
        numbers = [int(m.group(1)) for name in names if (m := _ATTEMPT.search(name))]
        return max(numbers, default=0)

    def register(self, world_size: int) -> int:
        """Claim the next attempt number (rank 0 only)."""
        self.attempt = self.newest() + 1
        record = {"attempt": self.attempt, "world_size": world_size, "time": time.time()}
        self.store.fs.makedirs(self.directory, exist_ok=True)
        self.store.fs.pipe_file(
            f"{self.directory}/attempt-{self.attempt:08d}.json", json.dumps(record).encode()
        )
        return self.attempt

    def check(self) -> None:
        """Raise StaleWriterError when a newer group has registered."""
        newest = self.newest()
        if newest > self.attempt:
            raise StaleWriterError(f"attempt {self.attempt} is stale: attempt {newest} has started")
