"""`train.compile`: torch.compile the model, its compiler caches in a directory only this user can change.

The model is compiled in place (`nn.Module.compile`) before DDP wraps it. In place, its state_dict keeps its
keys (torch.compile's wrapper would prefix them with `_orig_mod.`), so checkpoints move freely between
compiled and eager runs, and `unwrap`, `no_sync` and evaluation see the module they always saw. Inside DDP,
forward and backward each compile to one graph: DDP's all-reduce starts once the whole backward is done,
instead of overlapping bucket by bucket as it would with the DDP wrapper compiled (DDPOptimizer's graph
breaks at bucket boundaries, more graphs to compile at every restart). What is given up grows with the
gradients: 5 MB for the default model.

Inductor's caches (the generated C++ and its compiled libraries, the FX graph and AOT autograd caches) hold
code that is loaded and run, read by path whenever torch compiles. They live in a directory of this user's,
`<train.compile_cache_dir>/<host and run directory's digest>`, never in run.dir: a run directory may be
writable by others (who could swap what a check saw for a symlink before inductor reads it) or copied from
elsewhere (a documented way to resume) with its files edited. Every level of the path, from /, must be a
directory (not a symlink) owned by this user or root and writable by no one else, or sticky (/tmp) above a
level that is ours: then no one else can change what the check saw, before or after it. So whatever
inductor loads was written by this user's runs of this run directory on this host, and a worker that
torchrun restarts loads what the last one compiled instead of compiling again. Triton's cache is pointed
there too, and torch's remote caches are turned off. Ranks and restarts that write at once race safely:
inductor writes each entry to a temporary file and renames it into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from torch import nn

from elastic_qa.config import Config, ConfigError

_SETTING = "train.compile_cache_dir"

# torch's counters of its caches' lookups: (counter group, name) -> the name said in the `compile` event.
_CACHE_COUNTERS = {
    ("stats", "unique_graphs"): "graphs_compiled",
    ("inductor", "fxgraph_cache_hit"): "graph_cache_hits",
    ("inductor", "fxgraph_cache_miss"): "graph_cache_misses",
    ("aot_autograd", "autograd_cache_hit"): "autograd_cache_hits",
    ("aot_autograd", "autograd_cache_miss"): "autograd_cache_misses",
}


def cache_root(cfg: Config) -> Path:
    """train.compile_cache_dir as an absolute path; ConfigError when its `~` has no home to expand to (HOME
    unset with no home in the password database, or empty or relative: `~/.cache` must not turn into
    `/.cache` or a path under the working directory) or when it lies in run.dir (copied with it)."""
    setting = cfg.train.compile_cache_dir
    home = os.environ.get("HOME")
    mine = setting == "~" or setting.startswith("~/")
    if mine and home is not None and not os.path.isabs(home):
        raise ConfigError(
            f"{_SETTING}={setting}: HOME={home!r} is not an absolute path, so `~` has no home to expand to "
            f"(set HOME, or {_SETTING} to an absolute path)"
        )
    expanded = os.path.expanduser(setting)
    if not os.path.isabs(expanded):  # only a `~` can be left: the config takes no relative path
        whose = f"HOME is unset and uid {os.getuid()} has no home directory" if mine else "no such user"
        raise ConfigError(
            f"{_SETTING}={setting}: {whose}, so its `~` cannot be expanded (set HOME, or {_SETTING} to an "
            "absolute path)"
        )
    root = Path(os.path.realpath(expanded))
    run_dir = Path(os.path.realpath(Path(cfg.run.dir).expanduser()))
    if root == run_dir or run_dir in root.parents:
        raise ConfigError(
            f"{_SETTING}={setting}: inside run.dir={cfg.run.dir}, which may be copied from elsewhere with "
            "its files: compiled code is never loaded from there (set it outside the run directory)"
        )
    return root


def compile_cache_dir(cfg: Config) -> Path:
    """This host's compile cache for cfg.run.dir: a run directory of another path or host starts cold."""
    run_dir = Path(cfg.run.dir).expanduser().resolve()
    key = hashlib.sha256(f"{socket.gethostname()}\0{run_dir}".encode()).hexdigest()[:20]
    return cache_root(cfg) / key


# Caches that torch reads from elsewhere when an environment variable turns them on (a remote cache server,
# Meta's internal ones): (config module, name). Each is set False, so that nothing is loaded from there.
_REMOTE_CACHES = (
    ("torch._inductor.config", "fx_graph_remote_cache"),
    ("torch._inductor.config", "autotune_remote_cache"),
    ("torch._inductor.config", "bundled_autotune_remote_cache"),
    ("torch._functorch.config", "enable_remote_autograd_cache"),
    ("torch._dynamo.config", "automatic_dynamic_remote_pgo"),
)


def use_compile_cache(cfg: Config) -> Path:
    """Point every compiler cache that torch and Triton read at the run's compile cache, and turn the remote
    ones off; returns the directory. With train.compile_cache=false every cache is off (each compile starts
    from nothing, its scratch files still in that directory). Call before the first compile."""
    import importlib

    import torch._inductor.config  # here: an eager run has no use for it
    import torch.compiler.config

    directory = private_directory(compile_cache_dir(cfg))
    # Both replace whatever the environment said: the compile workers inductor starts inherit them.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    os.environ["TRITON_CACHE_DIR"] = str(directory / "triton")  # else ~/.triton/cache, or the env's
    for module, name in _REMOTE_CACHES:
        setattr(importlib.import_module(module), name, False)
    # Precompiled headers would be read from /tmp/torchinductor_<user> whatever the cache directory (a
    # directory anyone could have made first): every kernel parses its headers instead.
    torch._inductor.config.cpp_cache_precompile_headers = False
    if not cfg.train.compile_cache:
        # Not merely "this run's cache off": inductor's default, /tmp/torchinductor_<user>, persists too.
        torch.compiler.config.force_disable_caches = True
    return directory


def private_directory(path: Path) -> Path:
    """`path` made absolute, its missing levels created 0700; ConfigError unless every level from / down is a
    directory that no other user can change (module docstring), the last one this user's."""
    path = Path(os.path.realpath(path))  # symlinks of the path as given, resolved once; none may follow
    uid = os.getuid()
    level = Path(path.anchor)
    for part in ("", *path.parts[1:]):
        level = level / part
        try:
            if part:
                with contextlib.suppress(FileExistsError):
                    level.mkdir(mode=0o700)
            info = level.lstat()
        except OSError as err:
            raise ConfigError(f"{_SETTING}: cannot create {level} ({err.strerror or err})") from None
        last = level == path
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISDIR(info.st_mode):
            symlink = stat.S_ISLNK(info.st_mode)
            what = "a symlink (swapped in since the path was resolved?)" if symlink else "not a directory"
            raise ConfigError(
                f"{_SETTING}: {level} is {what}: compiled code is loaded only from directories no one else "
                "can change"
            )
        if info.st_uid != uid and (last or info.st_uid != 0):
            raise ConfigError(
                f"{_SETTING}: {level} belongs to uid {info.st_uid}, not this user"
                f"{'' if last else ' or root'}: its compiled code is not this user's to load (use another "
                "train.compile_cache_dir)"
            )
        if mode & (stat.S_IWGRP | stat.S_IWOTH) and (last or not mode & stat.S_ISVTX):
            raise ConfigError(
                f"{_SETTING}: {level} is writable by others (mode {mode:o}): its compiled code could be "
                f"anyone's (chmod go-w {level} once it is known to be clean, or use another "
                "train.compile_cache_dir)"
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
