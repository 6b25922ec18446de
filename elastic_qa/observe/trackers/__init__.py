"""Experiment trackers (`log.trackers: [mlflow, wandb]`): one tracker run per elastic run, kept across
every restart, regroup and resume, each step logged once. TensorBoard (per rank, local files) is
observe/tensorboard.py.

Rank 0 alone writes to them. The tracker run is found again through the run's uuid (the checkpoint
directory's run record, written when the first start registers, before any step is trained; every
checkpoint's manifest carries it too: checkpoint/run_record.py): MLflow finds the run tagged with it, W&B
takes it as the run's id. So a rank 0 restarted on another node, or a job that crashed before its first
checkpoint, continues the same tracker run; `checkpoint.resume_from` starts a new run and a new tracker run.
How steps that a crashed attempt already logged are skipped: background.py.
"""

from __future__ import annotations

import importlib.util
import threading
import time

from elastic_qa.config import Config, ConfigError
from elastic_qa.observe.trackers.background import QUEUE_CALLS, BackgroundTracker, Record, TrackerRun

# The most records a tracker may not hold for certain (see Trackers): queued, being sent, W&B's pending.
STANDBY_RECORDS = 3 * QUEUE_CALLS

# The extra that installs each tracker's package (pyproject.toml).
_PACKAGES = {"mlflow": ("mlflow", "elastic-qa[mlflow]"), "wandb": ("wandb", "elastic-qa[wandb]")}


def check_installed(cfg: Config) -> None:
    """ConfigError naming the extra when a tracker in log.trackers is not installed, or the setting when
    W&B could not write its folder (wandb_run.check_dir)."""
    for name in cfg.log.tracker_names:
        if name in _PACKAGES:
            module, extra = _PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                raise ConfigError(f"log.trackers lists {name}, which needs a package: pip install '{extra}'")
    if "wandb" in cfg.log.tracker_names:
        from elastic_qa.observe.trackers.wandb_run import check_dir, wandb_dir

        check_dir(*wandb_dir(cfg))


class Trackers:
    """Rank 0's MLflow and W&B runs, each behind its own thread (background.py).

    Keeps the records that some live tracker does not hold for certain yet (background.py's `confirmed`):
    a checkpoint stores them (`backlog`) and the resumed job replays them first (`start`), each tracker
    skipping what it already holds. A tracker that lags behind the checkpoint when the job dies (still
    opening its run, a slow server, W&B's own process not done writing) thus still gets every step up to
    the checkpoint; the steps after it are trained and logged again.

    The other ranks have no trackers but keep the same records, the newest STANDBY_RECORDS of them: when
    rank 0 dies, a survivor writes the emergency checkpoint, and its backlog must cover what rank 0's
    trackers had not stored. A tracker holds at most that many unconfirmed records: a queue full of them,
    the batch it is sending and W&B's pending ones.
    """

    def __init__(self, trackers: list[BackgroundTracker], standby: bool = False) -> None:
        self.trackers = trackers
        self.standby = standby  # a rank other than 0: no trackers, the newest records kept
        self._records: list[Record] = []  # logged, not confirmed by every live tracker
        self._first = 0  # the sequence number of _records[0]
        self._lock = threading.Lock()

    @classmethod
    def start(cls, cfg: Config, run_uuid: str, backlog: list[Record], main: bool) -> Trackers | None:
        """Start (or continue) the tracker runs of run `run_uuid` and replay the checkpoint's `backlog`
        (rank 0, `main`; the other ranks only keep the records); returns at once, the runs open in the
        background. None when log.trackers names neither MLflow nor W&B."""
        runs: list[TrackerRun] = []
        if "mlflow" in cfg.log.tracker_names:
            from elastic_qa.observe.trackers.mlflow_run import MlflowRun

            runs.append(MlflowRun(cfg, run_uuid))
        if "wandb" in cfg.log.tracker_names:
            from elastic_qa.observe.trackers.wandb_run import WandbRun

            runs.append(WandbRun(cfg, run_uuid))
        if not runs:
            return None
        if main:
            timeout_s, send_every_s = (
                cfg.log.tracker_timeout.total_seconds(),
                cfg.log.tracker_send_every.total_seconds(),
            )
            trackers = cls([BackgroundTracker(run, timeout_s, send_every_s=send_every_s) for run in runs])
        else:
            trackers = cls([], standby=True)
        for step, metrics in backlog:
            trackers.log(step, **metrics)
        return trackers

    def log(self, step: int, **metrics: float) -> None:
        with self._lock:
            self._records.append((step, metrics))
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def backlog(self) -> list[Record]:
        """For a checkpoint: the records that a live tracker does not hold for certain yet."""
        live = [tracker for tracker in self.trackers if tracker.dropped is None]
        with self._lock:
            end = self._first + len(self._records)
            done = end - STANDBY_RECORDS if self.standby else min((t.confirmed for t in live), default=end)
            del self._records[: max(0, done - self._first)]
            self._first = max(self._first, done)
            return list(self._records)

    def close(self, finished: bool) -> None:
        """Flush and end every tracker run, together: at most log.tracker_timeout in all."""
        for tracker in self.trackers:
            tracker.start_closing(finished)
        started = time.monotonic()
        for tracker in self.trackers:
            tracker.wait_closed(started + tracker.timeout_s)
