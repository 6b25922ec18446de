"""The GPU check in its CPU mode (gloo; CUDA not tested): a real torchrun job, a real SIGKILL of its worker,
and the figures and checks it reports; its refusals of a missing package and of arguments that cannot work.

No timing assertions: only that each figure exists and is sane and that every check passed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from elastic_qa.bench import gpu_check
from elastic_qa.bench.cli import main as bench
from elastic_qa.bench.gpu_evidence import Checks, scaler_restored
from elastic_qa.chaos.evidence import checkpoint_store
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.checkpoint.payload import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE
from elastic_qa.launcher.processes import python_env


@pytest.mark.integration
@pytest.mark.bench
def test_the_cpu_mode_kills_the_worker_resumes_from_a_checkpoint_and_passes_every_check(
    tmp_path: Path, cache_dir: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    command = [
        *(sys.executable, "-m", "elastic_qa.bench.gpu_check", "--cpu", "--config", "tiny"),
        *("--cases", "native-bf16,native-fp16", "--steps", "30", "--kill-at", "14"),
        *("--checkpoint-every", "5", "--log-every", "2", "train.threads=1", f"data.cache_dir={cache_dir}"),
    ]
    result = subprocess.run(
        command, env={**python_env(), "OUT": str(out)}, capture_output=True, text=True, timeout=300
    )

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "CUDA IS NOT TESTED" in result.stdout
    figures = json.loads((out / "gpu-check.json").read_text())
    assert figures["ok"] and not figures["cuda_tested"] and figures["not_run"] == ["native-fp16"]
    case = figures["cases"]["native-bf16"]
    assert all(row["ok"] for row in case["checks"]) and len(case["checks"]) >= 9
    assert 5 <= case["resumed_step"] <= case["killed_worker_reached_step"] < 30
    assert case["steps_trained_again"] == case["killed_worker_reached_step"] - case["resumed_step"]
    assert case["steps_per_s_before_kill"] > 0 and case["steps_per_s_after_resume"] > 0
    assert case["async_saves"] >= 3 and 0 < case["async_stall_ms"]["median"] <= case["async_stall_ms"]["max"]
    assert case["kill_to_first_step_s"] > case["kill_to_worker_start_s"] > 0
    assert 0 <= case["em"] <= 1 and 0 <= case["f1"] <= 1
    assert 0 <= case["data_share"] <= 1 and 0 <= case["comm_share"] <= 1
    with tarfile.open(out / "gpu-check-logs.tar.gz") as archive:
        names = archive.getnames()
    assert any("native-bf16/logs/rank-000" in name for name in names)
    assert not any("checkpoints" in name for name in names)


def test_a_missing_package_is_named_before_anything_runs(monkeypatch, capsys) -> None:
    monkeypatch.setitem(gpu_check.REQUIRED, "no_such_module_for_the_gpu_check", "no-such-package")

    assert gpu_check.main(["--cpu"]) == 2
    assert "missing Python packages: no-such-package" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--steps", "50", "--kill-at", "50"], "--kill-at 50 must be below --steps 50"),
        (["--kill-at", "30", "--checkpoint-every", "30"], "--checkpoint-every 30 must be below --kill-at 30"),
    ],
    ids=["kill-after-the-end", "no-checkpoint-before-the-kill"],
)
def test_a_kill_that_cannot_test_a_resume_is_refused(
    argv: list[str], complaint: str, tmp_path, capsys
) -> None:
    assert bench(["gpu", "--cpu", *argv, "--work-dir", str(tmp_path)]) == 2
    assert complaint in capsys.readouterr().err


SAVED_SCALER = {
    "scale": 32768.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "_growth_tracker": 37,
}


@pytest.mark.parametrize(
    ("restored", "passed"),
    [
        (SAVED_SCALER, True),
        ({**SAVED_SCALER, "_growth_tracker": 0}, False),  # a fresh scaler's count
        (None, False),  # the resume event carried no scaler state
    ],
    ids=["restored", "growth-count-lost", "not-logged"],
)
def test_the_fp16_check_compares_the_new_workers_grad_scaler_with_the_resumed_checkpoints(
    tiny_config, restored: dict | None, passed: bool
) -> None:
    cfg = tiny_config()
    trainer = {"grad_scaler": SAVED_SCALER, "config": cfg.to_dict()}
    checkpointer = Checkpointer(cfg.checkpoint, checkpoint_store(cfg))
    checkpointer.save(40, {MODEL_FILE: {}, OPTIMIZER_FILE: {}, TRAINER_FILE: trainer}, {}, blocking=True)
    check = Checks()

    figures = scaler_restored(cfg, 40, restored, check)

    assert figures["grad_scaler_saved"] == SAVED_SCALER
    assert [row["ok"] for row in check.rows] == [True, passed]
