"""`elastic-qa export` of a trained transformers-family checkpoint: a directory transformers' own Auto
class loads, whose logits are the checkpoint's, and that `ask` answers from exactly as from the checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_qa.cli import main
from elastic_qa.export import load_checkpoint, load_for_prediction

transformers = pytest.importorskip("transformers")

CONTEXT = "bako lives in rome . bako owns a red car ."
QUESTION = "where does bako live ?"


def test_an_exported_hf_checkpoint_loads_in_transformers_and_answers_as_the_checkpoint(
    hf_models: dict[str, Path], tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "elastic_qa.train", "--config", "hf-tiny",
        f"model.name_or_path={hf_models['bert']}", f"run.dir={run_dir}", f"data.cache_dir={cache_dir}",
        "train.max_steps=4", "data.synthetic.train_examples=64", "data.synthetic.eval_examples=16",
        "log.console=none",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert not list(out.glob("*.bin"))  # no pickles
    # A class name transformers 4.x knows too (5.x calls a generic fast tokenizer TokenizersBackend).
    tokenizer_class = json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert tokenizer_class != "TokenizersBackend"

    checkpoint = load_checkpoint(str(run_dir))
    loaded = transformers.AutoModelForQuestionAnswering.from_pretrained(out)
    inner = {k.removeprefix("model."): v for k, v in checkpoint.model.items()}
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, inner[name]), name

    capsys.readouterr()
    replies = []
    for source in (str(run_dir), str(out)):
        args = ["ask", "--checkpoint", source, "--context", CONTEXT, "--question", QUESTION, "--json"]
        assert main([*args, "--null-threshold=1e9"]) == 0
        replies.append(json.loads(capsys.readouterr().out))
    assert replies[0] == replies[1] and replies[0]["answer"]
    assert load_for_prediction(str(out), torch.device("cpu")).cfg.model.kind == "hf"
