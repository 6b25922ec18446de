"""checkpoint: how long training stalls for an async save, against the whole time of a synchronous save;
and what a save and a restore of that state cost.

For each model: build it and its AdamW (the trainer's own parameter groups), take one optimizer step so
the optimizer holds its moments, then save the same state with the real Checkpointer on local disk,
alternately async (stall = SaveResult.blocking_seconds, then wait for the commit; the background write is
the rest) and sync (the whole save); after each pair, restore the newest checkpoint the way a resume does:
verify and load its files (`load_step`), then apply them to the model and optimizer. Goal: stall / sync
<= 10%.

Models: the native `default` and `big` (~13x), and with --model-dir a transformers model (model.kind=hf)
from a save_pretrained directory, e.g. a pretrained encoder or `python -m elastic_qa.models.tiny DIR --size
base`. Repetitions default to 5, or 2 when a --model-dir is measured (a bert-base-sized save is seconds).
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
    UsageError,
    alternate,
    choice_list,
    goal_line,
    new_parser,
    print_table,
    show,
    summary,
)
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.checkpoint.payload import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE, rng_state
from elastic_qa.config import CheckpointConfig, Config, ConfigError, resolve_config
from elastic_qa.models import family_for
from elastic_qa.optim import build_optimizer

GOAL = 0.10
# Model sizes: a packaged config's model section, plus overrides. `big` is ~13x the default's parameters.
MODELS = {
    "tiny": ("tiny", []),
    "default": ("default", []),
    "big": ("default", ["model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.d_ff=2048"]),
}
REPS = 5
MODEL_DIR_REPS = 2


def build_parser() -> argparse.ArgumentParser:
    note = f"default {REPS}, or {MODEL_DIR_REPS} with a --model-dir"
    parser = new_parser("checkpoint", __doc__, reps=REPS, reps_note=note)
    parser.set_defaults(reps=None)  # chosen in run(), once --model-dir is known
    parser.add_argument(
        "--models",
        type=choice_list(list(MODELS)),
        help=f"comma-separated, from {','.join(MODELS)} (default: default,big; none with --model-dir)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        action="append",
        default=[],
        help="a transformers model directory (save_pretrained) to measure as model.kind=hf; repeatable",
    )
    parser.add_argument(
        "--dir", type=Path, help="where to write (a fresh subdirectory, removed after; default: the work dir)"
    )
    return parser


def model_configs(args: argparse.Namespace) -> dict[str, Config]:
    """name -> resolved config of every model to measure; a bad --model-dir is a usage error."""
    names = args.models if args.models is not None else ([] if args.model_dir else ["default", "big"])
    configs = {name: resolve_config(MODELS[name][0], MODELS[name][1]) for name in names}
    for directory in args.model_dir:
        if not directory.is_dir():
            raise UsageError(f"--model-dir {directory}: not a directory")
        try:
            configs[directory.name] = resolve_config("hf-tiny", [f"model.name_or_path={directory.resolve()}"])
        except ConfigError as err:
            raise UsageError(f"--model-dir {directory}: {err}") from None
    return configs


def training_state(cfg: Config) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """Model + AdamW after one step (so the moments exist), and the files the trainer would save of them."""
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
    return model, optimizer, state


def measure(name: str, cfg: Config, reps: int, root: Path) -> dict[str, Any]:
    try:
        model, optimizer, state = training_state(cfg)
    except ConfigError as err:
        raise UsageError(f"{name}: {err}") from None
    params = sum(p.numel() for p in model.parameters())
    target = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))  # fresh: no earlier step to collide
    store = open_store(str(target))
    checkpointer = Checkpointer(CheckpointConfig(async_=True, keep_last=2), store)
    figures: dict[str, list[float]] = {
        key: [] for key in ("stall", "async_total", "background", "sync", "load", "apply")
    }
    print(f"[checkpoint] {name}: {params:,} parameters, {reps} rep(s) ...", flush=True)
    for step, (_rep, mode) in enumerate(alternate(reps, ["async", "sync"]), start=1):
        started = time.perf_counter()
        saved = checkpointer.save(step, state, {"world_size": 1}, blocking=mode == "sync")
        if mode == "async":
            figures["stall"].append(saved.blocking_seconds)
            checkpointer.wait()  # the commit, so that the next save never waits on this one
            figures["async_total"].append(time.perf_counter() - started)
            figures["background"].append(figures["async_total"][-1] - saved.blocking_seconds)
            continue
        figures["sync"].append(time.perf_counter() - started)
        info = store.list_steps()[-1]
        started = time.perf_counter()
        loaded = checkpointer.load_step(info.path, info.step)  # verify (hashes) and unpickle
        figures["load"].append(time.perf_counter() - started)
        started = time.perf_counter()
        model.load_state_dict(loaded.model)
        optimizer.load_state_dict(loaded.optimizer)
        figures["apply"].append(time.perf_counter() - started)
    checkpointer.close()
    ratios = [a / s for a, s in zip(figures["stall"], figures["sync"], strict=True)]
    files = store.read_manifest(store.list_steps()[-1].path)["files"]
    shutil.rmtree(target, ignore_errors=True)
    return {
        "parameters": params,
        "model": cfg.to_dict()["model"],
        "bytes": sum(entry["size"] for entry in files.values()),
        "file_bytes": {name: entry["size"] for name, entry in files.items()},
        **{f"{key}_s": summary(values) for key, values in figures.items()},
        "restore_s": summary([a + b for a, b in zip(figures["load"], figures["apply"], strict=True)]),
        "stall_ratio": statistics.median(ratios),
        "stall_ratio_spread": summary(ratios),
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    reps = args.reps or (MODEL_DIR_REPS if args.model_dir else REPS)
    configs = model_configs(args)
    root = args.dir or work / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    results = {name: measure(name, cfg, reps, root) for name, cfg in configs.items()}
    print_table(
        [
            "model",
            "params",
            "MB",
            "trainer.pt kB",
            "async stall ms",
            "background write ms",
            "sync save ms",
            "stall/sync",
            "restore ms (load + apply)",
        ],
        [
            [
                name,
                f"{r['parameters']:,}",
                f"{r['bytes'] / 1e6:.1f}",
                f"{r['file_bytes'][TRAINER_FILE] / 1e3:.1f}",
                show(_ms(r["stall_s"]), ".1f"),
                show(_ms(r["background_s"]), ".1f"),
                show(_ms(r["sync_s"]), ".1f"),
                show(r["stall_ratio_spread"], ".3f"),
                f"{show(_ms(r['restore_s']), '.1f')} = "
                f"{_ms(r['load_s'])['median']:.1f} + {_ms(r['apply_s'])['median']:.1f}",
            ]
            for name, r in results.items()
        ],
    )
    worst = max(r["stall_ratio"] for r in results.values())
    print(goal_line("stall/sync (worst model)", worst, GOAL))
    return {
        "benchmark": "checkpoint",
        "settings": {
            "models": list(configs),
            "model_dirs": [str(d) for d in args.model_dir],
            "reps": reps,
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
