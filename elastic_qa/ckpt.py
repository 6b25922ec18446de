"""`elastic-qa ckpt list | verify | show`: look at checkpoints without training.

`list` shows each checkpoint's evaluation scores (when it was evaluated at its step) and marks the run's
best checkpoint (checkpoint.keep_best: the one the newest committed manifest names, checkpoint/best.py).

Each takes a run directory, its checkpoints directory or one step directory (resolve_checkpoint_path):
list and verify then cover that one checkpoint, show picks the newest committed one of a directory.
Everything shown comes from files an attacker may have written: each checkpoint gets one line, reasons
are folded onto it with control characters escaped, and a path that is not a checkpoint directory (or,
for `show`, not a checkpoint) is bad input (CheckpointError: one line, exit code 2).
"""

from __future__ import annotations

import time
from typing import Any

from elastic_qa.checkpoint.best import best_record
from elastic_qa.checkpoint.locate import CheckpointLocation, resolve_checkpoint_path
from elastic_qa.checkpoint.manager import STATE_FILES, Checkpointer
from elastic_qa.checkpoint.store import MANIFEST, CheckpointError, CheckpointInfo
from elastic_qa.train_state import ResumeError, upgrade

PRUNED = "pruned while verifying"


def _located(path: str) -> tuple[CheckpointLocation, Checkpointer, list[CheckpointInfo]]:
    """The checkpoints `path` names (all of a directory, or the one step directory) and their checkpointer;
    CheckpointError (bad input) when it names none."""
    location = resolve_checkpoint_path(path)
    checkpointer = location.checkpointer()
    infos = checkpointer.store.list_steps(committed_only=False)
    if location.step_path is not None:  # one checkpoint, maybe under a name that is not step-N
        step = -1 if location.step is None else location.step
        committed = checkpointer.store.fs.exists(f"{location.step_path}/{MANIFEST}")
        infos = [CheckpointInfo(step, location.step_path, committed)]
    if not infos:
        raise CheckpointError(f"{path}: no checkpoints in {location.directory}")
    return location, checkpointer, infos


def _printable(text: Any) -> str:
    """`text` with control characters escaped: it may quote what a hostile file holds."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def _one_line(text: Any) -> str:
    return _printable(" ".join(str(text).split()))


def _full_check(checkpointer: Checkpointer, info: CheckpointInfo) -> str:
    """'' when the checkpoint verifies and every file loads with weights_only=True, else the reason."""
    try:
        checkpointer.load_step(info.path, info.step)
    except (CheckpointError, OSError, ValueError, KeyError) as err:
        if checkpointer.store.vanished(info):  # deleted under our feet: gone, not damaged
            return PRUNED
        return _one_line(err) or type(err).__name__
    return ""


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _size(manifest: dict[str, Any]) -> str:
    sizes = [e.get("size") for e in manifest.get("files", {}).values() if isinstance(e, dict)]
    return f"{sum(s for s in sizes if type(s) is int and s >= 0) / 2**20:.1f}MiB"


def _score(manifest: dict[str, Any], step: int, metric: str) -> str:
    """The manifest's `metric` score of its own state (evaluated at `step`), or '-'."""
    scores = manifest.get("eval")
    if not isinstance(scores, dict) or scores.get("step") != step:
        return "-"
    value = scores.get(metric)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    return f"{value:.4f}"


