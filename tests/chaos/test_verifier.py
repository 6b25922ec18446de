"""The verifier must be able to fail: doctored evidence is caught, check by check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from chaos.evidence import load_config
from chaos.verify import judge_faults, verify_run
from elastic_qa.checkpoint.state import MODEL_FILE
from elastic_qa.checkpoint.store import CheckpointStore, serialize
from tests.conftest import train_tiny

STEPS = 30


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A real, fault-free single-process run with a ledger: the evidence the tests then doctor."""
    run_dir = tmp_path_factory.mktemp("verified") / "run"
    train_tiny(
        run_dir,
        cache_dir,
        f"train.max_steps={STEPS}",
        "debug.sample_ledger=true",
        "log.every_steps=1",
        "checkpoint.every_steps=10",
        "train.threads=1",
    )
    return run_dir


@pytest.fixture
def copy_of(finished_run: Path, tmp_path: Path):
    def make(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(finished_run, target)
        config = (target / "config.yaml").read_text().replace(str(finished_run), str(target))
        (target / "config.yaml").write_text(config)
        return target

    return make


def ledger_lines(run_dir: Path) -> tuple[Path, list[dict]]:
    path = next((run_dir / "ledger").glob("*.jsonl"))
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_untouched_evidence_passes_every_check(copy_of) -> None:
    run, reference = copy_of("run"), copy_of("reference")
    verdict = verify_run(run, reference)
    assert verdict.ok, verdict.checks
    assert verdict.checks["matches_reference"]["detail"]["bitwise_equal"]


def test_a_duplicated_sample_is_caught(copy_of) -> None:
    run = copy_of("run")
    path, rows = ledger_lines(run)
    rows[4]["samples"][0] = rows[3]["samples"][0]  # step 5 trains on a sample of step 4
    write_lines(path, rows)
    verdict = verify_run(run, copy_of("reference"))
    assert not verdict.checks["exactly_once"]["ok"]
    assert not verdict.ok


def test_a_missing_step_is_caught(copy_of) -> None:
    run = copy_of("run")
    path, rows = ledger_lines(run)
    write_lines(path, [row for row in rows if row["step"] != 7])
    verdict = verify_run(run, copy_of("reference"))
    assert not verdict.checks["exactly_once"]["ok"]
    assert any("missing" in problem for problem in verdict.checks["exactly_once"]["detail"]["problems"])


def test_a_corrupt_retained_checkpoint_is_caught(copy_of) -> None:
    run = copy_of("run")
    victim = run / "checkpoints" / "step-00000020" / "optimizer.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    verdict = verify_run(run, copy_of("reference"))
    assert not verdict.checks["checkpoints"]["ok"]
    assert verdict.checks["matches_reference"]["ok"]  # the final checkpoint is intact


def test_a_final_model_that_differs_is_caught(copy_of) -> None:
    run, reference = copy_of("run"), copy_of("reference")
    cfg = load_config(reference)
    store = CheckpointStore(cfg.checkpoint_dir)
    final = Path(store.path(f"step-{STEPS:08d}"))
    files = {name: (final / name).read_bytes() for name in ("model.pt", "optimizer.pt", "trainer.pt")}
    model = torch.load(final / MODEL_FILE, weights_only=True)
    model["span_head.weight"] = model["span_head.weight"] + 1e-3
    files[MODEL_FILE] = serialize(model)
    manifest = json.loads((final / "manifest.json").read_text())
    store.remove(str(final))
    store.commit(
        STEPS, files, {k: manifest[k] for k in ("epoch", "world_size", "attempt", "config_hash", "versions")}
    )
    verdict = verify_run(run, reference)
    assert verdict.checks["checkpoints"]["ok"] and verdict.checks["exactly_once"]["ok"]
    assert not verdict.checks["matches_reference"]["ok"]
    assert verdict.checks["matches_reference"]["detail"]["relative"] > 0


def _events(*attempts: tuple[float, int, int, int]) -> list[dict]:
    """(start time, world size, resumed step, last step) per attempt -> the log events the judge reads."""
    events = []
    for number, (start, world, resumed, last) in enumerate(attempts, start=1):
        events.append(
            {"event": "worker_start", "ts": start, "attempt": number, "world_size": world, "rank": 0}
        )
        if resumed:
            events.append({"event": "resume", "ts": start + 0.1, "attempt": number, "step": resumed})
        for step in range(resumed + 1, last + 1):
            events.append({"event": "step", "ts": start + 1 + step * 0.01, "attempt": number, "step": step})
    return sorted(events, key=lambda e: e["ts"])


def test_lost_work_beyond_the_bound_of_a_graceful_leave_is_caught() -> None:
    events = _events((0.0, 2, 0, 40), (20.0, 1, 35, 60))  # resumed 5 steps behind
    rows = judge_faults(events, [{"fault": "term-node", "ts": 10.0, "step": 40}], dist_timeout_s=30)
    assert rows[0]["lost"] == 5 and rows[0]["verdict"] == "FAIL"


def test_a_kill_with_survivors_may_lose_one_step_but_not_two() -> None:
    fault = [{"fault": "kill-worker", "ts": 10.0, "step": 40}]
    one = judge_faults(_events((0.0, 2, 0, 40), (20.0, 2, 39, 60)), fault, dist_timeout_s=30)
    two = judge_faults(_events((0.0, 2, 0, 40), (20.0, 2, 38, 60)), fault, dist_timeout_s=30)
    assert one[0]["verdict"] == "ok" and one[0]["recovery_s"] == pytest.approx(11.4, abs=0.01)
    assert two[0]["verdict"] == "FAIL"


def test_a_fault_that_should_restart_the_group_but_did_not_is_caught() -> None:
    rows = judge_faults(_events((0.0, 2, 0, 60)), [{"fault": "kill-node", "ts": 5.0, "step": 30}], 30)
    assert rows[0]["verdict"] == "FAIL"


def test_resuming_from_a_corrupted_copy_is_caught_but_not_from_a_later_recommit() -> None:
    from chaos.verify import resumed_from_corrupted

    corrupt = [{"fault": "corrupt-checkpoint", "ts": 10.0, "checkpoint_step": 40}]
    resume = {"event": "resume", "rank": 0, "ts": 20.0, "step": 40}
    assert resumed_from_corrupted([resume], corrupt) == [40]
    recommit = {"event": "checkpoint_committed", "ts": 15.0, "step": 40}  # the step was replayed and saved
    assert resumed_from_corrupted([recommit, resume], corrupt) == []
