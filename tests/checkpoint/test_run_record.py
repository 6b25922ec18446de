"""A checkpoint directory belongs to one run: another run (a checkpoint.dir that is, or links to, another
run's) is refused before anything is written; checkpoint.resume_from starts a run from another's state,
read only; the run itself (restarted, moved, a regroup, hosts with their own run.dir) still resumes.

Real single-process training runs (python -m elastic_qa.train), checked on disk byte for byte."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from elastic_qa.chaos.evidence import final_parameters, parameter_difference
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.run_record import belongs, new_record, read_record, write_record
from elastic_qa.checkpoint.store import MANIFEST, RUN_RECORD
from elastic_qa.cli import main as cli_main
from elastic_qa.config import ConfigError, load_config, packaged_config
from elastic_qa.observe.follow import read_events
from elastic_qa.session.restore import uuid_of as _uuid_of
from elastic_qa.session.restore import uuid_words as _uuid_words
from tests.checkpoint.runs import snapshot, train, trained_ok
from tests.conftest import tiny_overrides


def steps(checkpoints: Path) -> list[str]:
    return sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-"))


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e.get("event") == name]


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A finished run at step 40 with checkpoints 20, 30 and 40 (kept read only by every test)."""
    run_dir = tmp_path_factory.mktemp("first") / "run"
    trained_ok(run_dir, cache_dir, "train.max_steps=40")
    assert steps(run_dir / "checkpoints") == ["step-00000020", "step-00000030", "step-00000040"]
    return run_dir


def test_the_run_is_recorded_in_its_checkpoint_directory_and_every_manifest(first: Path) -> None:
    record = read_record(open_store(str(first / "checkpoints")))
    assert record is not None and record.run_dir == str(first.resolve())
    for name in steps(first / "checkpoints"):
        assert json.loads((first / "checkpoints" / name / MANIFEST).read_text())["run"] == record.run
    assert cli_main(["ckpt", "verify", str(first)]) == 0


@pytest.mark.parametrize("layout", ["checkpoint.dir links to it", "run.dir/checkpoints links to it"])
def test_a_new_run_on_another_runs_checkpoints_is_refused_and_changes_nothing(
    first: Path, tmp_path: Path, cache_dir: Path, layout: str
) -> None:
    before = snapshot(first)
    second = tmp_path / "second"
    second.mkdir()
    if layout == "checkpoint.dir links to it":
        (tmp_path / "link").symlink_to(first / "checkpoints")
        extra = [f"checkpoint.dir={tmp_path / 'link'}"]
    else:
        (second / "checkpoints").symlink_to(first / "checkpoints")
        extra = []
    result = train(second, cache_dir, "train.max_steps=60", "run.seed=7", *extra)
    assert result.returncode == 2, result.stderr[-3000:]
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and "holds the checkpoints of another run" in message[0], message
    assert f"run.dir {first.resolve()}" in message[0] and f"run.dir {second.resolve()}" in message[0]
    assert "checkpoint.resume_from=" in message[0]
    assert snapshot(first) == before  # not resumed, extended, pruned, fenced, registered or recorded


def test_resume_from_starts_from_that_state_writes_its_own_and_leaves_the_source_untouched(
    first: Path, tmp_path: Path, cache_dir: Path
) -> None:
    before = snapshot(first)
    # The reference: the first run itself carried on to step 60 (in a copy: a run directory moved or
    # copied as a whole is still that run; restarted, `make run` again on the same run.dir, it resumes).
    reference = tmp_path / "reference"
    shutil.copytree(first, reference, symlinks=True)
    trained_ok(reference, cache_dir, "train.max_steps=60")
    assert [e["step"] for e in events(reference, "resume")] == [40]

    forked = tmp_path / "forked"
    trained_ok(forked, cache_dir, "train.max_steps=60", f"checkpoint.resume_from={first / 'checkpoints'}")
    assert [e["step"] for e in events(forked, "resume_from")] == [40]
    assert steps(forked / "checkpoints") == ["step-00000050", "step-00000060"]
    assert snapshot(first) == before
    cfg = load_config(packaged_config("tiny"), tiny_overrides(forked, cache_dir))
    reference_cfg = load_config(packaged_config("tiny"), tiny_overrides(reference, cache_dir))
    (step, params), (ref_step, ref_params) = final_parameters(cfg), final_parameters(reference_cfg)
    assert step == ref_step == 60
    assert parameter_difference(params, ref_params)[
        "bitwise_equal"
    ]  # exactly the state the first run would reach

    # A restart of the forked run resumes its own newest checkpoint, not the source again.
    trained_ok(forked, cache_dir, "train.max_steps=70", f"checkpoint.resume_from={first / 'checkpoints'}")
    assert [e["step"] for e in events(forked, "resume")][-1] == 60
    assert [e["step"] for e in events(forked, "resume_from_ignored")] == [60]
    # One step directory of the source, by name.
    one = tmp_path / "one"
    source = first / "checkpoints" / "step-00000020"
    trained_ok(one, cache_dir, "train.max_steps=30", f"checkpoint.resume_from={source}")
    assert [e["step"] for e in events(one, "resume_from")] == [20]
    assert steps(one / "checkpoints") == ["step-00000030"]
    assert snapshot(first) == before
    for run_dir in (first, reference, forked, one):
        assert cli_main(["ckpt", "verify", str(run_dir)]) == 0

    # The same run's checkpoints written before run records (this was a test of its own, which first
    # restarted a copy of the run as the reference above does: one training start less).
    assert_checkpoints_from_before_run_records_resume(reference, tmp_path, cache_dir)


