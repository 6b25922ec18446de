"""`elastic-qa`: the commands around training.

    elastic-qa train [--config CFG] [overrides]        train in this one process (no torchrun)
    elastic-qa prepare [--config CFG] [--workers N] [overrides]   tokenise once into the memory-mapped cache
    elastic-qa config show [--config CFG] [overrides]   print the resolved config (YAML; for kind=hf, then
                                                        what differs from transformers' run_qa recipe)
    elastic-qa eval --checkpoint PATH [--data FILE] [--out DIR] [--null-threshold X] [--json]
                                                        SQuAD v2 scores; predictions.json, null_odds.json
    elastic-qa ask --checkpoint PATH --context TEXT --question TEXT [--json]
    elastic-qa export PATH --out DIR [--force] [--best] weights + config, no training state
    elastic-qa ckpt list|verify|show PATH               look at checkpoints without training
    elastic-qa bench NAME [...]                         benchmarks (`elastic-qa bench --help` lists them)
    elastic-qa chaos run|verify|schedule [...]          break a job on purpose, verify nothing was lost
    elastic-qa report RUN_DIR                           one self-contained HTML page of a run
    elastic-qa dashboard RUN_DIR [--port N]             the run report, live, in a browser (127.0.0.1)
    elastic-qa serve MODEL [--port N] [--max-batch N] [...]   answer questions over HTTP (JSON API, a page)
    elastic-qa node --endpoint HOST0:29400 --nnodes 1:4 --nproc-per-node N [--store-host] [...]
                                                        this host's part of a multi-node job (torchrun)
    elastic-qa node --replicas --group N --endpoint HOST0:29510 [--store-host] [...]
                                                        this host's replica group of a replica-group job

A checkpoint PATH is a run directory, its checkpoints directory (the newest valid checkpoint) or one
step-N directory. Elastic training: `launch/local.sh start` in a checkout (installed:
`python -m elastic_qa.launcher.local start`); `elastic-qa train` is `python -m elastic_qa.train` (its exit
codes: `elastic-qa train --help`). Exit codes: 0 ok, 1 a check failed (ckpt verify), 2 bad input, 141 the
output's reader left early (`| head`).
"""

# torch and the models are imported by the commands that use them: `prepare` and `config` start in a
# fraction of the second torch takes to import.

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_qa import __version__
from elastic_qa.argtypes import whole_number
from elastic_qa.checkpoint.errors import CheckpointError
from elastic_qa.config import Config, ConfigError, config_help, resolve_config
from elastic_qa.data.examples import DataError
from elastic_qa.exits import EXIT_BAD_INPUT, UsageError, quiet_when_stdout_closes, stdout_gone
from elastic_qa.observe.log import configure_terminal_logging
from elastic_qa.prep import Featurizer, prepare

if TYPE_CHECKING:
    import torch


def _device() -> torch.device:
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _featurizer(cfg: Config) -> Featurizer | None:
    """The model family's featurizer; None stands for the native one (prep.windows: no torch needed)."""
    if cfg.model.kind == "native":
        return None
    from elastic_qa.models import family_for

    return family_for(cfg.model)


def cmd_prepare(args: argparse.Namespace) -> int:
    cfg = resolve_config(args.config, args.overrides)
    started = time.perf_counter()
    try:
        data = prepare(cfg, _featurizer(cfg), workers=args.workers)
    except KeyboardInterrupt:  # a build in progress took its staging directory along: nothing half-made
        print("elastic-qa: prepare interrupted: no feature cache was published", file=sys.stderr)
        return 130
    skipped = sum(data.skipped.values())
    print(
        f"cache {data.path}: {len(data.train)} training windows, "
        f"{len(data.eval) if data.eval is not None else 0} evaluation windows"
        + (f", {skipped} malformed records skipped" if skipped else "")
        + f" ({time.perf_counter() - started:.2f}s)"
    )
    return 0


def _write_json(path: Path, value: Any) -> None:
    """Written aside and renamed into place: an interrupted write leaves the previous file whole."""
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps(value, ensure_ascii=False, indent=2) + "\n")
    staging.replace(path)


