"""An exported hf model answers in transformers' question-answering pipeline exactly as `elastic-qa ask`.

transformers 5 removed that pipeline, so it runs in a subprocess from a transformers 4 install: the
directory ELASTIC_QA_TRANSFORMERS4 names (`.ci/run` installs one in .venv/transformers4). The model is a tiny
BERT-style one fine-tuned for a few hundred steps, so that its spans and null scores are learnt, not noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_qa.cli import main
from elastic_qa.config import Config, load_config
from elastic_qa.data.examples import QAExample
from elastic_qa.export import CONFIG_FILE
from elastic_qa.models import family_for
from elastic_qa.prep import synthetic

pytest.importorskip("transformers")

TRANSFORMERS4 = os.environ.get("ELASTIC_QA_TRANSFORMERS4", "")
pytestmark = pytest.mark.skipif(
    not TRANSFORMERS4,
    reason="set ELASTIC_QA_TRANSFORMERS4 to a directory holding transformers 4 (`python -m pip install "
    "--target DIR transformers==4.57.6 tokenizers==0.22.1`, as .ci/run does)",
)

# One pipeline for every question; prints the transformers version it ran with and the answers.
PIPELINE = """
import json, sys
import transformers
request = json.load(sys.stdin)
qa = transformers.pipeline(
    "question-answering", model=request["model"], tokenizer=request["model"], device="cpu"
)
answers = [qa(question=q, context=c, **request["arguments"]) for q, c in request["questions"]]
json.dump({"version": transformers.__version__, "answers": answers}, sys.stdout)
"""


def pipeline_arguments(cfg: Config) -> dict:
    """The pipeline's arguments that decide as `ask` does with this config (see docs/evaluation.md)."""
    return {
        "max_seq_len": cfg.data.max_seq_len,
        "doc_stride": cfg.data.doc_stride,  # both: tokens shared by consecutive windows
        "max_answer_len": cfg.data.max_answer_len,
        "handle_impossible_answer": True,  # "" when [CLS] beats the best span: null_threshold 0
        "align_to_words": False,  # ask answers the tokens' characters, not whole words
        "top_k": 1,
    }


def pipeline_answers(model: Path, questions: list[tuple[str, str]], arguments: dict) -> list[dict]:
    request = {"model": str(model), "questions": questions, "arguments": arguments}
    env = {**os.environ, "PYTHONPATH": TRANSFORMERS4, "HF_HUB_OFFLINE": "1"}  # transformers 4 first
    result = subprocess.run(
        [sys.executable, "-c", PIPELINE],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reply = json.loads(result.stdout)
    assert reply["version"].startswith("4."), f"{TRANSFORMERS4} holds transformers {reply['version']}"
    return reply["answers"]


def ask(model: Path, question: str, context: str, capsys: pytest.CaptureFixture) -> dict:
    capsys.readouterr()
    args = ["ask", "--checkpoint", str(model), "--question", question, "--context", context, "--json"]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def exported(hf_models: dict[str, Path], cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BERT fine-tuned for 600 steps on the synthetic task, exported (300 left it answering only 3 of
    the 32 questions below since its loss reads every position: too close to "no answer" everywhere). A third
    of the questions unanswerable, so that it learns to say so too. eval.n_best covers every token of a
    window: ask then searches all spans, as the pipeline does."""
    root = tmp_path_factory.mktemp("hf-pipeline")
    command = [
        sys.executable, "-m", "elastic_qa.train", "--config", "hf-tiny",
        f"model.name_or_path={hf_models['bert']}", f"run.dir={root / 'run'}", f"data.cache_dir={cache_dir}",
        "data.synthetic.unanswerable_fraction=0.3", "train.max_steps=600", "train.lr=3e-3", "train.threads=1",
        "eval.n_best=64", "log.console=none",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert main(["export", str(root / "run"), "--out", str(root / "export")]) == 0
    return root / "export"


def single_window_questions(cfg: Config, count: int) -> list[QAExample]:
    """Held-out synthetic questions (answerable and not) whose context fits one window."""
    examples = synthetic.generate("eval", 2 * count, seed=99, unanswerable_fraction=0.3)
    windows = family_for(cfg.model).features(examples, cfg).example_index.tolist()
    single = [e for i, e in enumerate(examples) if windows.count(i) == 1][:count]
    assert len(single) == count
    return single


def test_the_pipeline_with_asks_settings_gives_asks_answers_on_single_window_contexts(
    exported: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = load_config(exported / CONFIG_FILE)
    questions = [(e.question, e.context) for e in single_window_questions(cfg, 32)]
    replies = [ask(exported, q, c, capsys) for q, c in questions]
    answers = pipeline_answers(exported, questions, pipeline_arguments(cfg))
    # Both ways out are taken: answers, and "no answer" where [CLS] outscores every span.
    assert any(r["answer"] for r in replies) and any(not r["answer"] for r in replies)
    for (question, context), reply, answer in zip(questions, replies, answers, strict=True):
        seen = (answer["answer"], answer["start"], answer["end"])
        if reply["answer"]:
            assert seen == (reply["answer"], reply["start"], reply["end"]), (question, context)
            assert context[reply["start"] : reply["end"]] == reply["answer"]
        else:  # the pipeline's "no answer" is the empty string at 0..0
            assert seen == ("", 0, 0), (question, context)
