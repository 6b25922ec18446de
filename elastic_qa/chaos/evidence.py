"""What a run left behind, read back: log events, the sample ledger, checkpoints, final parameters.

Every check here works from evidence on disk, never from the runner's memory of what it did, so the same
functions judge a run made by `elastic-qa chaos run`, by the test suite, or by hand on a cluster.

Log lines are evidence that may be missing (a full disk drops them; elastic_qa.observe.follow reads what
is left, torn lines included): exactly-once is judged from the sample ledger and what was saved from the
checkpoints themselves (their manifests), never from log lines alone.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.best import best_record
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.checkpoint.policy import retained_steps
from elastic_qa.checkpoint.store import CheckpointStore
from elastic_qa.config import CheckpointConfig, Config, config_from_dict
from elastic_qa.data.cursor import GlobalCursor
from elastic_qa.observe.events import AttemptStartRecord, ResumeRecord, StepProgressRecord, record
from elastic_qa.observe.ledger import effective_order, read_ledger

REJECTED_NOTE = "REJECTED.json"  # written next to a quarantined checkpoint: why it was set aside
_REJECTED = re.compile(r"^(step-(\d{8}))\.")
# attempt-00000007.json, or a claim attempt-00000007.<token>.json (two registrants never share a number)
_ATTEMPT_FILE = re.compile(r"attempt-(\d{8,})(?:\.[0-9a-f]+)?\.json$")


def run_config(run_dir: Path) -> Config:
    """The resolved config a run was trained with (<run.dir>/config.yaml, written by the workers)."""
    return config_from_dict(yaml.safe_load((Path(run_dir) / "config.yaml").read_text()))


@dataclass
class LedgerVerdict:
    ok: bool
    problems: list[str] = field(default_factory=list)
    steps: int = 0
    epochs_completed: int = 0


def check_ledger(run_dir: Path, cfg: Config, num_samples: int) -> LedgerVerdict:
    """Effective order (for each step, the highest attempt that ran it) against the planned global order:
    no step missing, each step's samples are exactly its planned global batch, and so each sample is used
    exactly once per completed epoch."""
    order = effective_order(read_ledger(run_dir))
    problems: list[str] = []
    max_steps = cfg.train.max_steps
    missing = [s for s in range(1, max_steps + 1) if s not in order]
    if missing:
        problems.append(f"{len(missing)} steps missing from the ledger (first: {missing[:5]})")
    planned = GlobalCursor(num_samples, cfg.train.global_batch_size, cfg.run.seed).batches(first_step=1)
    seen_in_epoch: Counter[int] = Counter()
    epoch, epochs_completed = 0, 0
    for step in range(1, max_steps + 1):
        plan = next(planned)
        if plan.epoch != epoch:
            if len(seen_in_epoch) == num_samples and max(seen_in_epoch.values()) == 1:
                epochs_completed += 1
            seen_in_epoch, epoch = Counter(), plan.epoch
        entries = order.get(step)
        if entries is None:
            continue
        samples = [index for entry in entries for index in entry["samples"]]
        seen_in_epoch.update(samples)
        duplicated = [index for index, count in Counter(samples).items() if count > 1]
        if duplicated:
            problems.append(f"step {step}: samples used twice in one step {duplicated[:5]}")
        if sorted(samples) != sorted(plan.global_indices):
            problems.append(
                f"step {step} (attempt {entries[0]['attempt']}): trained on {len(samples)} samples that are "
                f"not its planned global batch of {plan.global_count}"
            )
        if entries[0]["epoch"] != plan.epoch:
            problems.append(f"step {step}: epoch {entries[0]['epoch']}, planned {plan.epoch}")
    if len(seen_in_epoch) == num_samples and max(seen_in_epoch.values()) == 1:
        epochs_completed += 1  # the last epoch ended exactly at max_steps
    repeated = [index for index, count in seen_in_epoch.items() if count > 1]
    if repeated:
        problems.append(f"epoch {epoch}: {len(repeated)} samples used more than once")
    return LedgerVerdict(not problems, problems, len(order), epochs_completed)


def checkpoint_store(cfg: Config) -> CheckpointStore:
    return open_store(cfg.checkpoint_dir)


@dataclass
class Copy:
    """One checkpoint directory on disk: in place (`step-N`) or quarantined (`rejected/step-N.*`)."""

    step: int
    path: str
    quarantined: bool
    manifest: dict[str, Any] | None
    ok: bool  # verifies and loads
    reason: str = ""
    note: dict[str, Any] | None = None  # a quarantined copy's REJECTED.json: why it was set aside

    @property
    def attempt(self) -> int | None:
        return (self.manifest or {}).get("attempt")

    @property
    def created_ts(self) -> float | None:
        return (self.manifest or {}).get("created_ts")


def checkpoint_copies(cfg: Config) -> list[Copy]:
    """Every committed checkpoint in place and every quarantined one, each verified and loaded."""
    store = checkpoint_store(cfg)
    checkpointer = Checkpointer(CheckpointConfig(), store)
    found = [(info.step, info.path, False) for info in store.list_steps(committed_only=False)]
    try:
        rejected = store.fs.ls(store.path("rejected"), detail=False)
    except (FileNotFoundError, NotADirectoryError):
        rejected = []
    for entry in rejected:
        match = _REJECTED.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if match:
            found.append((int(match.group(2)), entry.rstrip("/"), True))
    copies = []
    for step, path, quarantined in sorted(found):
        manifest = None
        with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
            manifest = store.read_manifest(path)
        try:
            checkpointer.load_step(path, step)
            ok, reason = True, ""
        except Exception as err:  # noqa: BLE001 - any failure to load is a failed check
            ok, reason = False, str(err)
        note = None
        if quarantined:
            with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
                note = json.loads(store.fs.cat_file(f"{path}/{REJECTED_NOTE}"))
        copies.append(Copy(step, path, quarantined, manifest, ok, reason, note))
    return copies


def superseded(copy: Copy, copies: list[Copy]) -> bool:
    """A quarantined copy that a newer attempt's commit of the same step replaced (a replay across it)."""
    newer = any(o.step == copy.step and (o.attempt or 0) > (copy.attempt or 0) for o in copies)
    return newer or "superseded" in str((copy.note or {}).get("reason", ""))


