"""`elastic-qa prepare | eval | ask` on a real (tiny) checkpoint, on the CPU, without torchrun."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic_qa import __version__
from elastic_qa.cli import build_parser, main
from elastic_qa.config import load_config, packaged_config
from elastic_qa.metrics import squad_v2_scores
from elastic_qa.prep.sources import read_squad
from tests.conftest import FIXTURES


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic_qa.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_prepare_builds_the_cache_and_reports_its_size(tmp_path: Path) -> None:
    result = cli("prepare", "--config", "tiny", f"data.cache_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "2000 training windows" in result.stdout
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 1


def test_prepare_of_the_native_model_never_imports_torch(tmp_path: Path) -> None:
    # Preparing data is often a CPU job of its own: it should not pay the second torch takes to import.
    code = (
        "import sys; from elastic_qa.cli import main; "
        f"code = main(['prepare', '--config', 'tiny', '--workers', '2', 'data.cache_dir={tmp_path}']); "
        "print('torch' in sys.modules); sys.exit(code)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"


def test_prepare_refuses_zero_workers_with_exit_2(tmp_path: Path) -> None:
    result = cli("prepare", "--config", "tiny", "--workers", "0", f"data.cache_dir={tmp_path}")
    assert result.returncode == 2 and "--workers" in result.stderr and "'0'" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", [None, "not json", "specials elsewhere"])
def test_prepare_with_a_bad_vocab_file_exits_2_naming_the_file_and_builds_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, content: str | None
) -> None:
    pytest.importorskip("tokenizers")
    from elastic_qa.prep import wordpiece

    vocab = tmp_path / "vocab.json"
    if content == "not json":
        vocab.write_text("[PAD] [CLS] [SEP] [UNK]\nparis\n")  # a vocab.txt is not a tokenizer.json
    elif content is not None:
        definition = json.loads(wordpiece.train(lambda: ["Paris is in France"] * 5, 300, lowercase=True))
        definition["model"]["vocab"] = {"[UNK]": 0, "[PAD]": 1, "[CLS]": 2, "[SEP]": 3, "paris": 4}
        definition["added_tokens"] = []
        vocab.write_text(json.dumps(definition))
    cache = tmp_path / "cache"
    overrides = ["data.tokenizer=wordpiece", f"data.vocab_file={vocab}", f"data.cache_dir={cache}"]
    assert main(["prepare", "--config", "tiny", *overrides]) == 2
    err = capsys.readouterr().err
    assert f"data.vocab_file='{vocab}'" in err and len(err.strip().splitlines()) == 1
    assert not cache.exists() or not [p for p in cache.iterdir() if p.is_dir()]


def test_eval_scores_the_newest_checkpoint_and_a_given_step(trained: Path, tmp_path: Path) -> None:
    newest = cli("eval", "--checkpoint", str(trained / "checkpoints"), "--out", str(tmp_path))
    assert newest.returncode == 0, newest.stderr
    assert "(step 30)" in newest.stdout and "EM" in newest.stdout
    older = cli(
        "eval", "--checkpoint", str(trained / "checkpoints" / "step-00000020"), "--out", str(tmp_path)
    )
    assert older.returncode == 0 and "(step 20)" in older.stdout


def test_eval_on_a_squad_file_with_an_unanswerable_and_a_chinese_question(
    trained: Path, tmp_path: Path
) -> None:
    data = FIXTURES / "squad-v2-handwritten.json"
    result = cli("eval", "--checkpoint", str(trained), "--data", str(data), "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "HasAns" in result.stdout and "NoAns" in result.stdout and "best" in result.stdout


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


# ---- eval's files and ask --json, in process ------------------------------------------------------------


def run_main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_eval_writes_predictions_and_null_odds_in_the_official_format(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = FIXTURES / "squad-v2-dev-sample.json"
    examples, _ = read_squad(str(data))
    args = ("--checkpoint", str(trained), "--data", str(data), "--out", str(tmp_path), "--json")
    code, out, err = run_main(capsys, "eval", *args)
    assert code == 0, err
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    null_odds = json.loads((tmp_path / "null_odds.json").read_text())
    assert set(predictions) == set(null_odds) == {e.id for e in examples}
    assert all(isinstance(v, str) for v in predictions.values())
    assert all(isinstance(v, float) for v in null_odds.values())
    contexts = {e.id: e.context for e in examples}
    for qid, answer in predictions.items():
        assert (answer == "") == (null_odds[qid] > 0.0)  # eval.null_threshold's default
        assert answer in contexts[qid]
    scores = json.loads(out)
    golds = {e.id: [a.text for a in e.answers] for e in examples}
    assert scores["total"] == len(examples)
    assert scores["HasAns_total"] + scores["NoAns_total"] == len(examples)
    expected = squad_v2_scores(predictions, golds)
    assert {k: scores[k] for k in expected} == pytest.approx(expected)
    assert {"best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh"} <= set(scores)


def test_eval_null_threshold_overrides_the_config(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = str(FIXTURES / "squad-v2-dev-sample.json")
    args = ("--checkpoint", str(trained), "--data", data, "--out", str(tmp_path), "--null-threshold", "1e9")
    code, _, err = run_main(capsys, "eval", *args)
    assert code == 0, err
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    assert all(predictions.values())  # every question answered: no null_odds exceed 1e9


def test_ask_json_gives_the_answer_its_character_span_and_null_odds(
    trained: Path, capsys: pytest.CaptureFixture
) -> None:
    context = "bako lives in rome . bako owns a red car ."
    for threshold in ("-1e9", "1e9"):
        args = ("--checkpoint", str(trained / "checkpoints"), "--context", context, "--json")
        code, out, err = run_main(
            capsys, "ask", *args, "--question", "where does bako live ?", f"--null-threshold={threshold}"
        )
        assert code == 0, err
        reply = json.loads(out)
        assert set(reply) == {"answer", "start", "end", "score", "null_odds", "null_threshold", "best_span"}
        span = reply["best_span"]
        assert context[span["start"] : span["end"]] == span["text"]
        if threshold == "-1e9":  # nothing is answered
            assert (reply["answer"], reply["start"], reply["end"]) == ("", None, None)
        else:
            assert reply["answer"] == span["text"] == context[reply["start"] : reply["end"]]


@pytest.mark.parametrize("form", ["run", "step"])
def test_eval_and_ask_take_a_run_directory_or_a_step_directory(
    trained: Path, form: str, tmp_path: Path, capsys
) -> None:
    given = str(trained if form == "run" else trained / "checkpoints" / "step-00000020")
    assert main(["eval", "--checkpoint", given, "--out", str(tmp_path)]) == 0
    assert ("(step 30)" if form == "run" else "(step 20)") in capsys.readouterr().out
    question = ["--context", "bako lives in rome .", "--question", "where does bako live ?"]
    assert main(["ask", "--checkpoint", given, *question]) == 0
    assert capsys.readouterr().out.strip()


def test_version_and_a_help_that_lists_every_command_with_help_on_every_option(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
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
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "drift" in out and "Exit codes" in out and "build_parser" not in out


def test_config_show_prints_the_resolved_config_with_the_overrides(capsys) -> None:
    assert main(["config", "show", "--config", "tiny", "train.max_steps=7"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert (
        shown["train"]["max_steps"] == 7
        and shown["model"] == load_config(packaged_config("tiny")).to_dict()["model"]
    )
    assert main(["config", "show", "train.max_stepz=7"]) == 2


def test_config_show_prints_an_hf_config_without_a_model_and_notes_that_training_refuses_it(capsys) -> None:
    assert main(["config", "show", "--config", "hf-tiny"]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["model"] == {
        **load_config(packaged_config("hf-tiny"), ["model.name_or_path=x"]).to_dict()["model"],
        "name_or_path": "",
    }
    assert err.splitlines() == [
        "elastic-qa: note: model.name_or_path='': needed by kind=hf (training refuses this config until it "
        "is set)"
    ]
    assert main(["prepare", "--config", "hf-tiny"]) == 2
    assert capsys.readouterr().err.splitlines() == ["elastic-qa: model.name_or_path='': needed by kind=hf"]


def recipe_block(out: str) -> list[str]:
    lines = out.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("#")) :]


def test_config_show_lists_every_hf_setting_that_differs_from_run_qa_after_the_config(capsys) -> None:
    overrides = ["model.name_or_path=x", "train.lr=1e-4", "data.max_query_len=64", "model.dropout=0.1"]
    assert main(["config", "show", "--config", "hf-base", *overrides]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["train"]["lr"] == 1e-4  # the block is YAML comments: the config still reads
    assert recipe_block(out) == [
        "# differs from transformers' run_qa.py recipe (key: value here, recipe's value):",
        "#   model.dropout: 0.1, recipe null (the model's own)",
        "#   data.max_query_len: 64, recipe 0",
        "#   train.lr: 0.0001, recipe 3.0e-05",
        "#   train.freeze_loss_invariant: true, recipe false",
    ]
    assert main(["config", "show", "--config", "hf-base", "train.freeze_loss_invariant=false"]) == 0
    assert recipe_block(capsys.readouterr().out) == [
        "# every setting of transformers' run_qa.py recipe is as run_qa sets it"
    ]
    assert main(["config", "show", "--config", "tiny"]) == 0  # native: the recipe is for pretrained models
    assert "#" not in capsys.readouterr().out


# ---- where output cannot go ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [("ckpt", "show", "RUN"), ("ckpt", "list", "RUN"), ("config", "show", "--config", "tiny")],
    ids=["ckpt show", "ckpt list", "config show"],
)
def test_a_command_whose_stdout_reader_left_ends_quietly_with_the_status_sigpipe_gives(
    trained: Path, command: tuple[str, ...]
) -> None:
    """`elastic-qa ckpt show RUN | head -1`: the reader here closes before reading a byte, so every line
    the command prints meets a broken pipe; that is no fault of RUN, and no traceback either."""
    reader, writer = os.pipe()
    os.close(reader)
    args = [str(trained) if arg == "RUN" else arg for arg in command]
    with os.fdopen(writer, "wb") as stdout:
        result = subprocess.run(
            [sys.executable, "-m", "elastic_qa.cli", *args],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert (result.returncode, result.stderr) == (128 + signal.SIGPIPE, "")


def test_eval_into_a_directory_that_cannot_be_made_exits_2_in_one_line_before_evaluating(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "a-file").write_text("mine\n")
    out = tmp_path / "a-file" / "scores"  # root can write anywhere, but not below a regular file
    data = str(tmp_path / "absent.json")  # read only once the evaluation starts: never, here
    code, printed, said = run_main(
        capsys, "eval", "--checkpoint", str(trained), "--data", data, "--out", str(out)
    )
    assert (code, printed) == (2, "")
    assert said == f"elastic-qa: --out {out}: cannot be written: {tmp_path / 'a-file'} is not a directory\n"
    assert (tmp_path / "a-file").read_text() == "mine\n"


def test_an_export_below_a_regular_file_exits_2_in_one_line(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "a-file").touch()
    out = tmp_path / "a-file" / "model"
    code, _, said = run_main(capsys, "export", str(trained), "--out", str(out))
    assert (code, said) == (
        2,
        f"elastic-qa: --out {out}: cannot be written: {out.parent} is not a directory\n",
    )


def test_a_report_that_cannot_be_written_exits_2_in_one_line(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "a-file").touch()
    out = tmp_path / "a-file" / "report.html"
    code, _, said = run_main(capsys, "report", str(trained), "--out", str(out))
    assert (code, said) == (
        2,
        f"elastic-qa: --out {out}: cannot be written: {out.parent} is not a directory\n",
    )
    code, _, said = run_main(capsys, "report", str(trained), "--out", str(tmp_path))
    assert (code, said) == (2, f"elastic-qa: --out {tmp_path}: is a directory; name the file to write\n")
