"""Models for prediction: from a verified checkpoint or an exported directory, and export between the two.

`elastic-qa eval|ask|export` accept any of: a run directory (its checkpoints/, or checkpoint.dir from its
config.yaml), a checkpoint directory (the newest checkpoint that verifies), one step directory, or (eval
and ask) an exported directory. Checkpoint files load with weights_only=True after their manifest verifies.

An exported directory holds what the model family writes (the native family: model.safetensors; a
transformers family: what `save_pretrained` writes) plus two files of ours: the resolved config
(CONFIG_FILE) and EXPORT_FILE, naming the family, the step, the tokenizer settings and every file's
sha256, which loading checks. It is written aside and renamed into place, so a failed export leaves
nothing half-written under --out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from elastic_qa.checkpoint.locate import load_best_checkpoint, load_checkpoint, resolve_checkpoint_path
from elastic_qa.checkpoint.manager import LoadedCheckpoint
from elastic_qa.config import Config, ConfigError, DataConfig, config_from_dict, load_config
from elastic_qa.exits import UsageError
from elastic_qa.models import ModelFamily, family_for
from elastic_qa.output_paths import refuse_managed_output, refuse_unwritable_output
from elastic_qa.prep.wordpiece import materialise

if TYPE_CHECKING:
    from elastic_qa.data.examples import QAExample
    from elastic_qa.data.features import Features

EXPORT_FILE = "elastic_qa_export.json"
CONFIG_FILE = "elastic_qa_config.yaml"
EXPORT_FORMAT = 1


@dataclass
class PredictionModel:
    """A model in eval mode, the config it predicts with, its family, and where it came from."""

    model: nn.Module
    cfg: Config
    family: ModelFamily
    source: str  # e.g. "checkpoint runs/x/checkpoints/step-00000030 (step 30)"
    step: int


def model_from_checkpoint(loaded: LoadedCheckpoint, device: torch.device) -> PredictionModel:
    """The checkpoint's model in eval mode on `device`, with the config it was trained with."""
    try:
        cfg = with_stored_vocabulary(config_from_dict(loaded.trainer["config"]), loaded.trainer)
        family = family_for(cfg.model)
    except (ConfigError, KeyError, TypeError) as err:
        raise UsageError(f"{loaded.path}: the config stored in the checkpoint is not usable: {err}") from None
    model = family.build_model(cfg, family.tokenizer(cfg).vocab_size)
    try:
        model.load_state_dict(loaded.model)
    except RuntimeError as err:
        raise UsageError(f"{loaded.path}: model weights do not fit the stored config: {err}") from None
    # Checkpoints load to the CPU; moved here to wherever we run, so GPU-trained ones work anywhere.
    source = f"checkpoint {loaded.path} (step {loaded.step})"
    return PredictionModel(model.to(device).eval(), cfg, family, source, loaded.step)


def with_stored_vocabulary(cfg: Config, trainer: dict[str, Any]) -> Config:
    """`cfg` reading the vocabulary the checkpoint carries (wordpiece), saved content-addressed under
    data.cache_dir: the feature cache that trained it may be gone, or on another machine."""
    vocabulary = trainer.get("vocabulary")
    if cfg.data.tokenizer != "wordpiece" or not isinstance(vocabulary, str):
        return cfg
    try:
        path = materialise(vocabulary, Path(cfg.data.cache_dir).expanduser())
    except OSError:  # the training machine's directory: this one's default will do
        try:
            path = materialise(vocabulary, Path(DataConfig().cache_dir).expanduser())
        except OSError as err:
            raise UsageError(f"cannot store the checkpoint's vocabulary: {err}") from None
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, vocab_file=str(path)))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_exported(directory: Path, device: torch.device) -> PredictionModel:
    """An exported directory's model, after checking every file against the recorded sha256."""
    try:
        record = json.loads((directory / EXPORT_FILE).read_text())
        files, step = dict(record["files"]), int(record["step"])
        if CONFIG_FILE not in files:
            raise ValueError(f"it lists no {CONFIG_FILE}")
        if record["format"] != EXPORT_FORMAT:
            raise ValueError(f"format {record['format']!r}, this version reads {EXPORT_FORMAT}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{directory / EXPORT_FILE}: not a usable export record: {err}") from None
    for name, digest in files.items():
        path = directory / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not path.is_file():
            raise UsageError(f"{directory}: exported file {name!r} is missing")
        if _sha256(path) != digest:
            raise UsageError(f"{path}: does not match its sha256 in {EXPORT_FILE} (damaged or edited)")
    cfg = load_config(directory / CONFIG_FILE)
    family = family_for(cfg.model)
    try:
        model, cfg = family.load_export(cfg, directory)
    except (OSError, RuntimeError, ValueError) as err:
        raise UsageError(f"{directory}: the exported model does not load: {err}") from None
    return PredictionModel(
        model.to(device).eval(), cfg, family, f"exported model {directory} (step {step})", step
    )


