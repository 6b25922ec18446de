"""`train.compile`: torch.compile the model, with the compiler's caches in a directory private to the run.

The model is compiled in place (`nn.Module.compile`) before DDP wraps it. In place, its state_dict keeps its
keys (torch.compile's wrapper would prefix them with `_orig_mod.`), so checkpoints move freely between
compiled and eager runs, and `unwrap`, `no_sync` and evaluation see the module they always saw. Inside DDP,
forward and backward each compile to one graph: DDP's all-reduce starts once the whole backward is done,
instead of overlapping bucket by bucket as it would with the DDP wrapper compiled (DDPOptimizer's graph
breaks at bucket boundaries, more graphs to compile at every restart). What is given up grows with the
gradients: 5 MB for the default model.

Inductor's caches (the generated C++ and its compiled libraries, the FX graph and AOT autograd caches) go
to <run.dir>/compile-cache, so a worker that torchrun restarts loads what the last one compiled instead of
compiling again. The cache holds code that is loaded and run: the directory is created owner-only (0700)
and a start is refused when another user owns it or others can write to it. Ranks and restarts that write
at once race safely: inductor writes each entry to a temporary file and renames it into place.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

from torch import nn

from elastic_qa.config import Config, ConfigError

CACHE_DIR = "compile-cache"

# torch's counters of its caches' lookups: (counter group, name) -> the name said in the `compile` event.
_CACHE_COUNTERS = {
    ("stats", "unique_graphs"): "graphs_compiled",
    ("inductor", "fxgraph_cache_hit"): "graph_cache_hits",
    ("inductor", "fxgraph_cache_miss"): "graph_cache_misses",
    ("aot_autograd", "autograd_cache_hit"): "autograd_cache_hits",
    ("aot_autograd", "autograd_cache_miss"): "autograd_cache_misses",
}


def compile_cache_dir(cfg: Config) -> Path:
    return Path(cfg.run.dir) / CACHE_DIR


def use_compile_cache(cfg: Config) -> Path:
    """Point inductor's caches at the run's compile cache; returns the directory. With
    train.compile_cache=false every cache is off (each compile starts from nothing, its scratch files still
    in that directory). Call before the first compile."""
    import torch._inductor.config  # here: an eager run has no use for it
    import torch.compiler.config

    directory = private_directory(compile_cache_dir(cfg))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    # Precompiled headers would be read from /tmp/torchinductor_<user> whatever the cache directory (a
    # directory anyone could have made first): every kernel parses its headers instead.
    torch._inductor.config.cpp_cache_precompile_headers = False
    if not cfg.train.compile_cache:
        # Not merely "this run's cache off": inductor's default, /tmp/torchinductor_<user>, persists too.
        torch.compiler.config.force_disable_caches = True
    return directory


def private_directory(path: Path) -> Path:
    """`path`, created 0700 where missing; ConfigError where someone else could have written into it."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as err:
        raise ConfigError(f"train.compile: cannot create {path} ({err.strerror or err})") from None
    if info.st_uid != os.getuid():
        raise ConfigError(
            f"train.compile: {path} belongs to uid {info.st_uid}, not this user: its compiled code is not "
            "this run's to load (remove it, or use another run.dir)"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"train.compile: {path} is writable by others (mode {stat.S_IMODE(info.st_mode):o}): its "
            f"compiled code could be anyone's (chmod 700 {path} once it is known to be clean, or remove it)"
        )
    return path


def compile_model(model: nn.Module, cfg: Config, full_width: bool) -> None:
    """Compile `model` in place; the compilation itself happens at its first forward.

    Which graph runs a batch depends on its shape only, never on the batches before it: a resumed run must
    take the same steps as the uninterrupted one, and a restarted worker must find in the cache the graphs
    its predecessor compiled. torch's default would compile static shapes first and recompile for dynamic
    ones once a size changes, i.e. after whichever batch came first. So: batches trimmed to their longest
    window change length at every step and are compiled for any shape at once; full-width batches (a few
    shapes: the micro-batch, a smaller last one, evaluation's) are compiled static, one graph per shape.
    """
    model.compile(mode=cfg.train.compile_mode, dynamic=not full_width)


def cache_counters() -> dict[str, int]:
    """torch's cache hits and misses of this process so far."""
    from torch._dynamo.utils import counters

    return {said: int(counters[group][name]) for (group, name), said in _CACHE_COUNTERS.items()}


class CompileWatch:
    """Notices the steps during which torch compiled (its cache counters moved): how long such a step took
    and what the caches gave."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.last = cache_counters()
        self.since = time.perf_counter()

    def step_started(self) -> None:
        self.since = time.perf_counter()

    def news(self) -> dict[str, Any] | None:
        """At the end of a step: its seconds and the counters' totals when they moved during it, else None
        (a few dict reads)."""
        now = cache_counters()
        if now == self.last:
            return None
        self.last = now
        return {"step_s": round(time.perf_counter() - self.since, 3), "cache_dir": str(self.directory), **now}
