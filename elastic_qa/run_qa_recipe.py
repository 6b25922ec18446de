"""The reference recipe for fine-tuning a pretrained encoder (model.kind=hf), in this package's settings, and
the settings of a config that differ from it (`elastic-qa config show` lists them: none is silent).

The recipe is transformers' examples/pytorch/question-answering/run_qa.py: its argument defaults, those of
TrainingArguments (Trainer: AdamW, linear decay to 0 after a warm-up of 0 steps, weight decay 0, gradient
norm clipped at 1.0, fp32, every parameter trained), and the learning rate and batch of its README's SQuAD
example (--learning_rate 3e-5, --per_device_train_batch_size 12 on one GPU). run_qa counts epochs
(--num_train_epochs 2 in that example); the hf-base config counts train.max_steps (train.epochs=2 with
train.max_steps=0 is the same length); settings without a counterpart there are not compared.
"""

from __future__ import annotations

from typing import Any

import yaml

from elastic_qa.config import Config

RUN_QA: dict[str, Any] = {
    "model.dropout": None,  # the pretrained config's own dropout probabilities
    "data.max_seq_len": 384,
    "data.doc_stride": 128,
    "data.max_query_len": 0,  # the question is never cut
    "data.max_answer_len": 30,
    "train.global_batch_size": 12,
    "train.lr": 3e-5,
    "train.lr_scaling": "none",
    "train.lr_schedule": "linear",
    "train.warmup_steps": 0,
    "train.min_lr_ratio": 0.0,
    "train.weight_decay": 0.0,
    "train.grad_clip": 1.0,
    "train.freeze_loss_invariant": False,
    "train.precision": "fp32",
    "eval.n_best": 20,
    "eval.null_threshold": 0.0,  # --null_score_diff_threshold
}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def deviations(cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, value here, run_qa's value) for every recipe setting this config sets otherwise."""
    here = _flat(cfg.to_dict())
    return [(key, here[key], value) for key, value in RUN_QA.items() if here[key] != value]


def _shown(value: Any, key: str = "") -> str:
    if value is None and key == "model.dropout":
        return "null (the model's own)"
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def deviations_comment(cfg: Config) -> str:
    """The deviations as a YAML comment block (to follow the config's YAML), one line each."""
    found = deviations(cfg)
    if not found:
        return "# every setting of transformers' run_qa.py recipe is as run_qa sets it\n"
    lines = ["# differs from transformers' run_qa.py recipe (key: value here, recipe's value):"]
    lines += [f"#   {key}: {_shown(mine, key)}, recipe {_shown(theirs, key)}" for key, mine, theirs in found]
    return "\n".join(lines) + "\n"
