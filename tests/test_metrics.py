"""SQuAD v2 exact match and F1, splits and threshold search: by hand, and against the official definitions."""

from __future__ import annotations

import collections
import random
import re
import string

import pytest

from elastic_qa.metrics import (
    best_thresholds,
    exact_match,
    f1_score,
    gold_answers,
    normalize_answer,
    squad_scores,
    squad_v2_scores,
)
from elastic_qa.prep.sources import read_squad
from tests.conftest import FIXTURES


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  an   apple\ta day\n", "apple day"),
        ("A.B.C.", "abc"),
        ("Rock 'n' Roll!", "rock n roll"),
        ("theory of the atom", "theory of atom"),
        ("Anthem", "anthem"),  # "an" inside a word is not an article
        ("", ""),
    ],
)
def test_normalisation_lowers_case_and_drops_punctuation_articles_and_extra_spaces(text, normal):
    assert normalize_answer(text) == normal


def test_exact_match_compares_normalised_answers():
    assert exact_match("the Normans.", "Normans") == 1.0
    assert exact_match("Normans", "Norman") == 0.0


@pytest.mark.parametrize(
    ("prediction", "gold", "f1"),
    [
        ("quick brown fox", "quick brown fox", 1.0),
        ("the quick fox", "quick brown fox", 0.8),  # p = 2/2, r = 2/3
        ("quick brown fox jumps", "brown fox", 2 / 3),  # p = 2/4, r = 2/2
        ("fox fox fox", "fox", 0.5),  # repeated tokens count once per occurrence in gold
        ("cat", "dog", 0.0),
        ("The Cat!", "a cat", 1.0),
    ],
)
def test_f1_scores_token_overlap(prediction, gold, f1):
    assert f1_score(prediction, gold) == pytest.approx(f1)


def test_with_cjk_tokens_chinese_answers_are_scored_per_character():
    assert f1_score("北京大学", "北京", cjk=True) == pytest.approx(2 / 3)  # p = 2/4, r = 2/2
    assert f1_score("甘肃嘉峪关", "嘉峪关", cjk=True) == pytest.approx(2 * 0.6 * 1 / 1.6)
    assert f1_score("上海", "北京", cjk=True) == 0.0
    assert exact_match("北京。", "北京", cjk=True) == 1.0
    assert normalize_answer("北京，中国。", cjk=True) == "北京中国"


def test_with_cjk_tokens_mixed_chinese_and_latin_tokens():
    # "iphone" is one token, each Han character another
    assert f1_score("iPhone手机", "iPhone", cjk=True) == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))


def test_official_scoring_keeps_a_chinese_answer_one_token_and_its_punctuation():
    assert normalize_answer("北京，中国。") == "北京，中国。"  # only ASCII punctuation is removed
    assert f1_score("北京大学", "北京") == 0.0
    assert exact_match("北京。", "北京") == 0.0


def test_an_empty_prediction_for_an_unanswerable_question_scores_one():
    assert f1_score("", "") == 1.0
    assert exact_match("", "") == 1.0
    assert squad_scores({"q": ""}, {"q": []}) == {"em": 1.0, "f1": 1.0, "count": 1}


def test_an_answer_for_an_unanswerable_question_scores_zero():
    assert f1_score("Rollo", "") == 0.0
    assert squad_scores({"q": "Rollo"}, {"q": []}) == {"em": 0.0, "f1": 0.0, "count": 1}


def test_no_answer_for_an_answerable_question_scores_zero():
    assert f1_score("", "France") == 0.0
    assert squad_scores({"q": ""}, {"q": ["France"]})["f1"] == 0.0


def test_a_prediction_made_only_of_articles_counts_as_no_answer():
    assert f1_score("the", "") == 1.0
    assert f1_score("the", "France") == 0.0


