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
the one the BERT paper fine-tuned SQuAD v1.1 and v2.0 with, and TrainingArguments' default; the warm-up is
10% of the steps unless --warmup says otherwise.

Every figure of quality comes from one scorer, the product's elastic_qa/metrics.py (the official SQuAD v2
definitions), fed each side's per-question answers, best spans and null odds: the product's from its final
checkpoint (evaluate.predict), the HF side's from its post-processing. Speed: samples/s from the median
step time after the first --skip of the steps, from rank 0's per-step wall-clock times (the product's
`step` events, the HF side's TrainerCallback); training time from the start of training to its last step;
total time from launch to exit; CPU seconds of all the run's processes (getrusage of the children); the loss
at every step (a few points printed, every step in the JSON). Each run's predictions stay in its directory
(predictions.json: answers, best spans, null odds; kept with --work-dir). samples/s ratio: product over hf,
paired rep by rep. Goals: |EM diff| and |F1 diff| <= 1 point, product samples/s >= hf's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import (
    UsageError,
    alternate,
    choice_list,
    new_parser,
    positive_int,
    print_table,
    show,
    summary,
)
from elastic_qa.bench.recipe_sides import (
    MAX_ANSWER_LEN,
    N_BEST,
    NULL_THRESHOLD,
    PRODUCT_CONFIG,
    Split,
    product_overrides,
    run_hf,
    run_product,
    score,
    speed,
    split_articles,
)
from elastic_qa.bench.runs import bench_config, default_threads
from elastic_qa.metrics import squad_v2_scores

SIDES = ("product", "hf")
GOAL_POINTS = 1.0  # |EM diff| and |F1 diff|, in points


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
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=600,
        help="optimizer steps (600: 1.8 epochs of the 5,292 windows that the first 12 articles of CS224N's "
        "SQuAD 2.0 dev split give at the default lengths)",
    )
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
        # Paired rep by rep (the two runs of a rep are next to each other): a slow spell cancels out.
        ratios = [
            p / h
            for p, h in zip(product["samples_per_s"]["values"], hf["samples_per_s"]["values"], strict=True)
        ]
        ratio = statistics.median(ratios)
        result["comparison"] = {
            "em_diff": em_diff,
            "f1_diff": f1_diff,
            "samples_per_s_ratio": ratio,
            "samples_per_s_ratio_spread": summary(ratios),
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
    for run in sides.get("product", {}).get("runs", []):
        own, scores = run["own_eval"], run["scores"]
        if abs(own["em"] - scores["exact"]) > 0.01 or abs(own["f1"] - scores["f1"]) > 0.01:
            print(
                f"warning: the product run's own final evaluation (EM {own['em']:.2f} F1 {own['f1']:.2f}) "
                f"differs from its checkpoint's predictions (EM {scores['exact']:.2f} F1 {scores['f1']:.2f})"
            )
    if "comparison" in result:
        c = result["comparison"]
        print(f"product/hf samples/s: {show(c['samples_per_s_ratio_spread'])}")
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
    curves = {name: dict(side["runs"][0]["loss_curve"]) for name, side in sides.items()}
    print_table(
        ["loss at step", *(str(p) for p in points)],
        [
            [side, *(f"{curve[p]:.3f}" if p in curve else "-" for p in points)]
            for side, curve in curves.items()
        ],
    )
