"""The Python API: train, answer and score from a script or a notebook.

    import elastic_qa
    run = elastic_qa.fit("tiny", overrides={"train.max_steps": 50}, run={"dir": "runs/notebook"})
    answers = elastic_qa.predict(run.checkpoint, [("where does bako live ?", "bako lives in rome .")])
    scores = elastic_qa.evaluate(run.checkpoint, "dev-v2.0.json")

`fit(agents=0)` trains in this process, as `elastic-qa train` does; `fit(agents=N)` starts the local launcher
with N torchrun agents, as `make run` does. `predict` and `evaluate` are `elastic-qa ask` and `elastic-qa
eval` on a model loaded once. Errors are exceptions, never an exit: ConfigError (a bad config or override),
DataError, ResumeError (a checkpoint that does not fit), UsageError (no model at that path), TrainingFailed
(a job under agents that failed: its exit code and its last line), FitInProgress (a second fit(agents=0)
while one trains in this process). torch is imported by the calls that need it, not by `import elastic_qa`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_qa.config import Config, ConfigError, config_from_dict, resolve_config
from elastic_qa.exits import UsageError

ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | Config
# The launcher's lines kept to say why a job under agents failed.
KEPT_LINES = 20


class FitInProgress(RuntimeError):
    """fit(agents=0) while another fit trains in this process: the log configuration, the umask and torch's
    threads it sets are the process's, so a second run would write its lines into the first one's log."""

    def __init__(self, run_dir: str) -> None:
        super().__init__(
            f"run {run_dir} is already training in this process (fit with agents=0, from another thread); "
            "one at a time: wait for it to return, or train this run with agents=N (its own processes) or "
            "from a second Python process"
        )
        self.run_dir = run_dir


# The run directory of the fit(agents=0) training in this process, if any (see FitInProgress).
_training: str | None = None
_training_lock = threading.Lock()


class TrainingFailed(RuntimeError):
    """A job under agents ended without finishing: its launcher's exit code and last line."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(f"the job failed (launcher exit code {exit_code}): {message}")
        self.exit_code = exit_code


@dataclass(frozen=True)
class FitResult:
    """What a `fit` left: where the run is, the step it reached, its final evaluation and its model."""

    run_dir: Path
    step: int  # the last step trained (the final one unless `stopped`)
    metrics: dict[str, float]  # the final evaluation: em and f1 (fractions), eval_loss; {} without eval data
    checkpoint: str | None  # the newest committed checkpoint (a step directory), for predict and evaluate
    export: Path | None  # the exported model, when fit was given `export=`
    stopped: bool  # a signal (Ctrl-C, a notebook's interrupt) stopped it early; it saved first
    config: Config = field(repr=False)  # the resolved config it trained with

    @property
    def em(self) -> float | None:
        return self.metrics.get("em")

    @property
    def f1(self) -> float | None:
        return self.metrics.get("f1")


@dataclass(frozen=True)
class Answer:
    """One question's answer: `elastic-qa ask --json`'s fields."""

    text: str  # "" when no_answer
    start: int | None  # the answer's characters in the context, end exclusive; None when no_answer
    end: int | None
    score: float  # the best span's start+end logit
    null_odds: float  # the no-answer score minus `score`: above the null threshold means no answer
    no_answer: bool
    best_span: str  # the best span's text whatever the threshold ("" when the context has none)
    best_start: int | None  # its characters (None when there is none)
    best_end: int | None


def build_config(
    config: ConfigSource | None = None,
    overrides: Mapping[str, Any] | None = None,
    sections: Mapping[str, Any] | None = None,
) -> Config:
    """The resolved config: `config` (a YAML path, a packaged name such as `tiny` or `hf-base`, a dict of
    sections or a Config; None: `default`), then `overrides` ({"train.max_steps": 50}), then `sections`
    ({"train": {"max_steps": 50}}), validated; ConfigError names a bad key or value."""
    changes = {**_plain(overrides or {}), **_flatten(sections or {}, "")}
    if config is None:
        config = "default"
    if isinstance(config, Config):
        return config_from_dict(config.to_dict(), changes)
    if isinstance(config, Mapping):
        return config_from_dict(dict(config), changes)
    return resolve_config(os.fspath(config), changes)