def cmd_list(path: str) -> int:
    _, checkpointer, infos = _located(path)
    store = checkpointer.store
    best = best_record(store)
    best_step = None if best is None else best["step"]
    rows = [("step", "epoch", "world", "size", "age", "f1", "em", "best", "verified")]
    for info in infos:
        verdict = store.verify(info.path)
        if verdict.vanished or (not verdict.ok and store.vanished(info)):
            continue  # pruned since it was listed: no longer a checkpoint of this directory
        manifest = verdict.manifest or {}
        created = manifest.get("created_ts")
        age = "?"
        if isinstance(created, (int, float)) and not isinstance(created, bool):
            age = _age(time.time() - created)
        rows.append(
            (
                str(info.step),
                _one_line(manifest.get("epoch", "?"))[:12],
                _one_line(manifest.get("world_size", "?"))[:12],
                _size(manifest),
                age,
                _score(manifest, info.step, "f1"),
                _score(manifest, info.step, "em"),
                f"{best['metric']}={best['value']:.4f}" if best and info.step == best_step else "-",
                "yes" if verdict.ok else f"NO: {_one_line(verdict.reason)}",
            )
        )
    if len(rows) == 1:
        raise CheckpointError(f"{path}: no checkpoints (every one was pruned while listing)")
    widths = [max(len(r[i]) for r in rows) for i in range(8)]
    for row in rows:
        print("  ".join(cell.rjust(widths[i]) for i, cell in enumerate(row[:8])) + "  " + row[8])
    return 0


def cmd_verify(path: str) -> int:
    """Verify and load every checkpoint: 1 if one is damaged; one pruned meanwhile is no damage."""
    _, checkpointer, infos = _located(path)
    bad = 0
    for info in infos:
        reason = _full_check(checkpointer, info)
        if reason == PRUNED:
            print(f"step {info.step}: {PRUNED}")
            continue
        print(f"step {info.step}: {'ok' if not reason else 'BAD: ' + reason}")
        bad += bool(reason)
    return 1 if bad else 0


def cmd_show(path: str) -> int:
    """One checkpoint in detail (of a directory: the newest committed); anything that is not a valid
    checkpoint is bad input (one line, exit 2)."""
    location, checkpointer, infos = _located(path)
    if location.step_path is None:
        committed = [info for info in infos if info.committed]
        info = (committed or infos)[-1]
    else:
        info = infos[0]
    shown = checkpointer.store.display(info.path) if location.step_path is None else path
    try:
        loaded = checkpointer.load_step(info.path, info.step)
        lines = _describe(shown, loaded.trainer, loaded.manifest)
    except (CheckpointError, ResumeError, OSError, ValueError) as err:
        raise CheckpointError(f"{shown}: not a valid checkpoint: {_one_line(err)}") from None
    except (KeyError, TypeError, IndexError, AttributeError) as err:  # verified, but not what we write
        reason = _one_line(f"{type(err).__name__}: {err}")
        raise CheckpointError(f"{shown}: not a checkpoint of this trainer ({reason})") from None
    print("\n".join(lines))
    return 0


def _describe(path: str, trainer_file: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    state = upgrade(trainer_file, path)
    counters, data, saved_by = state["counters"], state["data"], state["saved_by"]
    lines = [
        f"checkpoint {path}",
        f"  step {counters['step']}  epoch {data['epoch']}  samples consumed in epoch "
        f"{data['samples_consumed']}  tokens seen {counters['tokens_seen']}",
        f"  world size at save {saved_by['world_size']}  global batch {saved_by['global_batch_size']}  "
        f"attempt {saved_by.get('attempt', '?')}",
        f"  lr {state['lr_scheduler'].get('_last_lr', ['?'])[0]}  created {manifest.get('created')}  "
        f"config {str(manifest.get('config_hash', ''))[:12]}  versions {manifest.get('versions')}",
        f"  rng states for ranks {sorted(state['rng'])}",
    ]
    best = trainer_file.get("best")
    if isinstance(best, dict) and best.get("step") is not None:
        lines.append(
            f"  best {best.get('metric')} {best.get('value')} at step {best.get('step')}  "
            f"evaluations without improvement {best.get('stale_evals')}"
        )
    for name in STATE_FILES:
        entry = manifest["files"][name]
        lines.append(f"  {name}: {entry['size']} bytes  sha256 {entry['sha256'][:16]}...")
    return [_printable(line) for line in lines]