def cmd_eval(args: argparse.Namespace) -> int:
    from elastic_qa.evaluation import squad_v2_evaluation
    from elastic_qa.export import evaluation_data, load_for_prediction
    from elastic_qa.output_paths import refuse_managed_output, refuse_unwritable_output

    out = Path(args.out)
    refuse_unwritable_output(out, "--out")  # before the evaluation, not after it
    refuse_managed_output(out, "--out")
    device = _device()
    loaded = load_for_prediction(args.checkpoint, device)
    cfg = loaded.cfg
    threshold = cfg.eval.null_threshold if args.null_threshold is None else args.null_threshold
    examples, features = evaluation_data(args.data, loaded)
    scores, predictions = squad_v2_evaluation(loaded, examples, features, device, threshold)
    answers = {qid: p.answer for qid, p in predictions.items()}
    null_odds = {qid: p.null_odds for qid, p in predictions.items()}
    try:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "predictions.json", answers)
        _write_json(out / "null_odds.json", null_odds)
    except OSError as err:  # what the check above cannot see: a full disk, an ACL, a quota
        raise UsageError(f"--out {out}: cannot write {err.filename or out}: {err.strerror}") from None
    if args.json:
        print(json.dumps({"source": loaded.source, "step": loaded.step, "null_threshold": threshold,
                          "predictions": str(out / "predictions.json"),
                          "null_odds": str(out / "null_odds.json"), **scores}))  # fmt: skip
        return 0
    print(f"{loaded.source}: {scores['total']} questions, null threshold {threshold:g}")
    for prefix, name in (("", "all"), ("HasAns_", "HasAns"), ("NoAns_", "NoAns")):
        if f"{prefix}total" in scores:
            print(
                f"  {name:<7} EM {scores[prefix + 'exact']:6.2f}  F1 {scores[prefix + 'f1']:6.2f}"
                f"  ({scores[prefix + 'total']} questions)"
            )
    print(
        f"  best    EM {scores['best_exact']:6.2f} at null threshold {scores['best_exact_thresh']:g}"
        f"  F1 {scores['best_f1']:6.2f} at {scores['best_f1_thresh']:g}"
    )
    print(f"wrote {out / 'predictions.json'} and {out / 'null_odds.json'}")
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    from elastic_qa.evaluation import answer_questions, answer_record
    from elastic_qa.export import load_for_prediction

    device = _device()
    loaded = load_for_prediction(args.checkpoint, device)
    cfg = loaded.cfg
    threshold = cfg.eval.null_threshold if args.null_threshold is None else args.null_threshold
    [p] = answer_questions(loaded, [(args.question, args.context)], device, threshold)
    if args.json:
        print(json.dumps(answer_record(p, threshold), ensure_ascii=False))
        return 0
    print(p.answer if p.answer else "(no answer in the context)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from elastic_qa.export import export_checkpoint

    exported = export_checkpoint(args.checkpoint, Path(args.out), force=args.force, best=args.best)
    print(f"exported {exported.source} ({exported.cfg.model.kind} model) to {args.out}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from elastic_qa.run_qa_recipe import deviations_comment

    # Shown even while a setting that training needs is empty: seeing the config is how one fills it in.
    cfg = resolve_config(args.config, args.overrides, complete=False)
    print(cfg.to_yaml(), end="")
    if cfg.model.kind == "hf":
        print(deviations_comment(cfg), end="")
    unset = cfg.unset()
    if unset:
        print(f"elastic-qa: note: {unset} (training refuses this config until it is set)", file=sys.stderr)
    return 0


def cmd_ckpt(args: argparse.Namespace) -> int:
    from elastic_qa import ckpt as inspect

    handlers = {"list": inspect.cmd_list, "verify": inspect.cmd_verify, "show": inspect.cmd_show}
    try:
        return handlers[args.ckpt_command](args.path)
    except OSError as err:  # unreadable directory, permissions: bad input, one line
        if isinstance(err, BrokenPipeError) and stdout_gone():  # `| head` was done: not the path's fault
            raise
        raise UsageError(f"{args.path}: {err}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-qa", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"elastic-qa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("train", help="train in this one process, without torchrun (python -m elastic_qa.train)")
    p = sub.add_parser("prepare", help="build the pre-tokenised feature cache")
    _config_arguments(p)
    p.add_argument(
        "--workers",
        type=whole_number,
        help="tokenising processes (default data.prepare_workers: one per CPU core); same cache whatever N",
    )
    p = sub.add_parser("config", help="print the resolved config")
    shows = p.add_subparsers(dest="config_command", required=True, metavar="show")
    _config_arguments(shows.add_parser("show", help="the config after --config and the overrides, as YAML"))
    p = sub.add_parser("eval", help="SQuAD v2 EM/F1 of a model; writes predictions.json and null_odds.json")
    p.add_argument("--checkpoint", required=True, help=MODEL_HELP)
    p.add_argument("--data", help="SQuAD JSON to evaluate on (default: the run's evaluation split)")
    p.add_argument("--out", default=".", help="directory for predictions.json and null_odds.json (default .)")
    p.add_argument(
        "--null-threshold", type=float, help="no answer when null_odds exceed this (eval.null_threshold)"
    )
    p.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    p = sub.add_parser("ask", help="answer one question from a context")
    p.add_argument("--checkpoint", required=True, help=MODEL_HELP)
    p.add_argument("--context", required=True, help="the text to find the answer in")
    p.add_argument("--question", required=True, help="the question; the answer is a span of the context")
    p.add_argument(
        "--null-threshold", type=float, help="no answer when null_odds exceed this (eval.null_threshold)"
    )
    p.add_argument(
        "--json", action="store_true", help="answer, character span (end exclusive), score, null_odds"
    )
    p = sub.add_parser(
        "export", help="weights and config of a checkpoint, loadable without the training state"
    )
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument("--out", required=True, help="directory to create (must be empty or absent)")
    p.add_argument(
        "--force", action="store_true", help="replace a non-empty --out once the export is complete"
    )
    p.add_argument(
        "--best",
        action="store_true",
        help="the run's best checkpoint (checkpoint.keep_best) instead of its newest valid one",
    )
    p = sub.add_parser("ckpt", help="list, verify or show checkpoints")
    p.add_argument(
        "ckpt_command",
        choices=["list", "verify", "show"],
        help="list: one line each; verify: load every file (exit 1 if one is damaged); show: one in detail",
    )
    p.add_argument("path", help=CHECKPOINT_HELP)
    sub.add_parser(
        "bench", help="benchmarks: throughput, compile, checkpoint, resume, recovery, drift, serve, ..."
    )
    sub.add_parser("chaos", help="break a job on purpose (run), check nothing was lost (verify), schedule")
    sub.add_parser("serve", help="answer questions over HTTP: a JSON API and a page (docs/serve.md)")
    sub.add_parser("node", help="this host's part of a multi-node job (torchrun agent, store host, network)")
    sub.add_parser("replicas", help="replica groups that keep training through a fault (torchft; optional)")
    p = sub.add_parser("report", help="render a run into one self-contained HTML page")
    p.add_argument("run_dir", help="the run directory (run.dir)")
    p.add_argument("--out", help="output file (default RUN_DIR/report.html)")
    sub.add_parser("dashboard", help="the run report, live, in a browser (serves on 127.0.0.1)")
    return parser


CHECKPOINT_HELP = (
    "a run directory or its checkpoints directory (the newest valid checkpoint), or one step-N directory"
)
MODEL_HELP = CHECKPOINT_HELP + ", or a directory `elastic-qa export` wrote"


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default="default",
        help=config_help(),
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=200")


def main(argv: list[str] | None = None) -> int:
    """Every command; one whose stdout's reader left early ends quietly with 141 (exits.py)."""
    return quiet_when_stdout_closes(lambda: _command(sys.argv[1:] if argv is None else argv))


def _command(argv: list[str]) -> int:
    if argv[:1] == ["train"]:  # before argparse: its overrides and `--help` are the worker's own
        from elastic_qa.train import main as train_main

        return train_main(argv[1:], prog="elastic-qa train")
    if argv[:1] == ["bench"]:  # before argparse, which would take `bench --help` for itself
        from elastic_qa.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["node"] and "--replicas" in argv:  # one host's replica group (its own module)
        from elastic_qa.replica.node import main as replica_node_main

        return replica_node_main(argv[1:])
    if argv[:1] == ["node"]:  # likewise: its overrides and `--help` are its own
        from elastic_qa.launcher.node import main as node_main

        return node_main(argv[1:])
    if argv[:1] == ["replicas"]:  # likewise: its overrides and `--help` are its own
        from elastic_qa.replica.launch import main as replicas_main

        return replicas_main(argv[1:])
    if argv[:1] == ["serve"]:  # likewise: `elastic-qa serve --help`
        from elastic_qa.serve.cli import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["dashboard"]:  # likewise: its own parser, served until Ctrl-C
        from elastic_qa.report.dashboard import main as dashboard_main

        return dashboard_main(argv[1:])
    if argv[:1] == ["chaos"]:  # likewise: `elastic-qa chaos run --help`
        from elastic_qa.chaos.cli import main as chaos_main

        return chaos_main(argv[1:])
    args = build_parser().parse_args(argv)
    configure_terminal_logging()  # in-process warnings as sentences; no JSON lines beside the output
    try:
        if args.command == "report":
            from elastic_qa.output_paths import refuse_managed_output, refuse_unwritable_output
            from elastic_qa.report.page import render_report

            if args.out:
                refuse_managed_output(args.out, "--out")
            target = Path(args.out) if args.out else Path(args.run_dir) / "report.html"
            if target.is_dir():
                raise UsageError(f"--out {target}: is a directory; name the file to write")
            if args.out or target.parent.is_dir():  # (no run directory there: render_report says so)
                refuse_unwritable_output(target, "--out", in_parent=True)  # before the run is read
            out = render_report(Path(args.run_dir), target)
            print(out)
            return 0
        handler = {
            "prepare": cmd_prepare,
            "config": cmd_config,
            "eval": cmd_eval,
            "ask": cmd_ask,
            "export": cmd_export,
            "ckpt": cmd_ckpt,
        }[args.command]
        return handler(args)
    except (UsageError, ConfigError, DataError, CheckpointError, FileNotFoundError) as err:
        print(f"elastic-qa: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
