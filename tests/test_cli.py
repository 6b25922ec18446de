"""`elastic-qa prepare | eval | ask` on a real (tiny) checkpoint, on the CPU, without torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, train_tiny


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic_qa.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    train_tiny(run_dir, cache_dir, "train.max_steps=30", "checkpoint.every_steps=10")
    return run_dir


def test_prepare_builds_the_cache_and_reports_its_size(tmp_path: Path) -> None:
    result = cli("prepare", "--config", "tiny", f"data.cache_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "2000 training windows" in result.stdout
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 1


def test_prepare_refuses_zero_workers_with_exit_2(tmp_path: Path) -> None:
    result = cli("prepare", "--config", "tiny", "--workers", "0", f"data.cache_dir={tmp_path}")
    assert result.returncode == 2 and "--workers" in result.stderr and "'0'" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_eval_scores_the_newest_checkpoint_and_a_given_step(trained: Path) -> None:
    newest = cli("eval", "--checkpoint", str(trained / "checkpoints"))
    assert newest.returncode == 0, newest.stderr
    assert "(step 30)" in newest.stdout and "EM" in newest.stdout
    older = cli("eval", "--checkpoint", str(trained / "checkpoints" / "step-00000020"))
    assert older.returncode == 0 and "(step 20)" in older.stdout


def test_eval_on_a_squad_file_with_an_unanswerable_and_a_chinese_question(trained: Path) -> None:
    result = cli(
        "eval",
        "--checkpoint",
        str(trained / "checkpoints"),
        "--data",
        str(FIXTURES / "squad-v2-handwritten.json"),
    )
    assert result.returncode == 0, result.stderr
    assert "questions" in result.stdout


def test_ask_answers_from_the_context_or_says_there_is_no_answer(trained: Path) -> None:
    result = cli(
        "ask",
        "--checkpoint",
        str(trained / "checkpoints"),
        "--context",
        "bako lives in rome . bako owns a red car .",
        "--question",
        "where does bako live ?",
    )
    assert result.returncode == 0, result.stderr
    answer = result.stdout.strip()
    assert answer == "(no answer in the context)" or answer in "bako lives in rome . bako owns a red car ."


@pytest.mark.parametrize(
    "args",
    [
        ("eval", "--checkpoint", "/nonexistent/checkpoints"),
        ("ask", "--checkpoint", "/nonexistent", "--context", "a", "--question", "b"),
    ],
)
def test_a_missing_checkpoint_is_one_clear_error_with_exit_2(args: tuple[str, ...]) -> None:
    result = cli(*args)
    assert result.returncode == 2
    assert result.stderr.startswith("elastic-qa:") and len(result.stderr.strip().splitlines()) == 1