def _plain(value: Any) -> Any:
    """Paths as the strings the config holds."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _flatten(sections: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in sections.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        elif not prefix:
            raise ConfigError(
                f"{name}={value!r}: a section takes a dict of its keys, e.g. train={{'max_steps': 50}}"
            )
        else:
            flat[name] = _plain(value)
    return flat


def fit(
    config: ConfigSource | None = None,
    *,
    agents: int = 0,
    overrides: Mapping[str, Any] | None = None,
    export: str | os.PathLike[str] | None = None,
    **sections: Mapping[str, Any],
) -> FitResult:
    """Train `config` (see build_config; sections as keywords: `train={"max_steps": 50}`) to its end.

    agents=0: in this process (world size 1, no process group), as `elastic-qa train`; a stop signal (Ctrl-C,
    a notebook's interrupt) saves and returns with `stopped`. agents=N: the local launcher with N torchrun
    agents, as `make run`; its output is printed here. A run directory holding checkpoints resumes from them.
    `export`: an empty or absent directory to export the final model to.
    """
    if not isinstance(agents, int) or isinstance(agents, bool) or agents < 0:
        raise ValueError(f"agents={agents!r}: 0 (this process) or a number of torchrun agents >= 1")
    cfg = build_config(config, overrides, sections)
    target = Path(export) if export is not None else None
    if target is not None and target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"export={target}: not an empty directory (said before training, not after)")
    if agents == 0:
        with _training_alone(cfg.run.dir):
            step, metrics, stopped = _fit_here(cfg)
    else:
        step, metrics, stopped = _fit_with_agents(cfg, agents)
    checkpoint = _newest_checkpoint(cfg.checkpoint_dir)
    exported = None
    if target is not None and not stopped and checkpoint is not None:
        from elastic_qa.export import export_checkpoint

        export_checkpoint(checkpoint, target)
        exported = target
    return FitResult(Path(cfg.run.dir), step, metrics, checkpoint, exported, stopped, cfg)


@contextlib.contextmanager
def _training_alone(run_dir: str) -> Iterator[None]:
    """This process's only in-process fit until it returns; FitInProgress if another one is training."""
    global _training
    with _training_lock:
        if _training is not None:
            raise FitInProgress(_training)
        _training = run_dir
    try:
        yield
    finally:
        with _training_lock:
            _training = None


def _fit_here(cfg: Config) -> tuple[int, dict[str, float], bool]:
    """Train in this process; what the process had of its own (umask, torch threads, logging) is put back."""
    import torch

    from elastic_qa import train
    from elastic_qa.dist import denormals_flushed
    from elastic_qa.observe.log import configure_terminal_logging

    umask = os.umask(0o022)
    os.umask(umask)  # read, not changed (run.private changes it for the run)
    threads = torch.get_num_threads()
    flushed = denormals_flushed()  # this thread's flag (train.flush_denormals sets it for the run)
    try:
        result = train.run(cfg)
    finally:
        os.umask(umask)
        torch.set_num_threads(threads)
        torch.set_flush_denormal(flushed)
        configure_terminal_logging()  # later warnings (predict's) go to stderr, not into the run's log
    metrics = {"em": result["em"], "f1": result["f1"], "eval_loss": result["loss"]} if "em" in result else {}
    return int(result["step"]), metrics, bool(result["stopped"])


def _fit_with_agents(cfg: Config, agents: int) -> tuple[int, dict[str, float], bool]:
    """The local launcher with `agents` agents, on the resolved config written into the run directory."""
    from elastic_qa.launcher.local import train_done
    from elastic_qa.launcher.processes import python_env, tied_to_this_process

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir.absolute() / "fit-config.yaml"  # what the agents' workers load (join reads it too)
    descriptor = os.open(
        config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if cfg.run.private else 0o666
    )
    with os.fdopen(descriptor, "w") as handle:
        handle.write(cfg.to_yaml())
    command = [sys.executable, "-m", "elastic_qa.launcher.local", "start", "--agents", str(agents)]
    command += ["--max", str(agents), "--config", str(config_file)]
    started = time.time()
    # Its own session: a notebook's interrupt reaches this process only, which passes it on (below).
    launcher = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=python_env(),
        start_new_session=True,
        preexec_fn=tied_to_this_process(),  # the job stops (saving) if this process dies
    )
    assert launcher.stdout is not None
    last: collections.deque[str] = collections.deque(maxlen=KEPT_LINES)
    try:
        _relay(launcher.stdout, last)
    except KeyboardInterrupt:  # as Ctrl-C to the launcher: every agent saves its step, then stops
        launcher.send_signal(signal.SIGINT)
        _relay(launcher.stdout, last)
    code = launcher.wait()
    done = train_done(run_dir, started) if code == 0 else None
    # Stopped and saved: by a signal (128 + its number), or by `launch/local.sh stop` (0, no train_done).
    if code in (0, 128 + signal.SIGINT, 128 + signal.SIGTERM) and done is None:
        return _newest_step(cfg.checkpoint_dir) or 0, {}, True
    if done is None:
        said = [line for line in last if line.startswith("elastic-qa:")]
        raise TrainingFailed(code, (said or list(last) or ["no output"])[-1].strip())
    metrics: dict[str, float] = {k: float(done[k]) for k in ("em", "f1", "eval_loss") if k in done}
    return int(done["step"]), metrics, False


