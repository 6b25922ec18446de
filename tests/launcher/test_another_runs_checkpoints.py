"""Two agents started (the local launcher, real torchrun) on a run.dir whose checkpoints/ links to another
run's: every worker refuses with rank 0's one line, the launcher sees the crash loop on bad input and exits
2, and the other run's checkpoints are byte for byte as they were."""

from __future__ import annotations

from pathlib import Path

from elastic_qa.chaos.job import Job
from tests.checkpoint.runs import snapshot, trained_ok


def test_a_launched_job_on_another_runs_checkpoints_exits_2_with_the_one_line(
    tmp_path: Path, cache_dir: Path
) -> None:
    first = tmp_path / "first"
    trained_ok(first, cache_dir, "train.max_steps=20")
    before = snapshot(first)
    second = tmp_path / "second"
    second.mkdir()
    (second / "checkpoints").symlink_to(first / "checkpoints")
    job = Job(second, "tiny", [f"data.cache_dir={cache_dir}", "train.max_steps=40", "run.seed=7"], agents=2)
    job.start()
    try:
        code = job.wait(timeout=300)
    finally:
        job.kill_everything()
    output = (second / "chaos" / "launcher.log").read_text()
    assert code == 2, output[-2000:]
    assert "every attempt fails with: checkpoint.dir=" in output  # rank 0's line, told by every rank
    assert "another run (run " in output and f"run.dir {first.resolve()})" in output
    assert snapshot(first) == before
