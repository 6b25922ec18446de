"""Joining a process group: bad input refused before any is formed; how a worker process ends: without
interpreter finalisation, but losing nothing a normal exit keeps; rank 0's decisions, on every rank."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_qa.config import ConfigError, DistConfig
from elastic_qa.dist import (
    MAX_REFUSAL,
    DistContext,
    decide_on_rank0,
    has_running_statistics,
    init_distributed,
)
from tests.spawned import spawn_ranks

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from pathlib import Path
    from elastic_qa.dist import exit_process

    out = Path(sys.argv[1])

    def slow_write():  # like a checkpoint still being written when main returns
        time.sleep(0.5)
        (out / "thread-finished").write_text("yes")

    threading.Thread(target=slow_write, daemon=False).start()
    atexit.register(lambda: (out / "atexit-ran").write_text("yes"))
    print("buffered line, never flushed by hand")  # stdout is a pipe: block-buffered
    exit_process(3)
    (out / "after-exit").write_text("must not run")
    """
)


def test_exit_process_waits_for_threads_runs_atexit_flushes_and_keeps_the_code(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 3, result.stderr
    assert result.stdout == "buffered line, never flushed by hand\n"
    assert (tmp_path / "thread-finished").read_text() == "yes"
    assert (tmp_path / "atexit-ran").read_text() == "yes"
    assert not (tmp_path / "after-exit").exists()


def test_nccl_without_a_cuda_device_is_bad_input_before_any_process_group(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")

    with pytest.raises(ConfigError, match=r"dist\.backend=nccl needs a CUDA device"):
        init_distributed(DistConfig(backend="nccl"))
    assert not dist.is_initialized()


def test_more_workers_on_a_host_than_gpus_is_bad_input_before_any_device_is_bound(monkeypatch) -> None:
    bound: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setenv("LOCAL_RANK", "1")

    with pytest.raises(ConfigError, match="local rank 1 but torch sees 1 CUDA device"):
        init_distributed(DistConfig())
    assert bound == [] and not dist.is_initialized()


def test_only_a_model_with_running_statistics_has_its_buffers_broadcast(hf_models: dict) -> None:
    from elastic_qa.config import load_config, packaged_config
    from elastic_qa.models import family_for

    cfg = load_config(packaged_config("tiny"))
    native = family_for(cfg.model).build_model(cfg, cfg.data.vocab_size)
    hf_cfg = load_config(packaged_config("hf-tiny"), [f"model.name_or_path={hf_models['bert']}"])
    bert = family_for(hf_cfg.model).build_model(hf_cfg, 1000)
    assert any(True for _ in bert.buffers())  # constant position and token type ids
    assert not has_running_statistics(native) and not has_running_statistics(bert)
    assert has_running_statistics(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))


WRAP = textwrap.dedent(
    """
    import sys, warnings
    import torch, torch.distributed as dist
    from elastic_qa.config import DistConfig
    from elastic_qa.dist import DistContext, wrap_model

    warnings.simplefilter("always")  # every warning printed, however often it was seen
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
    # wrap_model reads the world's size from the context: two ranks, so that it wraps (DDP itself runs on
    # the one-rank group); a world of one rank gets the model itself.
    ctx = DistContext(0, 2, 0, torch.device("cpu"), "gloo", 1)
    plain = wrap_model(torch.nn.Linear(4, 4), ctx, DistConfig())
    norm = wrap_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)), ctx, DistConfig())
    alone = torch.nn.Linear(4, 4)
    one = wrap_model(alone, DistContext(0, 1, 0, torch.device("cpu"), "gloo", 1), DistConfig())
    print(plain.broadcast_buffers, norm.broadcast_buffers, one is alone)
    dist.destroy_process_group()
    """
)


def test_wrapping_a_model_in_ddp_prints_no_warning_syncs_only_running_statistics_and_skips_a_world_of_one(
    tmp_path: Path,
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", WRAP, str(tmp_path / "store")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "True", "True"]
    assert "Warning" not in result.stderr, result.stderr


# ---- rank 0's decisions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    step: int
    fresh: bool
    lr: float
    run_word: int


class Refused(Exception):
    pass


class Held(Exception):
    pass


CHOICE = Choice(step=420, fresh=True, lr=1 / 3, run_word=-(2**63) + 5)


def _decide_everywhere(ctx: DistContext, group: dist.ProcessGroup | None) -> dict:
    """Three decisions in a row, as a worker makes them: a choice, a refusal of the second refusal type
    (longer than MAX_REFUSAL bytes), then a choice again (the ranks are still in step after a refusal)."""
    calls: list[str] = []

    def choose() -> Choice:
        calls.append("choose")
        return CHOICE

    def refuse() -> Choice:
        calls.append("refuse")
        raise Held("held by job 7 " + "x" * MAX_REFUSAL)

    first = decide_on_rank0(ctx, group, choose, Choice, (Refused, Held))
    try:
        decide_on_rank0(ctx, group, refuse, Choice, (Refused, Held))
        refusal = None
    except (Refused, Held) as err:
        refusal = [type(err).__name__, str(err)]
    last = decide_on_rank0(ctx, group, lambda: Choice(7, False, 2.5, 1), Choice)
    return {"first": asdict(first), "refusal": refusal, "last": asdict(last), "calls": calls}


def _decision_rank(rank: int, world: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo", world)
        Path(out, f"rank{rank}.json").write_text(json.dumps(_decide_everywhere(ctx, None)))
    finally:
        dist.destroy_process_group()


def test_rank_0_decides_and_every_rank_gets_its_decision_or_its_refusal(tmp_path: Path) -> None:
    spawn_ranks(_decision_rank, (3, str(tmp_path / "store"), str(tmp_path)), nprocs=3)

    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    expected_refusal = ["Held", ("held by job 7 " + "x" * MAX_REFUSAL)[:MAX_REFUSAL]]
    for rank, result in enumerate(results):
        assert result["first"] == asdict(CHOICE), rank  # the float to the last bit, the int64 extreme
        assert result["refusal"] == expected_refusal, rank
        assert result["last"] == {"step": 7, "fresh": False, "lr": 2.5, "run_word": 1}, rank
        assert result["calls"] == (["choose", "refuse"] if rank == 0 else []), rank


def test_a_single_process_decides_alone_with_the_same_refusal() -> None:
    single = DistContext(0, 1, 0, torch.device("cpu"), None, 1)
    result = _decide_everywhere(single, None)
    assert result["first"] == asdict(CHOICE) and result["last"]["lr"] == 2.5
    assert result["refusal"] == ["Held", ("held by job 7 " + "x" * MAX_REFUSAL)[:MAX_REFUSAL]]


def test_a_decision_of_a_type_that_cannot_travel_is_refused_on_rank_0() -> None:
    @dataclass
    class Named:
        name: str

    single = DistContext(0, 1, 0, torch.device("cpu"), None, 1)
    with pytest.raises(TypeError, match="only int, bool and float travel"):
        decide_on_rank0(single, None, lambda: Named("x"), Named)
