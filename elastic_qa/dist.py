"""Process group up and down, backend and device, threads per process, DDP and its comm hooks."""

from __future__ import annotations

import atexit
import concurrent.futures.thread
import contextlib
import dataclasses
import functools
import inspect
import os
import socket
import struct
import sys
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, TypedDict, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from elastic_qa.config import ConfigError, DistConfig


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group
    ranks_on_host: int  # ranks that share this process's cores (its machine and CPU affinity)

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """Whether the environment describes a process group (torchrun's, or RANK/WORLD_SIZE set by hand)."""
    return under_torchrun_agent() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def under_torchrun_agent() -> bool:
    """Whether a torchrun agent started this process: it sets TORCHELASTIC_RUN_ID for its workers, and
    only then is there an agent to regroup the workers after one of them stops."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def all_gather_bytes(payload: bytes, world_size: int, group: object) -> list[bytes]:
    """Every rank's `payload`, in rank order, on every rank: the lengths, then the bytes padded to the
    longest, in uint8 tensors (a collective: every rank calls it). The receiver decides how to read them
    (json, weights_only torch.load): nothing here is unpickled."""
    mine = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.zeros(0, dtype=torch.uint8)
    )
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([mine.numel()]), group=group)
    padded = torch.zeros(int(max(size.item() for size in sizes)), dtype=torch.uint8)
    padded[: mine.numel()] = mine
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded, group=group)
    return [part[: int(size.item())].numpy().tobytes() for part, size in zip(parts, sizes, strict=True)]


MAX_REFUSAL = 4096  # bytes of rank 0's refusal sent to the other ranks
_Decision = TypeVar("_Decision")


def decide_on_rank0(
    ctx: DistContext,
    group: dist.ProcessGroup | None,
    decide: Callable[[], _Decision],
    kind: type[_Decision],
    refusals: tuple[type[Exception], ...] = (),
) -> _Decision:
    """Run `decide` on rank 0 only and return its decision on every rank (a collective: every rank calls
    it with the same `kind` and `group`; a single process just decides).

    `kind` is a dataclass of int, bool and float fields: its values travel in one int64 tensor in field
    order (a float as its 64 bits, so exactly), and every rank reads them back by name. When `decide`
    raises one of `refusals`, every rank raises that type with rank 0's message (its first MAX_REFUSAL
    bytes): each worker then fails with the same line, which is how a launcher tells bad input (exit 2)
    from bad luck. Two broadcasts at most: the decision (with the refusal's length and type), then the
    refusal's text.
    """
    hints, names = _fields_of(kind)  # type: ignore[arg-type]
    header = torch.zeros(2 + len(names), dtype=torch.int64)  # refusal length, refusal type, the fields
    refusal = b""
    if ctx.is_main:
        try:
            decision = decide()
            words = [_word(getattr(decision, name), hints[name]) for name in names]
            header[2:] = torch.tensor(words, dtype=torch.int64)
        except refusals as err:
            refusal = (str(err) or type(err).__name__).encode()[:MAX_REFUSAL]
            header[0] = len(refusal)
            header[1] = next(i for i, refused in enumerate(refusals) if isinstance(err, refused))
    # A group of one (a replica group of one worker, every step) has no one to tell: no broadcast.
    broadcasts = ctx.distributed and dist.get_world_size(group) > 1
    if broadcasts:
        dist.broadcast(header, src=0, group=group)
    if header[0]:
        text = torch.zeros(int(header[0]), dtype=torch.uint8)
        if ctx.is_main:
            text[:] = torch.frombuffer(bytearray(refusal), dtype=torch.uint8)
        if broadcasts:
            dist.broadcast(text, src=0, group=group)
        raise refusals[int(header[1])](text.numpy().tobytes().decode(errors="replace"))
    words = header[2:].tolist()
    return kind(**{name: _value(word, hints[name]) for name, word in zip(names, words, strict=True)})


@functools.cache
def _fields_of(kind: type) -> tuple[dict[str, Any], list[str]]:
    """A decision kind's field types and names, in order (read once per kind: some decide every step)."""
    return typing.get_type_hints(kind), [field.name for field in dataclasses.fields(kind)]


def _word(value: object, of: object) -> int:
    """A field's value as one signed 64-bit word, by the field's declared type."""
    if of is float and isinstance(value, (int, float)):
        return int(struct.unpack("<q", struct.pack("<d", float(value)))[0])
    if of in (int, bool) and isinstance(value, int):  # a bool is an int
        return int(value)
    raise TypeError(f"a decision field declared {of} holds {value!r}: only int, bool and float travel")


def _value(word: int, of: object) -> int | bool | float:
    """The inverse of _word."""
    if of is float:
        return float(struct.unpack("<d", struct.pack("<q", word))[0])
    return bool(word) if of is bool else word


def init_distributed(cfg: DistConfig, per_attempt_store: bool = False) -> DistContext:
    """Join the process group torchrun describes in the environment, or run as one process.

    `per_attempt_store`: the group's keys go under this torchrun attempt's prefix of the agent's store
    (`attempt_store`), for a job whose workers all belong to one torchrun agent (a replica group): the
    ranks of different agents may count their restarts differently, so the classic mode keeps env://."""
    cuda = torch.cuda.is_available()
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # Both would otherwise fail deep in torch, in every worker torchrun restarts: bad input, said once.
    if backend == "nccl" and not cuda and launched_by_torchrun():
        raise ConfigError("dist.backend=nccl needs a CUDA device and torch sees none; use gloo or auto")
    if cuda and local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"this worker is local rank {local_rank} but torch sees {torch.cuda.device_count()} CUDA "
            "device(s) on this host: start at most one worker per GPU (--nproc-per-node), or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=) to train on the CPU"
        )
    device = torch.device("cpu")
    if cuda:
        # Bind before any CUDA work, or every process piles onto GPU 0.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not launched_by_torchrun():
        return DistContext(0, 1, 0, device, None, 1)
    store = attempt_store(cfg.timeout) if per_attempt_store else None
    dist.init_process_group(
        backend=backend,
        init_method=None if store else "env://",
        store=store,
        rank=int(os.environ["RANK"]) if store else -1,
        world_size=int(os.environ["WORLD_SIZE"]) if store else -1,
        timeout=cfg.timeout,
        device_id=device if backend == "nccl" else None,
    )
    # Not LOCAL_WORLD_SIZE: the local launcher runs one torchrun agent per rank on the same host, each
    # with a local world of one (every rank took all the cores: `make run` ran 11x slower); not hostnames,
    # which machines can share. The ranks that share this process's cores say so themselves.
    world, mine = dist.get_world_size(), core_key()
    keys: list[str | None] = [None] * world
    dist.all_gather_object(keys, mine)
    ranks_on_host = keys.count(mine)
    return DistContext(dist.get_rank(), world, local_rank, device, backend, ranks_on_host)


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """A client of the torchrun agent's store with this attempt's keys under a prefix of their own; None when
    the workers do not use the agent's store (rank 0 then hosts a new one each attempt).

    torch 2.13's agent keeps one store server across its restarts (the same MASTER_PORT in every attempt)
    and env:// puts no attempt in the keys, so what the workers of an earlier attempt wrote is still there
    when the next attempt's start. Without this, a restarted 2-worker replica group's rank 0 failed to
    connect to a gloo address no process listened on any more, and the next attempt hung
    (tests/replica/test_faults.py, a killed worker of a two-worker group)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(
        f"elastic_qa/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", client
    )


def core_key() -> str:
    """Which cores this process runs on: its kernel's boot id (one per running machine: its containers
    and network namespaces share it, two machines never do) and its CPU affinity."""
    try:
        machine = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the host name is the best there is
        machine = socket.gethostname()
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = list(range(os.cpu_count() or 1))
    return f"{machine}:{cores}"


def set_threads(requested: int, ctx: DistContext) -> int:
    """Intra-op threads: the cores this process may use, shared by the ranks on its host (oversubscription
    costs 2-5x)."""
    threads = requested or max(1, usable_cores() // ctx.ranks_on_host)
    torch.set_num_threads(threads)
    return threads


# The bits of a float32 denormal (2**-129, below the smallest normal number 2**-126): written as bits, since a
# conversion or an operation on a flushing thread would make it zero.
DENORMAL_BITS = 0x00100000


def flush_denormals(enabled: bool) -> bool:
    """Make the CPU treat denormal floats as zero (x86 FTZ and DAZ) in this thread and in every thread it
    starts later, torch's intra-op pool among them (`enabled` false: IEEE denormals again). Whether every
    intra-op thread now flushes them.

    The flag is a thread's own: a pool thread started before this call keeps the flag it started with (half
    of a 2-thread multiplication then still computes denormals), so this runs before torch's first parallel
    operation in the process. Why training wants it: Adam's first moment of an embedding row that no batch
    hits decays by 0.9 a step into the denormal range within ~740 steps and stays there (at 4 times the
    smallest denormal, 0.9 x rounds back to x), and an x86 core is slow over denormals: the fused AdamW step
    over a 65536-word embedding took 4.4-6.0x as long once its rare rows had decayed (docs/benchmarks.md,
    "Denormals"). Flushed, those moments become zero; in that benchmark the weights ended bitwise equal."""
    torch.set_flush_denormal(enabled)
    return denormals_flushed(every_thread=True)


def set_denormals(enabled: bool, warn: Callable[[str], None]) -> bool:
    """`flush_denormals(enabled)` (train.flush_denormals); `warn` gets one finding when it was asked for and
    some thread does not flush: a CPU without the flag, or torch's pool started earlier in this process (the
    Python API in the caller's process). Whether every intra-op thread flushes."""
    flushed = flush_denormals(enabled)
    if enabled and not flushed:
        warn(
            "denormals: train.flush_denormals is on, but not every CPU thread of this process flushes them "
            "(no such flag on this CPU, or torch's threads started before the trainer): steps may slow down "
            "as the optimizer's moments decay"
        )
    return flushed


