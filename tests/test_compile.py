"""train.compile: its config, the compile cache's privacy, and (long) a restarted compiled run that loads its
graphs from the cache and resumes to the uninterrupted compiled run's parameters."""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_qa.bench.cli import main as bench_main
from elastic_qa.chaos.evidence import final_parameters, parameter_difference
from elastic_qa.compile import CACHE_DIR, private_directory
from elastic_qa.config import ConfigError, load_config, packaged_config
from elastic_qa.exits import EXIT_BAD_INPUT
from elastic_qa.observe.follow import read_events
from tests.conftest import tiny_overrides

STEPS = 40
# A compile takes ~25 s of CPU for the tiny model; a loaded 2-core machine stretches that several times.
COMPILED_RUN_TIMEOUT_S = 900


def compiled_run(run_dir: Path, cache: Path, *extra: str, expect: int = 0) -> subprocess.CompletedProcess:
    overrides = tiny_overrides(
        run_dir, cache, f"train.max_steps={STEPS}", "train.threads=1", "train.compile=true", *extra
    )
    result = subprocess.run(
        [sys.executable, "-m", "elastic_qa.train", "--config", "tiny", *overrides],
        capture_output=True,
        text=True,
        timeout=COMPILED_RUN_TIMEOUT_S,
    )
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def test_compile_is_off_by_default_and_its_keys_are_checked(tiny_config) -> None:
    assert tiny_config().train.compile is False
    with pytest.raises(ConfigError, match=r"train\.compile_mode='fast': must be one of"):
        tiny_config("train.compile_mode=fast")
    with pytest.raises(ConfigError, match=r"train\.compile=2: expected true or false"):
        tiny_config("train.compile=2")


def test_the_compile_cache_is_created_readable_by_its_owner_only(tmp_path: Path) -> None:
    cache = private_directory(tmp_path / "run" / CACHE_DIR)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_a_compile_cache_that_others_can_write_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / CACHE_DIR
    cache.mkdir()
    cache.chmod(0o777)
    with pytest.raises(ConfigError, match=r"writable by others \(mode 777\)"):
        private_directory(cache)


def test_a_worker_refuses_to_load_code_from_a_cache_that_others_can_write(
    tmp_path: Path, cache_dir: Path
) -> None:
    (tmp_path / CACHE_DIR).mkdir()
    (tmp_path / CACHE_DIR).chmod(0o777)
    result = compiled_run(tmp_path, cache_dir, expect=EXIT_BAD_INPUT)
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"elastic-qa: train.compile: {tmp_path / CACHE_DIR}")
    assert not any(e["event"] == "train_start" for e in read_events(tmp_path))


def test_the_recovery_benchmark_turns_the_compile_cache_off_only_for_a_compiled_product(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_main(["recovery", "--no-compile-cache", "--work-dir", str(tmp_path)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip() == (
        "elastic-qa bench recovery: --no-compile-cache: only with --compile"
    )


def compile_events(run_dir: Path, attempt: int) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "compile" and e.get("attempt") == attempt]


def final_params(run_dir: Path, cache: Path) -> dict[str, torch.Tensor]:
    found = final_parameters(load_config(packaged_config("tiny"), tiny_overrides(run_dir, cache)))
    assert found is not None and found[0] == STEPS
    return found[1]


@pytest.mark.long
def test_a_restarted_compiled_run_loads_its_graphs_from_the_cache_and_resumes_bitwise(
    tmp_path: Path, cache_dir: Path
) -> None:
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    compiled_run(uninterrupted, cache_dir)
    # SIGKILL after step 25; the newest checkpoint is step 20 (written synchronously: see test_trainer).
    compiled_run(
        killed,
        cache_dir,
        "checkpoint.every_steps=10",
        "checkpoint.async=false",
        "debug.kill_at_step=25",
        expect=-signal.SIGKILL,
    )
    [first] = compile_events(killed, attempt=1)
    assert first["step"] == 1 and first["graph_cache_misses"] > 0 and first["graph_cache_hits"] == 0
    cache = killed / CACHE_DIR
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and any((cache / "fxgraph").iterdir())

    compiled_run(killed, cache_dir, "checkpoint.every_steps=10")
    [restarted] = compile_events(killed, attempt=2)
    assert restarted["step"] == 21
    assert restarted["graph_cache_hits"] > 0 and restarted["graph_cache_misses"] == 0
    diff = parameter_difference(final_params(killed, cache_dir), final_params(uninterrupted, cache_dir))
    assert diff["bitwise_equal"], diff