def _relay(lines: Iterable[str], last: collections.deque[str]) -> None:
    for line in lines:
        sys.stdout.write(line)
        sys.stdout.flush()
        last.append(line)


def _newest_step(checkpoint_dir: str) -> int | None:
    from elastic_qa.launcher.terminal import newest_saved_step

    return newest_saved_step(checkpoint_dir)


def _newest_checkpoint(checkpoint_dir: str) -> str | None:
    """The newest committed step directory, as the user would write it (None: none)."""
    from elastic_qa.checkpoint.backends import open_store

    store = open_store(checkpoint_dir)
    steps = store.list_steps()
    return store.display(steps[-1].path) if steps else None


def _loaded(model: str | os.PathLike[str]) -> Any:
    import torch

    from elastic_qa.export import load_for_prediction

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return load_for_prediction(os.fspath(model), device), device


def predict(
    model: str | os.PathLike[str],
    questions: Sequence[Mapping[str, str] | tuple[str, str]],
    *,
    null_threshold: float | None = None,
) -> list[Answer]:
    """Answer each question from its context, in order, with a model loaded once (a run directory, a
    checkpoints directory, a step directory or an export). `questions`: {"question", "context"} dicts or
    (question, context) pairs. `null_threshold` defaults to the model's eval.null_threshold."""
    from elastic_qa.evaluation import answer_questions, answer_record

    pairs = [_pair(i, item) for i, item in enumerate(questions)]
    if not pairs:
        return []
    loaded, device = _loaded(model)
    threshold = loaded.cfg.eval.null_threshold if null_threshold is None else null_threshold
    answers = []
    for p in answer_questions(loaded, pairs, device, threshold):
        record = answer_record(p, threshold)
        best = record["best_span"] or {"text": "", "start": None, "end": None}
        answer = Answer(
            record["answer"], record["start"], record["end"], record["score"], record["null_odds"],
            not record["answer"], best["text"], best["start"], best["end"],
        )  # fmt: skip
        answers.append(answer)
    return answers


def _pair(index: int, item: Any) -> tuple[str, str]:
    question: Any = None
    context: Any = None
    if isinstance(item, Mapping):
        question, context = item.get("question"), item.get("context")
    elif isinstance(item, tuple | list) and len(item) == 2:
        question, context = item
    if not isinstance(question, str) or not isinstance(context, str):
        raise ValueError(
            f"questions[{index}]={item!r}: expected a {{'question': str, 'context': str}} dict or a "
            "(question, context) pair"
        )
    return question, context


def evaluate(
    model: str | os.PathLike[str],
    data: str | os.PathLike[str] | None = None,
    *,
    null_threshold: float | None = None,
) -> dict[str, Any]:
    """`elastic-qa eval --json`'s scores of a model on a SQuAD v1.1/v2.0 file (None: the evaluation split of
    the data it was trained on): exact and f1 (percentages) and total, the same by HasAns and NoAns, the
    best null thresholds; with `source`, `step` and `null_threshold`."""
    from elastic_qa.evaluation import squad_v2_evaluation
    from elastic_qa.export import evaluation_data

    loaded, device = _loaded(model)
    threshold = loaded.cfg.eval.null_threshold if null_threshold is None else null_threshold
    examples, features = evaluation_data(os.fspath(data) if data is not None else None, loaded)
    scores, _ = squad_v2_evaluation(loaded, examples, features, device, threshold)
    return {"source": loaded.source, "step": loaded.step, "null_threshold": threshold, **scores}
