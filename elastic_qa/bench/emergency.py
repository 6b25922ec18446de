"""emergency: what the node-local copy (checkpoint/node_local.py) buys when a peer dies: the emergency save's
time until the newest state is safe on the node, and a restarted worker's restore to its first step, with
and without the copy, on local disk and on slow storage.

For each model: build it and its AdamW after one step (as `bench checkpoint` does), then per repetition and
variant (alternately, so that a slow spell of the shared machine hits all of them) on a fresh store:
  periodic   a periodic save of step 1 by the real Checkpointer (the background writer: with the copy on,
             it commits to node memory first, then to the store)
  emergency  the emergency save of step 2 as CheckpointSession.save_emergency makes it: with the copy,
             node memory first (`safe after` ends here), then the store; without, the store only
  restart    what a restarted worker does after process start and rendezvous (the same in both
             variants, not timed here): load the newest state (from the node-local copy when it is there
             and at least as new, else from the store: verify, read, unpickle), apply it to the model and
             optimizer, and train one step (2 x 128 tokens)
Storage: `disk` is a directory on local disk (--dir); `slow` is the same directory behind a throttled fsspec
file system used only by this benchmark, which sleeps size / --slow-mbs for every file written or opened
for reading, standing in for shared storage (NFS, an object store) at that bandwidth. The node-local copy
lives in --node-local-dir (default: a directory of this process under /dev/shm, removed at the end).

Models: with --model-dir, a transformers model (model.kind=hf) from a save_pretrained directory, e.g. the
random BERT-base-shaped one `python -m elastic_qa.models.tiny DIR --size base` writes (110M parameters);
without, the native `default` model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from elastic_qa.bench.checkpoint import model_configs, training_state
from elastic_qa.bench.common import UsageError, alternate, new_parser, print_table, show, summary
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.manager import STATE_FILES, Checkpointer, LoadedCheckpoint
from elastic_qa.checkpoint.node_local import NodeLocalCopy
from elastic_qa.checkpoint.store import CheckpointStore
from elastic_qa.config import CheckpointConfig, Config, ConfigError
from elastic_qa.models import family_for

REPS = 3
SLOW_MBS = 50.0
VARIANTS = ("durable only", "node-local copy")
STORAGES = ("disk", "slow")


class ThrottledFileSystem(DirFileSystem):
    """A local directory at a fixed bandwidth (this benchmark's stand-in for slow shared storage): every
    file written, and every file opened for reading, first costs its size / `bytes_per_s` seconds."""

    def __init__(self, path: str, bytes_per_s: float) -> None:
        super().__init__(path=path, fs=LocalFileSystem())
        self.bytes_per_s = bytes_per_s

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        time.sleep(len(value) / self.bytes_per_s)
        super().pipe_file(path, value, *args, **kwargs)

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode:
            time.sleep(self.size(path) / self.bytes_per_s)
        return super().open(path, mode, *args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("emergency", __doc__, reps=REPS)
    parser.add_argument("--model-dir", type=Path, action="append", default=[], help="a transformers model")
    parser.add_argument(
        "--dir", type=Path, help="the durable stores' local directory (default: the work dir)"
    )
    parser.add_argument(
        "--node-local-dir", type=Path, help="where the node-local copies go (default: under /dev/shm)"
    )
    parser.add_argument(
        "--slow-mbs", type=float, default=SLOW_MBS, help=f"the slow storage's MB/s (default {SLOW_MBS:g})"
    )
    parser.add_argument(
        "--storage", default=",".join(STORAGES), help=f"comma-separated, from {','.join(STORAGES)}"
    )
    return parser


def open_durable(storage: str, directory: Path, slow_bytes_per_s: float) -> CheckpointStore:
    directory.mkdir(parents=True)
    if storage == "disk":
        return open_store(str(directory))
    return open_store("/", fs=ThrottledFileSystem(str(directory), slow_bytes_per_s))


def first_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, vocab: int) -> None:
    ids = torch.randint(4, vocab, (2, 128))
    start, end = model(
        input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids)
    )
    (start.logsumexp(-1) + end.logsumexp(-1)).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def one_rep(
    cfg: Config,
    built: tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]],
    storage: str,
    variant: str,
    where: tuple[Path, Path],
    slow_bytes_per_s: float,
) -> dict[str, float]:
    model, optimizer, state = built
    durable_root, node_root = where
    base = Path(tempfile.mkdtemp(dir=durable_root))
    store = open_durable(storage, base / "checkpoints", slow_bytes_per_s)
    node = (
        NodeLocalCopy(str(node_root), f"{store.url}-{time.monotonic_ns()}")
        if variant != VARIANTS[0]
        else None
    )
    checkpoint_cfg = CheckpointConfig(keep_last=2)
    checkpointer = Checkpointer(checkpoint_cfg, store, node_local=node)
    fields = {"world_size": 1, "attempt": 1, "run": "bench"}
    figures: dict[str, float] = {}
    try:
        started = time.perf_counter()
        checkpointer.save(1, state, fields, blocking=True)
        figures["periodic"] = time.perf_counter() - started
        started = time.perf_counter()  # the emergency: step 2 (the same tensors: the size is what counts)
        if node is not None and not checkpointer.copy_to_node_local(2, state, fields):
            raise RuntimeError(f"the node-local copy failed (see the log in the work dir): {node.directory}")
        figures["safe_after"] = time.perf_counter() - started
        checkpointer.save(2, state, fields, blocking=True, node_local=False)
        figures["emergency_durable"] = time.perf_counter() - started
        if node is None:
            figures["safe_after"] = figures["emergency_durable"]
        started = time.perf_counter()  # the restarted worker, once its process and group are up
        # As a restore does: the copy verified once, its state files' bytes kept and loaded.
        newest = node.newest(keep=STATE_FILES) if node is not None else None
        if node is not None and newest is not None and newest.verdict is not None:
            local = Checkpointer(checkpoint_cfg, node.store)
            loaded: LoadedCheckpoint | None = local.load_verified(newest.path, newest.step, newest.verdict)
        else:
            loaded = checkpointer.load_newest()
        assert loaded is not None and loaded.step == 2
        figures["load"] = time.perf_counter() - started
        model.load_state_dict(loaded.model)
        optimizer.load_state_dict(loaded.optimizer)
        del loaded
        first_step(model, optimizer, cfg, family_for(cfg.model).tokenizer(cfg).vocab_size)
        figures["restart_to_first_step"] = time.perf_counter() - started
    finally:
        checkpointer.wait()
        if node is not None:
            node.remove()
        shutil.rmtree(base, ignore_errors=True)
    return figures


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    storages = [s for s in args.storage.split(",") if s]
    if not storages or any(s not in STORAGES for s in storages):
        raise UsageError(f"--storage {args.storage}: comma-separated, from {','.join(STORAGES)}")
    if args.slow_mbs <= 0:
        raise UsageError(f"--slow-mbs {args.slow_mbs}: must be > 0")
    args.models = None if args.model_dir else ["default"]
    configs = model_configs(args)
    durable_root = args.dir or work / "durable"
    durable_root.mkdir(parents=True, exist_ok=True)
    own_node_root = args.node_local_dir is None
    node_root = args.node_local_dir or Path(f"/dev/shm/elastic_qa-bench-{os.getpid()}")
    results: dict[str, Any] = {}
    try:
        for name, cfg in configs.items():
            try:
                built = training_state(cfg)
            except ConfigError as err:
                raise UsageError(f"{name}: {err}") from None
            params = sum(p.numel() for p in built[0].parameters())
            print(f"[emergency] {name}: {params:,} parameters, {args.reps} rep(s) ...", flush=True)
            figures: dict[tuple[str, str], list[dict[str, float]]] = {}
            for _rep, (storage, variant) in alternate(
                args.reps, [(s, v) for s in storages for v in VARIANTS]
            ):
                rep = one_rep(cfg, built, storage, variant, (durable_root, node_root), args.slow_mbs * 1e6)
                figures.setdefault((storage, variant), []).append(rep)
            results[name] = {
                "parameters": params,
                "variants": {
                    f"{storage}/{variant}": {key: summary([rep[key] for rep in reps]) for key in reps[0]}
                    for (storage, variant), reps in figures.items()
                },
            }
    finally:
        if own_node_root:
            shutil.rmtree(node_root, ignore_errors=True)
    rows = []
    for name, result in results.items():
        for label, r in result["variants"].items():
            storage = label.split("/", 1)[0]
            shown = f"slow ({args.slow_mbs:g} MB/s)" if storage == "slow" else storage
            rows.append(
                [
                    name,
                    shown,
                    label.split("/", 1)[1],
                    show(r["periodic"], ".2f"),
                    show(r["safe_after"], ".2f"),
                    show(r["emergency_durable"], ".2f"),
                    show(r["load"], ".2f"),
                    show(r["restart_to_first_step"], ".2f"),
                ]
            )
    print_table(
        [
            "model",
            "durable storage",
            "variant",
            "periodic save s",
            "emergency: state safe after s",
            "emergency: durable after s",
            "restart: load s",
            "restart: load + apply + first step s",
        ],
        rows,
    )
    return {
        "benchmark": "emergency",
        "settings": {
            "models": list(configs),
            "model_dirs": [str(d) for d in args.model_dir],
            "reps": args.reps,
            "storages": storages,
            "slow_mbs": args.slow_mbs,
            "node_local_dir": str(node_root),
            "threads": torch.get_num_threads(),
        },
        "models": results,
    }
