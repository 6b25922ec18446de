"""The two sides of the `recipe` benchmark: the data they share, how each is run, and how both are measured.

The data file is split by article into the files both sides read. The product runs under torchrun on its
packaged run_qa config (hf-base) and the overrides here; its per-question predictions come from its final
checkpoint. The HF side runs elastic_qa/bench/recipe_hf.py under the same torchrun and writes its own. One
scorer (the product's metrics) and one timing rule (median step time from rank 0's step end times) serve
both.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import BenchError, UsageError
from elastic_qa.bench.runs import NO_CHECKPOINTS, records_of, run_logged, torchrun, worker_env
from elastic_qa.data.examples import DataError, QAExample
from elastic_qa.metrics import best_thresholds, squad_v2_scores
from elastic_qa.observe.events import StepRecord, TrainDoneRecord, TrainStartRecord
from elastic_qa.prep.sources import parse_squad

PRODUCT_CONFIG = "hf-base"  # the product's packaged run_qa recipe, under the overrides below
MAX_ANSWER_LEN, N_BEST, NULL_THRESHOLD = 30, 20, 0.0  # run_qa's defaults, on both sides


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
    parts = {"train": articles[: args.train_articles], "eval": articles[args.train_articles : wanted]}
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / f"{name}.json" for name in parts}
    examples = {}
    for name, part in parts.items():
        try:  # the articles as they are (a malformed record is named by its place among them)
            parse_squad({"data": part}, f"--data {args.data} ({name} articles)")
        except DataError as err:
            raise UsageError(str(err)) from None
        if name == "train" and args.answerable_only_train:
            part = parts[name] = [_answerable_only(article) for article in part]
        part_document = {"version": document.get("version", ""), "data": part}
        try:
            examples[name], _ = parse_squad(part_document, str(paths[name]))
        except DataError:  # valid above: only the filter can have emptied it
            raise UsageError(f"--data {args.data}: no answerable question in the training articles") from None
        paths[name].write_text(json.dumps(part_document, ensure_ascii=False))
    info = {
        "file": str(args.data),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "train_titles": [a.get("title", "") for a in parts["train"]],
        "eval_titles": [a.get("title", "") for a in parts["eval"]],
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
    steps = records_of(run_dir, StepRecord)
    begin = records_of(run_dir, TrainStartRecord)
    done = records_of(run_dir, TrainDoneRecord)
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

    from elastic_qa.evaluation import predict
    from elastic_qa.export import load_for_prediction
    from elastic_qa.prep import prepare

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
