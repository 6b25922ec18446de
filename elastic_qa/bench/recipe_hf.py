"""The HF side of the `recipe` benchmark: a plain transformers Trainer fine-tuning run, run_qa style.

    torchrun --standalone --nproc_per_node=2 -m elastic_qa.bench.recipe_hf --model-dir DIR \\
        --train train.json --eval eval.json --out hf.json --steps 300

AutoModelForQuestionAnswering from --model-dir (its own dropout), Trainer + TrainingArguments on CPU with
the gloo backend: AdamW, linear schedule after --warmup steps, no weight decay, max_grad_norm 1 (the
default), per-device batch = --global-batch / processes, a seeded data order, a loss logged every step,
nothing saved; DDP as the Trainer sets it up by default, which run_qa keeps (for a model without activation
checkpointing, find_unused_parameters=True: one more walk of the autograd graph a step). Then the held-out
windows are predicted (Trainer.predict, gathered over the ranks) and rank 0 post-processes them (recipe_qa)
and writes --out: per-step wall-clock times and losses, and per question the answer, best span and null
odds. The benchmark scores them; nothing here scores anything.

Needs `accelerate` (transformers' Trainer does); the benchmark checks for it before it starts this.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import (
    AutoModelForQuestionAnswering,
    AutoTokenizer,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from elastic_qa.bench.recipe_qa import (
    postprocess_qa_predictions,
    prepare_train_features,
    prepare_validation_features,
    read_squad_examples,
)
from elastic_qa.dist import exit_process

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class Windows(Dataset):
    """Tokenised windows as tensors, one dict per window (the columns the model takes)."""

    def __init__(self, features: dict[str, list[Any]], columns: tuple[str, ...]) -> None:
        self.columns = {name: torch.tensor(features[name]) for name in columns if name in features}

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: values[index] for name, values in self.columns.items()}


class StepClock(TrainerCallback):
    """Rank 0's wall-clock time when training begins and at the end of every optimizer step, and the loss
    logged at every step (the same clock as the product's `ts`)."""

    def __init__(self) -> None:
        self.begin_ts = 0.0
        self.step_ts: dict[int, float] = {}
        self.losses: dict[int, float] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.begin_ts = time.time()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step_ts[state.global_step] = time.time()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m elastic_qa.bench.recipe_hf", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--train", type=Path, required=True, help="SQuAD JSON to train on")
    parser.add_argument("--eval", type=Path, required=True, help="SQuAD JSON to predict")
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes its figures here")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--doc-stride", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--n-best", type=int, default=20)
    parser.add_argument("--max-answer-len", type=int, default=30)
    parser.add_argument("--eval-batch", type=int, default=64, help="windows per device per forward")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: cores / processes)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForQuestionAnswering.from_pretrained(args.model_dir)
    train_examples = read_squad_examples(args.train)
    eval_examples = read_squad_examples(args.eval)
    train_features = prepare_train_features(train_examples, tokenizer, args.max_seq_len, args.doc_stride)
    eval_features = prepare_validation_features(eval_examples, tokenizer, args.max_seq_len, args.doc_stride)

    training_args = TrainingArguments(
        output_dir=str(args.out.parent / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=args.global_batch // world,
        per_device_eval_batch_size=args.eval_batch,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=args.warmup,
        weight_decay=0.0,
        seed=args.seed,
        data_seed=args.seed,
        logging_strategy="steps",
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    clock = StepClock()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Windows(train_features, (*MODEL_INPUTS, "start_positions", "end_positions")),
        data_collator=default_data_collator,
        callbacks=[clock],
    )
    trainer.train()
    end_ts = time.time()
    # Gathered over the ranks, in window order, the padding of the last shard removed.
    output = trainer.predict(Windows(eval_features, MODEL_INPUTS))
    start_logits, end_logits = (np.asarray(x) for x in output.predictions)
    if trainer.is_world_process_zero():
        predictions = postprocess_qa_predictions(
            eval_examples, eval_features, start_logits, end_logits, args.n_best, args.max_answer_len
        )
        figures = {
            "world_size": world,
            "per_device_batch": args.global_batch // world,
            "train_windows": len(train_features["input_ids"]),
            "eval_windows": len(eval_features["input_ids"]),
            "train_begin_ts": clock.begin_ts,
            "train_end_ts": end_ts,
            "step_ts": clock.step_ts,
            "losses": clock.losses,
            "answers": {qid: p.answer for qid, p in predictions.items()},
            "spans": {qid: p.span for qid, p in predictions.items()},
            "null_odds": {qid: p.null_odds for qid, p in predictions.items()},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    exit_process(main())
