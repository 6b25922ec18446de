"""recipe: the product's fine-tuning of a pretrained encoder against a plain transformers Trainer script.

Both sides train the same saved encoder (--model-dir) on the same articles and predict the same held-out
articles: --data is split BY ARTICLE (the first --train-articles train, the next --eval-articles are held
out), written to the work directory, and both sides read those files. The product runs
`torchrun -m elastic_qa.train` (its own windows, loop and evaluation; the recipe settings below); the HF side
runs elastic_qa/bench/recipe_hf.py, transformers' Trainer as the run_qa example uses it. Both run under
torchrun with --processes gloo ranks and the same threads per process, alternately (--reps).

Recipe on both sides: AdamW, linear warm-up over --warmup steps then linear decay to 0 at --steps, no weight
decay, gradient norm clipped at 1, the model's own dropout, --global-batch windows per step, --max-seq-len
tokens per window sharing --doc-stride tokens, questions not cut, answers of at most 30 tokens from the 20
best start and end candidates per window, no answer when the null odds exceed 0. The default --lr, 5e-5, is
TrainingArguments' default and the top of the BERT paper's fine-tuning grid (2e-5..5e-5): a short run of
a small encoder wants the top of it.

Every figure of quality comes from one scorer, the product's elastic_qa/metrics.py (the official SQuAD v2
definitions), fed each side's per-question answers, best spans and null odds: the product's from its final
checkpoint (evaluate.predict), the HF side's from its post-processing. Speed: samples/s from the median
step time after the first --skip of the steps, from rank 0's per-step wall-clock times (the product's
`step` events, the HF side's TrainerCallback); training time from the start of training to its last step;
total time from launch to exit; CPU seconds of all the run's processes (getrusage of the children).
Goals: |EM diff| and |F1 diff| <= 1 point, product samples/s >= hf's.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import (
    BenchError,
    UsageError,
    alternate,
    choice_list,
    new_parser,
    positive_int,
    print_table,
    show,
    summary,
)
from elastic_qa.bench.runs import (
    NO_CHECKPOINTS,
    bench_config,
    default_threads,
    events_of,
    run_logged,
    torchrun,
    worker_env,
)
from elastic_qa.data.squad import DataError, QAExample, parse_squad
from elastic_qa.metrics import best_thresholds, squad_v2_scores

SIDES = ("product", "hf")
PRODUCT_CONFIG = "hf-base"  # the product's packaged run_qa recipe, under the overrides below
GOAL_POINTS = 1.0  # |EM diff| and |F1 diff|, in points
MAX_ANSWER_LEN, N_BEST, NULL_THRESHOLD = 30, 20, 0.0  # run_qa's defaults, on both sides


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("recipe", __doc__, reps=1)
    parser.add_argument("--model-dir", type=Path, required=True, help="saved transformers encoder")
    parser.add_argument("--data", type=Path, required=True, help="SQuAD 2.0 JSON file to split by article")
    parser.add_argument("--train-articles", type=positive_int, default=12, help="articles to train on (12)")
    parser.add_argument(
        "--eval-articles", type=positive_int, default=4, help="held-out articles after them (4)"
    )
    parser.add_argument(
        "--answerable-only-train", action="store_true", help="drop unanswerable questions from training"
    )
    parser.add_argument("--steps", type=positive_int, default=600, help="optimizer steps (600)")
    parser.add_argument("--global-batch", type=positive_int, default=16, help="windows per step (16)")
    parser.add_argument("--max-seq-len", type=positive_int, default=256, help="tokens per window (256)")
    parser.add_argument("--doc-stride", type=int, default=64, help="tokens shared by windows (64)")
    parser.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (5e-5)")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default: 10%% of --steps)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of both sides (1234)")
    parser.add_argument("--processes", type=positive_int, default=2, help="ranks per side, gloo (2)")
    parser.add_argument("--threads", type=positive_int, help="threads per process (default: cores / ranks)")
    parser.add_argument("--sides", type=choice_list(SIDES), default=list(SIDES), help="product,hf")
    parser.add_argument("--skip", type=float, default=0.1, help="share of steps left out as warm-up (0.1)")
    parser.add_argument(
        "--run-timeout", type=float, default=7200.0, help="seconds one side's run may take (7200)"
    )
    return parser


# ---- the data: split by article ----------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    train: Path
    eval: Path
    eval_examples: list[QAExample]
    info: dict[str, Any]  # what the JSON records about the data


def split_articles(args: argparse.Namespace, out: Path) -> Split:
    """The first --train-articles articles (optionally answerable questions only) and the next
    --eval-articles, written as SQuAD JSON under `out`."""
    try:
        raw = args.data.read_bytes()
        document = json.loads(raw)
    except OSError as err:
        raise UsageError(f"--data {args.data}: cannot read ({err.strerror or err})") from None
    except ValueError as err:
        raise UsageError(f"--data {args.data}: not JSON ({err})") from None
    articles = document.get("data") if isinstance(document, dict) else None
    if not isinstance(articles, list) or not all(isinstance(a, dict) for a in articles):
        raise UsageError(f"--data {args.data}: not SQuAD JSON (expected an object with a 'data' list)")
    wanted = args.train_articles + args.eval_articles
    if len(articles) < wanted:
        raise UsageError(
            f"--data {args.data}: {len(articles)} articles, fewer than --train-articles + --eval-articles "
            f"= {wanted}"
        )
    train, held_out = articles[: args.train_articles], articles[args.train_articles : wanted]
    if args.answerable_only_train:
        train = [_answerable_only(article) for article in train]
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.json", "eval": out / "eval.json"}
    examples = {}
    for name, part in (("train", train), ("eval", held_out)):
        part_document = {"version": document.get("version", ""), "data": part}
        try:
            examples[name], _ = parse_squad(part_document, f"--data {args.data} ({name} articles)")
        except DataError as err:
            raise UsageError(str(err)) from None
        paths[name].write_text(json.dumps(part_document, ensure_ascii=False))
    info = {
        "file": str(args.data),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "train_titles": [a.get("title", "") for a in train],
        "eval_titles": [a.get("title", "") for a in held_out],
        "answerable_only_train": args.answerable_only_train,
        **{f"{name}_questions": _counts(part) for name, part in examples.items()},
    }
    return Split(paths["train"], paths["eval"], examples["eval"], info)


def _answerable_only(article: dict[str, Any]) -> dict[str, Any]:
    paragraphs = [
        {**p, "qas": [q for q in p.get("qas", []) if q.get("answers")]} for p in article.get("paragraphs", [])
    ]
    return {**article, "paragraphs": [p for p in paragraphs if p["qas"]]}


def _counts(examples: list[QAExample]) -> dict[str, int]:
    answerable = sum(1 for e in examples if e.answers)
    return {"total": len(examples), "answerable": answerable, "unanswerable": len(examples) - answerable}


# ---- one side's run ----------------------------------------------------------------------------------
@dataclass
class SideRun:
    """What one run of one side gave: rank 0's step times and losses, and per-question predictions."""

    begin_ts: float  # training starts
    step_ts: dict[int, float]  # step -> end-of-step wall-clock time
    losses: dict[int, float]
    answers: dict[str, str]  # at the null threshold
    spans: dict[str, str]  # best span whatever the threshold (best-threshold search)
    null_odds: dict[str, float]
    total_s: float  # launch to exit
    cpu_s: float  # user + system seconds of all the run's processes
    extra: dict[str, Any]


