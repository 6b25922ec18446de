"""The best evaluation so far, which checkpoint holds it, and when evaluations stop improving (early stop).

Every evaluation is observed here, on every rank alike (rank 0's scores travel to the others first). The
tracker is part of the training state (trainer.pt, key "best"), so the best value, its step and the count of
evaluations without improvement survive any resume. Each checkpoint's manifest carries:

    "eval": {"step", "em", "f1"}            the scores of this very state, when it was evaluated at its step
    "best": {"metric", "value", "step"}     the best evaluation as of this state (checkpoint.keep_best)

The checkpoint named by the newest committed manifest's "best" is the run's best: the rotation never prunes
it (manager.py), and a better one replaces it only once the better one is committed and verified, because
the pointer moves only with a commit. A crash before that commit leaves the old pointer, and the old best,
in place. A save of a new best that fails (a storage error, training goes on) leaves the evaluation without
its checkpoint: later manifests then go on naming the best the store holds (manager.py), never a step that
is not there.

Improvement: a score above the best so far is a new best; only one above best + early_stop_min_delta
resets the early-stop count. Scores are fractions (EM and F1 in [0, 1]).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elastic_qa.checkpoint.store import CheckpointStore
from elastic_qa.config import CheckpointConfig


class BestTracker:
    """Best evaluation so far (checkpoint.keep_best), the last evaluation, and the early-stop count."""

    def __init__(self, cfg: CheckpointConfig) -> None:
        self.metric = cfg.keep_best  # "none": only the last evaluation is tracked
        self.patience = cfg.early_stop_patience
        self.min_delta = cfg.early_stop_min_delta
        self.value: float | None = None
        self.step: int | None = None
        self.stale_evals = 0  # evaluations since the last improvement by more than min_delta
        self.last: dict[str, float] | None = None  # {"step", "em", "f1", "loss"} of the last evaluation

    @property
    def keeps_best(self) -> bool:
        return self.metric != "none"

    def observe(self, step: int, scores: Mapping[str, float]) -> bool:
        """Record an evaluation of the state at `step`; whether it is a new best."""
        self.last = {"step": step, **{key: float(scores[key]) for key in ("em", "f1", "loss")}}
        if not self.keeps_best:
            return False
        score = float(scores[self.metric])
        if self.value is not None and score <= self.value + self.min_delta:
            self.stale_evals += 1
        else:
            self.stale_evals = 0
        if self.value is not None and score <= self.value:
            return False
        self.value, self.step = score, step
        return True

    @property
    def exhausted(self) -> bool:
        """Early stopping is due: `patience` evaluations in a row without improvement."""
        return self.keeps_best and self.patience > 0 and self.stale_evals >= self.patience

    def scores_at(self, step: int) -> dict[str, float] | None:
        """The last evaluation's scores if it evaluated the state at `step`."""
        if self.last is None or int(self.last["step"]) != step:
            return None
        return {key: value for key, value in self.last.items() if key != "step"}

    def manifest_fields(self, step: int) -> dict[str, Any]:
        """What the manifest of checkpoint `step` records (see the module docstring)."""
        fields: dict[str, Any] = {}
        scores = self.scores_at(step)
        if scores is not None:
            fields["eval"] = {"step": step, "em": scores["em"], "f1": scores["f1"]}
        if self.keeps_best and self.step is not None:
            fields["best"] = {"metric": self.metric, "value": self.value, "step": self.step}
        return fields

    # ---- Stateful -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "value": self.value,
            "step": self.step,
            "stale_evals": self.stale_evals,
            "last": dict(self.last) if self.last else None,
        }

    def load_state_dict(self, saved: Mapping[str, Any] | None) -> None:
        """Restore; a checkpoint from before the tracker existed holds none. A best of another metric
        (keep_best changed on resume) starts over: its value does not compare with this metric's."""
        if not saved:
            return
        last = saved.get("last")
        self.last = {key: float(value) for key, value in last.items()} if last else None
        if saved.get("metric") != self.metric:
            return
        value, step = saved.get("value"), saved.get("step")
        self.value = None if value is None else float(value)
        self.step = None if step is None else int(step)
        self.stale_evals = int(saved.get("stale_evals", 0))


def best_of(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """The manifest's well-formed "best" record ({"metric", "value", "step"}), or None."""
    best = manifest.get("best")
    if not isinstance(best, dict):
        return None
    step, value, metric = best.get("step"), best.get("value"), best.get("metric")
    if type(step) is not int or step < 0 or not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if metric not in ("em", "f1"):
        return None
    return {"metric": metric, "value": float(value), "step": step}


def best_step(manifest: Mapping[str, Any]) -> int | None:
    """The step of the best checkpoint as of the checkpoint holding `manifest` (None: none recorded)."""
    best = best_of(manifest)
    return None if best is None else int(best["step"])


def best_record(store: CheckpointStore) -> dict[str, Any] | None:
    """The run's best checkpoint as the newest committed manifest that reads names it ({"metric", "value",
    "step"}), or None when that manifest names none."""
    for info in reversed(store.list_steps()):
        try:
            manifest = store.read_manifest(info.path)
        except (OSError, ValueError):
            continue
        return best_of(manifest)
    return None