def test_squad_scores_take_the_best_gold_answer_and_average_over_questions():
    predictions = {"a": "10th century", "b": "the Normans", "c": "Rollo", "d": ""}
    golds = {
        "a": ["in the 10th century", "10th"],  # no exact match; the best F1 is against the first
        "b": ["Normans", "Norman people"],
        "c": [],
        "d": [],
    }
    scores = squad_scores(predictions, golds)
    assert scores["count"] == 4
    assert scores["em"] == pytest.approx((0 + 1 + 0 + 1) / 4)
    f1_a = max(f1_score("10th century", "in the 10th century"), f1_score("10th century", "10th"))
    assert f1_a == pytest.approx(0.8)
    assert scores["f1"] == pytest.approx((f1_a + 1 + 0 + 1) / 4)


def test_a_missing_prediction_counts_as_no_answer():
    assert squad_scores({}, {"q": ["France"], "u": []}) == {"em": 0.5, "f1": 0.5, "count": 2}


def test_no_questions_score_zero():
    assert squad_scores({"q": "x"}, {}) == {"em": 0.0, "f1": 0.0, "count": 0}


# ---- SQuAD v2: splits and the threshold search, against hand-computed figures and the official script ----

# Five questions; `SPANS` is each one's best span, `NULL_ODDS` how strongly it is unanswerable.
GOLDS = {
    "q1": ["Normans", "the Normans"],
    "q2": ["in the 10th century"],
    "q3": [],
    "q4": [],
    "q5": ["Rollo"],
}
SPANS = {"q1": "the Normans", "q2": "10th century", "q3": "Rollo", "q4": "France", "q5": "Paris"}
NULL_ODDS = {"q1": -3.0, "q2": 1.0, "q3": 2.0, "q4": 1.5, "q5": 4.0}


def test_squad_v2_scores_split_answerable_and_unanswerable_questions():
    # At threshold 0 only q1 (null_odds -3) is answered.
    answers = {q: SPANS[q] if NULL_ODDS[q] <= 0 else "" for q in GOLDS}
    scores = squad_v2_scores(answers, GOLDS)
    # exact per question: q1 1, q2 0, q3 1, q4 1, q5 0
    assert scores == pytest.approx(
        {
            "exact": 60.0,
            "f1": 60.0,
            "total": 5,
            "HasAns_exact": 100 / 3,
            "HasAns_f1": 100 / 3,
            "HasAns_total": 3,
            "NoAns_exact": 100.0,
            "NoAns_f1": 100.0,
            "NoAns_total": 2,
        }
    )


def test_best_thresholds_follow_the_running_score_in_null_odds_order():
    # Order q1 (-3), q2 (1), q4 (1.5), q3 (2), q5 (4); start: both unanswerable right = 2.
    # exact: 2 -> 3 (q1) -> 3 (q2 wrong) -> 2 (q4) -> 1 (q3) -> 1 (q5): peak 3 at -3.
    # f1:    2 -> 3 (q1) -> 3.8 (q2 F1 0.8) -> 2.8 -> 1.8 -> 1.8: peak 3.8 at 1.0.
    assert best_thresholds(SPANS, GOLDS, NULL_ODDS) == pytest.approx(
        {"best_exact": 60.0, "best_exact_thresh": -3.0, "best_f1": 76.0, "best_f1_thresh": 1.0}
    )


def test_answering_nothing_is_the_best_threshold_zero_when_every_answer_is_wrong():
    golds = {"a": [], "b": ["x"]}
    assert best_thresholds({"a": "y", "b": "z"}, golds, {"a": -1.0, "b": 5.0}) == {
        "best_exact": 50.0,
        "best_exact_thresh": 0.0,
        "best_f1": 50.0,
        "best_f1_thresh": 0.0,
    }


def test_gold_answers_that_normalise_to_nothing_count_as_no_answer_but_stay_has_ans():
    assert gold_answers(["the", "..."]) == [""]
    assert gold_answers(["the", "Rollo"]) == ["Rollo"]
    scores = squad_v2_scores({"q": ""}, {"q": ["the"]})
    assert (scores["exact"], scores["HasAns_total"]) == (100.0, 1)
    assert "NoAns_total" not in scores