def denormals_flushed(every_thread: bool = False) -> bool:
    """Whether denormal inputs count as zero: on this thread alone (a probe too small to be split), or on
    every intra-op thread (one large enough that each thread multiplies a part of it)."""
    count = 65536 * max(1, torch.get_num_threads()) if every_thread else 16
    probe = torch.full((count,), DENORMAL_BITS, dtype=torch.int32).view(torch.float32)
    return not bool((probe * 1.0).any())


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or a scheduler's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


class CommTimer:
    """Wall seconds during which at least one gradient bucket's all-reduce was in flight.

    Buckets can be in flight together (a backend may run several collectives at once), so the time
    is the union of their intervals, never their sum: it cannot exceed the wall time it was taken over.
    Buckets are reduced while backward still computes, so this is communication time, not all of it
    exposed; a rank that waits for a slower peer also shows the wait here.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._in_flight = 0
        self._since = 0.0
        self._lock = threading.Lock()

    def started(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._since = time.perf_counter()
            self._in_flight += 1

    def finished(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.seconds += time.perf_counter() - self._since

    def take(self) -> float:
        """The seconds counted since the last take (an interval still open is counted when it closes)."""
        with self._lock:
            seconds, self.seconds = self.seconds, 0.0
        return seconds


_HOOKS = {
    "none": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


def _timed_hook(state, bucket):  # no annotations: DDP checks them and string annotations fail the check
    """All-reduce one gradient bucket with the configured hook, marking its interval on the CommTimer."""
    timer, inner = state
    timer.started()

    def finished(future):
        timer.finished()
        return future.value()

    return inner(None, bucket).then(finished)


def wrap_model(
    model: nn.Module, ctx: DistContext, cfg: DistConfig, timer: CommTimer | None = None
) -> nn.Module:
    """DDP with the configured bucket size and (optionally compressing) all-reduce, timed by `timer`; the
    model itself in a world of one rank (a job of one agent, a replica group of one worker), where DDP would
    only copy every gradient into its buckets and hand each bucket to gloo's thread and back for a sum over
    one rank: on a loaded 2-core host, a replica group's step spent more time there than in its backward."""
    if not ctx.distributed or ctx.world_size == 1:
        return model
    ddp = DistributedDataParallel(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=True,
        **buffer_sync(has_running_statistics(model)),
    )
    ddp.register_comm_hook((timer or CommTimer(), _HOOKS[cfg.comm_hook]), _timed_hook)
    return ddp


