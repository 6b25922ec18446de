"""`elastic-qa export` and loading for prediction: the exported model is the checkpoint's, and bad input
(paths, a non-empty --out, edited files) is one line and exit 2 with nothing valid overwritten."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from elastic_qa.checkpoint.locate import load_checkpoint
from elastic_qa.cli import main
from elastic_qa.data.cache import VOCAB_FILE
from elastic_qa.data.loader import collate
from elastic_qa.evaluation import predict
from elastic_qa.export import CONFIG_FILE, EXPORT_FILE, load_for_prediction
from elastic_qa.models import model_inputs
from elastic_qa.prep.sources import read_squad
from tests.conftest import FIXTURES, train_tiny

CPU = torch.device("cpu")


def run_main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def exported(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "model"
    assert main(["export", str(trained), "--out", str(out)]) == 0
    return out


def test_an_export_holds_safetensors_weights_the_config_and_a_record_of_every_file(exported: Path) -> None:
    assert sorted(p.name for p in exported.iterdir()) == sorted(
        ["model.safetensors", CONFIG_FILE, EXPORT_FILE]
    )
    record = json.loads((exported / EXPORT_FILE).read_text())
    assert (record["kind"], record["step"]) == ("native", 30)
    assert set(record["files"]) == {"model.safetensors", CONFIG_FILE}
    assert record["tokenizer"]["tokenizer"] == "word"


def test_the_exported_model_gives_the_checkpoints_logits_and_answers(trained: Path, exported: Path) -> None:
    original = load_for_prediction(str(trained / "checkpoints"), CPU)
    reloaded = load_for_prediction(str(exported), CPU)
    assert reloaded.step == original.step == 30
    assert reloaded.cfg.to_dict() == original.cfg.to_dict()
    examples, _ = read_squad(str(FIXTURES / "squad-v2-dev-sample.json"))
    features = original.family.features(examples, original.cfg)
    batch = collate(features, torch.arange(len(features)).numpy())
    with torch.no_grad():
        for a, b in zip(
            original.model(**model_inputs(batch, CPU)),
            reloaded.model(**model_inputs(batch, CPU)),
            strict=True,
        ):
            assert torch.equal(a, b)
    answers = [predict(m.model, m.family, features, examples, 64, 16, CPU)[0] for m in (original, reloaded)]
    assert answers[0] == answers[1]


@pytest.mark.parametrize(("where", "step"), [("run", 30), ("checkpoints", 30), ("step-00000020", 20)])
def test_export_accepts_a_run_a_checkpoint_directory_or_one_step(
    trained: Path, tmp_path: Path, where: str, step: int
) -> None:
    source = {"run": trained, "checkpoints": trained / "checkpoints"}.get(
        where, trained / "checkpoints" / where
    )
    assert main(["export", str(source), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / EXPORT_FILE).read_text())["step"] == step


def test_export_refuses_a_non_empty_directory_and_replaces_it_only_with_force(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, _, err = run_main(capsys, "export", str(trained), "--out", str(out))
    assert code == 2 and "not empty" in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory left behind
    code, _, err = run_main(capsys, "export", str(trained), "--out", str(out), "--force")
    assert code == 0, err
    assert not (out / "keep.txt").exists() and (out / EXPORT_FILE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_export_never_replaces_the_directory_that_holds_its_checkpoint(
    trained: Path, capsys: pytest.CaptureFixture
) -> None:
    before = sorted(p.name for p in (trained / "checkpoints").iterdir())
    for out in (trained, trained / "checkpoints"):
        code, _, err = run_main(capsys, "export", str(trained / "checkpoints"), "--out", str(out), "--force")
        assert code == 2 and "holds the checkpoint" in err
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == before


def test_export_of_a_bad_checkpoint_leaves_a_non_empty_out_untouched_even_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, _, err = run_main(capsys, "export", str(tmp_path / "nowhere"), "--out", str(out), "--force")
    assert code == 2 and err.startswith("elastic-qa:")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize(
    "args",
    [
        ("export", "/nonexistent/run", "--out", "{tmp}/out"),
        ("export", "{run}", "--out", "{tmp}/file"),
        ("eval", "--checkpoint", "/nonexistent/run", "--out", "{tmp}"),
        ("eval", "--checkpoint", "{run}", "--out", "{tmp}/file"),
        ("ask", "--checkpoint", "{tmp}/empty", "--context", "a", "--question", "b"),
    ],
)
def test_bad_paths_are_one_clear_error_with_exit_2(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture, args: tuple[str, ...]
) -> None:
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "empty").mkdir()
    code, _, err = run_main(capsys, *(a.format(tmp=tmp_path, run=trained) for a in args))
    assert code == 2
    assert err.startswith("elastic-qa:") and len(err.strip().splitlines()) == 1
    assert (tmp_path / "file").read_text() == "not a directory"


def test_an_edited_export_is_refused_by_eval_and_ask(
    exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in exported.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (copy / "model.safetensors").write_bytes(bytes(weights))
    code, _, err = run_main(capsys, "ask", "--checkpoint", str(copy), "--context", "a b", "--question", "b")
    assert code == 2 and "sha256" in err


@pytest.fixture(scope="module")
def wordpiece_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A tiny run on a trained wordpiece vocabulary whose feature cache is deleted after training: the
    run directory, that cache directory and the vocabulary's text."""
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("wordpiece")
    cache = root / "cache"
    train_tiny(root / "run", cache, "data.tokenizer=wordpiece", "data.vocab_size=1000", "train.max_steps=10")
    [vocabulary] = [p.read_text() for p in cache.glob("*/tokenizer.json")]
    shutil.rmtree(cache)
    return root / "run", cache, vocabulary