def timed(name: str, command: list[str], log: Path, threads: int, timeout: float) -> tuple[float, float]:
    """run_logged, with its wall-clock and CPU seconds (every process of the run: torchrun reaps its
    workers, so their usage reaches this process's children total)."""
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    run_logged(name, command, log, worker_env(threads), timeout)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - started
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def product_overrides(args: argparse.Namespace, split: Split, cache: Path, warmup: int) -> list[str]:
    """The recipe in the product's config keys, over its packaged run_qa config (hf-base), which keeps one
    deliberate difference: train.freeze_loss_invariant (see that file). Data loads in the training process
    on both sides (the Trainer's default: no loader workers)."""
    return [
        f"model.name_or_path={args.model_dir.resolve()}",
        "model.dropout=null",
        f"data.source={split.train}",
        f"data.eval_source={split.eval}",
        f"data.cache_dir={cache}",
        "data.num_workers=0",
        f"data.max_seq_len={args.max_seq_len}",
        f"data.doc_stride={args.doc_stride}",
        "data.max_query_len=0",
        f"data.max_answer_len={MAX_ANSWER_LEN}",
        f"eval.n_best={N_BEST}",
        f"eval.null_threshold={NULL_THRESHOLD}",
        f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.global_batch}",
        f"train.lr={args.lr}",
        "train.lr_scaling=none",
        "train.lr_schedule=linear",
        f"train.warmup_steps={warmup}",
        "train.min_lr_ratio=0",
        "train.weight_decay=0",
        "train.grad_clip=1.0",
        f"train.max_steps={args.steps}",
        f"run.seed={args.seed}",
        "train.eval_every=0",
        "dist.backend=gloo",
        "log.every_steps=1",
        "log.console=none",
        NO_CHECKPOINTS,
    ]