def load_for_prediction(path: str, device: torch.device) -> PredictionModel:
    """An exported directory, or the checkpoint `path` resolves to (see the module docstring)."""
    if (Path(path) / EXPORT_FILE).is_file():
        return load_exported(Path(path), device)
    return model_from_checkpoint(load_checkpoint(path), device)


def _empty_or_absent(out: Path) -> bool:
    return not out.exists() or (out.is_dir() and not any(out.iterdir()))


def export_checkpoint(path: str, out: Path, force: bool = False, best: bool = False) -> PredictionModel:
    """Write the model of the checkpoint `path` resolves to (with `best`: the run's best checkpoint, see
    checkpoint/best.py) into `out` (see the module docstring).

    A non-empty `out` is refused unless `force`; even then it is replaced only once the new export is
    complete.
    """
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    refuse_unwritable_output(out, "--out", in_parent=True)  # made beside it: before the checkpoint is read
    if not force and not _empty_or_absent(out):
        raise UsageError(f"--out {out}: not empty (pass --force to replace it)")
    if "://" not in path and Path(path).resolve().is_relative_to(out.resolve()):
        raise UsageError(
            f"--out {out}: holds the checkpoint being exported ({path}); choose another directory"
        )
    refuse_managed_output(out, "--out", [resolve_checkpoint_path(path).directory])
    checkpoint = load_best_checkpoint(path) if best else load_checkpoint(path)
    loaded = model_from_checkpoint(checkpoint, torch.device("cpu"))
    out = out.absolute()
    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        loaded.family.export(loaded.model, loaded.cfg, staging)
        _follow_umask(staging)
        (staging / CONFIG_FILE).write_text(loaded.cfg.to_yaml())
        record: dict[str, Any] = {
            "format": EXPORT_FORMAT,
            "kind": loaded.cfg.model.kind,
            "step": loaded.step,
            "source": loaded.source,
            "tokenizer": loaded.family.cache_identity(loaded.cfg),
            "files": {
                str(p.relative_to(staging)): _sha256(p) for p in sorted(staging.rglob("*")) if p.is_file()
            },
        }
        (staging / EXPORT_FILE).write_text(json.dumps(record, indent=2) + "\n")
        _publish(staging, out)
    except OSError as err:
        raise UsageError(f"--out {out}: cannot write the export: {err}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return loaded


def _follow_umask(directory: Path) -> None:
    """Give what the model family wrote the modes the umask asks for, as docs/evaluation.md promises:
    safetensors writes its file through a private temporary file (0600), whatever the umask."""
    umask = os.umask(0)
    os.umask(umask)  # read, not changed: there is no call that only reads it
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)
        elif path.is_dir() and not path.is_symlink():
            path.chmod(0o777 & ~umask)


def _publish(staging: Path, out: Path) -> None:
    """Rename the finished export into place; what `out` held goes only after that rename."""
    if not out.exists():
        staging.rename(out)
        return
    previous = out.parent / f".{out.name}.previous-{os.getpid()}"
    out.rename(previous)
    try:
        staging.rename(out)
    except OSError:
        previous.rename(out)
        raise
    shutil.rmtree(previous, ignore_errors=True)


def evaluation_data(path: str | None, loaded: PredictionModel) -> tuple[Sequence[QAExample], Features]:
    """The questions to evaluate `loaded` on (`elastic-qa eval`, elastic_qa.evaluate): a SQuAD file's, or
    (None) the evaluation split of the data the model was trained on."""
    from elastic_qa.prep import prepare
    from elastic_qa.prep.sources import read_squad

    cfg, family = loaded.cfg, loaded.family
    if path:
        examples, _ = read_squad(path, cfg.data.skip_malformed)
        return examples, family.features(examples, cfg)
    data = prepare(cfg, family)
    if data.eval is None:
        raise UsageError(f"{loaded.source}: its data has no evaluation split: pass --data FILE")
    return data.eval_examples, data.eval
