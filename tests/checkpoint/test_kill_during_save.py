"""SIGKILL a real checkpoint writer at many points of its work: no committed checkpoint is damaged or lost.

The writer (tests/checkpoint/kill_writer.py) saves a state of about 3 MiB again and again into a local
directory with the real Checkpointer, resuming from the newest valid checkpoint after each restart, like a
trainer that keeps being killed. Each writer SIGKILLs itself at a planned point (a file write, the publish,
the verification, the rotation's delete) of a planned save, so the kills land where they are meant to
whatever the machine's load. After every kill the directory is checked as a restarted job would see it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.checkpoint.store import MANIFEST, CheckpointStore
from elastic_qa.config import CheckpointConfig

REPO = Path(__file__).resolve().parents[2]
KILLS = 24
STEP_DIR = re.compile(r"^step-(\d{8})$")


# Where each writer kills itself: (its save number, the point in that save). Every phase of a save is
# hit several times, at writers that start with no checkpoint, with fewer than keep_last, and with more.
POINTS = ("file-0", "file-1", "file-2", "publish", "verify", "prune")
KILL_PLAN = [(3, "publish")] + [(1 + i % 3, POINTS[i % len(POINTS)]) for i in range(KILLS - 1)]


def reported(progress: Path) -> list[int]:
    if not progress.exists():
        return []
    return [int(line) for line in progress.read_text().split()]


def check_directory(store: CheckpointStore, root: Path, newest_reported: int | None) -> list[int]:
    """What a restarted job relies on; returns the committed steps."""
    names = sorted(os.listdir(root)) if root.exists() else []
    step_dirs = [name for name in names if STEP_DIR.match(name)]
    for name in step_dirs:
        assert (root / name / MANIFEST).exists(), f"{name} is a step directory without a manifest: {names}"
        verdict = store.verify(str(root / name))
        assert verdict.ok, f"{name}: {verdict.reason}"
    steps = [int(STEP_DIR.match(name).group(1)) for name in step_dirs]
    if newest_reported is not None:
        assert newest_reported in steps, f"step {newest_reported} was committed and is gone: {steps}"
    others = [name for name in names if not STEP_DIR.match(name) and name != "attempts"]
    assert all(name.startswith(".tmp-") for name in others), names
    return steps


def test_killing_the_writer_at_any_point_never_loses_or_damages_a_committed_checkpoint(tmp_path) -> None:
    root = tmp_path / "ckpt"
    progress = tmp_path / "committed.txt"
    stderr = open(tmp_path / "zygote.stderr", "w")  # noqa: SIM115 (closed below)
    zygote = subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.kill_writer", str(root), str(tmp_path / "logs")],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    store = open_store(str(root))
    saw_staging = 0
    pid = None
    try:
        assert zygote.stdout.readline().strip() == "ready", (tmp_path / "zygote.stderr").read_text()
        for i in range(KILLS):
            save, point = KILL_PLAN[i]
            zygote.stdin.write(f"fork {save} {point}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            status = int(zygote.stdout.readline().split()[1])
            pid = None  # reaped: the number may be reused
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"writer {i} ({point} of save {save}) ended on its own (status {status}):\n"
                + (tmp_path / "zygote.stderr").read_text()
            )

            steps = reported(progress)
            assert steps == sorted(set(steps)), f"a step was committed twice: {steps}"
            committed = check_directory(store, root, steps[-1] if steps else None)
            saw_staging += root.exists() and any(name.startswith(".tmp-") for name in os.listdir(root))
            loaded = Checkpointer(CheckpointConfig(), store).load_newest()
            assert (loaded.step if loaded else None) == (max(committed) if committed else None)
    finally:
        if pid is not None:  # a writer left alive by a failing assertion
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        zygote.stdin.close()
        try:
            zygote.wait(timeout=10)
        except subprocess.TimeoutExpired:
            zygote.kill()
            zygote.wait()
        stderr.close()

    steps = reported(progress)
    assert len(steps) >= 8, f"too few commits to mean anything: {steps}"
    assert saw_staging > 0, "no kill landed during a write"
    hit = set((tmp_path / "kills.txt").read_text().split())
    assert set(POINTS) <= hit, f"planned kill points never reached: {set(POINTS) - hit}"