def run_product(
    args: argparse.Namespace, split: Split, run_dir: Path, threads: int, base: list[str]
) -> SideRun:
    overrides = [*base, f"run.dir={run_dir}", f"train.threads={threads}"]
    command = torchrun(args.processes, "elastic_qa.train", ["--config", PRODUCT_CONFIG, *overrides])
    total_s, cpu_s = timed(
        f"product run {run_dir.name}", command, run_dir / "output.log", threads, args.run_timeout
    )
    steps = events_of(run_dir, "step")
    begin = events_of(run_dir, "train_start")
    done = events_of(run_dir, "train_done")
    if not begin or not done:
        raise BenchError(f"product run {run_dir.name}: no train_start/train_done event (logs: {run_dir})")
    started = time.perf_counter()
    predictions = product_predictions(run_dir)
    own = {"em": 100 * done[-1].get("em", math.nan), "f1": 100 * done[-1].get("f1", math.nan)}
    return SideRun(
        begin[-1]["ts"],
        {row["step"]: row["ts"] for row in steps},
        {row["step"]: row["loss"] for row in steps},
        {qid: p.answer for qid, p in predictions.items()},
        {qid: p.span for qid, p in predictions.items()},
        {qid: p.null_odds for qid, p in predictions.items()},
        total_s,
        cpu_s,
        {"own_eval": own, "offline_predict_s": time.perf_counter() - started},
    )


def product_predictions(run_dir: Path) -> dict[str, Any]:
    """Every held-out question's prediction from the run's final checkpoint, as `elastic-qa eval` makes
    them (the run's own final evaluation logs only its scores)."""
    import torch

    from elastic_qa.data.cache import prepare
    from elastic_qa.evaluate import predict
    from elastic_qa.export import load_for_prediction

    device = torch.device("cpu")
    loaded = load_for_prediction(str(run_dir), device)
    cfg = loaded.cfg
    data = prepare(cfg, loaded.family)
    assert data.eval is not None  # the run's config names data.eval_source
    result = predict(
        loaded.model, loaded.family, data.eval, data.eval_examples, cfg.train.eval_batch_size,
        cfg.data.max_answer_len, device, n_best=cfg.eval.n_best, null_threshold=cfg.eval.null_threshold,
    )  # fmt: skip
    assert result is not None  # not in a process group: this process is rank 0
    return result[0]


def run_hf(args: argparse.Namespace, split: Split, run_dir: Path, threads: int, warmup: int) -> SideRun:
    out = run_dir / "hf.json"
    options = {
        "--model-dir": args.model_dir.resolve(),
        "--train": split.train,
        "--eval": split.eval,
        "--out": out,
        "--steps": args.steps,
        "--global-batch": args.global_batch,
        "--max-seq-len": args.max_seq_len,
        "--doc-stride": args.doc_stride,
        "--lr": args.lr,
        "--warmup": warmup,
        "--seed": args.seed,
        "--n-best": N_BEST,
        "--max-answer-len": MAX_ANSWER_LEN,
        "--threads": threads,
    }
    flat = [str(part) for pair in options.items() for part in pair]
    command = torchrun(args.processes, "elastic_qa.bench.recipe_hf", flat)
    total_s, cpu_s = timed(
        f"hf run {run_dir.name}", command, run_dir / "output.log", threads, args.run_timeout
    )
    got = json.loads(out.read_text())
    return SideRun(
        got["train_begin_ts"],
        {int(step): ts for step, ts in got["step_ts"].items()},
        {int(step): loss for step, loss in got["losses"].items()},
        got["answers"],
        got["spans"],
        got["null_odds"],
        total_s,
        cpu_s,
        {"train_windows": got["train_windows"], "eval_windows": got["eval_windows"]},
    )


