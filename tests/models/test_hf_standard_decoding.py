"""An exported hf model decodes as one trained by transformers' recipe: the standard n-best post-processing
of transformers' question-answering example (run_qa.py: `prepare_validation_features` and
`postprocess_qa_predictions`, SQuAD v2 flavour), written out here with transformers alone, finds a span in
every window and gives the answers `elastic-qa ask` gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from elastic_qa.cli import main
from elastic_qa.data.examples import QAExample
from elastic_qa.observe.follow import read_events
from elastic_qa.prep import synthetic
from tests.models.test_hf import headless

transformers = pytest.importorskip("transformers")

# The run's window settings, which the standard decoding is given as run_qa is given its arguments.
MAX_LEN, QUERY, STRIDE, MAX_ANSWER = 64, 16, 24, 16
N_BEST = 20  # run_qa's --n_best_size default
EMPTY = "empty"  # run_qa's placeholder when no window has a span among its top start and end logits


def windows(tokenizer, question: str, context: str) -> dict:
    """run_qa's prepare_validation_features: padded windows, offsets kept on context tokens only."""
    encoded = tokenizer(
        question.lstrip(),
        context,
        truncation="only_second",
        max_length=MAX_LEN,
        stride=STRIDE,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length",
    )
    encoded["offset_mapping"] = [
        [span if encoded.sequence_ids(row)[p] == 1 else None for p, span in enumerate(spans)]
        for row, spans in enumerate(encoded["offset_mapping"])
    ]
    return encoded


def spans_in(start: np.ndarray, end: np.ndarray, offsets: list) -> list[tuple[float, int, int]]:
    """run_qa's candidates of one window: the top N_BEST start and end indices over *all* positions,
    kept when both are context tokens, in order, and at most MAX_ANSWER tokens apart."""
    found = []
    for s in np.argsort(start)[-1 : -N_BEST - 1 : -1].tolist():
        for e in np.argsort(end)[-1 : -N_BEST - 1 : -1].tolist():
            if offsets[s] is None or offsets[e] is None or e < s or e - s + 1 > MAX_ANSWER:
                continue
            found.append((float(start[s] + end[e]), offsets[s][0], offsets[e][1]))
    return found


def standard_answer(
    model, tokenizer, question: str, context: str, null_threshold: float = 0.0
) -> tuple[str, int, int]:
    """run_qa's answer ("" for no answer above its null_score_diff_threshold), its windows, and how many
    of them had no span among their candidates."""
    encoded = windows(tokenizer, question, context)
    inputs = {name: torch.tensor(encoded[name]) for name in tokenizer.model_input_names}
    with torch.no_grad():
        output = model(**inputs)
    null, best, without_span = float("inf"), None, 0
    for row in range(len(encoded["input_ids"])):
        start, end = output.start_logits[row].numpy(), output.end_logits[row].numpy()
        null = min(null, float(start[0] + end[0]))
        found = spans_in(start, end, encoded["offset_mapping"][row])
        without_span += not found
        for candidate in found:
            if best is None or candidate[0] > best[0]:
                best = candidate
    count = len(encoded["input_ids"])
    if best is None:
        return EMPTY, count, without_span
    score, first, last = best
    return ("" if null - score > null_threshold else context[first:last]), count, without_span


@pytest.fixture(scope="module")
def exported(hf_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A tiny BERT encoder (no QA head) trained briefly on synthetic questions, exported."""
    root = tmp_path_factory.mktemp("standard-decoding")
    base = headless(hf_models["bert"], root / "base")
    command = [
        sys.executable, "-m", "elastic_qa.train", "--config", "hf-tiny",
        f"model.name_or_path={base}", f"run.dir={root / 'run'}", f"data.cache_dir={cache_dir}",
        f"data.max_seq_len={MAX_LEN}", f"data.max_query_len={QUERY}", f"data.doc_stride={STRIDE}",
        f"data.max_answer_len={MAX_ANSWER}", "train.max_steps=60", "log.console=none",
        "data.synthetic.train_examples=480", "data.synthetic.eval_examples=16",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # The new head is said once, in the run's own words; transformers' table is not printed.
    assert "LOAD REPORT" not in result.stderr and "MISSING" not in result.stderr
    fresh = [e for e in read_events(root / "run") if e["event"] == "start_fresh"]
    assert [e["newly_initialized"] for e in fresh] == [["qa_outputs.bias", "qa_outputs.weight"]]
    assert main(["export", str(root / "run"), "--out", str(root / "export")]) == 0
    return root / "export"


def held_out(count: int) -> list[QAExample]:
    """Questions the run never trained on (a split of their own, in the world of the run's seed); every
    second one reads its context among the next four, so that it spans several windows."""
    examples = synthetic.generate("heldout", count + 4, seed=7, unanswerable_fraction=0.2)
    return [
        e if i % 2 == 0 else QAExample(e.id, e.question, " ".join(x.context for x in examples[i : i + 4]), ())
        for i, e in enumerate(examples[:count])
    ]


def test_the_standard_decoding_finds_a_span_in_every_window_of_an_export(exported: Path) -> None:
    model = transformers.AutoModelForQuestionAnswering.from_pretrained(exported).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    total = without_span = 0
    for example in held_out(200):
        _, count, missed = standard_answer(model, tokenizer, example.question, example.context)
        total, without_span = total + count, without_span + missed
    assert total > 200 and without_span == 0, f"{without_span} of {total} windows had no span"


def test_the_standard_decoding_of_an_export_answers_as_elastic_qa_ask(
    exported: Path, capsys: pytest.CaptureFixture
) -> None:
    model = transformers.AutoModelForQuestionAnswering.from_pretrained(exported).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    capsys.readouterr()
    spans = set()
    for example in held_out(10):
        # the default threshold, and one no null score passes: the best span itself
        for threshold in (0.0, 1e9):
            expected, _, _ = standard_answer(model, tokenizer, example.question, example.context, threshold)
            args = ["ask", "--checkpoint", str(exported), "--context", example.context, "--question"]
            assert main([*args, example.question, "--json", f"--null-threshold={threshold}"]) == 0
            reply = json.loads(capsys.readouterr().out)
            assert reply["answer"] == expected, (example.id, threshold)
        spans.add(expected)
    assert "" not in spans and len(spans) > 1  # real spans, not one constant answer
