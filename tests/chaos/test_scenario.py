"""Short chaos scenarios on real torchrun agents: one fault of every kind, then the verdict.

Two scenarios share one fault-free reference run (the same training: only debug and checkpoint settings
differ, which the reference ignores): the original eight kinds, and the five that go after lost data
(the final save, a replay across a corrupt checkpoint, a full log disk, SIGHUP, a second job).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_qa.observe.follow import read_events

pytestmark = pytest.mark.integration

FAULTS = [
    "kill-worker@step=20",
    "join-node@step=35",
    "term-node@step=50",
    "freeze-worker@step=65,for=2s",
    "kill-during-save@step=75",
    "corrupt-checkpoint@step=90",
    "storage-errors@step=100,for=3s",
    "kill-node@step=110",
]
# The log fault comes first: while its window is open, every log line is dropped. The second job starts
# early: it needs seconds to start (torch) while the main job trains on, and the main job must still be
# alive when it checks the run's hold, so that it is refused (exit 2) and fences nothing.
NEW_FAULTS = [
    "hup@step=10",
    "log-full@step=20,for=3s",
    "corrupt-replay@step=40",
    "second-job@step=55",
    "final-storage-errors@step=295,for=3s",
]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos-references")


def run_chaos(
    run_dir: Path, references: Path, cache_dir: Path, faults: list[str], *extra: str, config: str = "tiny"
) -> dict:
    command = [
        sys.executable,
        "-m",
        "chaos",
        "run",
        "--config",
        config,
        "--run-dir",
        str(run_dir),
        "--agents",
        "2",
        "--max",
        "3",
        "--reference-cache",
        str(references),
        "--timeout",
        "400",
        *[arg for fault in faults for arg in ("--fault", fault)],
        f"data.cache_dir={cache_dir}",
        "train.max_steps=150",
        "checkpoint.interval=2s",
        *extra,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    assert report["ok"]
    assert [row["fault"] for row in report["faults"]] == [f.split("@")[0] for f in faults]
    assert all(row["verdict"] == "ok" for row in report["faults"])
    assert report["faults_injected"] == report["faults_requested"] == len(faults)
    return report


def test_a_scenario_with_every_fault_kind_passes_verification(
    tmp_path: Path, cache_dir: Path, references: Path
) -> None:
    """At full speed (no step delay: the steps between two faults take well under a second), which used
    to fail as a loaded machine did: the runner raced the job, a recovery outlasted what was left and
    the later faults were skipped ("the job had already ended"). Now the job waits at each fault's step."""
    run_dir = tmp_path / "run"
    run_chaos(run_dir, references, cache_dir, FAULTS, "debug.save_delay=100ms")
    assert (run_dir / "chaos" / "report.html").stat().st_size > 1000
    assert_injected_while_held(run_dir, FAULTS)


def assert_injected_while_held(run_dir: Path, faults: list[str]) -> None:
    """Each fault was injected while the job was held for it: after its very step, or, where a group
    stopping for a regroup ran past that step (a stop is never held up), after the next group's first
    step beyond it; a join was released only once the joining agent was admitted."""
    rows = [json.loads(line) for line in (run_dir / "chaos" / "faults.jsonl").open()]
    fired = {row["fault"]: row["step"] for row in rows if "fault" in row and "step" in row}
    held = {(e["hold"], e["step"]) for e in read_events(run_dir) if e["event"] == "hold"}
    for fault in faults:
        kind, step = fault.split("@")[0], int(fault.split("=")[1].split(",")[0])
        assert (step, fired[kind]) in held, (fault, fired[kind], sorted(held))
    admitted = [r["why"] for r in rows if r.get("action") == "released" and r["fault"] == "join-node"]
    assert admitted == ["the joining agent was admitted"]


# The same eight faults on a pretrained transformers model (the tiny BERT, hf-tiny): a few minutes, most of
# it the restarts (each imports transformers). Dropout off, as the comparison across world sizes needs.
@pytest.mark.long
def test_a_scenario_with_every_fault_kind_passes_verification_with_an_hf_model(
    tmp_path: Path, cache_dir: Path, references: Path, hf_models: dict[str, Path]
) -> None:
    report = run_chaos(
        tmp_path / "run",
        references,
        cache_dir,
        FAULTS,
        f"model.name_or_path={hf_models['bert']}",
        "model.dropout=0.0",
        "debug.step_delay=50ms",
        "debug.save_delay=100ms",
        config="hf-tiny",
    )
    # The job regrouped at other world sizes (a join, kills), so it matched the reference within 1e-4.
    assert report["checks"]["matches_reference"]["detail"]["world_sizes"] != [2]
    model_pt = next((tmp_path / "run" / "checkpoints").glob("step-*/model.pt"))
    assert any(name.startswith("model.bert.") for name in torch.load(model_pt, weights_only=True))


# About 90 s on two cores, and timing-sensitive on a loaded machine; each of these faults also has a
# deterministic test of its own (tests/test_no_lost_work.py).
@pytest.mark.long
def test_a_scenario_with_every_data_loss_fault_kind_passes_verification(
    tmp_path: Path, cache_dir: Path, references: Path
) -> None:
    # Saves every 15 steps, all kept (milestones): the replay saves the corrupted step again, and it stays.
    saves = ("checkpoint.interval=30m", "checkpoint.every_steps=15", "checkpoint.keep_every_steps=15")
    report = run_chaos(
        tmp_path / "run",
        references,
        cache_dir,
        NEW_FAULTS,
        "train.max_steps=300",
        "debug.step_delay=100ms",
        *saves,
    )
    rows = {row["fault"]: row for row in report["faults"]}
    assert rows["hup"]["lost"] == 0
    assert "refused" in rows["second-job"]["note"]  # the live job held its run: no attempt, no restart
    corrupted = next(
        json.loads(line)
        for line in (tmp_path / "run" / "chaos" / "faults.jsonl").open()
        if '"corrupt-replay"' in line and '"checkpoint_step"' in line
    )
    checkpoints = tmp_path / "run" / "checkpoints"
    assert len(list((checkpoints / "rejected").glob(f"step-{corrupted['checkpoint_step']:08d}.*"))) == 1
    replayed = json.loads(
        (checkpoints / f"step-{corrupted['checkpoint_step']:08d}" / "manifest.json").read_text()
    )
    assert replayed["attempt"] > corrupted["copy_attempt"]