# ---- scoring and timing: the same code for both sides ------------------------------------------------
def score(run: SideRun, golds: dict[str, list[str]]) -> dict[str, float]:
    """Official SQuAD v2 scores at the null threshold, and the best thresholds over each question's best
    span (as `elastic-qa eval` searches them)."""
    missing = sorted(set(golds) - set(run.answers))
    if missing or set(run.answers) - set(golds):
        raise BenchError(f"predictions do not cover the held-out questions exactly (e.g. {missing[:1]})")
    scores = squad_v2_scores(run.answers, golds)
    scores.update(best_thresholds(run.spans, golds, run.null_odds))
    return scores


def speed(run: SideRun, steps: int, skip: float, batch: int) -> dict[str, float]:
    """samples/s from the median step time after the first `skip` of the steps, and training seconds."""
    first = max(1, math.ceil(skip * steps))
    missing = [s for s in range(first, steps + 1) if s not in run.step_ts]
    if missing or first >= steps:
        raise BenchError(
            f"no step time for step {missing[0] if missing else steps} ({len(run.step_ts)} logged)"
        )
    step_s = statistics.median(run.step_ts[s] - run.step_ts[s - 1] for s in range(first + 1, steps + 1))
    return {
        "samples_per_s": batch / step_s,
        "median_step_s": step_s,
        "train_s": run.step_ts[steps] - run.begin_ts,
        "total_s": run.total_s,
        "cpu_s": run.cpu_s,
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    if not 0 <= args.skip < 1:
        raise UsageError(f"--skip {args.skip}: must be in [0, 1)")
    if args.global_batch % args.processes:
        raise UsageError(
            f"--global-batch {args.global_batch} must be divisible by --processes {args.processes}"
        )
    if args.steps < 2 or max(1, math.ceil(args.skip * args.steps)) >= args.steps:
        raise UsageError(f"--steps {args.steps}: too few for a step time after --skip {args.skip}")
    warmup = round(0.1 * args.steps) if args.warmup is None else args.warmup
    if not 0 <= warmup <= args.steps:
        raise UsageError(f"--warmup {warmup}: must be in [0, --steps]")
    if not (args.model_dir / "config.json").is_file():
        raise UsageError(f"--model-dir {args.model_dir}: not a saved transformers model (no config.json)")
    sides, skipped = list(args.sides), {}
    if "hf" in sides and importlib.util.find_spec("accelerate") is None:
        skipped["hf"] = "accelerate is not installed (transformers' Trainer needs it: pip install accelerate)"
        sides.remove("hf")
        print(f"[recipe] hf side skipped: {skipped['hf']}")
    split = split_articles(args, work / "data")
    threads = args.threads or default_threads(args.processes)
    base = product_overrides(args, split, work / "feature-cache", warmup)
    if "product" in sides:
        started = time.perf_counter()
        bench_config(PRODUCT_CONFIG, base)  # the feature cache, built before any timed run
        prepare_s = time.perf_counter() - started
    golds = {e.id: [a.text for a in e.answers] for e in split.eval_examples}
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for rep, side in alternate(args.reps, sides):
        print(f"[recipe] rep {rep + 1}/{args.reps}: {side} ...", flush=True)
        run_dir = work / f"{side}-{rep}"
        got = (
            run_product(args, split, run_dir, threads, base)
            if side == "product"
            else run_hf(args, split, run_dir, threads, warmup)
        )
        predictions = {"answers": got.answers, "spans": got.spans, "null_odds": got.null_odds}
        (run_dir / "predictions.json").write_text(json.dumps(predictions, ensure_ascii=False))
        runs[side].append(
            {
                "predictions": str(run_dir / "predictions.json"),
                "scores": score(got, golds),
                **speed(got, args.steps, args.skip, args.global_batch),
                "loss_curve": [[step, got.losses[step]] for step in sorted(got.losses)],
                **got.extra,
            }
        )
    result = summarise(args, split, runs, skipped, threads, warmup, base)
    if "product" in sides:
        result["settings"]["product_prepare_s"] = prepare_s
    report(result)
    return result


def summarise(
    args: argparse.Namespace,
    split: Split,
    runs: dict[str, list[dict[str, Any]]],
    skipped: dict[str, str],
    threads: int,
    warmup: int,
    base: list[str],
) -> dict[str, Any]:
    golds = {e.id: [a.text for a in e.answers] for e in split.eval_examples}
    figures = ("samples_per_s", "median_step_s", "train_s", "total_s", "cpu_s")
    keys = ("exact", "f1", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1", "best_exact", "best_f1")
    sides: dict[str, dict[str, Any]] = {
        side: {
            **{name: summary([r[name] for r in rows]) for name in figures},
            **{
                key: summary([r["scores"][key] for r in rows])
                for key in keys
                if all(key in r["scores"] for r in rows)  # HasAns/NoAns: when the held-out set has any
            },
            "runs": rows,
        }
        for side, rows in runs.items()
    }
    result: dict[str, Any] = {
        "benchmark": "recipe",
        "settings": {
            "model_dir": str(args.model_dir),
            "steps": args.steps,
            "global_batch": args.global_batch,
            "max_seq_len": args.max_seq_len,
            "doc_stride": args.doc_stride,
            "lr": args.lr,
            "warmup": warmup,
            "seed": args.seed,
            "processes": args.processes,
            "threads_per_process": threads,
            "skip": args.skip,
            "reps": args.reps,
            "max_answer_len": MAX_ANSWER_LEN,
            "n_best": N_BEST,
            "null_threshold": NULL_THRESHOLD,
            "product_overrides": base,
        },
        "data": split.info,
        "no_answer_baseline": squad_v2_scores(dict.fromkeys(golds, ""), golds),
        "sides": sides,
        "skipped": skipped,
    }
    if {"product", "hf"} <= set(sides):
        product, hf = sides["product"], sides["hf"]
        em_diff = product["exact"]["median"] - hf["exact"]["median"]
        f1_diff = product["f1"]["median"] - hf["f1"]["median"]
        ratio = product["samples_per_s"]["median"] / hf["samples_per_s"]["median"]
        result["comparison"] = {
            "em_diff": em_diff,
            "f1_diff": f1_diff,
            "samples_per_s_ratio": ratio,
            "goal_quality_met": abs(em_diff) <= GOAL_POINTS and abs(f1_diff) <= GOAL_POINTS,
            "goal_speed_met": ratio >= 1.0,
        }
    return result


def report(result: dict[str, Any]) -> None:
    sides = result["sides"]
    rows = [
        ("EM", "exact", ".2f"),
        ("F1", "f1", ".2f"),
        ("HasAns EM", "HasAns_exact", ".2f"),
        ("HasAns F1", "HasAns_f1", ".2f"),
        ("NoAns EM", "NoAns_exact", ".2f"),
        ("best EM", "best_exact", ".2f"),
        ("best F1", "best_f1", ".2f"),
        ("samples/s", "samples_per_s", ".2f"),
        ("train s", "train_s", ".1f"),
        ("total s", "total_s", ".1f"),
        ("CPU s (all processes)", "cpu_s", ".1f"),
    ]
    print_table(
        ["", *sides],
        [
            [label, *(show(s[key], spec) if key in s else "-" for s in sides.values())]
            for label, key, spec in rows
        ],
    )
    baseline = result["no_answer_baseline"]
    print(f"all-no-answer baseline on the held-out set: EM {baseline['exact']:.2f}  F1 {baseline['f1']:.2f}")
    print_loss_points(sides, result["settings"]["steps"])
    if "comparison" in result:
        c = result["comparison"]
        print(f"product/hf samples/s: {c['samples_per_s_ratio']:.3f}")
        verdict = "met" if c["goal_quality_met"] else "NOT met"
        print(
            f"goal |EM diff| <= {GOAL_POINTS:g} and |F1 diff| <= {GOAL_POINTS:g}: "
            f"{abs(c['em_diff']):.2f}, {abs(c['f1_diff']):.2f} ({verdict})"
        )
        verdict = "met" if c["goal_speed_met"] else "NOT met"
        print(f"goal product samples/s >= hf's: {c['samples_per_s_ratio']:.3f} ({verdict})")


def print_loss_points(sides: dict[str, Any], steps: int) -> None:
    """The first run's loss at a few steps per side (the JSON keeps every step of every run)."""
    points = sorted({1, *(max(1, round(steps * share)) for share in (0.25, 0.5, 0.75)), steps})
    curves = {side: dict((int(s), v) for s, v in s_["runs"][0]["loss_curve"]) for side, s_ in sides.items()}
    print_table(
        ["loss at step", *(str(p) for p in points)],
        [
            [side, *(f"{curve[p]:.3f}" if p in curve else "-" for p in points)]
            for side, curve in curves.items()
        ],
    )
