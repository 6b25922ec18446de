"""The trained model is never lost: replays commit their own state, a refused start writes nothing, the
final state is committed and verified before a job says it is done. Single-process runs of the tiny config."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.store import MANIFEST, CheckpointStore
from elastic_qa.observe.follow import read_events
from tests.conftest import tiny_overrides

STEPS = 40


def command(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    overrides = tiny_overrides(run_dir, cache, f"train.max_steps={STEPS}", "train.threads=1", *extra)
    return [sys.executable, "-m", "elastic_qa.train", "--config", "tiny", *overrides]


def train(run_dir: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(run_dir, cache, *extra), capture_output=True, text=True, timeout=180)


def store_of(run_dir: Path) -> CheckpointStore:
    return open_store(str(run_dir / "checkpoints"))


def manifest(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step-{step:08d}" / MANIFEST).read_text())


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def model_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    store = store_of(run_dir)
    path = store.path(f"step-{step:08d}")
    verdict = store.verify(path)
    assert verdict.ok, verdict.reason
    return store.load_file(path, verdict.manifest, "model.pt")


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A run trained to STEPS with a checkpoint every 10 steps (copy it before changing anything)."""
    run = tmp_path_factory.mktemp("finished")
    assert train(run, cache_dir, "checkpoint.every_steps=10").returncode == 0
    return run


def copy_of(finished: Path, target: Path) -> Path:
    shutil.copytree(finished, target)
    return target


def test_a_replay_across_a_rejected_checkpoint_commits_its_own_final_state(
    tmp_path: Path, cache_dir: Path, finished: Path
) -> None:
    """The newest checkpoint is damaged: resume rejects it, replays to that step, and the final save must
    replace it (before, the save found the step 'already on disk' and the replayed model was lost)."""
    run = copy_of(finished, tmp_path / "run")
    expected = model_weights(run, STEPS)
    model = run / "checkpoints" / f"step-{STEPS:08d}" / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))

    result = train(run, cache_dir, "checkpoint.every_steps=10")

    assert result.returncode == 0, result.stderr[-2000:]
    resumes = [e for e in read_events(run) if e["event"] == "resume"]
    assert [r["step"] for r in resumes] == [30]
    assert manifest(run, STEPS)["attempt"] == 2
    final = model_weights(run, STEPS)
    assert all(torch.equal(final[name], expected[name]) for name in expected)
    rejected = list((run / "checkpoints" / "rejected").iterdir())
    assert [p.name.split(".")[0] for p in rejected] == [f"step-{STEPS:08d}"]
    assert (rejected[0] / "model.pt").read_bytes() == bytes(data)  # kept as it was found, for forensics


def test_resume_false_on_another_jobs_checkpoints_is_refused_and_overwrites_nothing(
    tmp_path: Path, cache_dir: Path, finished: Path
) -> None:
    tmp_path = copy_of(finished, tmp_path / "run")
    before = tree(tmp_path / "checkpoints")

    result = train(tmp_path, cache_dir, "checkpoint.every_steps=10", "checkpoint.resume=false", "run.seed=99")

    assert result.returncode == 2
    assert "checkpoint.resume=false" in result.stderr and "step 40" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert tree(tmp_path / "checkpoints") == before


def test_a_start_refused_as_bad_input_registers_no_attempt(
    tmp_path: Path, cache_dir: Path, finished: Path
) -> None:
    """A refused start (a checkpoint of another model size) must not fence the job running on the run."""
    tmp_path = copy_of(finished, tmp_path / "run")
    attempts = sorted(p.name for p in (tmp_path / "checkpoints" / "attempts").iterdir())

    result = train(tmp_path, cache_dir, "model.d_model=48", "model.n_heads=2")

    assert result.returncode == 2, result.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "attempts").iterdir()) == attempts


def test_resuming_past_max_steps_says_so_and_exits_2(tmp_path: Path, cache_dir: Path, finished: Path) -> None:
    tmp_path = copy_of(finished, tmp_path / "run")
    before = tree(tmp_path / "checkpoints")

    result = train(tmp_path, cache_dir, "train.max_steps=25")

    assert result.returncode == 2
    assert "step 40" in result.stderr and "train.max_steps=25" in result.stderr
    assert tree(tmp_path / "checkpoints") == before


def test_a_final_save_that_storage_refuses_is_not_done_and_exits_nonzero(
    tmp_path: Path, cache_dir: Path
) -> None:
    flag = tmp_path / "disk-full"
    flag.touch()

    result = train(
        tmp_path / "run",
        cache_dir,
        "train.max_steps=12",
        f"debug.storage_fault_file={flag}",
        "checkpoint.final_retry_for=2s",
    )

    assert result.returncode == 1
    assert "final state could not be committed" in result.stderr
    events = read_events(tmp_path / "run")
    assert not [e for e in events if e["event"] == "train_done"]
    assert [e["step"] for e in events if e["event"] == "checkpoint_lost"] == [12]


