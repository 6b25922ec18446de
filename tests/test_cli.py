"""`elastic-qa prepare | eval | ask` on a real (tiny) checkpoint, on the CPU, without torchrun."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic_qa import __version__
from elastic_qa.cli import build_parser
from elastic_qa.cli import main as cli_main
from elastic_qa.config import load_config, packaged_config
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


@pytest.mark.parametrize("form", ["run", "step"])
def test_eval_and_ask_take_a_run_directory_or_a_step_directory(trained: Path, form: str, capsys) -> None:
    given = str(trained if form == "run" else trained / "checkpoints" / "step-00000020")
    assert cli_main(["eval", "--checkpoint", given]) == 0
    assert ("(step 30)" if form == "run" else "(step 20)") in capsys.readouterr().out
    question = ["--context", "bako lives in rome .", "--question", "where does bako live ?"]
    assert cli_main(["ask", "--checkpoint", given, *question]) == 0
    assert capsys.readouterr().out.strip()


def test_version_and_a_help_that_lists_every_command_with_help_on_every_option(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"elastic-qa {__version__}"

    parser = build_parser()
    help_text = parser.format_help()
    for command in ("prepare", "config", "eval", "ask", "ckpt", "bench", "chaos", "report", "drift"):
        assert command in help_text
    assert "Exit codes" in help_text
    commands = [parser]
    while commands:  # every option of every command and subcommand
        command = commands.pop()
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                commands += action.choices.values()
            else:
                assert action.help, f"{command.prog} {action.dest} has no help"


def test_bench_help_is_for_users(capsys) -> None:
    assert cli_main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "drift" in out and "Exit codes" in out and "build_parser" not in out


def test_config_show_prints_the_resolved_config_with_the_overrides(capsys) -> None:
    assert cli_main(["config", "show", "--config", "tiny", "train.max_steps=7"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert (
        shown["train"]["max_steps"] == 7
        and shown["model"] == load_config(packaged_config("tiny")).to_dict()["model"]
    )
    assert cli_main(["config", "show", "train.max_stepz=7"]) == 2
