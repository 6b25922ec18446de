"""A checkpoint writer for test_kill_during_save.py, run as `python -m tests.checkpoint.kill_writer DIR LOGS`.

Importing torch takes a second or two, far longer than one save, so this process is a zygote: it imports
everything once, then forks one writer per "fork SAVE POINT" line read on stdin, prints the writer's pid,
waits for it to die and prints "dead STATUS". Each writer does what a restarted trainer does: register an
attempt, clean the staging directories left behind, resume from the newest valid checkpoint, then save
step after step (synchronously, keep_last=3), appending each step it saw committed to DIR/../committed.txt.

The writer SIGKILLs itself at an exact point of its SAVE-th save (counted from 1), so every phase of a
save is hit on purpose, not by the scheduler's luck: `file-N` just before its N-th file is written (0 is
the first), `publish` just after the fencing check (staging complete, not yet renamed into place),
`verify` once the checkpoint is published (before it is verified and the rotation prunes), `prune` in the
middle of the first delete of the rotation.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import torch

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.fencing import Fence
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.checkpoint.payload import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE, versions
from elastic_qa.config import CheckpointConfig
from elastic_qa.observe.log import configure_logging

MODEL_FLOATS = 512 * 1024  # 2 MiB
OPTIMIZER_FLOATS = 256 * 1024  # 1 MiB
KILLS_FILE = "kills.txt"  # set by main()
LIFETIME_S = 20.0  # a writer nobody kills stops by itself


def state_for(step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {
        MODEL_FILE: {"w": torch.randn(MODEL_FLOATS, generator=generator)},
        OPTIMIZER_FILE: {
            "state": {0: {"exp_avg": torch.randn(OPTIMIZER_FLOATS, generator=generator), "step": step}},
            "param_groups": [{"lr": 0.001, "params": [0]}],
        },
        TRAINER_FILE: {"trainer": {"step": step, "epoch": 0, "world_size": 1}, "versions": versions()},
    }


def die(where: str) -> None:
    """SIGKILL this writer, noting first where (DIR/../kills.txt) so the test can see every point hit."""
    with open(KILLS_FILE, "a") as handle:
        handle.write(where + "\n")
    os.kill(os.getpid(), signal.SIGKILL)


def writer(directory: str, progress: str, logs: str, kill_save: int, kill_point: str) -> None:
    configure_logging(logs, "info")
    store = open_store(directory)
    fence = Fence(store)
    attempt = fence.register(world_size=1)  # what a restarted job does first
    saves = {"n": 0, "files": 0}

    def before_file(_name: str) -> None:
        if saves["n"] == kill_save and kill_point == f"file-{saves['files']}":
            die(kill_point)
        saves["files"] += 1

    def may_commit() -> None:
        fence.check()
        if saves["n"] == kill_save and kill_point == "publish":
            die(kill_point)

    def hooked(method, point: str):
        def call(*args, **kwargs):
            if saves["n"] == kill_save and kill_point == point:
                die(point)
            return method(*args, **kwargs)

        return call

    store.verify = hooked(store.verify, "verify")
    store.fs.rm = hooked(store.fs.rm, "prune")  # the first delete after the commit is the rotation's
    ckpt = Checkpointer(
        CheckpointConfig(async_=False, keep_last=3), store, may_commit=may_commit, before_file=before_file
    )
    store.clean_staging(attempt)
    loaded = ckpt.load_newest()
    step = loaded.step if loaded is not None else 0
    if loaded is not None:
        assert torch.equal(loaded.model["w"], state_for(step)[MODEL_FILE]["w"])
    deadline = time.monotonic() + LIFETIME_S
    fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    while time.monotonic() < deadline:
        step += 1
        saves["n"] += 1
        saves["files"] = 0
        fields = {"epoch": 0, "world_size": 1, "attempt": attempt, "versions": versions()}
        ckpt.save(step, state_for(step), fields)
        ckpt.raise_if_failed()
        if ckpt.last_committed_step == step:
            os.write(fd, f"{step}\n".encode())
        if saves["n"] == kill_save:  # the point was not reached in this save (nothing to prune): die here
            die("after-save")


def main() -> None:
    global KILLS_FILE
    directory, logs = sys.argv[1], sys.argv[2]
    KILLS_FILE = os.path.join(os.path.dirname(directory.rstrip("/")), "kills.txt")
    progress = os.path.join(os.path.dirname(directory.rstrip("/")), "committed.txt")
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] != ["fork"]:
            break
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                writer(directory, progress, logs, int(words[1]), words[2])
            except BaseException:  # noqa: BLE001 (reported to the test, which fails on it)
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"dead {status}", flush=True)


if __name__ == "__main__":
    main()
