"""A run directory written by hand, log line by log line, for the report's unit tests: its numbers are
known exactly (a real run's are not), so a test can say what the summary must show.

The story: attempt 1 trains 2 ranks from step 0 to 50 (t=0..10 s) and is stopped by a signal; no worker
runs from t=10 to t=20; attempt 2 resumes 3 ranks from step 50 at t=20 and finishes step 100 at t=35,
with an evaluation at step 100. Checkpoints are committed at steps 50 and 100.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

T0 = 1_700_000_000.0
IDLE = (10.0, 20.0)  # seconds since start when no worker ran
CONFIG = {
    "data": {"source": "synthetic", "synthetic": {"train_examples": 2000, "eval_examples": 200}},
    "model": {"kind": "native", "d_model": 32, "n_layers": 1, "n_heads": 2},
    "train": {"max_steps": 100, "global_batch_size": 16, "micro_batch_size": 16, "lr": 0.003},
    "checkpoint": {"interval": "2s", "every_steps": 0, "keep_last": 3},
}


def line(event: str, ts: float, rank: int, attempt: int, world: int, **fields: object) -> dict:
    return {
        "event": event,
        "ts": T0 + ts,
        "time": "2023-11-14T22:13:20Z",
        "rank": rank,
        "attempt": attempt,
        "world_size": world,
        "pid": 1000 * attempt + rank,
        **fields,
    }


def write_run(run_dir: Path, config: dict | None = None, **extra: list[dict]) -> Path:
    """The run above in run_dir (logs/ and config.yaml); `extra` adds lines to a rank's file by name."""
    rows: dict[str, list[dict]] = {}

    def add(row: dict) -> None:
        rows.setdefault(f"rank-{row['rank']:03d}.pid-{row['pid']}.jsonl", []).append(row)

    attempts = ((1, 2, (0, 10), (0, 50)), (2, 3, (20, 35), (50, 100)))
    for attempt, world, (start, end), (first, last) in attempts:
        for rank in range(world):
            add(line("worker_start", start, rank, attempt, world, restart_count=attempt - 1))
            if first:
                add(line("resume", start + 0.1, rank, attempt, world, step=first))
            else:
                add(line("start_fresh", start + 0.1, rank, attempt, world))
            for step in range(first + 10, last + 1, 10):
                ts = start + (end - start) * (step - first) / (last - first)
                loss = 3.0 * 0.97**step
                numbers = {"loss": loss, "rank_loss": loss * (1 + 0.01 * rank), "lr": 0.003, "grad_norm": 1.5}
                add(line("step", ts, rank, attempt, world, step=step, samples_per_s=100.0 * world, **numbers))
        add(line("checkpoint_committed", end - 0.2, 0, attempt, world, step=last, reason="final"))
    for rank in range(2):
        add(line("stopping", 9.9, rank, 1, 2, step=50, signal="SIGTERM"))
    add(line("eval", 34.5, 0, 2, 3, step=100, em=0.625, f1=0.75, loss=0.5))
    add(line("train_done", 35.0, 0, 2, 3, step=100, em=0.625, f1=0.75, eval_loss=0.5))
    for name, more in extra.items():
        rows.setdefault(name, []).extend(more)
    (run_dir / "logs").mkdir(parents=True)
    for name, lines in rows.items():
        (run_dir / "logs" / name).write_text("".join(json.dumps(row) + "\n" for row in lines))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config or CONFIG))
    return run_dir
