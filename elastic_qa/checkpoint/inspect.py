"""`elastic-qa ckpt list | verify | show`: look at a checkpoint directory without training."""

from __future__ import annotations

import time

from elastic_qa.checkpoint.manager import STATE_FILES, Checkpointer
from elastic_qa.checkpoint.store import CheckpointError, CheckpointStore
from elastic_qa.config import CheckpointConfig


def _checkpointer(path: str) -> Checkpointer:
    return Checkpointer(CheckpointConfig(), CheckpointStore(path.rstrip("/")))


def _full_check(checkpointer: Checkpointer, path: str, step: int) -> str:
    """'' when the checkpoint verifies and every file loads with weights_only=True, else the reason."""
    try:
        checkpointer.load_step(path, step)
    except (CheckpointError, OSError, ValueError, KeyError) as err:
        return str(err)
    return ""


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def cmd_list(path: str) -> int:
    checkpointer = _checkpointer(path)
    store = checkpointer.store
    rows = [("step", "epoch", "world", "size", "age", "verified")]
    for info in store.list_steps(committed_only=False):
        verdict = store.verify(info.path)
        manifest = verdict.manifest or {}
        size = sum(f.get("size", 0) for f in manifest.get("files", {}).values())
        age = _age(time.time() - manifest["created_ts"]) if "created_ts" in manifest else "?"
        rows.append(
            (
                str(info.step),
                str(manifest.get("epoch", "?")),
                str(manifest.get("world_size", "?")),
                f"{size / 2**20:.1f}MiB",
                age,
                "yes" if verdict.ok else f"NO: {verdict.reason}",
            )
        )
    if len(rows) == 1:
        print(f"no checkpoints in {path}")
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.rjust(widths[i]) for i, cell in enumerate(row[:5])) + "  " + row[5])
    return 0


def cmd_verify(path: str) -> int:
    checkpointer = _checkpointer(path)
    infos = checkpointer.store.list_steps(committed_only=False)
    bad = 0
    for info in infos:
        reason = _full_check(checkpointer, info.path, info.step)
        print(f"step {info.step}: {'ok' if not reason else 'BAD: ' + reason}")
        bad += bool(reason)
    if not infos:
        print(f"no checkpoints in {path}")
    return 1 if bad else 0


def cmd_show(path: str) -> int:
    store = CheckpointStore(path.rstrip("/"))
    parent, _, name = store.root.rpartition("/")
    checkpointer = Checkpointer(CheckpointConfig(), CheckpointStore(parent or "/", store.fs))
    step = int(name.split("-")[-1]) if name.startswith("step-") else -1
    loaded = checkpointer.load_step(store.root, step)
    state, manifest = loaded.trainer, loaded.manifest
    trainer = state["trainer"]
    print(f"checkpoint {path}")
    print(
        f"  step {trainer['step']}  epoch {trainer['epoch']}  samples consumed in epoch "
        f"{trainer['samples_consumed']}  tokens seen {trainer['tokens_seen']}"
    )
    print(
        f"  world size at save {trainer['world_size']}  global batch {trainer['global_batch_size']}  "
        f"attempt {trainer.get('attempt', '?')}"
    )
    print(
        f"  lr {state['scheduler'].get('_last_lr', ['?'])[0]}  created {manifest.get('created')}  "
        f"config {manifest.get('config_hash', '')[:12]}  versions {manifest.get('versions')}"
    )
    print(f"  rng states for ranks {sorted(state['rng'])}")
    for name in STATE_FILES:
        entry = manifest["files"][name]
        print(f"  {name}: {entry['size']} bytes  sha256 {entry['sha256'][:16]}...")
    return 0