def test_a_final_save_retries_until_storage_is_back(tmp_path: Path, cache_dir: Path) -> None:
    flag = tmp_path / "disk-full"
    flag.touch()
    run = tmp_path / "run"
    process = subprocess.Popen(
        command(run, cache_dir, "train.max_steps=12", f"debug.storage_fault_file={flag}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def heal_after_the_first_failed_final_save() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(e["event"] == "checkpoint_failed" for e in read_events(run)):
                time.sleep(1.0)
                flag.unlink()
                return
            time.sleep(0.1)

    healer = threading.Thread(target=heal_after_the_first_failed_final_save)
    healer.start()
    _, stderr = process.communicate(timeout=180)
    healer.join()

    assert process.returncode == 0, stderr[-2000:]
    events = read_events(run)
    assert [e["step"] for e in events if e["event"] == "checkpoint_failed"][:1] == [12]
    assert [e["step"] for e in events if e["event"] == "checkpoint_committed"] == [12]
    assert store_of(run).verify(store_of(run).path("step-00000012")).ok


def test_only_stale_staging_of_this_product_is_removed_at_start(tmp_path: Path, cache_dir: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / ".tmp-my-notes").mkdir()
    (checkpoints / ".tmp-my-notes" / "keep.txt").write_text("not yours")
    stale = checkpoints / ".tmp-step-00000003-0123abcd"  # what an interrupted writer leaves
    stale.mkdir()

    assert train(tmp_path, cache_dir, "train.max_steps=5").returncode == 0

    assert (checkpoints / ".tmp-my-notes" / "keep.txt").read_text() == "not yours"
    assert not stale.exists()


def test_a_read_only_checkpoint_dir_is_one_line_and_exit_2(tmp_path: Path, cache_dir: Path) -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode != 0:
        pytest.skip("needs a private mount namespace (unshare -m) to mount a read-only directory")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    script = f'mount -t tmpfs -o ro,size=1m tmpfs {readonly} && exec "$@"'
    result = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            script,
            "sh",
            *command(tmp_path / "run", cache_dir, "train.max_steps=5", f"checkpoint.dir={readonly}/ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(readonly) in lines[0] and "Traceback" not in result.stderr


def test_two_jobs_on_one_run_never_both_claim_done_without_their_final_state(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Started at the same moment on one run directory: usually the later one is refused (the run's hold);
    if both got past it, fencing lets the newer one commit; a job that exits 0 has its final state standing
    (written by it, or resumed by it at max_steps)."""
    extra = ("checkpoint.every_steps=5", "debug.step_delay=20ms")
    processes = [
        subprocess.Popen(command(tmp_path, cache_dir, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    codes = [p.wait(timeout=180) for p in processes]
    errors = [p.communicate()[1].decode() for p in processes]

    assert 0 in codes and set(codes) <= {0, 1, 2}
    assert all(
        "is held by a live job" in err for code, err in zip(codes, errors, strict=True) if code == 2
    ), errors
    events = read_events(tmp_path)
    final = manifest(tmp_path, STEPS)
    assert store_of(tmp_path).verify(store_of(tmp_path).path(f"step-{STEPS:08d}")).ok
    for done in (e for e in events if e["event"] == "train_done"):
        resumed_at_end = any(
            e["event"] == "resume" and e["pid"] == done["pid"] and e["step"] == STEPS for e in events
        )
        assert final["attempt"] == done["attempt"] or resumed_at_end, (done, final)
    fenced = [e for e in events if e["event"] in ("checkpoint_fenced", "checkpoint_fatal")]
    assert codes.count(1) == len({e["pid"] for e in fenced})


def test_a_checkpoint_damaged_after_it_was_written_is_quarantined_at_the_end(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Bit rot nobody read until now: the job ends with a store in which every listed checkpoint verifies."""
    run = tmp_path / "run"
    process = subprocess.Popen(
        command(run, cache_dir, "checkpoint.every_steps=10", "debug.step_delay=50ms"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    model = run / "checkpoints" / "step-00000020" / "model.pt"
    deadline = time.monotonic() + 120
    while not (model.parent / MANIFEST).exists():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    _, stderr = process.communicate(timeout=180)

    assert process.returncode == 0, stderr[-2000:]
    store = store_of(run)
    assert all(store.verify(info.path).ok for info in store.list_steps(committed_only=False))
    rejected = list((run / "checkpoints" / "rejected").iterdir())
    assert [p.name.split(".")[0] for p in rejected] == ["step-00000020"]
