"""The elastic guarantees for pretrained transformers models (model.kind=hf): real torchrun agents and kills.

Tiny random BERT- and RoBERTa-style models (built at test time) through the packaged hf-tiny config. The
BERT runs keep transformers' dropout on: a worker killed and resumed at the same world size must still
reproduce the fault-free run bit for bit, which only holds if the per-step seeding reaches the model's own
dropout. The RoBERTa runs (no token types) train with dropout off across a change of world size.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_qa.chaos.job import Job
from elastic_qa.observe.follow import read_events
from tests.integration.test_elastic import (
    assert_nothing_lost,
    checked_final_parameters,
    finish,
    held_at,
    join_while_held,
    world_sizes,
)

pytestmark = pytest.mark.integration

STEPS = 30


def hf_overrides(cache: Path, model_dir: Path, *extra: str) -> list[str]:
    return [
        f"data.cache_dir={cache}",
        f"model.name_or_path={model_dir}",
        f"train.max_steps={STEPS}",
        "train.threads=1",
        "debug.sample_ledger=true",
        "log.every_steps=1",
        "log.console=none",
        "checkpoint.every_steps=10",
        *extra,
    ]


def hf_job(run_dir: Path, cache: Path, model_dir: Path, *extra: str, agents: int = 2) -> Job:
    job = Job(run_dir, "hf-tiny", hf_overrides(cache, model_dir, *extra), agents=agents)
    job.start()
    return job


def fault_free(run_dir: Path, cache: Path, model_dir: Path, *extra: str) -> dict[str, torch.Tensor]:
    assert finish(hf_job(run_dir, cache, model_dir, *extra)) == 0
    return checked_final_parameters(run_dir, STEPS)


@pytest.fixture(scope="module")
def bert_reference(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path, hf_models: dict) -> dict:
    """Two agents, BERT style, dropout 0.1, no fault."""
    return fault_free(
        tmp_path_factory.mktemp("bert-reference"), cache_dir, hf_models["bert"], "model.dropout=0.1"
    )


def test_a_killed_worker_of_an_hf_model_with_dropout_resumes_bitwise(
    tmp_path: Path, cache_dir: Path, hf_models: dict, bert_reference: dict
) -> None:
    run_dir = tmp_path / "run"
    job = hf_job(
        run_dir,
        cache_dir,
        hf_models["bert"],
        "model.dropout=0.1",
        "debug.kill_at_step=15",
        "debug.kill_rank=1",
    )
    assert finish(job) == 0
    result = assert_nothing_lost(
        run_dir, bert_reference, max_lost=1, restarts=1, bitwise=True, max_steps=STEPS
    )
    assert world_sizes(result["events"]) == [2, 2]
    frozen = [e for e in result["events"] if e["event"] == "frozen_parameters"]
    assert frozen and frozen[0]["count"] == 4  # 2 key biases, the QA bias, the last LayerNorm bias


def fault_free_in_one_process(
    run_dir: Path, cache: Path, model_dir: Path, *extra: str
) -> dict[str, torch.Tensor]:
    """The same training without torchrun, one process (world size 1): with dropout off the trajectory
    does not depend on the world size, so a job that changes it must match this within 1e-4, as it must a
    fault-free torchrun job's, which costs a launcher, two agents and their workers more."""
    overrides = [f"run.dir={run_dir}", *hf_overrides(cache, model_dir, *extra)]
    command = [sys.executable, "-m", "elastic_qa.train", "--config", "hf-tiny", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return checked_final_parameters(run_dir, STEPS)


def test_an_agent_joining_an_hf_run_grows_the_world_and_matches_the_fault_free_run(
    tmp_path: Path, cache_dir: Path, hf_models: dict
) -> None:
    reference = fault_free_in_one_process(
        tmp_path / "reference", cache_dir, hf_models["roberta"], "model.dropout=0.0"
    )
    run_dir = tmp_path / "run"
    hold, hold_dir = held_at(run_dir, 2)
    job = hf_job(run_dir, cache_dir, hf_models["roberta"], "model.dropout=0.0", hold, agents=1)
    join_while_held(job, hold_dir, 2)  # the job cannot end before the second agent is admitted
    assert finish(job) == 0
    result = assert_nothing_lost(run_dir, reference, max_lost=0, restarts=1, max_steps=STEPS)
    assert world_sizes(result["events"]) == [1, 2]
    model_pt = next((run_dir / "checkpoints").glob("step-*/model.pt"))
    state = torch.load(model_pt, weights_only=True)
    assert any(name.startswith("model.roberta.") for name in state)
    done = [e for e in read_events(run_dir) if e["event"] == "train_done" and e["rank"] == 0]
    assert done and 0.0 <= done[0]["em"] <= 1.0
