"""The typed config tree: YAML files plus dotted command-line overrides, validated at load.

Every field is documented by the string under it. Validation happens once, here, so that a bad value
fails at start-up with one line naming the key and the value, before anything is written.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import yaml

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"


class ConfigError(ValueError):
    """A config value is unknown, of the wrong type or impossible. The message names key and value."""


class _FieldError(ValueError):
    def __init__(self, name: str, value: Any, reason: str) -> None:
        super().__init__(reason)
        self.name, self.value, self.reason = name, value, reason


def _require(ok: bool, name: str, value: Any, reason: str) -> None:
    if not ok:
        raise _FieldError(name, value, reason)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str | int | float) -> timedelta:
    """`"10s"`, `"5m"`, `"1h"`, `"250ms"`, `"2d"` or a bare number of seconds."""
    if isinstance(text, bool):
        raise ValueError(f"not a duration: {text!r}")
    if isinstance(text, int | float):
        return timedelta(seconds=float(text))
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 10s, 5m, 1h)")
    return timedelta(seconds=float(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def format_duration(value: timedelta) -> str:
    seconds = value.total_seconds()
    if seconds == 0:
        return "0s"  # not "0ms": an error about `interval=0s` should show the value as the user wrote it
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


@dataclass
class RunConfig:
    dir: str = "runs/default"
    """Run directory (local path): resolved config, logs, ledger, default checkpoint dir."""
    seed: int = 1234
    """Base seed: data order, init, dropout. Per-rank randomness is derived from (seed, step, rank)."""
    private: bool = False
    """Create run and checkpoint files readable by their owner only (umask 077); false follows the umask."""

    def __post_init__(self) -> None:
        _require(bool(self.dir.strip()), "dir", self.dir, "must not be empty")


@dataclass
class SyntheticConfig:
    train_examples: int = 24000
    """Number of generated training questions."""
    eval_examples: int = 1000
    """Number of generated held-out questions (a disjoint split of the same generator)."""
    seed: int = 7
    """Generator seed; the same seed gives byte-identical data."""
    unanswerable_fraction: float = 0.15
    """Share of questions whose answer is not in the context (SQuAD v2 style)."""

    def __post_init__(self) -> None:
        _require(self.train_examples >= 1, "train_examples", self.train_examples, "must be >= 1")
        _require(self.eval_examples >= 1, "eval_examples", self.eval_examples, "must be >= 1")
        _require(
            0 <= self.unanswerable_fraction < 1,
            "unanswerable_fraction",
            self.unanswerable_fraction,
            "must be in [0, 1)",
        )


_INT32_MAX = 2**31 - 1


def question_tokens(max_seq_len: int, max_query_len: int, doc_stride: int, special_tokens: int) -> int:
    """The most question tokens a window keeps: max_query_len, or for 0 (questions not cut) what leaves
    doc_stride + 1 context tokens beside `special_tokens` ([CLS] and [SEP]s)."""
    return max_query_len or max_seq_len - special_tokens - doc_stride - 1


@dataclass
class DataConfig:
    source: str = "synthetic"
    """`synthetic`, or SQuAD v1.1/v2.0 JSON, JSON Lines, Parquet or Arrow files (paths or fsspec URLs, globs
    allowed), `datasets` save_to_disk directories (`DIR`, `DIR:SPLIT`) or hub datasets
    (`hub:NAME[:CONFIG]:SPLIT`), comma-separated (docs/data.md)."""
    eval_source: str = ""
    """Files for evaluation, as `source`; empty: the synthetic held-out split (or no eval for files)."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """The embedded generator used when source is `synthetic`."""
    tokenizer: Literal["word", "byte", "wordpiece"] = "word"
    """Native model only. `word`: hashed words, CJK characters as single tokens (short sequences); `byte`:
    UTF-8 bytes; `wordpiece`: subwords of a vocabulary trained on the training texts (needs tokenizers:
    `pip install 'elastic-qa[hf]'`)."""
    vocab_size: int = 8192
    """`word`: hash buckets (more buckets, fewer collisions); `wordpiece`: the vocabulary size to train
    (a small corpus may give fewer); ignored by `byte` and by a `vocab_file`."""
    lowercase: bool = True
    """Lower-case words (`word`, and the `wordpiece` vocabulary trained, which also strips accents)."""
    vocab_file: str = ""
    """`wordpiece`: a tokenizer.json to use instead of training one (path or fsspec URL; [PAD], [CLS],
    [SEP], [UNK] must be its ids 0-3); empty: trained from the training texts when the feature cache is
    built."""
    max_seq_len: int = 64
    """Tokens per window: [CLS] question [SEP] context [SEP]."""
    max_query_len: int = 24
    """Question tokens kept (the rest are cut); 0: questions are not cut (transformers' run_qa), up to what
    leaves doc_stride + 1 context tokens in a window (max_seq_len - doc_stride - 4 with [CLS] and two
    [SEP]; 5 for RoBERTa's pair of separators): a longer question is cut there."""
    doc_stride: int = 32
    """Context tokens shared by consecutive windows when a context is longer than one window."""
    max_answer_len: int = 16
    """Longest answer span, in tokens, considered at prediction time."""
    cache_dir: str = "~/.cache/elastic_qa"
    """Directory of pre-tokenised feature caches (memory-mapped, keyed by content hash); hosts may share
    it."""
    num_workers: int = 0
    """StatefulDataLoader worker processes per rank (0: batches built in the training process, without a
    DataLoader)."""
    skip_malformed: bool = False
    """Skip malformed SQuAD records with a counted warning instead of failing."""
    prepare_workers: int = 0
    """Processes that tokenise while the feature cache is built (0: one per CPU core); not in the key."""
    build_wait: timedelta = timedelta(hours=1)
    """Longest wait for a feature cache that another live process is building (it holds the cache's lease):
    then the start fails, naming that builder. A builder that is gone never makes anyone wait."""

    def question_tokens(self, special_tokens: int) -> int:
        """The most question tokens a window keeps, for a tokenizer adding `special_tokens` to a pair."""
        return question_tokens(self.max_seq_len, self.max_query_len, self.doc_stride, special_tokens)

    def __post_init__(self) -> None:
        _require(bool(self.source.strip()), "source", self.source, "must not be empty")
        # The feature cache stores token ids and positions as int32; past that they would not fit.
        _require(
            256 <= self.vocab_size <= _INT32_MAX,
            "vocab_size",
            self.vocab_size,
            f"must be in [256, {_INT32_MAX}]",
        )
        _require(
            8 <= self.max_seq_len <= _INT32_MAX,
            "max_seq_len",
            self.max_seq_len,
            f"must be in [8, {_INT32_MAX}]",
        )
        _require(
            0 <= self.max_query_len <= self.max_seq_len - 4,
            "max_query_len",
            self.max_query_len,
            f"must be in [0, max_seq_len - 4 = {self.max_seq_len - 4}] (0: questions not cut)",
        )
        room = self.max_seq_len - max(1, self.max_query_len) - 3
        _require(
            0 <= self.doc_stride < room,
            "doc_stride",
            self.doc_stride,
            f"must be in [0, {room}) (context tokens per window"
            + (", with a question of at least one token)" if self.max_query_len == 0 else ")"),
        )
        _require(
            1 <= self.max_answer_len <= _INT32_MAX,
            "max_answer_len",
            self.max_answer_len,
            f"must be in [1, {_INT32_MAX}]",
        )
        _require(self.num_workers >= 0, "num_workers", self.num_workers, "must be >= 0")
        _require(self.prepare_workers >= 0, "prepare_workers", self.prepare_workers, "must be >= 0")
        _require(
            self.build_wait.total_seconds() >= 0,
            "build_wait",
            format_duration(self.build_wait),
            "must be >= 0",
        )
        if self.tokenizer == "wordpiece":
            # find_spec imports nothing: a config is checked in processes that never tokenise.
            _require(
                importlib.util.find_spec("tokenizers") is not None,
                "tokenizer",
                self.tokenizer,
                "needs tokenizers: pip install 'elastic-qa[hf]' (or pip install tokenizers)",
            )
        else:
            _require(not self.vocab_file, "vocab_file", self.vocab_file, "only read by tokenizer=wordpiece")


@dataclass
class ModelConfig:
    kind: Literal["native", "hf"] = "native"
    """Model family (elastic_qa/models/): `native`, the built-in span encoder the fields below size; `hf`, a
    pretrained transformers model with its own tokenizer (`pip install 'elastic-qa[hf]'`)."""
    name_or_path: str = ""
    """hf only: a saved model directory (save_pretrained: config, weights, fast tokenizer) or a hub id."""
    d_model: int = 128
    """Hidden size (native only; hf reads its size from the model)."""
    n_layers: int = 2
    """Transformer encoder layers (native only)."""
    n_heads: int = 4
    """Attention heads, must divide d_model (native only)."""
    d_ff: int = 256
    """Feed-forward inner size (native only)."""
    dropout: float | None = None
    """Dropout probability; per-step masks derive from (seed, step, rank). hf: a number replaces every
    dropout probability of the pretrained config; null keeps the model's own (BERT's: 0.1). native: null is
    0.0."""
    grad_checkpointing: bool = False
    """Recompute activations in backward: ~30% more compute for much less activation memory."""

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "d_ff"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        _require(
            self.d_model % self.n_heads == 0,
            "n_heads",
            self.n_heads,
            f"must divide d_model={self.d_model}",
        )
        if self.dropout is None and self.kind == "native":
            self.dropout = 0.0  # resolved, so that a native config reads as it did before null existed
        _require(self.dropout is None or 0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")
        if self.kind == "hf":
            # find_spec imports nothing: a config is checked in processes that never train.
            _require(
                importlib.util.find_spec("transformers") is not None,
                "kind",
                self.kind,
                "needs transformers: pip install 'elastic-qa[hf]'",
            )
        else:
            _require(not self.name_or_path, "name_or_path", self.name_or_path, "only read by kind=hf")


# The shape a checkpoint written before train.lr_schedule existed was trained with: the only one there was.
LR_SCHEDULE_BEFORE_THE_KEY = "cosine"


@dataclass
class TrainConfig:
    max_steps: int = 600
    """Optimizer steps to train (steps count updates from 1); changed on resume, the LR schedule keeps its
    position. 0: train.epochs sets the length."""
    epochs: int = 0
    """Passes over the training windows, instead of max_steps (which must then be 0; 0 here: off): resolved
    once, at the run's first start, to epochs x ceil(training windows / global_batch_size) steps and recorded
    in every checkpoint, so that no resize or restart moves the end."""
    global_batch_size: int = 32
    """Samples per optimizer step, whatever the world size; ranks split it (unevenly if need be)."""
    micro_batch_size: int = 32
    """Largest forward/backward per rank; a larger share is accumulated under no_sync."""
    lr: float = 2e-3
    """Peak learning rate (after warm-up), for reference_batch_size samples per step."""
    lr_scaling: Literal["none", "sqrt"] = "none"
    """`sqrt`: lr * sqrt(global_batch_size / reference_batch_size) when the batch is changed on purpose."""
    reference_batch_size: int = 32
    """The global batch the lr was tuned for (used by lr_scaling=sqrt)."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """After warm-up: `cosine` or `linear` decay to min_lr_ratio * lr at max_steps, or `constant` (the peak
    throughout). Changed on resume, the new shape starts from the learning rate at the checkpoint."""
    warmup_steps: int = 60
    """Linear warm-up steps from lr / warmup_steps to the peak, whatever lr_schedule (0: none)."""
    min_lr_ratio: float = 0.05
    """Final learning rate of `cosine` and `linear` as a share of the peak (0: decay to zero); `constant`
    ignores it."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases, norms and embeddings)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0: off)."""
    freeze_loss_invariant: bool = True
    """Freeze the parameters the span loss cannot see (e.g. the QA head's bias, attention key biases), found
    at start-up by a float64 probe: their gradient is rounding noise that Adam would turn into steps."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype: bf16 on CPU or CUDA; fp16 with a GradScaler, CUDA only."""
    eval_every: int = 200
    """Evaluate every N steps (0: only at the end)."""
    eval_batch_size: int = 256
    """Windows per evaluation forward, per rank."""
    threads: int = 0
    """torch intra-op threads per process (0: CPU cores / processes on this host)."""
    flush_denormals: bool = True
    """Treat denormal floats as zero on the CPU (x86 flush-to-zero): Adam's moments of rarely seen embedding
    rows decay into the denormal range, where the CPU is slow (the fused AdamW step over a 65536 x 256
    embedding took 4.4-6.0x as long: `elastic-qa bench denormals`). False keeps IEEE denormals. No effect on
    a GPU's kernels."""
    compile: bool = False
    """torch.compile the model (inductor; C++ on CPU, needs a compiler): faster steps after a first step that
    compiles (docs/compile.md)."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    """torch.compile's mode when compile is true: `reduce-overhead` adds CUDA graphs, `max-autotune` times
    kernel choices at compile time (a longer first step)."""
    compile_cache: bool = True
    """Keep the compiler's caches (in compile_cache_dir, one directory per host and run directory), so that a
    restarted worker loads what was compiled instead of compiling again; false: every start compiles from
    nothing."""
    compile_cache_dir: str = "~/.cache/elastic_qa/compile"
    """Where this user's compile caches live (absolute, or under ~): every level must be this user's or root's
    and writable by no one else (checked at every start; docs/compile.md). Refused inside run.dir, which
    others may write or copy."""

    def __post_init__(self) -> None:
        _require(self.max_steps >= 0, "max_steps", self.max_steps, "must be >= 1 (0: train.epochs sets it)")
        _require(self.epochs >= 0, "epochs", self.epochs, "must be >= 0 (0: train.max_steps sets the length)")
        _require(
            not (self.max_steps and self.epochs),
            "epochs",
            self.epochs,
            f"train.max_steps={self.max_steps} sets the length too: set one "
            "(train.max_steps=0 to train by epochs)",
        )
        _require(
            bool(self.max_steps or self.epochs),
            "max_steps",
            self.max_steps,
            "must be >= 1, unless train.epochs sets the length",
        )
        _require(self.global_batch_size >= 1, "global_batch_size", self.global_batch_size, "must be >= 1")
        _require(self.micro_batch_size >= 1, "micro_batch_size", self.micro_batch_size, "must be >= 1")
        _require(self.lr > 0 and math.isfinite(self.lr), "lr", self.lr, "must be a positive number")
        _require(
            self.compile_cache_dir.startswith(("/", "~")),
            "compile_cache_dir",
            self.compile_cache_dir,
            "must be an absolute path or start with ~ (a relative one would follow the working directory)",
        )
        _require(
            self.reference_batch_size >= 1, "reference_batch_size", self.reference_batch_size, "must be >= 1"
        )
        _require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        _require(self.grad_clip >= 0, "grad_clip", self.grad_clip, "must be >= 0")
        _require(self.eval_every >= 0, "eval_every", self.eval_every, "must be >= 0")
        _require(self.eval_batch_size >= 1, "eval_batch_size", self.eval_batch_size, "must be >= 1")
        _require(self.threads >= 0, "threads", self.threads, "must be >= 0")

    @property
    def peak_lr(self) -> float:
        if self.lr_scaling == "sqrt":
            return self.lr * math.sqrt(self.global_batch_size / self.reference_batch_size)
        return self.lr


@dataclass
class EvalConfig:
    n_best: int = 20
    """Start and end candidates per window (the highest logits over context tokens) paired into spans."""
    null_threshold: float = 0.0
    """Predict no answer when null_odds (no-answer score minus best span score) exceeds this."""
    cjk_tokens: bool = False
    """Score CJK characters as one token each (CMRC-style); false is the official SQuAD v2 scoring."""

    def __post_init__(self) -> None:
        _require(1 <= self.n_best <= _INT32_MAX, "n_best", self.n_best, "must be >= 1")
        _require(math.isfinite(self.null_threshold), "null_threshold", self.null_threshold, "must be finite")


@dataclass
class CheckpointConfig:
    dir: str = ""
    """Checkpoint directory as a path or fsspec URL; empty means <run.dir>/checkpoints."""
    interval: timedelta = timedelta(minutes=30)
    """Save when this much wall time has passed since the last save (decided by rank 0 for all)."""
    every_steps: int = 0
    """Also save every N steps (0: off)."""
    keep_last: int = 3
    """Committed checkpoints to keep; older ones are pruned after a newer one commits."""
    keep_every_steps: int = 0
    """Milestones: checkpoints whose step is a multiple of N are never pruned (0: none)."""
    keep_best: Literal["none", "f1", "em"] = "none"
    """Also keep the checkpoint of the best evaluation so far by this metric, beside the rotation: saved at
    the step of a new best, never pruned until a better one is committed and verified."""
    early_stop_patience: int = 0
    """End the run (final checkpoint, exit 0) after N evaluations in a row without improvement of the
    keep_best metric (0: never; needs keep_best)."""
    early_stop_min_delta: float = 0.0
    """An evaluation improves only by more than this (a fraction: F1 and EM are in [0, 1])."""
    async_: bool = True
    """Copy the state to CPU at a step boundary, write and commit it in the background."""
    resume: bool = True
    """Continue from the newest valid checkpoint when one exists."""
    require_resume: bool = False
    """Fail instead of starting fresh when no valid checkpoint exists."""
    resume_from: str = ""
    """Start this run from another run's checkpoint (a step directory, or a checkpoint or run directory:
    its newest valid one), read only; used only while this run's checkpoint.dir holds none of its own."""
    give_up_after: timedelta = timedelta(minutes=10)
    """Saves that keep failing (storage errors) stop training once none has succeeded for this long."""
    final_retry_for: timedelta = timedelta(minutes=10)
    """The final save retries storage errors this long; a job whose final state is not committed exits 1."""
    emergency_retry_for: timedelta = timedelta(seconds=20)
    """Stop and emergency saves (SIGTERM, SIGHUP, a failed peer) retry storage errors this long (the agent
    SIGKILLs its workers 30 s after its SIGTERM)."""
    fence_check_every: timedelta = timedelta(seconds=10)
    """Under torchrun, rank 0 lists the job's attempt numbers this often, and the group stops (exit 75: its
    agent rejoins the rendezvous) once a newer group of the job has registered: a split brain of two groups
    at once, which the fence keeps from committing, is then left within this time, not at the next save.
    0s: only saves check."""
    allow_non_persistent: bool = False
    """Allow a checkpoint.dir on a store that vanishes with the process (memory://); for tests only."""
    node_local: bool = True
    """Also keep the newest checkpoint in node-local memory (checkpoint.node_local_dir), written by the
    background writer: an emergency save writes it there first, and a restarted worker on the same node
    restores from it when it is at least as new as the newest durable checkpoint. Off where that
    directory's parent does not exist."""
    node_local_dir: str = ""
    """Where the node-local copies live (a local path; one directory per checkpoint.dir inside); empty:
    $ELASTIC_QA_NODE_LOCAL_DIR, else /dev/shm/elastic_qa."""

    def __post_init__(self) -> None:
        seconds = self.interval.total_seconds()
        _require(seconds > 0, "interval", format_duration(self.interval), "must be > 0")
        _require(self.every_steps >= 0, "every_steps", self.every_steps, "must be >= 0")
        _require(self.keep_last >= 1, "keep_last", self.keep_last, "must be >= 1")
        _require(self.keep_every_steps >= 0, "keep_every_steps", self.keep_every_steps, "must be >= 0")
        _require(
            self.early_stop_patience >= 0, "early_stop_patience", self.early_stop_patience, "must be >= 0"
        )
        _require(
            self.keep_best != "none" or not self.early_stop_patience,
            "early_stop_patience",
            self.early_stop_patience,
            "needs checkpoint.keep_best=f1 or em (the metric it watches)",
        )
        _require(
            0 <= self.early_stop_min_delta < 1,
            "early_stop_min_delta",
            self.early_stop_min_delta,
            "must be in [0, 1) (scores are fractions)",
        )
        _require(
            self.emergency_retry_for.total_seconds() >= 0,
            "emergency_retry_for",
            format_duration(self.emergency_retry_for),
            "must be >= 0",
        )
        _require(
            self.fence_check_every.total_seconds() >= 0,
            "fence_check_every",
            format_duration(self.fence_check_every),
            "must be >= 0",
        )
        _require(
            self.allow_non_persistent or not self.dir.lower().startswith("memory:"),
            "dir",
            self.dir,
            "memory:// vanishes with the process, and every checkpoint with it "
            "(checkpoint.allow_non_persistent=true allows it, for tests)",
        )
        _require(
            self.resume or not self.resume_from,
            "resume_from",
            self.resume_from,
            "needs checkpoint.resume=true (resume=false starts from nothing)",
        )
        _require(
            not self.node_local_dir
            or (os.path.isabs(self.node_local_dir) and "://" not in self.node_local_dir),
            "node_local_dir",
            self.node_local_dir,
            "must be an absolute local path (node-local memory, e.g. /dev/shm/elastic_qa)",
        )
        for name in ("give_up_after", "final_retry_for"):
            value = getattr(self, name)
            _require(value.total_seconds() >= 0, name, format_duration(value), "must be >= 0")


@dataclass
class DistConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: auto picks nccl when CUDA is available, else gloo."""
    timeout: timedelta = timedelta(seconds=60)
    """Collective timeout: a frozen rank stalls the others at most this long (torch's default: 30m)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size; bigger buckets suit many small layers."""
    comm_hook: Literal["none", "bf16", "fp16"] = "none"
    """Compress gradients to this dtype for the all-reduce (halves the bytes on the wire)."""
    agent_check_interval: timedelta = timedelta(milliseconds=500)
    """How often a worker checks that its torchrun agent is still alive."""
    agent_lost_grace: timedelta = timedelta(seconds=15)
    """A worker whose agent died gets this long to save and leave before it exits (code 76) regardless."""
    control_period: timedelta = timedelta(milliseconds=100)
    """Ranks agree on stop/save (one tiny all-reduce) about this often: a SIGTERM is acted on this late.
    The `step` lines' loss sums ride on it: a line is written up to this late (stamped with its step's
    time)."""

    def __post_init__(self) -> None:
        _require(self.timeout.total_seconds() > 0, "timeout", format_duration(self.timeout), "must be > 0")
        _require(self.bucket_cap_mb > 0, "bucket_cap_mb", self.bucket_cap_mb, "must be > 0")
        _require(
            self.control_period.total_seconds() >= 0,
            "control_period",
            format_duration(self.control_period),
            "must be >= 0 (0: every step)",
        )
        _require(
            self.agent_check_interval.total_seconds() > 0,
            "agent_check_interval",
            format_duration(self.agent_check_interval),
            "must be > 0",
        )
        _require(
            self.agent_lost_grace.total_seconds() >= 0,
            "agent_lost_grace",
            format_duration(self.agent_lost_grace),
            "must be >= 0",
        )


@dataclass
class ReplicaConfig:
    """The replica-group mode (`elastic-qa replicas`, docs/replica-groups.md): replica groups that keep
    training while one of them restarts, their quorums formed through torchft's Lighthouse."""

    groups: int = 2
    """Replica groups of the job, each its own torchrun job: `elastic-qa replicas` starts them all on this
    host; with `elastic-qa node --replicas` each host runs one (`--group 0` .. `groups - 1`)."""
    nproc_per_group: int = 1
    """Worker processes in each replica group (DDP inside the group)."""
    min_replicas: int = 1
    """The fewest replica groups a step commits with (1: a single survivor goes on)."""
    heartbeat_timeout: timedelta = timedelta(seconds=1)
    """A replica group whose heartbeat is this old is left out of the next quorum."""
    join_timeout: timedelta = timedelta(milliseconds=500)
    """How long a quorum waits for a live replica group that has not asked for it yet."""
    quorum_timeout: timedelta = timedelta(seconds=30)
    """A quorum request fails after this long (then, past quorum_retries, every group commits the state it
    holds and restarts); a replica group holding no state that finds no peer to heal from within this long
    restores the newest verified checkpoint in a new lineage (at once when every group of the job is in its
    quorum)."""
    collective_timeout: timedelta = timedelta(seconds=10)
    """The gradient all-reduce across replica groups, the commit vote and the heal transfer time out
    after this long (a stalled peer costs at most this)."""
    quorum_retries: int = 20
    """Quorum requests retried while the Lighthouse is down (it is restarted at the same address)."""
    lighthouse_port: int = 0
    """The Lighthouse's port on the launcher's host (0: a free one, chosen once per job); `elastic-qa node
    --replicas` takes the --endpoint's (a different one here is refused)."""
    max_group_restarts: int = 10
    """A group whose torchrun agent died (its node lost, or out of torchrun's restarts of its workers) is
    started again at most this often in a row (0: never); past it, the group stays down while the others go
    on, and the launcher exits 1. A group that ran for restarts_reset_after before it died counts from 0
    again: a multi-day job losing a node now and then keeps it, a group that dies at every start does not."""
    restarts_reset_after: timedelta = timedelta(minutes=10)
    """How long a started group must run before its death no longer counts as one more restart in a row."""

    def __post_init__(self) -> None:
        _require(self.groups >= 1, "groups", self.groups, "must be >= 1")
        _require(self.nproc_per_group >= 1, "nproc_per_group", self.nproc_per_group, "must be >= 1")
        _require(self.min_replicas >= 1, "min_replicas", self.min_replicas, "must be >= 1")
        _require(self.quorum_retries >= 0, "quorum_retries", self.quorum_retries, "must be >= 0")
        _require(self.max_group_restarts >= 0, "max_group_restarts", self.max_group_restarts, "must be >= 0")
        _require(0 <= self.lighthouse_port < 65536, "lighthouse_port", self.lighthouse_port, "is no port")
        timeouts = ("heartbeat_timeout", "join_timeout", "quorum_timeout", "collective_timeout")
        for name in (*timeouts, "restarts_reset_after"):
            value = getattr(self, name)
            _require(value.total_seconds() > 0, name, format_duration(value), "must be > 0")


@dataclass
class MlflowConfig:
    tracking_uri: str = ""
    """Where MLflow keeps runs, e.g. sqlite:////abs/path/mlflow.db or http://host:5000 (empty: MLflow's own
    default, MLFLOW_TRACKING_URI)."""
    experiment: str = "elastic-qa"
    """The experiment the run is created in (created when missing)."""


@dataclass
class WandbConfig:
    project: str = "elastic-qa"
    """The W&B project of the run."""
    entity: str = ""
    """The W&B team or user (empty: the API key's default)."""
    mode: Literal["online", "offline"] = "online"
    """offline: write the run under dir only (`wandb sync` uploads it later)."""
    dir: str = ""
    """The folder wandb writes its files in (empty: WANDB_DIR, else run.dir)."""


@dataclass
class LogConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level written to the per-process JSON log."""
    every_steps: int = 10
    """Write a `step` event every N steps (1: every step)."""
    breakdown_every: int = 50
    """Write a `step_breakdown` event (data, compute, comm, optimizer, checkpoint, memory) every N steps."""
    console: Literal["auto", "progress", "plain", "none"] = "auto"
    """Rank 0's progress on the console (the launcher's under the launcher): in place on a TTY (auto;
    `progress` forces it), plain lines, or none (YAML reads `off` as false)."""
    tensorboard: bool = False
    """Also write per-rank TensorBoard scalars under <run.dir>/tensorboard (needs the extra); the same as
    listing tensorboard in trackers."""
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = field(default_factory=list)
    """Experiment trackers given the step and eval metrics (docs/trackers.md): tensorboard per rank; mlflow
    and wandb from rank 0, one tracker run per run, continued across restarts (each needs its extra)."""
    tracker_run_name: str = ""
    """The run's name in MLflow and W&B (empty: the name of run.dir)."""
    tracker_timeout: timedelta = timedelta(seconds=60)
    """A tracker call (opening the run, logging, the last flush) that takes longer drops that tracker."""
    tracker_send_every: timedelta = timedelta(seconds=1)
    """How often a tracker's thread sends what was logged meanwhile, in one call (fewer, larger calls
    take less of rank 0's CPU; 0s: as soon as it can)."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        _require(self.every_steps >= 1, "every_steps", self.every_steps, "must be >= 1")
        _require(self.breakdown_every >= 0, "breakdown_every", self.breakdown_every, "must be >= 0")
        _require(len(set(self.trackers)) == len(self.trackers), "trackers", self.trackers, "lists one twice")
        _require(
            self.tracker_send_every.total_seconds() >= 0,
            "tracker_send_every",
            format_duration(self.tracker_send_every),
            "must be >= 0",
        )
        _require(
            self.tracker_timeout.total_seconds() > 0,
            "tracker_timeout",
            format_duration(self.tracker_timeout),
            "must be > 0",
        )

    @property
    def tracker_names(self) -> list[str]:
        """`trackers`, with tensorboard when `tensorboard: true` asks for it the older way."""
        extra = ["tensorboard"] if self.tensorboard and "tensorboard" not in self.trackers else []
        return [*self.trackers, *extra]


@dataclass
class DebugConfig:
    sample_ledger: bool = False
    """Append, per rank and step, the dataset indices trained on to <run.dir>/ledger/."""
    kill_at_step: int = 0
    """Fault injection: SIGKILL this process after completing this step (once per run; 0: off)."""
    kill_rank: int = 0
    """The rank that kill_at_step applies to."""
    step_delay: timedelta = timedelta(0)
    """Sleep this long after each step (to give chaos tools time on tiny models)."""
    save_delay: timedelta = timedelta(0)
    """Sleep this long before each checkpoint file is written (widens the window for kill-during-save)."""
    storage_fault_file: str = ""
    """While this file exists, checkpoint writes fail with ENOSPC (the chaos `storage-errors` fault)."""
    log_fault_file: str = ""
    """While this file exists, log writes fail with ENOSPC (the chaos `log-full` fault)."""
    hold_dir: str = ""
    """Step holds (chaos runs): after step N, wait while `hold-N` here has no `release-N`; save at each
    `save-N` (step_holds.py)."""
    hold_timeout: timedelta = timedelta(minutes=10)
    """The longest one step hold waits for its release before training goes on (with a warning)."""

    def __post_init__(self) -> None:
        _require(self.kill_at_step >= 0, "kill_at_step", self.kill_at_step, "must be >= 0")
        _require(self.kill_rank >= 0, "kill_rank", self.kill_rank, "must be >= 0")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    log: LogConfig = field(default_factory=LogConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(Path(self.run.dir) / "checkpoints")

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def digest(self) -> str:
        """sha256 of the resolved config: recorded in every checkpoint manifest."""
        return hashlib.sha256(self.to_yaml().encode()).hexdigest()

    def unset(self) -> str | None:
        """The line naming a setting that training needs and this config leaves empty, or None. Loading
        refuses such a config unless asked not to (`config show` prints it with this line as a note)."""
        if self.model.kind == "hf" and not self.model.name_or_path.strip():
            return f"model.name_or_path={self.model.name_or_path!r}: needed by kind=hf"
        return None


def _yaml_name(f: dataclasses.Field) -> str:
    # `async` is a Python keyword; the YAML key is spelt without the trailing underscore.
    return f.name[:-1] if f.name.endswith("_") else f.name


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {_yaml_name(f): _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, timedelta):
        return format_duration(obj)
    return obj


_EXPECTED = {float: "a number", int: "an integer", str: "a string", bool: "true or false"}


def _coerce(path: str, hint: Any, value: Any) -> Any:
    """Check `value` against the field's type hint, converting only the unambiguous cases."""

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{path}={value!r}: expected {expected}")

    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):  # `float | None`: YAML's null, or a value of the other type
        others = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if value is None and len(others) < len(typing.get_args(hint)):
            return None
        if len(others) != 1:
            raise TypeError(f"unsupported config type {hint!r} at {path}")  # a bug in this file
        try:
            return _coerce(path, others[0], value)
        except ConfigError:
            raise bad(f"{_EXPECTED.get(others[0], others[0].__name__)} or null") from None
    if origin is list:
        if not isinstance(value, list):
            raise bad("a list, e.g. [a, b]")
        (item,) = typing.get_args(hint)
        return [_coerce(f"{path}[{i}]", item, element) for i, element in enumerate(value)]
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{path}={value!r}: must be one of {', '.join(map(str, choices))}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if hint is float:
        if isinstance(value, bool):
            raise bad("a number")
        if isinstance(value, str):  # PyYAML reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad("a number") from None
        if not isinstance(value, int | float):
            raise bad("a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if hint is timedelta:
        if isinstance(value, timedelta):
            return value
        try:
            return parse_duration(value)
        except ValueError:
            raise bad("a duration such as 10s, 5m or 1h") from None
    raise TypeError(f"unsupported config type {hint!r} at {path}")  # a bug in this file, not user input


def _build(cls: type, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}={raw!r}: expected a mapping of keys")
    hints = typing.get_type_hints(cls)
    by_yaml = {_yaml_name(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in by_yaml:
            raise ConfigError(f"{where}: unknown key (known: {', '.join(by_yaml)})")
        f = by_yaml[key]
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a hint is a class, never an instance
            kwargs[f.name] = _build(hint, value, where)
        else:
            kwargs[f.name] = _coerce(where, hint, value)
    try:
        return cls(**kwargs)
    except _FieldError as err:
        key = next(k for k, f in by_yaml.items() if f.name == err.name)
        where = f"{path}.{key}" if path else key
        raise ConfigError(f"{where}={err.value!r}: {err.reason}") from None


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`train.max_steps=200` -> ("train.max_steps", 200); the value is read as a YAML scalar."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or " " in key.strip():
        raise ConfigError(f"{text!r}: overrides look like section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


# Dotted overrides: `section.key=value` strings (command lines) or {"section.key": value} (the Python API).
Overrides = typing.Sequence[str] | typing.Mapping[str, Any]


def _apply_overrides(tree: dict, overrides: Overrides) -> None:
    items = overrides.items() if isinstance(overrides, typing.Mapping) else map(parse_override, overrides)
    for key, value in items:
        if not isinstance(key, str) or not key.strip():
            raise ConfigError(f"{key!r}: an override's key is a dotted name such as train.max_steps")
        _set_dotted(tree, key.strip(), value)


def _checked(cfg: Config, complete: bool) -> Config:
    unset = cfg.unset() if complete else None
    if unset:
        raise ConfigError(unset)
    return cfg


def load_config(
    path: str | Path | None = None, overrides: Overrides = (), *, complete: bool = True
) -> Config:
    """Read a YAML config (default: the packaged one), apply dotted overrides, validate everything;
    `complete=False` lets a config through that leaves a needed setting empty (Config.unset)."""
    source = Path(path) if path else DEFAULT_CONFIG
    try:
        text = source.read_text()
    except OSError as err:
        raise ConfigError(f"config file {source}: cannot read ({err.strerror or err})") from None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {source}{where}: not valid YAML") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {source}: expected a mapping of sections at the top level")
    _apply_overrides(tree, overrides)
    return _checked(_build(Config, tree, ""), complete)


def resolve_config(name: str, overrides: Overrides = (), *, complete: bool = True) -> Config:
    """`--config NAME`: a YAML file, or the name of a packaged config (`packaged_config_names`), +
    overrides; `complete` as for load_config."""
    path = Path(name)
    if not path.suffix and not path.exists():
        if name not in packaged_config_names():
            raise ConfigError(
                f"--config {name}: no such file or packaged config "
                f"(packaged: {', '.join(packaged_config_names())})"
            )
        path = packaged_config(name)
    return load_config(path, overrides, complete=complete)


def config_from_dict(tree: dict[str, Any], overrides: Overrides = ()) -> Config:
    """A Config from a plain dict (e.g. the resolved config stored in a checkpoint), validated."""
    tree = copy.deepcopy(tree)
    _apply_overrides(tree, overrides)
    return _checked(_build(Config, tree, ""), complete=True)


def packaged_config(name: str) -> Path:
    """Path of a config shipped in elastic_qa/configs (e.g. `default`, `squad`, `tiny`)."""
    return Path(__file__).parent / "configs" / f"{name}.yaml"


def packaged_config_names() -> list[str]:
    """The configs shipped in elastic_qa/configs, by name: what `--config NAME` takes besides a file."""
    return sorted(path.stem for path in (Path(__file__).parent / "configs").glob("*.yaml"))


def config_help() -> str:
    """`--config`'s help line, naming the packaged configs as they are shipped."""
    return f"YAML file, or a packaged config: {', '.join(packaged_config_names())}"