def registrations(cfg: Config) -> dict[int, float]:
    """Attempt number -> when it was registered (`<checkpoint.dir>/attempts/`), for the fencing checks."""
    store = checkpoint_store(cfg)
    try:
        names = store.fs.ls(store.path("attempts"), detail=False)
    except FileNotFoundError:
        return {}
    found: dict[int, float] = {}
    for name in names:
        match = _ATTEMPT_FILE.search(name)
        if not match:
            continue
        try:
            ts = float(json.loads(store.fs.cat_file(name))["time"])
        except (OSError, ValueError, KeyError, TypeError):
            ts = float(store.fs.info(name).get("mtime") or 0.0)
        number = int(match.group(1))
        found[number] = min(ts, found.get(number, ts))
    return found


def is_corrupted_copy(copy: Copy, corruptions: list[tuple[int, float]]) -> bool:
    """The copy a fault corrupted on purpose: its step was corrupted after this copy was written."""
    return any(
        step == copy.step and (copy.created_ts is None or copy.created_ts <= ts) for step, ts in corruptions
    )


def check_checkpoints(
    cfg: Config, exclude: Set[int] = frozenset(), corruptions: Sequence[tuple[int, float]] = ()
) -> list[str]:
    """Every committed checkpoint in place verifies and loads (but `exclude`, and copies that were
    corrupted on purpose: (step, when) in `corruptions`, while a later commit of the step must verify);
    a quarantined one (`rejected/`) that verifies must have been superseded by a newer attempt's commit of
    its step (else a valid checkpoint was set aside); no more are retained than the policy allows (the
    rotation, and the best checkpoint the newest manifest names)."""
    problems = []
    copies = checkpoint_copies(cfg)
    for copy in copies:
        if copy.quarantined:
            if copy.ok and not superseded(copy, copies):
                problems.append(f"quarantined {copy.path} verifies: a valid checkpoint was set aside")
        elif not copy.ok and copy.step not in exclude and not is_corrupted_copy(copy, list(corruptions)):
            problems.append(f"checkpoint step {copy.step}: {copy.reason}")
    steps = [copy.step for copy in copies if not copy.quarantined]
    allowed = retained_steps(steps, cfg.checkpoint.keep_last, cfg.checkpoint.keep_every_steps)
    best = best_record(checkpoint_store(cfg))
    if best is not None:
        allowed.add(best["step"])
    extra = sorted(set(steps) - allowed)
    if extra:
        problems.append(f"{len(steps)} checkpoints retained, the policy allows {len(allowed)}: extra {extra}")
    return problems


def final_parameters(cfg: Config) -> tuple[int, dict[str, torch.Tensor]] | None:
    loaded = Checkpointer(CheckpointConfig(), checkpoint_store(cfg)).load_newest()
    return (loaded.step, loaded.model) if loaded else None


def parameter_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Relative L2 difference over all parameters (||a-b|| / ||b||), max abs difference, bitwise equality."""
    if a.keys() != b.keys():
        return {
            "bitwise_equal": False,
            "relative": float("inf"),
            "max_abs": float("inf"),
            "error": "different parameter names",
        }
    diff_sq = ref_sq = 0.0
    max_abs = 0.0
    bitwise = True
    for name in sorted(a):
        x, y = a[name].double(), b[name].double()
        if x.shape != y.shape:
            return {
                "bitwise_equal": False,
                "relative": float("inf"),
                "max_abs": float("inf"),
                "error": f"{name}: shape {tuple(x.shape)} vs {tuple(y.shape)}",
            }
        bitwise = bitwise and torch.equal(a[name], b[name])
        delta = x - y
        diff_sq += float((delta * delta).sum())
        ref_sq += float((y * y).sum())
        max_abs = max(max_abs, float(delta.abs().max()) if delta.numel() else 0.0)
    relative = (diff_sq**0.5) / max(ref_sq**0.5, 1e-30)
    return {"bitwise_equal": bitwise, "relative": relative, "max_abs": max_abs}


def attempts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per attempt: start time, world size, resumed step, first completed step time."""
    rows: dict[int, dict[str, Any]] = {}
    for event in events:
        number = event.get("attempt")
        if number is None:
            continue
        row = rows.setdefault(
            number,
            {
                "attempt": number,
                "start": event["ts"],
                "world_size": None,
                "resumed_step": 0,
                "first_step_ts": None,
                "last_step": 0,
            },
        )
        if (started := record(event, AttemptStartRecord)) is not None:
            row["world_size"] = started["world_size"]
            row["start"] = min(row["start"], started["ts"])
        elif (resumed := record(event, ResumeRecord)) is not None:
            row["resumed_step"] = resumed["step"]
        elif (step := record(event, StepProgressRecord)) is not None:
            if row["first_step_ts"] is None:
                row["first_step_ts"] = step["ts"]
            row["last_step"] = max(row["last_step"], step["step"])
    return [rows[k] for k in sorted(rows)]
