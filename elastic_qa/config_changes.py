"""What changed between the config a checkpoint was trained with and the config resuming it, and what the
change does; and settings that are valid but almost certainly not what the user meant.

Every checkpoint stores its resolved config. On resume:
    shape changes (model.kind and the model's dimensions, the tokenizer and its vocabulary) are refused:
        the weights cannot be loaded into the new model, or would mean something else (a wordpiece
        vocabulary is compared by content, wherever it comes from: see state.TrainState.load_state_dict)
    a change of the training data that changes its number of windows is refused: the data position
        is a count of windows consumed and would point nowhere meaningful
    other changes are allowed, listed (the `config_changed` event and one console line each) with the
        effect documented in EFFECTS
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_qa.config import LR_SCHEDULE_BEFORE_THE_KEY, Config
from elastic_qa.run_length import end_step, length_text

# model.* fields that do not change what the weights are; every other model field is a shape.
_MODEL_NOT_SHAPE = frozenset({"model.dropout", "model.grad_checkpointing"})
_DATA_SHAPE = frozenset({"data.tokenizer", "data.vocab_size", "data.lowercase"})
# Where things are, not what is trained: a run resumed from another path is the same run.
_IGNORED = frozenset(
    {"run.dir", "checkpoint.dir", "checkpoint.resume_from", "data.cache_dir", "train.compile_cache_dir"}
)
# What a checkpoint written before these keys existed was trained with: a resume that sets another value
# changes something, unlike a key the checkpoint merely predates.
_BEFORE_THE_KEY: dict[tuple[str, str], Any] = {("train", "lr_schedule"): LR_SCHEDULE_BEFORE_THE_KEY}

_SCHEDULE = "the learning rate keeps its position: from its value at the checkpoint"
_NEW_DATA = (
    "other training windows, as many as before (another count is refused): the data position (windows "
    "consumed in the epoch) points into the new ones"
)
EFFECTS: dict[str, str] = {
    "train.max_steps": f"{_SCHEDULE} it decays to train.min_lr_ratio x lr at the new train.max_steps "
    "(constant: stays there)",
    "train.epochs": "the end is resolved anew: train.epochs x ceil(training windows / global_batch_size) "
    f"steps from the run's start; {_SCHEDULE} it decays to train.min_lr_ratio x lr at that step",
    "train.lr_schedule": f"{_SCHEDULE} it follows the new shape to train.min_lr_ratio x lr at "
    "train.max_steps (constant: stays there)",
    "train.warmup_steps": "counts only while still warming up; past warm-up the decay goes on unchanged",
    "train.min_lr_ratio": f"{_SCHEDULE} it decays to the new floor at train.max_steps",
    "train.lr": "the learning rate is rescaled by the new peak from the resumed step on",
    "train.lr_scaling": "the peak learning rate changes from the resumed step on",
    "train.reference_batch_size": "the peak learning rate changes from the resumed step on (lr_scaling)",
    "train.global_batch_size": "steps from now on take the new batch; the data position is kept",
    "run.seed": "the order of the current epoch changes: its remaining samples are drawn from another "
    "permutation (some seen twice, some not at all this epoch)",
    "data.source": _NEW_DATA,
    "data.max_seq_len": _NEW_DATA,
    "data.max_query_len": _NEW_DATA,
    "data.doc_stride": _NEW_DATA,
    "checkpoint.keep_best": "none: no best is kept from now on (the rotation prunes the old one); another "
    "metric: the best starts over at the next evaluation",
    "data.vocab_file": "none if it holds the checkpoint's vocabulary (compared by content: another is "
    "refused)",
    "train.compile": "the same steps computed by other kernels: from the resumed step on the parameters "
    "differ from those of a run that kept the setting, by rounding",
}
DEFAULT_EFFECT = "applies from the resumed step on"


@dataclass(frozen=True)
class ConfigChange:
    key: str  # dotted, e.g. train.max_steps
    old: Any
    new: Any
    shape: bool  # the checkpoint's weights do not fit (or mean something else): refused

    @property
    def effect(self) -> str:
        if self.shape:
            return "the checkpoint's weights do not fit the new model"
        if self.key in EFFECTS:
            return EFFECTS[self.key]
        if self.key.startswith("data.synthetic."):
            return _NEW_DATA
        return DEFAULT_EFFECT

    def describe(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}: {self.effect}"


def is_shape(key: str) -> bool:
    return (key.startswith("model.") and key not in _MODEL_NOT_SHAPE) or key in _DATA_SHAPE


def config_changes(saved: dict[str, Any], current: Config) -> list[ConfigChange]:
    """The differences between a checkpoint's stored config and `current`, shape changes first."""
    for (section, key), value in _BEFORE_THE_KEY.items():
        if isinstance(saved.get(section), dict) and key not in saved[section]:
            saved = {**saved, section: {**saved[section], key: value}}
    changes = [
        ConfigChange(key, old, new, is_shape(key))
        for key, old, new in _differences(saved, current.to_dict(), "")
        if key not in _IGNORED
    ]
    return sorted(changes, key=lambda change: not change.shape)


def refusal(changes: list[ConfigChange], where: str) -> str | None:
    """The sentence refusing a resume across shape changes, or None when there are none."""
    shapes = [change for change in changes if change.shape]
    if not shapes:
        return None
    listed = "; ".join(f"{c.key}: {c.old!r} -> {c.new!r}" for c in shapes)
    return (
        f"the checkpoint in {where} was trained with another model shape ({listed}): it cannot be "
        "resumed with this config; keep those settings, or use a new run.dir to train from scratch"
    )


def data_refusal(changes: list[ConfigChange], saved_windows: int, windows: int, where: str) -> str | None:
    """The sentence refusing a resume whose training data has another number of windows, or None.

    The data position is a count of windows consumed in the epoch's permutation of all windows: with
    another count it points nowhere meaningful, and exactly-once would silently become neither."""
    if saved_windows == windows:
        return None
    data = [c for c in changes if c.key.startswith("data.")]
    listed = "; ".join(f"{c.key}: {c.old!r} -> {c.new!r}" for c in data) or "the data under the same settings"
    return (
        f"the checkpoint in {where} was trained on {saved_windows} training windows, this data makes "
        f"{windows} ({listed}): its data position cannot carry over; resume with the data it was trained "
        "on, or use a new run.dir to train from scratch"
    )


def suspicious_settings(cfg: Config, train_windows: int) -> list[str]:
    """Valid settings that are very likely mistakes, one sentence each (warned about once at start)."""
    train = cfg.train
    found = []
    end = end_step(train, train_windows)
    if train.warmup_steps >= end:
        found.append(
            f"train.warmup_steps={train.warmup_steps} >= {length_text(train, end)}: the run ends "
            "before warm-up does, so the learning rate never reaches train.lr"
        )
    if train.global_batch_size > train_windows:
        found.append(
            f"train.global_batch_size={train.global_batch_size} is larger than the {train_windows} training "
            "windows: every step takes the whole epoch, with fewer samples than the batch size"
        )
    best = cfg.checkpoint.keep_best
    if best != "none" and not train.eval_every:
        found.append(
            f"checkpoint.keep_best={best} with train.eval_every=0: only the final evaluation is scored, so "
            "the best checkpoint is the final one and early stopping never happens"
        )
    return found


def _differences(old: Any, new: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    """Keys in both trees whose values differ. A key only one side has is left out: a checkpoint written
    before a field existed did not choose a value for it."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in (k for k in new if k in old):
            name = f"{prefix}.{key}" if prefix else str(key)
            found += _differences(old[key], new[key], name)
        return found
    return [] if old == new else [(prefix, old, new)]
