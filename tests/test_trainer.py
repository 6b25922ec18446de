"""The training loop as a single process (no torchrun): resume exactness, rotation, stop on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from elastic_qa.chaos.evidence import final_parameters, parameter_difference
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.config import ConfigError, load_config, packaged_config
from elastic_qa.loop.step import autocast_dtype, clip_gradients, optimizer_step
from elastic_qa.observe.follow import read_events
from elastic_qa.optim import lr_multiplier
from tests.conftest import tiny_overrides

STEPS = 40


def train_command(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    overrides = tiny_overrides(run_dir, cache, f"train.max_steps={STEPS}", "train.threads=1", *extra)
    return [sys.executable, "-m", "elastic_qa.train", "--config", "tiny", *overrides]


def train(run_dir: Path, cache: Path, *extra: str, expect: int = 0) -> None:
    result = subprocess.run(
        train_command(run_dir, cache, *extra), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == expect, result.stderr[-2000:]


def final_params(run_dir: Path, cache: Path) -> dict[str, torch.Tensor]:
    cfg = load_config(packaged_config("tiny"), tiny_overrides(run_dir, cache))
    step, params = final_parameters(cfg)
    assert step == STEPS
    return params


# Dropout on in the runs compared with `uninterrupted`: a resume must reproduce the dropout masks too, and
# the run that evaluates every 10 steps has this run (no evaluation before the end) to compare with.
DROPOUT = "model.dropout=0.1"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train(run_dir, cache_dir, DROPOUT, "train.eval_every=0")
    return final_params(run_dir, cache_dir)


def test_killed_run_resumes_to_bitwise_identical_parameters(
    tmp_path: Path, cache_dir: Path, uninterrupted: dict
) -> None:
    # SIGKILL after step 25; the newest periodic checkpoint is step 20, so steps 21-25 are replayed. The
    # killed run saves synchronously: an async write of step 20 may still be in flight five tiny steps
    # later on a loaded machine (seen in CI: the resume was from 10), and the kill would be a race.
    train(
        tmp_path,
        cache_dir,
        DROPOUT,
        "checkpoint.every_steps=10",
        "checkpoint.async=false",
        "debug.kill_at_step=25",
        expect=-signal.SIGKILL,
    )
    train(tmp_path, cache_dir, DROPOUT, "checkpoint.every_steps=10")
    resumes = [e for e in read_events(tmp_path) if e["event"] == "resume"]
    assert [r["step"] for r in resumes] == [20]
    assert resumes[0]["cursor"] == 20 * 16
    diff = parameter_difference(final_params(tmp_path, cache_dir), uninterrupted)
    assert diff["bitwise_equal"], diff


def test_the_steps_after_an_evaluation_train_with_dropout_as_if_it_had_not_run(
    tmp_path: Path, cache_dir: Path, uninterrupted: dict
) -> None:
    """Evaluation puts the model in eval mode (dropout off); training must come back to train mode, so a
    run that evaluates every 10 steps ends with the parameters of one that evaluates only at the end (the
    `uninterrupted` run: the same dropout, eval_every=0)."""
    evaluating = tmp_path / "evaluating"
    train(evaluating, cache_dir, DROPOUT, "train.eval_every=10")
    assert [e["step"] for e in read_events(evaluating) if e["event"] == "eval"][:3] == [10, 20, 30]
    diff = parameter_difference(final_params(evaluating, cache_dir), uninterrupted)
    assert diff["bitwise_equal"], diff


def test_sigterm_saves_the_last_completed_step_and_resume_is_exact(
    tmp_path: Path, cache_dir: Path, uninterrupted: dict
) -> None:
    process = subprocess.Popen(
        train_command(tmp_path, cache_dir, DROPOUT, "debug.step_delay=100ms", "log.every_steps=1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not any('"event": "step"' in p.read_text() for p in (tmp_path / "logs").glob("*.jsonl")):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    # A single process (no torchrun agent to regroup) exits as a shell expects of a SIGTERMed program.
    assert process.wait(timeout=60) == 128 + signal.SIGTERM, process.stderr.read()[-2000:]
    events = read_events(tmp_path)
    last_step = max(e["step"] for e in events if e["event"] == "step")
    saved = [e for e in events if e["event"] == "checkpoint_committed"]
    assert [e["reason"] for e in saved] == ["sigterm"] and saved[0]["step"] == last_step  # 0 lost steps
    train(tmp_path, cache_dir, DROPOUT)
    diff = parameter_difference(final_params(tmp_path, cache_dir), uninterrupted)
    assert diff["bitwise_equal"], diff


def test_timed_rotation_keeps_the_last_three_plus_milestones(tmp_path: Path, cache_dir: Path) -> None:
    train(
        tmp_path,
        cache_dir,
        "checkpoint.interval=1s",
        "checkpoint.keep_every_steps=16",
        "debug.step_delay=150ms",
        "checkpoint.async=true",
    )
    events = read_events(tmp_path)
    committed = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    assert len(committed) >= 5  # ~6 s of training with a 1 s timer
    store = open_store(str(tmp_path / "checkpoints"))
    kept = [info.step for info in store.list_steps(committed_only=False)]
    milestones = [s for s in committed if s % 16 == 0 and s not in committed[-3:]]
    assert kept == sorted(set(committed[-3:]) | set(milestones))
    assert all(store.verify(info.path).ok for info in store.list_steps())
    assert all(e["blocking_seconds"] <= e["seconds"] for e in events if e["event"] == "checkpoint_committed")


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    multiplier = lr_multiplier(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert multiplier(0) == pytest.approx(0.1)
    assert multiplier(9) == pytest.approx(1.0)
    assert multiplier(60) == pytest.approx(0.55)
    assert multiplier(110) == pytest.approx(0.1)


def test_each_precision_has_its_autocast_dtype_and_fp16_needs_cuda() -> None:
    cpu = torch.device("cpu")
    assert autocast_dtype("fp32", cpu) is None and autocast_dtype("bf16", cpu) is torch.bfloat16
    with pytest.raises(ConfigError, match=r"train\.precision=fp16 needs CUDA"):
        autocast_dtype("fp16", cpu)


def test_bf16_on_a_gpu_without_bf16_is_refused_at_start_up_naming_the_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla K80")

    with pytest.raises(ConfigError, match=r"train\.precision=bf16: Tesla K80 cannot compute in bf16"):
        autocast_dtype("bf16", torch.device("cuda", 0))


def test_without_clipping_the_norm_is_computed_only_for_logged_steps_and_training_is_bitwise_the_same(
    tmp_path: Path, cache_dir: Path
) -> None:
    # Every step logged (the norm at every step) against every 7th (the norm at 7, 14, ... and the last):
    # skipping the norm changes no gradient, so the same final parameters; each line has its norm.
    runs = {}
    for every in (1, 7):
        run_dir = tmp_path / f"every-{every}"
        train(run_dir, cache_dir, "train.grad_clip=0", f"log.every_steps={every}")
        lines = [e for e in read_events(run_dir) if e["event"] == "step" and e["rank"] == 0]
        assert [e["step"] for e in lines] == sorted({*range(every, STEPS + 1, every), STEPS})
        assert all(e["grad_norm"] > 0 for e in lines)  # NaN, the placeholder of a skipped norm, fails
        runs[every] = final_params(run_dir, cache_dir)
    diff = parameter_difference(runs[7], runs[1])
    assert diff["bitwise_equal"], diff


def test_optimizer_step_skips_the_norm_only_when_it_neither_clips_nor_reports() -> None:
    def state_and_params() -> tuple[SimpleNamespace, list[torch.nn.Parameter]]:
        params = [torch.nn.Parameter(torch.ones(5))]
        params[0].grad = torch.full((5,), 3.0)
        optimizer = torch.optim.SGD(params, lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return SimpleNamespace(scaler=None, optimizer=optimizer, scheduler=scheduler), params

    state, params = state_and_params()
    assert optimizer_step(state, params, 0.0, norm_wanted=False) is None
    assert torch.equal(params[0].data, torch.full((5,), 1 - 0.3))  # stepped, unclipped
    state, params = state_and_params()
    norm = optimizer_step(state, params, 1.0, norm_wanted=False)  # clipping needs the norm anyway
    assert norm is not None and float(norm) == pytest.approx(3.0 * 5**0.5)
    assert torch.allclose(params[0].data, torch.full((5,), 1 - 0.1 / 5**0.5))
    state, params = state_and_params()
    norm = optimizer_step(state, params, 0.0, norm_wanted=True)
    assert norm is not None and float(norm) == pytest.approx(3.0 * 5**0.5)


@pytest.mark.parametrize("max_norm", [0.5, 1e6, float("inf")], ids=["clips", "within", "off"])
def test_clipping_gives_torchs_clip_grad_norm_bitwise_norm_and_gradients(max_norm: float) -> None:
    generator = torch.Generator().manual_seed(3)
    ours = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 130, 1)]
    theirs = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 130, 1)]
    for mine, torchs in zip(ours, theirs, strict=True):
        mine.grad = torch.randn(mine.shape, generator=generator)
        torchs.grad = mine.grad.clone()
    norm = clip_gradients(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=True)
    assert torch.equal(norm, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs, strict=True))