def has_running_statistics(model: nn.Module) -> bool:
    """Whether training changes any buffer: batch norm's running statistics are the buffers torch's modules
    update in forward. Without them DDP's buffer broadcast at every forward (by default) is a collective
    that sends constants (a transformers encoder's position and token type ids) and waits for every rank."""
    return any(getattr(module, "running_mean", None) is not None for module in model.modules())


class BufferSync(TypedDict, total=False):
    forward_sync_buffers: bool
    broadcast_buffers: bool


def buffer_sync(at_every_forward: bool) -> BufferSync:
    """DDP's argument for syncing buffers at every forward, under the name this torch reads without a
    FutureWarning: `forward_sync_buffers` from torch 2.13, where `broadcast_buffers` is deprecated.

    One difference: `forward_sync_buffers=False` still broadcasts buffers once at construction, where
    `broadcast_buffers=False` did not. Ranks build their models alike (same seed, same weights), so that
    broadcast sends values every rank already holds.
    """
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": at_every_forward}
    return {"broadcast_buffers": at_every_forward}


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a process that ran collectives, skipping the interpreter's finalisation.

    A gloo worker thread lets go of a finished collective (and the Python tensors it holds) a moment after
    the caller's wait has returned. If the interpreter is finalising by then, that thread cannot take the
    GIL, its exit unwinds through a noexcept destructor and the whole process aborts (SIGABRT, "terminate
    called without an active exception"): torchrun then reports a finished worker as failed. Seen at the
    end of 1 in 40 two-rank runs on a loaded 2-core box. So do what a normal exit does that matters here
    (join our own non-daemon threads, such as a checkpoint write; run the atexit handlers; flush) and
    leave with os._exit.
    """
    finish_process()
    os._exit(code)


def finish_process() -> None:
    """What a normal exit does that matters (exit_process), short of leaving."""
    # Executors' idle workers (inductor compiles in a ThreadPoolExecutor) wait for work until told that the
    # interpreter exits, which finalisation does before it joins threads: so do we, or the join never ends.
    concurrent.futures.thread._python_exit()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing left to save
            stream.flush()


def forked_worker() -> bool:
    """This process was started by multiprocessing (a warm worker: torchrun --start-method=forkserver),
    not as an interpreter of its own."""
    import multiprocessing

    return multiprocessing.parent_process() is not None
