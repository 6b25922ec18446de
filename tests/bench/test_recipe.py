"""bench recipe: the data split by article, the run_qa-style recipe's windows and post-processing, and both
sides end to end on a tiny random BERT, scored by the product's own scorer."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from elastic_qa.bench.cli import main
from elastic_qa.metrics import best_thresholds, squad_v2_scores
from elastic_qa.prep import synthetic


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT-style QA model with its WordPiece tokenizer (built once for this module)."""
    pytest.importorskip("transformers")
    from elastic_qa.models import tiny

    return tiny.create(tmp_path_factory.mktemp("recipe-model") / "bert", "bert")


def write_articles(path: Path, articles: int, questions_each: int) -> dict[str, Any]:
    """A SQuAD v2 file of synthetic questions (seeded), one paragraph each."""
    examples = synthetic.generate("train", articles * questions_each, seed=11, unanswerable_fraction=0.4)
    document: dict[str, Any] = {"version": "v2.0", "data": []}
    for a in range(articles):
        part = examples[a * questions_each : (a + 1) * questions_each]
        paragraphs = [
            {
                "context": e.context,
                "qas": [
                    {
                        "id": e.id,
                        "question": e.question,
                        "answers": [{"text": x.text, "answer_start": x.start} for x in e.answers],
                        "is_impossible": not e.answers,
                    }
                ],
            }
            for e in part
        ]
        document["data"].append({"title": f"article {a}", "paragraphs": paragraphs})
    path.write_text(json.dumps(document))
    return document


# ---- the recipe's windows and post-processing --------------------------------------------------------
def test_train_windows_point_at_the_answer_or_at_cls(bert: Path) -> None:
    from transformers import AutoTokenizer

    from elastic_qa.bench.recipe_qa import prepare_train_features

    tokenizer = AutoTokenizer.from_pretrained(bert)
    context = "kuli is employed as a fire fighter . the age of zipi is 46 . zipi owns a red lamp ."
    start = context.index("red lamp")
    examples = [
        {"id": "a", "question": "  what does zipi own ?", "context": context,
         "answers": {"text": ["red lamp"], "answer_start": [start]}},
        {"id": "n", "question": "what is the job of zipi ?", "context": context,
         "answers": {"text": [], "answer_start": []}},
    ]  # fmt: skip
    answerable = prepare_train_features(examples[:1], tokenizer, max_seq_len=18, doc_stride=2)
    assert len(answerable["input_ids"]) > 2  # the context overflows one window
    hits = 0
    for ids, s, e in zip(
        *(answerable[k] for k in ("input_ids", "start_positions", "end_positions")), strict=True
    ):
        if s == 0:
            assert e == 0  # [CLS]: the answer is not all in this window
        else:
            hits += 1
            assert tokenizer.decode(ids[s : e + 1]) == "red lamp"
    assert 0 < hits < len(answerable["input_ids"])
    unanswerable = prepare_train_features(examples[1:], tokenizer, max_seq_len=18, doc_stride=2)
    assert set(unanswerable["start_positions"]) == set(unanswerable["end_positions"]) == {0}


def test_postprocessing_takes_the_best_span_and_the_lowest_null_over_windows() -> None:
    from elastic_qa.bench.recipe_qa import postprocess_qa_predictions

    context = "alpha beta gamma delta"
    examples = [{"id": "q", "context": context}]
    # Two windows: positions 0 ([CLS]) and 1 (question) have no offsets; 2.. are context words.
    features = {
        "example_id": ["q", "q"],
        "offset_mapping": [
            [None, None, (0, 5), (6, 10), (11, 16)],
            [None, None, (11, 16), (17, 22), None],
        ],
    }
    start = np.array([[1.0, 9.0, 0.0, 4.0, 0.0], [3.0, 0.0, 0.0, 2.0, 0.0]])
    end = np.array([[1.0, 9.0, 0.0, 4.0, 0.0], [-2.0, 0.0, 0.0, 3.0, 0.0]])
    got = postprocess_qa_predictions(examples, features, start, end, n_best=5, max_answer_len=3)["q"]
    # The question token scores 18 but has no offsets; the best span is "beta" (8), null = min(2, 1) = 1.
    assert got.span == "beta" and got.answer == "beta"
    assert got.null_odds == pytest.approx(1.0 - 8.0)
    end[0, 3] = -10.0  # now the best span is "delta" in window 2 (5) and null 1: still answered
    assert postprocess_qa_predictions(examples, features, start, end, n_best=5)["q"].span == "delta"
    start[1, 0] = 20.0  # window 2's null (18) is not the question's null: the lowest (2) is
    assert postprocess_qa_predictions(examples, features, start, end, n_best=5)["q"].null_odds == -3.0
    start[0, 0] = start[1, 0] = 20.0  # both windows say "not here" more strongly than any span
    unanswered = postprocess_qa_predictions(examples, features, start, end, n_best=5)["q"]
    assert unanswered.answer == "" and unanswered.span == "delta" and unanswered.null_odds > 0


