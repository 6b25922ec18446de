"""SQuAD exact match and F1: standard normalisation, per-character CJK tokens, unanswerable questions."""

from __future__ import annotations

import pytest

from elastic_qa.metrics import exact_match, f1_score, normalize_answer, squad_scores


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  an   apple\ta day\n", "apple day"),
        ("A.B.C.", "abc"),
        ("Rock 'n' Roll!", "rock n roll"),
        ("theory of the atom", "theory of atom"),
        ("Anthem", "anthem"),  # "an" inside a word is not an article
        ("北京，中国。", "北京中国"),
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


def test_chinese_answers_are_scored_per_character():
    assert f1_score("北京大学", "北京") == pytest.approx(2 / 3)  # p = 2/4, r = 2/2
    assert f1_score("甘肃嘉峪关", "嘉峪关") == pytest.approx(2 * 0.6 * 1 / 1.6)
    assert f1_score("上海", "北京") == 0.0
    assert exact_match("北京。", "北京") == 1.0


def test_mixed_chinese_and_latin_tokens():
    # "iphone" is one token, each Han character another
    assert f1_score("iPhone手机", "iPhone") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))


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
