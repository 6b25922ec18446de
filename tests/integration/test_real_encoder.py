"""The elastic guarantees on a real pretrained encoder (opt-in: minutes of CPU per test).

    EQA_REAL_ENCODER=DIR [EQA_REAL_SQUAD=FILE] pytest -m long tests/integration/test_real_encoder.py

DIR is a save_pretrained BERT-style directory (e.g. all-MiniLM-L6-v2, 22M parameters); FILE a SQuAD JSON,
of which the first TRAIN_ARTICLES articles are the training data (without it: the synthetic set). The same
checks as test_elastic_hf's tiny models, with real windows (128 tokens, stride 32, global batch 8):
a worker SIGKILLed mid-run with dropout 0.1 resumes to the fault-free run's weights bit for bit (beside a
surviving peer, which saves at the kill; and alone, replaying the steps since the last checkpoint); an agent
joining (1 -> 2) and then leaving on SIGTERM (2 -> 1) loses no sample and no step and ends within 1e-4 of
the fault-free 2-rank run. Skipped unless EQA_REAL_ENCODER is set.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from elastic_qa.chaos.job import Job
from elastic_qa.config import resolve_config
from elastic_qa.models import family_for
from elastic_qa.prep import prepare
from elastic_qa.step_holds import arm, release
from tests.integration.test_elastic import assert_nothing_lost, checked_final_parameters, finish, world_sizes

ENCODER = os.environ.get("EQA_REAL_ENCODER", "")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.long,
    pytest.mark.skipif(not ENCODER, reason="EQA_REAL_ENCODER (a pretrained model directory) is not set"),
]

STEPS = 20
TRAIN_ARTICLES = 2
JOB_TIMEOUT = 1200  # seconds: 2 ranks of a 22M-parameter encoder on a shared 2-core machine
STEP_TIMEOUT = 600


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> str:
    squad = os.environ.get("EQA_REAL_SQUAD", "")
    if not squad:
        return "synthetic"
    full = json.loads(Path(squad).read_text(encoding="utf-8"))
    train = tmp_path_factory.mktemp("squad") / "train.json"
    train.write_text(json.dumps({"version": full.get("version", ""), "data": full["data"][:TRAIN_ARTICLES]}))
    return str(train)


def settings(cache: Path, source: str) -> list[str]:
    return [
        f"data.cache_dir={cache}",
        f"data.source={source}",
        f"model.name_or_path={ENCODER}",
        "data.max_seq_len=128",
        "data.max_query_len=32",
        "data.doc_stride=32",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.lr=5e-5",
        "train.warmup_steps=5",
        f"train.max_steps={STEPS}",
        "train.threads=1",
        "debug.sample_ledger=true",
        "log.every_steps=1",
        "log.console=none",
        "checkpoint.every_steps=5",
    ]


@pytest.fixture(scope="module")
def cache(cache_dir: Path, source: str) -> Path:
    """The feature cache built before any job: the launcher's preflight would build it while the job's
    start waits for agents (a minute at most)."""
    cfg = resolve_config("hf-tiny", settings(cache_dir, source))
    prepare(cfg, family_for(cfg.model))
    return cache_dir


def encoder_job(run_dir: Path, cache: Path, source: str, *extra: str, agents: int = 2) -> Job:
    job = Job(run_dir, "hf-tiny", [*settings(cache, source), *extra], agents=agents)
    job.start()
    return job


def fault_free(
    run_dir: Path, cache: Path, source: str, *extra: str, agents: int = 2
) -> dict[str, torch.Tensor]:
    assert finish(encoder_job(run_dir, cache, source, *extra, agents=agents), JOB_TIMEOUT) == 0
    return checked_final_parameters(run_dir, STEPS)


def test_a_killed_worker_of_a_pretrained_encoder_with_dropout_resumes_bitwise(
    tmp_path: Path, cache: Path, source: str
) -> None:
    reference = fault_free(tmp_path / "reference", cache, source, "model.dropout=0.1")
    run_dir = tmp_path / "run"
    job = encoder_job(
        run_dir, cache, source, "model.dropout=0.1", "debug.kill_at_step=12", "debug.kill_rank=1"
    )
    assert finish(job, JOB_TIMEOUT) == 0
    result = assert_nothing_lost(run_dir, reference, max_lost=1, restarts=1, bitwise=True, max_steps=STEPS)
    assert world_sizes(result["events"]) == [2, 2]
    frozen = [e for e in result["events"] if e["event"] == "frozen_parameters"]
    # a BERT of L layers: L attention key biases, the last LayerNorm's bias, the QA head's bias
    layers = json.loads((Path(ENCODER) / "config.json").read_text())["num_hidden_layers"]
    assert frozen and frozen[0]["count"] == layers + 2


def test_a_lone_killed_worker_replays_its_lost_steps_with_the_same_dropout(
    tmp_path: Path, cache: Path, source: str
) -> None:
    """One agent: no peer survives to save at the kill, so the new worker resumes from step 10 and trains
    steps 11 and 12 again; their dropout masks must be the ones the fault-free run drew."""
    reference = fault_free(tmp_path / "reference", cache, source, "model.dropout=0.1", agents=1)
    run_dir = tmp_path / "run"
    job = encoder_job(
        run_dir,
        cache,
        source,
        "model.dropout=0.1",
        "checkpoint.async=false",  # step 10 committed before 11: the resume point is not a race
        "debug.kill_at_step=12",
        "debug.kill_rank=0",
        agents=1,
    )
    assert finish(job, JOB_TIMEOUT) == 0
    result = assert_nothing_lost(run_dir, reference, max_lost=2, restarts=1, bitwise=True, max_steps=STEPS)
    assert world_sizes(result["events"]) == [1, 1]
    resumed = [e for e in result["events"] if e["event"] == "resume"]
    assert [e["step"] for e in resumed] == [10]


def test_an_agent_joining_then_one_leaving_a_pretrained_encoder_run_loses_nothing(
    tmp_path: Path, cache: Path, source: str
) -> None:
    reference = fault_free(tmp_path / "reference", cache, source, "model.dropout=0.0")
    run_dir = tmp_path / "run"
    hold_dir = tmp_path / "holds"
    arm(hold_dir, [5, 12])
    job = encoder_job(run_dir, cache, source, "model.dropout=0.0", f"debug.hold_dir={hold_dir}", agents=1)
    try:
        job.wait_for_step(5, timeout=STEP_TIMEOUT)
        before = job.attempt
        job.join()
        assert job.wait_for_new_attempt(after=before, timeout=STEP_TIMEOUT), (
            "the joining agent was not admitted"
        )
        release(hold_dir, 5)
        job.wait_for_step(12, timeout=STEP_TIMEOUT)
        leaving = next(agent for agent in job.live_agents() if not agent["is_host"])
        os.kill(leaving["pid"], signal.SIGTERM)
        release(hold_dir, 12)
    except BaseException:
        job.kill_everything()
        raise
    assert finish(job, JOB_TIMEOUT) == 0
    result = assert_nothing_lost(run_dir, reference, max_lost=0, restarts=2, max_steps=STEPS)
    assert world_sizes(result["events"]) == [1, 2, 1]
