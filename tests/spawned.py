"""Spawning ranks of a real gloo group in a test, and ending them the way the trainer ends its workers."""

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from elastic_qa.dist import exit_process


def _run_then_exit(rank: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    fn(rank, *args)
    # A rank that returns lets the interpreter finalise while a gloo worker thread may still let go of a
    # finished collective: that aborts the process (SIGABRT) now and then, after its work passed. The
    # trainer's workers leave through exit_process for that reason; so do these ranks. An exception
    # propagates as before: mp.spawn reports its traceback.
    exit_process(0)


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """mp.spawn(fn, args, nprocs) whose ranks end with exit_process(0) once fn has returned."""
    mp.spawn(_run_then_exit, args=(fn, args), nprocs=nprocs, join=True)
