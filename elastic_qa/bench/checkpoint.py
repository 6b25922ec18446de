"""checkpoint: how long training stalls for an async save, against the whole time of a synchronous save.

For each model size: build the model and its AdamW (the trainer's own parameter groups), take one optimizer
step so the optimizer holds its moments, then save the same state with the real Checkpointer on local
disk, alternately async (stall = SaveResult.blocking_seconds, then wait for the commit) and sync (the
whole save). Goal: stall / sync <= 10%.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from elastic_qa.bench.common import (
    alternate,
    choice_list,
    goal_line,
    new_parser,
    print_table,
    show,
    summary,
)
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.checkpoint.state import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE, rng_state
from elastic_qa.checkpoint.store import open_store
from elastic_qa.config import CheckpointConfig, Config, resolve_config
from elastic_qa.models import family_for
from elastic_qa.optim import build_optimizer

GOAL = 0.10
# Model sizes: a packaged config's model section, plus overrides. `big` is ~13x the default's parameters.
MODELS = {
    "tiny": ("tiny", []),
    "default": ("default", []),
    "big": ("default", ["model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.d_ff=2048"]),
}


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("checkpoint", __doc__, reps=5)
    parser.add_argument(
        "--models",
        type=choice_list(list(MODELS)),
        default=["default", "big"],
        help=f"comma-separated, from {','.join(MODELS)} (default: default,big)",
    )
    parser.add_argument(
        "--dir", type=Path, help="where to write (a fresh subdirectory, removed after; default: the work dir)"
    )
    return parser


def training_state(cfg: Config) -> tuple[dict[str, Any], int]:
    """Model + AdamW after one step (so the moments exist), as the trainer would save it; and #params."""
    family = family_for(cfg.model)
    torch.manual_seed(cfg.run.seed)
    vocab = family.tokenizer(cfg).vocab_size
    model = family.build_model(cfg, vocab)
    optimizer = build_optimizer(model, cfg)
    ids = torch.randint(4, vocab, (8, cfg.data.max_seq_len))  # no padding: every token is real
    segments = (torch.arange(cfg.data.max_seq_len) > cfg.data.max_query_len).long().expand(8, -1)
    start, end = model(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=segments)
    (start.logsumexp(-1) + end.logsumexp(-1)).mean().backward()
    optimizer.step()
    state = {
        MODEL_FILE: model.state_dict(),
        OPTIMIZER_FILE: optimizer.state_dict(),
        TRAINER_FILE: {"trainer": {"step": 1}, "rng": {"0": rng_state()}, "config": cfg.to_dict()},
    }
    return state, sum(p.numel() for p in model.parameters())


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    root = args.dir or work / "checkpoints"
    results: dict[str, Any] = {}
    for name in args.models:
        config, overrides = MODELS[name]
        cfg = resolve_config(config, overrides)
        state, params = training_state(cfg)
        root.mkdir(parents=True, exist_ok=True)
        target = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))  # fresh: no earlier step to collide
        store = open_store(str(target))
        checkpointer = Checkpointer(CheckpointConfig(async_=True, keep_last=2), store)
        figures: dict[str, list[float]] = {"stall": [], "async_total": [], "sync": []}
        print(f"[checkpoint] {name}: {params:,} parameters ...", flush=True)
        for step, (_rep, mode) in enumerate(alternate(args.reps, ["async", "sync"]), start=1):
            started = time.perf_counter()
            saved = checkpointer.save(step, state, {"world_size": 1}, blocking=mode == "sync")
            if mode == "async":
                figures["stall"].append(saved.blocking_seconds)
                checkpointer.wait()  # the commit, so that the next save never waits on this one
                figures["async_total"].append(time.perf_counter() - started)
            else:
                figures["sync"].append(time.perf_counter() - started)
        checkpointer.close()
        ratios = [a / s for a, s in zip(figures["stall"], figures["sync"], strict=True)]
        info = store.list_steps()[-1]
        results[name] = {
            "parameters": params,
            "model": cfg.to_dict()["model"],
            "bytes": sum(entry["size"] for entry in store.read_manifest(info.path)["files"].values()),
            **{f"{key}_s": summary(values) for key, values in figures.items()},
            "stall_ratio": statistics.median(ratios),
            "stall_ratio_spread": summary(ratios),
        }
        shutil.rmtree(target, ignore_errors=True)
    print_table(
        ["model", "params", "MB", "async stall ms", "async total ms", "sync save ms", "stall/sync"],
        [
            [
                name,
                f"{r['parameters']:,}",
                f"{r['bytes'] / 1e6:.1f}",
                show(_ms(r["stall_s"]), ".1f"),
                show(_ms(r["async_total_s"]), ".1f"),
                show(_ms(r["sync_s"]), ".1f"),
                show(r["stall_ratio_spread"], ".3f"),
            ]
            for name, r in results.items()
        ],
    )
    worst = max(r["stall_ratio"] for r in results.values())
    print(goal_line("stall/sync (worst model)", worst, GOAL))
    return {
        "benchmark": "checkpoint",
        "settings": {
            "models": args.models,
            "reps": args.reps,
            "dir": str(root),
            "threads": torch.get_num_threads(),
        },
        "models": results,
        "goal": GOAL,
        "goal_met": worst <= GOAL,
    }


def _ms(stat: dict[str, Any]) -> dict[str, Any]:
    return {
        key: [v * 1000 for v in value] if key == "values" else value * 1000 for key, value in stat.items()
    }