# ---- bad input ---------------------------------------------------------------------------------------
def test_bad_data_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "squad.json"
    write_articles(data, articles=3, questions_each=2)
    model = tmp_path / "model"  # looks like a saved model: no case gets as far as loading it
    model.mkdir()
    (model / "config.json").write_text("{}")
    not_squad = tmp_path / "list.json"
    not_squad.write_text("[]")
    malformed = tmp_path / "malformed.json"
    document = json.loads(data.read_text())
    del document["data"][2]["paragraphs"][0]["qas"][0]["question"]  # in the held-out article
    malformed.write_text(json.dumps(document))
    cases = [
        (["--data", str(tmp_path / "absent.json")], "absent.json: cannot read"),
        (["--data", str(malformed), "--train-articles", "2", "--eval-articles", "1"], "(eval articles)"),
        (["--data", str(not_squad)], "list.json: not SQuAD JSON"),
        (["--data", str(data), "--train-articles", "3", "--eval-articles", "1"], "3 articles, fewer than"),
        (["--data", str(data), "--global-batch", "3"], "--global-batch 3 must be divisible"),
        (["--data", str(data), "--model-dir", str(tmp_path)], "not a saved transformers model"),
    ]
    for extra, said in cases:
        argv = ["recipe", "--model-dir", str(model), "--work-dir", str(tmp_path / "w"), *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err


# ---- end to end --------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.bench
def test_both_sides_end_to_end_are_scored_by_the_product_scorer(tmp_path: Path, bert: Path) -> None:
    data = tmp_path / "squad.json"
    document = write_articles(data, articles=4, questions_each=4)
    out, work = tmp_path / "recipe.json", tmp_path / "work"
    steps = 3
    argv = [
        "recipe",
        "--model-dir", str(bert),
        "--data", str(data),
        "--train-articles", "3",
        "--eval-articles", "1",
        "--answerable-only-train",
        "--steps", str(steps),
        "--global-batch", "4",
        "--max-seq-len", "48",
        "--doc-stride", "8",
        "--processes", "1",
        "--skip", "0",
        "--json", str(out),
        "--work-dir", str(work),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())

    assert result["data"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert result["data"]["train_titles"] == ["article 0", "article 1", "article 2"]
    assert result["data"]["eval_titles"] == ["article 3"]
    assert result["data"]["train_questions"]["unanswerable"] == 0  # --answerable-only-train
    held_out = {p["qas"][0]["id"]: p["qas"][0]["answers"] for p in document["data"][3]["paragraphs"]}
    golds = {qid: [a["text"] for a in answers] for qid, answers in held_out.items()}
    no_answer = sum(1 for answers in held_out.values() if not answers)
    assert 0 < no_answer < len(held_out)  # the held-out article has both kinds (seeded)
    assert result["no_answer_baseline"]["exact"] == pytest.approx(100 * no_answer / len(held_out))

    accelerate = importlib.util.find_spec("accelerate") is not None
    expected = {"product", "hf"} if accelerate else {"product"}
    assert set(result["sides"]) == expected
    if not accelerate:
        assert "accelerate" in result["skipped"]["hf"]
    for side in result["sides"].values():
        assert side["samples_per_s"]["median"] > 0 and side["train_s"]["median"] > 0
        assert side["total_s"]["median"] >= side["train_s"]["median"] and side["cpu_s"]["median"] > 0
        (run,) = side["runs"]
        assert [step for step, _ in run["loss_curve"]] == list(range(1, steps + 1))
        # The figures are the product's scorer applied to what the side predicted: the same code, fed
        # the same predictions, gives the same numbers.
        predicted = json.loads(Path(run["predictions"]).read_text())
        assert set(predicted["answers"]) == set(golds)
        rescored = squad_v2_scores(predicted["answers"], golds)
        rescored.update(best_thresholds(predicted["spans"], golds, predicted["null_odds"]))
        assert run["scores"] == rescored
    product = result["sides"]["product"]["runs"][0]
    assert product["own_eval"]["em"] == pytest.approx(product["scores"]["exact"])  # the run's own eval
    assert product["own_eval"]["f1"] == pytest.approx(product["scores"]["f1"])
    if accelerate:
        comparison = result["comparison"]
        assert comparison["samples_per_s_ratio"] > 0 and isinstance(comparison["goal_quality_met"], bool)