# An independent transcription of the official SQuAD v2.0 evaluation script's functions.
def _official_normalize(s):
    def remove_articles(text):
        return re.sub(re.compile(r"\b(a|an|the)\b", re.UNICODE), " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def _official_tokens(s):
    return _official_normalize(s).split() if s else []


def _official_f1(a_gold, a_pred):
    gold_toks, pred_toks = _official_tokens(a_gold), _official_tokens(a_pred)
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    num_same = sum(common.values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        return int(gold_toks == pred_toks)
    if num_same == 0:
        return 0
    precision, recall = 1.0 * num_same / len(pred_toks), 1.0 * num_same / len(gold_toks)
    return (2 * precision * recall) / (precision + recall)


def _official_eval(golds, preds, na_probs):
    exact_raw, f1_raw = {}, {}
    for qid, answers in golds.items():
        gold = [a for a in answers if _official_normalize(a)] or [""]
        exact_raw[qid] = max(int(_official_normalize(a) == _official_normalize(preds[qid])) for a in gold)
        f1_raw[qid] = max(_official_f1(a, preds[qid]) for a in gold)
    has_ans = {qid: bool(a) for qid, a in golds.items()}

    def make(exact, f1, qids):
        total = len(qids)
        return {
            "exact": 100.0 * sum(exact[k] for k in qids) / total,
            "f1": 100.0 * sum(f1[k] for k in qids) / total,
            "total": total,
        }

    out = make(exact_raw, f1_raw, list(golds))
    has_ans_qids = [k for k, v in has_ans.items() if v]
    no_ans_qids = [k for k, v in has_ans.items() if not v]
    for prefix, qids in (("HasAns", has_ans_qids), ("NoAns", no_ans_qids)):
        if qids:
            out.update({f"{prefix}_{k}": v for k, v in make(exact_raw, f1_raw, qids).items()})

    def find_best_thresh(scores):
        num_no_ans = sum(1 for k in has_ans if not has_ans[k])
        cur_score = best_score = num_no_ans
        best_thresh = 0.0
        for qid in sorted(na_probs, key=lambda k: na_probs[k]):
            if qid not in scores:
                continue
            if has_ans[qid]:
                diff = scores[qid]
            elif preds[qid]:
                diff = -1
            else:
                diff = 0
            cur_score += diff
            if cur_score > best_score:
                best_score, best_thresh = cur_score, na_probs[qid]
        return 100.0 * best_score / len(scores), best_thresh

    out["best_exact"], out["best_exact_thresh"] = find_best_thresh(exact_raw)
    out["best_f1"], out["best_f1_thresh"] = find_best_thresh(f1_raw)
    return out


def test_scores_match_the_official_script_on_the_real_dev_sample():
    examples, _ = read_squad(str(FIXTURES / "squad-v2-dev-sample.json"))
    golds = {e.id: [a.text for a in e.answers] for e in examples}
    assert any(golds.values()) and not all(golds.values())
    rng = random.Random(0)
    predictions, null_odds = {}, {}
    for e in examples:  # a mix of exact, partial, wrong and empty answers
        words = e.context.split()
        first = rng.randrange(len(words))
        choice = rng.random()
        if e.answers and choice < 0.4:
            predictions[e.id] = e.answers[0].text
        elif choice < 0.8:
            predictions[e.id] = " ".join(words[first : first + rng.randint(1, 6)])
        else:
            predictions[e.id] = ""
        null_odds[e.id] = round(rng.uniform(-5, 5), 1)  # rounded: ties in the ordering happen
    expected = _official_eval(golds, predictions, null_odds)
    ours = squad_v2_scores(predictions, golds) | best_thresholds(predictions, golds, null_odds)
    assert ours == pytest.approx(expected)
