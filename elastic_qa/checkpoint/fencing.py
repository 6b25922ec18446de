"""Job-wide attempt numbers, so that a stale worker group can never commit over a newer one's work.

Every (re)start of the worker group registers the next attempt number in the checkpoint store, chosen by
rank 0 and broadcast. Before a checkpoint becomes visible the writer checks that no newer attempt is
registered; a group that lost a split brain (two groups formed on one run) finds one and is refused. The
check and the publish are two operations, so a group that registers in between can still see one last
commit from the stale group, never a later one; the trainer re-reads the newest checkpoint after it
registers for that reason.

Registration must hand out every number once, even when two groups (or two jobs on one run directory)
register at the same moment. It needs no atomic create or rename, so it works on object stores too; it
needs only that a listing shows every file written before it began (local disks, NFS with close-to-open
consistency, S3 and GCS are strongly consistent):

    write  attempts/attempt-<N>.<token>.json      (a claim of N, unique to this registrant)
    list   attempts/
    the claim wins if it is the only claim of N; otherwise it is withdrawn and N+1 is tried.

Two claimants of N cannot both win: whichever listed first did so after its own write and before the
other's write (else it would have seen it), so the other's listing, which comes after its own write, sees
both claims. A number both claimants withdrew is never handed out; it still fences older attempts.

Only the newest number counts (the fence, the next registration), so a winner deletes the claims more than
KEPT_CLAIMS below its own: a run that regroups every few minutes for days (every fault a new attempt, in
the replica mode a new lineage per quorum) would otherwise list thousands of claims at every save, a page
per thousand on an object store. Deleting one cannot hand its number out again, nor let an older writer
pass: both only ever compare against the newest. A registrant still trying a number that old (it lost 32
races in a row) finds its claim gone and tries past the newest, as it would after a collision.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import time
import uuid

from elastic_qa.checkpoint.confined import ATTEMPTS_DIR, confined
from elastic_qa.checkpoint.errors import StaleWriterError
from elastic_qa.checkpoint.store import CheckpointStore

# attempt-00000007.json (one claim per number, written by older versions) or attempt-00000007.<token>.json
_CLAIM = re.compile(r"attempt-(\d{8,})(?:\.([0-9a-f]{16}))?\.json$")
_MAX_TRIES = 64
KEPT_CLAIMS = 32  # claims kept below the newest (older ones are deleted by the next winner)
_jitter = random.Random()  # its own generator: the training RNG state must not move


class FenceError(RuntimeError):
    """No attempt number could be registered (the store keeps failing, or contention never settles)."""


class Fence:
    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.directory = store.path(ATTEMPTS_DIR)
        self.attempt = 0

    def _claims(self) -> dict[int, set[str]]:
        """Every claim in the store: attempt number -> the tokens that claimed it."""
        self.store.fs.invalidate_cache()
        try:
            names = self.store.fs.ls(self.directory, detail=False)
        except FileNotFoundError:
            return {}
        claims: dict[int, set[str]] = {}
        for name in names:
            if match := _CLAIM.search(name):
                claims.setdefault(int(match.group(1)), set()).add(match.group(2) or "")
        return claims

    def newest(self) -> int:
        return max(self._claims(), default=0)

    def register(self, world_size: int) -> int:
        """Claim the next attempt number (rank 0 only); unique even when registrants race."""
        confined(self.store.fs, self.store.root, ATTEMPTS_DIR)  # claims are written and withdrawn there
        self.store.fs.makedirs(self.directory, exist_ok=True)
        token = uuid.uuid4().hex[:16]
        number = self.newest() + 1
        for _ in range(_MAX_TRIES):
            path = f"{self.directory}/attempt-{number:08d}.{token}.json"
            record = {"attempt": number, "world_size": world_size, "time": time.time(), "token": token}
            self.store.fs.pipe_file(path, json.dumps(record).encode())
            claims = self._claims()
            if claims.get(number) == {token}:
                self.attempt = number
                self._prune(claims, number - KEPT_CLAIMS)
                return number
            # Someone else claimed this number too: withdraw (the number stays burnt) and go past everything
            # seen. A short random pause keeps two registrants from colliding on every number.
            with contextlib.suppress(OSError):
                self.store.fs.rm(path)
            number = max(claims, default=number) + 1
            time.sleep(_jitter.uniform(0.0, 0.02))
        raise FenceError(f"could not register an attempt in {self.directory} after {_MAX_TRIES} tries")

    def _prune(self, claims: dict[int, set[str]], below: int) -> None:
        """Delete the claims of numbers below `below` (best effort: one that stays is only listed again)."""
        for number in sorted(n for n in claims if n < below):
            for token in claims[number]:
                name = f"attempt-{number:08d}.{token}.json" if token else f"attempt-{number:08d}.json"
                with contextlib.suppress(OSError):
                    self.store.fs.rm(f"{self.directory}/{name}")

    def check(self) -> None:
        """Raise StaleWriterError when a newer group has registered."""
        newest = self.newest()
        if newest > self.attempt:
            raise StaleWriterError(f"attempt {self.attempt} is stale: attempt {newest} has started")
