"""Two agents started (the local launcher, real torchrun) on a run.dir whose checkpoints/ links to another
run's: every worker refuses with rank 0's one line, the launcher sees the crash loop on bad input and exits
2, and the other run's checkpoints are byte for byte as they were.

The other run's checkpoint directory is written here with the store's own writer (its run record), not by
a training run of its own (a start of seconds of CPU): a run that trained is refused the same way in
tests/checkpoint/test_run_record.py; what this test adds is the launcher's side."""

from __future__ import annotations

from pathlib import Path

from elastic_qa.chaos.job import Job
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.run_record import new_record, write_record
from tests.checkpoint.runs import snapshot


def test_a_launched_job_on_another_runs_checkpoints_exits_2_with_the_one_line(
    tmp_path: Path, cache_dir: Path
) -> None:
    first = tmp_path / "first"
    store = open_store(str(first / "checkpoints"))
    record = new_record("", str(first), "eqa-first")
    write_record(store, record)
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