def test_a_wordpiece_model_answers_and_exports_with_its_own_vocabulary_once_its_cache_is_gone(
    wordpiece_run: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run, cache, vocabulary = wordpiece_run
    assert load_checkpoint(str(run)).trainer["vocabulary"] == vocabulary
    context = "bako lives in rome . bako owns a red car ."
    question = (
        "--context",
        context,
        "--question",
        "where does bako live ?",
        "--null-threshold=1e9",
        "--json",
    )
    code, out, err = run_main(capsys, "ask", "--checkpoint", str(run), *question)
    assert code == 0, err
    answered = json.loads(out)
    assert answered["answer"] and context[answered["start"] : answered["end"]] == answered["answer"]
    code, _, err = run_main(capsys, "export", str(run), "--out", str(tmp_path / "model"))
    assert code == 0, err
    assert (tmp_path / "model" / VOCAB_FILE).read_text() == vocabulary
    assert VOCAB_FILE in json.loads((tmp_path / "model" / EXPORT_FILE).read_text())["files"]
    assert not list(cache.glob("*/meta.json"))  # no feature cache was built for any of this
    # the export stands alone: moved, with no cache anywhere, it answers the same
    moved = shutil.move(tmp_path / "model", tmp_path / "moved")
    shutil.rmtree(cache)
    code, out, err = run_main(capsys, "ask", "--checkpoint", str(moved), *question)
    assert code == 0, err
    assert json.loads(out) == answered


def _tree(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    "out",
    [
        "{run}/checkpoints/step-00000030/my-export",  # rotation prunes step 30, and the export with it
        "{run}/checkpoints/my-export",
        "{run}/logs/my-export",
        "{tmp}/link-to-checkpoints/my-export",  # through a symlink
        "{tmp}/link-to-run/checkpoints/step-00000020/../my-export",  # through a symlink and `..`
    ],
)
def test_export_refuses_an_out_inside_a_checkpoint_directory_or_the_runs_logs(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture, out: str
) -> None:
    (tmp_path / "link-to-checkpoints").symlink_to(trained / "checkpoints")
    (tmp_path / "link-to-run").symlink_to(trained)
    before = _tree(trained)
    target = out.format(run=trained, tmp=tmp_path)
    code, _, err = run_main(capsys, "export", str(trained / "checkpoints" / "step-00000020"), "--out", target)
    assert code == 2, err
    assert err.startswith(f"elastic-qa: --out {target}: inside the ") and len(err.strip().splitlines()) == 1
    assert _tree(trained) == before


def test_a_relative_out_is_resolved_before_it_is_judged(
    trained: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(trained / "checkpoints" / "step-00000030")
    before = _tree(trained)
    code, _, err = run_main(capsys, "export", str(trained), "--out", "my-export")
    assert code == 2 and "inside the checkpoint step directory" in err
    code, _, err = run_main(capsys, "eval", "--checkpoint", str(trained))  # --out defaults to .
    assert code == 2 and "inside the checkpoint step directory" in err
    assert _tree(trained) == before


def test_eval_and_report_refuse_an_out_the_trainer_deletes(
    trained: Path, capsys: pytest.CaptureFixture
) -> None:
    before = _tree(trained)
    out = trained / "checkpoints" / "step-00000020" / "scores"
    code, _, err = run_main(capsys, "eval", "--checkpoint", str(trained), "--out", str(out))
    assert code == 2 and "inside the checkpoint step directory" in err
    code, _, err = run_main(capsys, "report", str(trained), "--out", str(trained / "logs" / "report.html"))
    assert code == 2 and "inside the run's logs" in err
    assert _tree(trained) == before


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_follow_the_umask(trained: Path, tmp_path: Path, umask: int) -> None:
    previous = os.umask(umask)
    try:
        assert main(["export", str(trained), "--out", str(tmp_path / "out")]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert modes == {name: 0o666 & ~umask for name in ["model.safetensors", CONFIG_FILE, EXPORT_FILE]}
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask


def test_an_out_merely_named_like_a_step_directory_is_accepted(trained: Path, tmp_path: Path) -> None:
    """Exports of your own named by step are not checkpoints: nothing prunes them."""
    for step in ("step-00000020", "step-00000030"):
        source = trained / "checkpoints" / step
        assert main(["export", str(source), "--out", str(tmp_path / "exports" / step)]) == 0
    assert main(["export", str(trained), "--out", str(tmp_path / "exports" / "step-00000030" / "again")]) == 0
