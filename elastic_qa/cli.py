"""`elastic-qa`: the commands around training.

    elastic-qa prepare [--config CFG] [overrides]       tokenise once into the memory-mapped cache
    elastic-qa config show [--config CFG] [overrides]   print the resolved config (YAML)
    elastic-qa eval --checkpoint PATH [--data FILE]     EM/F1 of a checkpoint
    elastic-qa ask --checkpoint PATH --context TEXT --question TEXT
    elastic-qa ckpt list|verify|show PATH               look at checkpoints without training
    elastic-qa bench throughput|checkpoint|resume|recovery|scaling|drift [...]
    elastic-qa chaos run|verify|schedule [...]          break a job on purpose, verify nothing was lost
    elastic-qa report RUN_DIR                           one self-contained HTML page of a run

A checkpoint PATH is a run directory, its checkpoints directory (the newest valid checkpoint) or one
step-N directory. Training itself: `launch/local.sh start` in a checkout (installed:
`python -m elastic_qa.launcher.local start`), or `python -m elastic_qa.train` for one process.
Exit codes: 0 ok, 1 a check failed (ckpt verify), 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from elastic_qa import __version__
from elastic_qa.checkpoint.locate import load_checkpoint
from elastic_qa.checkpoint.manager import LoadedCheckpoint
from elastic_qa.checkpoint.store import CheckpointError
from elastic_qa.config import Config, ConfigError, config_from_dict, resolve_config
from elastic_qa.data.cache import prepare
from elastic_qa.data.squad import DataError, QAExample, read_squad
from elastic_qa.evaluate import answers_from_windows, evaluate, predict_windows
from elastic_qa.exits import EXIT_BAD_INPUT, UsageError
from elastic_qa.models import ModelFamily, family_for
from elastic_qa.observe.log import configure_terminal_logging


def model_from_checkpoint(
    loaded: LoadedCheckpoint, device: torch.device
) -> tuple[torch.nn.Module, Config, ModelFamily]:
    """The checkpoint's model in eval mode on `device`, the config it was trained with, and its family."""
    try:
        cfg = config_from_dict(loaded.trainer["config"])
        family = family_for(cfg.model)
    except (ConfigError, KeyError, TypeError) as err:
        raise UsageError(f"{loaded.path}: the config stored in the checkpoint is not usable: {err}") from None
    model = family.build_model(cfg, family.tokenizer(cfg).vocab_size)
    try:
        model.load_state_dict(loaded.model)
    except RuntimeError as err:
        raise UsageError(f"{loaded.path}: model weights do not fit the stored config: {err}") from None
    # map_location="cpu" at load time, then here to wherever we run: works for GPU-trained checkpoints.
    return model.to(device).eval(), cfg, family


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def cmd_prepare(args: argparse.Namespace) -> int:
    cfg = resolve_config(args.config, args.overrides)
    started = time.perf_counter()
    data = prepare(cfg, family_for(cfg.model))
    skipped = sum(data.skipped.values())
    print(
        f"cache {data.path}: {len(data.train)} training windows, "
        f"{len(data.eval) if data.eval is not None else 0} evaluation windows"
        + (f", {skipped} malformed records skipped" if skipped else "")
        + f" ({time.perf_counter() - started:.2f}s)"
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    device = _device()
    loaded = load_checkpoint(args.checkpoint)
    model, cfg, family = model_from_checkpoint(loaded, device)
    if args.data:
        examples, _ = read_squad(args.data, cfg.data.skip_malformed)
        features = family.features(examples, cfg)
    else:
        data = prepare(cfg, family_for(cfg.model))
        if data.eval is None:
            raise UsageError("the checkpoint's data has no evaluation split: pass --data FILE")
        examples, features = data.eval_examples, data.eval
    scores = evaluate(
        model, family, features, examples, cfg.train.eval_batch_size, cfg.data.max_answer_len, device
    )
    print(
        f"checkpoint {loaded.path} (step {loaded.step}): EM {scores['em']:.4f}  F1 {scores['f1']:.4f}  "
        f"on {scores['count']} questions"
    )
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    device = _device()
    loaded = load_checkpoint(args.checkpoint)
    model, cfg, family = model_from_checkpoint(loaded, device)
    example = QAExample("ask", args.question, args.context, ())
    features = family.features([example], cfg)
    windows = predict_windows(
        model, family, features, range(len(features)), 64, cfg.data.max_answer_len, device
    )
    answer = answers_from_windows(windows, [example])["ask"]
    print(answer if answer else "(no answer in the context)")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    print(resolve_config(args.config, args.overrides).to_yaml(), end="")
    return 0


def cmd_ckpt(args: argparse.Namespace) -> int:
    from elastic_qa import ckpt as inspect

    handlers = {"list": inspect.cmd_list, "verify": inspect.cmd_verify, "show": inspect.cmd_show}
    try:
        return handlers[args.ckpt_command](args.path)
    except OSError as err:  # unreadable directory, permissions: bad input, one line
        raise UsageError(f"{args.path}: {err}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-qa", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"elastic-qa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("prepare", help="build the pre-tokenised feature cache")
    _config_arguments(p)
    p = sub.add_parser("config", help="print the resolved config")
    shows = p.add_subparsers(dest="config_command", required=True, metavar="show")
    _config_arguments(shows.add_parser("show", help="the config after --config and the overrides, as YAML"))
    p = sub.add_parser("eval", help="EM/F1 of a checkpoint")
    p.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    p.add_argument("--data", help="SQuAD JSON to evaluate on (default: the run's evaluation split)")
    p = sub.add_parser("ask", help="answer one question from a context")
    p.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    p.add_argument("--context", required=True, help="the text to find the answer in")
    p.add_argument("--question", required=True, help="the question; the answer is a span of the context")
    p = sub.add_parser("ckpt", help="list, verify or show checkpoints")
    p.add_argument(
        "ckpt_command",
        choices=["list", "verify", "show"],
        help="list: one line each; verify: load every file (exit 1 if one is damaged); show: one in detail",
    )
    p.add_argument("path", help=CHECKPOINT_HELP)
    sub.add_parser("bench", help="benchmarks: throughput, checkpoint, resume, recovery, scaling, drift")
    sub.add_parser("chaos", help="break a job on purpose (run), check nothing was lost (verify), schedule")
    p = sub.add_parser("report", help="render a run into one self-contained HTML page")
    p.add_argument("run_dir", help="the run directory (run.dir)")
    p.add_argument("--out", help="output file (default RUN_DIR/report.html)")
    return parser


CHECKPOINT_HELP = (
    "a run directory or its checkpoints directory (the newest valid checkpoint), or one step-N directory"
)


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default="default", help="YAML file, or a packaged config: default, tiny, squad"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=200")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # before argparse, which would take `bench --help` for itself
        from elastic_qa.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["chaos"]:  # likewise: `elastic-qa chaos run --help`
        from elastic_qa.chaos.cli import main as chaos_main

        return chaos_main(argv[1:])
    args = build_parser().parse_args(argv)
    configure_terminal_logging()  # in-process warnings as sentences; no JSON lines beside the output
    try:
        if args.command == "report":
            from elastic_qa.observe.report import render_report

            out = render_report(Path(args.run_dir), Path(args.out) if args.out else None)
            print(out)
            return 0
        handler = {
            "prepare": cmd_prepare,
            "config": cmd_config,
            "eval": cmd_eval,
            "ask": cmd_ask,
            "ckpt": cmd_ckpt,
        }[args.command]
        return handler(args)
    except (UsageError, ConfigError, DataError, CheckpointError, FileNotFoundError) as err:
        print(f"elastic-qa: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
