"""The freeze probe's answer travels in the checkpoint: a restart of the same model takes it instead of
probing again; another model, or a checkpoint without one, is probed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.payload import TRAINER_FILE
from elastic_qa.config import load_config, packaged_config
from elastic_qa.loop.freeze import ANSWER_KEY, known_frozen, model_identity, stored_answer
from elastic_qa.models import family_for
from elastic_qa.observe.follow import read_events
from tests.conftest import tiny_overrides

HF_TINY = ("train.max_steps=3", "train.threads=1", "checkpoint.async=false")


def hf_run(run_dir: Path, cache: Path, model: Path, *extra: str) -> None:
    overrides = tiny_overrides(run_dir, cache, f"model.name_or_path={model}", *HF_TINY, *extra)
    command = [sys.executable, "-m", "elastic_qa.train", "--config", "hf-tiny", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


def freezes(run_dir: Path) -> list[dict]:
    return [event for event in read_events(run_dir) if event["event"] == "frozen_parameters"]


def test_a_restart_takes_the_answer_from_the_checkpoint_and_another_model_setting_probes_again(
    tmp_path: Path, cache_dir: Path, hf_models: dict[str, Path]
) -> None:
    # One run and two restarts of it (these were two tests, each starting the same first run): the same
    # model takes the checkpoint's answer, another model setting probes again.
    hf_run(tmp_path, cache_dir, hf_models["bert"])
    hf_run(tmp_path, cache_dir, hf_models["bert"], "train.max_steps=5")
    first, restart = freezes(tmp_path)
    assert (first["source"], restart["source"]) == ("probe", "checkpoint")
    assert first["count"] == 4 and restart["names"] == first["names"]
    # What travelled: the answer in trainer.pt, loadable with weights_only like the rest of it.
    store = open_store(str(tmp_path / "checkpoints"))
    newest = store.list_steps()[-1].path
    trainer = store.load_file(newest, store.read_manifest(newest), TRAINER_FILE)
    assert trainer[ANSWER_KEY]["frozen"] == first["names"]
    # The restarted worker trained the same parameters: its optimizer state fits the frozen set.
    steps = [event["step"] for event in read_events(tmp_path) if event["event"] == "step"]
    assert steps[-1] == 5

    hf_run(tmp_path, cache_dir, hf_models["bert"], "train.max_steps=7", "model.dropout=0.0")
    assert [event["source"] for event in freezes(tmp_path)] == ["probe", "checkpoint", "probe"]


def test_a_stored_answer_counts_only_for_the_model_it_was_found_on(
    tmp_path: Path, cache_dir: Path, hf_models: dict[str, Path]
) -> None:
    cfg = load_config(
        packaged_config("hf-tiny"),
        tiny_overrides(tmp_path, cache_dir, f"model.name_or_path={hf_models['bert']}"),
    )
    family = family_for(cfg.model)
    model = family.build_model(cfg, family.tokenizer(cfg).vocab_size)
    names = [name for name, _ in model.named_parameters()]
    identity = model_identity(model, cfg)
    answer = {"identity": identity, "frozen": names[:2]}
    assert known_frozen(answer, identity, names) == names[:2]
    assert known_frozen({**answer, "identity": "0" * 64}, identity, names) is None
    assert known_frozen({**answer, "frozen": ["not.a.parameter"]}, identity, names) is None
    assert known_frozen(None, identity, names) is None  # a checkpoint written before answers travelled
    # Another architecture (roberta: other names and shapes): another identity.
    other = load_config(
        packaged_config("hf-tiny"),
        tiny_overrides(tmp_path, cache_dir, f"model.name_or_path={hf_models['roberta']}"),
    )
    torch.manual_seed(0)
    assert model_identity(family.build_model(other, family.tokenizer(other).vocab_size), other) != identity
    assert stored_answer(cfg) is None  # no checkpoint in this run