def assert_checkpoints_from_before_run_records_resume(run_dir: Path, tmp_path: Path, cache_dir: Path) -> None:
    """`run_dir`, a run at step 60, with its checkpoints as written before run records: no run.json,
    manifests without "run". Resumed and adopted, but not by another run directory."""
    checkpoints = run_dir / "checkpoints"
    (checkpoints / RUN_RECORD).unlink()
    for name in steps(checkpoints):
        manifest = json.loads((checkpoints / name / MANIFEST).read_text())
        manifest.pop("run")
        (checkpoints / name / MANIFEST).write_text(json.dumps(manifest))
    legacy = snapshot(run_dir)
    # ... but not by another run directory (its checkpoints/ is another run's own).
    other = tmp_path / "other"
    other.mkdir()
    (other / "checkpoints").symlink_to(checkpoints)
    refused = train(other, cache_dir, "train.max_steps=70")
    assert refused.returncode == 2 and "holds the checkpoints of another run" in refused.stderr
    assert snapshot(run_dir) == legacy
    trained_ok(run_dir, cache_dir, "train.max_steps=70")
    assert [e["step"] for e in events(run_dir, "resume")][-1] == 60
    assert [e["run_dir"] for e in events(run_dir, "checkpoint_run_adopted")] == [str(run_dir.resolve())]
    record = read_record(open_store(str(checkpoints)))
    assert record is not None and record.run_dir == str(run_dir.resolve())
    assert json.loads((checkpoints / "step-00000070" / MANIFEST).read_text())["run"] == record.run


def test_a_regroup_or_another_host_of_the_same_torchrun_job_belongs_to_the_run(tmp_path: Path) -> None:
    """The job id decides where run.dir does not: a host whose run.dir path differs (one checkpoint.dir
    URL, one --rdzv-id) is the same run; another job with another run.dir is not."""
    store = open_store(str(tmp_path / "shared"))
    record = new_record("", str(tmp_path / "host-a" / "run"), "eqa-job1")
    write_record(store, record)
    assert read_record(store) == record
    assert belongs(record, str(tmp_path / "host-a" / "run"), store, "another-job")  # restarted
    assert belongs(record, str(tmp_path / "host-b" / "run"), store, "eqa-job1")  # same job, other host
    assert not belongs(record, str(tmp_path / "host-b" / "run"), store, "eqa-job2")
    store.commit(10, {"model": b"x"}, {"attempt": 1, "run": record.run, "run_id": "eqa-job2"})
    assert belongs(record, str(tmp_path / "host-b" / "run"), store, "eqa-job2")  # wrote its checkpoints
    write_record(store, new_record("", str(tmp_path / "elsewhere"), "eqa-job3"))  # never replaced
    assert read_record(store) == record


@pytest.mark.parametrize(
    "content", ["{", "[]", '{"run": "x", "run_dir": "/r", "job": "j", "host": "h", "created": 1}']
)
def test_a_damaged_run_record_refuses_the_start_in_one_line(
    tmp_path: Path, cache_dir: Path, content: str
) -> None:
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / RUN_RECORD).write_text(content)
    result = train(tmp_path / "run", cache_dir, "train.max_steps=5")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "is not a run record" in result.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [RUN_RECORD]


def test_resume_from_needs_resume(tmp_path: Path, cache_dir: Path) -> None:
    with pytest.raises(ConfigError, match="resume_from"):
        load_config(
            packaged_config("tiny"),
            tiny_overrides(tmp_path, cache_dir, "checkpoint.resume=false", "checkpoint.resume_from=/x"),
        )


def test_resume_from_a_path_without_checkpoints_is_one_line_and_exit_2(
    tmp_path: Path, cache_dir: Path
) -> None:
    result = train(
        tmp_path / "run", cache_dir, "train.max_steps=5", f"checkpoint.resume_from={tmp_path / 'nope'}"
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "checkpoint.resume_from=" in result.stderr
    assert not (tmp_path / "run" / "checkpoints" / "attempts").exists()


def test_the_run_uuid_travels_whole_in_the_restore_broadcast() -> None:
    """Rank 0 tells the other ranks the run (their emergency saves record it) as two int64 words."""
    for run in ["0" * 32, "f" * 32, "8" + "0" * 31, uuid.uuid4().hex, "7fffffffffffffff8000000000000000"]:
        assert _uuid_of(*_uuid_words(run)) == run
