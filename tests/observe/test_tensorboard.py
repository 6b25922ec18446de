"""Optional TensorBoard scalars: written per rank when asked for, a clear error when not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import tiny_overrides, train_tiny


def test_tensorboard_scalars_are_written_per_rank(tmp_path: Path, cache_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_tiny(tmp_path, cache_dir, "log.tensorboard=true", "train.max_steps=10")
    events = EventAccumulator(str(tmp_path / "tensorboard" / "rank-0"))
    events.Reload()
    assert {"loss", "grad_norm", "lr", "eval_em"} <= set(events.Tags()["scalars"])
    assert [s.step for s in events.Scalars("loss")] == [5, 10]


def test_without_the_package_the_worker_fails_with_exit_2_naming_the_fix(
    tmp_path: Path, cache_dir: Path
) -> None:
    hide = (
        "import sys; sys.modules['tensorboard'] = None; from elastic_qa.train import main; sys.exit(main())"
    )
    overrides = tiny_overrides(tmp_path / "run", cache_dir, "log.tensorboard=true")
    result = subprocess.run(
        [sys.executable, "-c", hide, "--config", "tiny", *overrides],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "elastic-qa[tensorboard]" in result.stderr
