"""The embedded synthetic QA task: seeded, split, correctly labelled and hard enough to need reading."""

from __future__ import annotations

import re
from collections import Counter
from functools import cache

import pytest

from elastic_qa.prep.synthetic import _RELATIONS, generate

SEED = 7


def _template_regex(template: str) -> re.Pattern:
    rx = re.escape(template).replace(r"\{e\}", r"(?P<e>[a-z]+)").replace(r"\{v\}", r"(?P<v>[a-z0-9 ]+?)")
    return re.compile(rx + "$")


_STATEMENTS = [(rel, _template_regex(t)) for rel, (statements, _) in _RELATIONS.items() for t in statements]
_QUESTIONS = [(rel, _template_regex(t)) for rel, (_, questions) in _RELATIONS.items() for t in questions]


def parse_facts(context: str) -> list[tuple[str, str, str, int]]:
    """(person, relation, value, value_start) per sentence; each sentence must match exactly one template."""
    facts, offset = [], 0
    for sentence in context.split(" . "):
        sentence = sentence if sentence.endswith(" .") else sentence + " ."
        matches = [(rel, m) for rel, rx in _STATEMENTS if (m := rx.match(sentence))]
        assert len(matches) == 1, (sentence, matches)
        relation, match = matches[0]
        facts.append((match["e"], relation, match["v"], offset + match.start("v")))
        offset += len(sentence) + 1
    return facts


def parse_question(question: str) -> tuple[str, str]:
    """(person, relation) the question asks about."""
    matches = [(rel, m["e"]) for rel, rx in _QUESTIONS if (m := rx.match(question))]
    assert len(matches) == 1, question
    return matches[0][1], matches[0][0]


@cache
def train_examples(count: int = 3000, fraction: float = 0.15):
    return tuple(generate("train", count, SEED, fraction))


def test_the_same_seed_gives_identical_examples():
    assert generate("train", 300, SEED, 0.15) == generate("train", 300, SEED, 0.15)


def test_a_prefix_of_a_larger_split_is_the_smaller_split():
    assert generate("eval", 50, SEED, 0.15) == generate("eval", 200, SEED, 0.15)[:50]


def test_different_seeds_give_different_examples():
    first, second = generate("train", 200, 1, 0.15), generate("train", 200, 2, 0.15)
    assert [e.context for e in first] != [e.context for e in second]
    assert len({e.context for e in first} & {e.context for e in second}) == 0


def test_train_and_eval_splits_are_disjoint():
    train, held_out = generate("train", 1000, SEED, 0.15), generate("eval", 1000, SEED, 0.15)
    assert {e.id for e in train}.isdisjoint(e.id for e in held_out)
    assert {(e.question, e.context) for e in train}.isdisjoint((e.question, e.context) for e in held_out)
    assert [e.question for e in train] != [e.question for e in held_out]
    assert all(e.id.startswith("syn-train-") for e in train)
    assert all(e.id.startswith("syn-eval-") for e in held_out)
    assert len({e.id for e in train}) == len(train)


def test_every_answer_sits_at_its_answer_start():
    for example in train_examples():
        for answer in example.answers:
            assert example.context[answer.start : answer.start + len(answer.text)] == answer.text


def test_every_context_sentence_is_one_known_fact_and_the_answer_is_the_asked_fact():
    for example in train_examples():
        facts = parse_facts(example.context)
        target, asked = parse_question(example.question)
        asked_facts = [(v, start) for p, r, v, start in facts if p == target and r == asked]
        if example.is_impossible:
            assert asked_facts == []
        else:
            assert len(example.answers) == 1
            assert asked_facts == [(example.answers[0].text, example.answers[0].start)]


@pytest.mark.parametrize("fraction", [0.0, 0.15, 0.5])
def test_the_unanswerable_share_is_close_to_the_configured_fraction(fraction):
    examples = train_examples(3000, fraction)
    share = sum(e.is_impossible for e in examples) / len(examples)
    assert share == pytest.approx(fraction, abs=0.03)


def test_the_asked_relation_always_appears_for_another_person_as_a_distractor():
    for example in train_examples():
        target, asked = parse_question(example.question)
        facts = parse_facts(example.context)
        assert any(p != target and r == asked for p, r, _, _ in facts), example


def test_the_target_has_at_least_two_facts_when_answerable():
    for example in train_examples():
        target, _ = parse_question(example.question)
        own = [f for f in parse_facts(example.context) if f[0] == target]
        assert len(own) >= (1 if example.is_impossible else 2), example


def test_the_answer_is_rarely_the_only_value_of_its_relation_in_the_context():
    answerable = [e for e in train_examples() if not e.is_impossible]
    with_other_value = 0
    for example in answerable:
        _, asked = parse_question(example.question)
        values = {v for _, r, v, _ in parse_facts(example.context) if r == asked}
        with_other_value += len(values - {example.answers[0].text}) > 0
    assert with_other_value / len(answerable) > 0.9


def test_the_target_name_also_appears_in_other_peoples_facts_in_some_contexts():
    mentioned = 0
    for example in train_examples():
        target, _ = parse_question(example.question)
        mentioned += any(v == target for p, r, v, _ in parse_facts(example.context) if p != target)
    assert 0.2 < mentioned / len(train_examples()) < 0.7


def friends_of(person: str, facts) -> set[str]:
    """Friendship reads both ways: 'a is friends with b' answers 'who is a friend of b?' too."""
    return {v for p, r, v, _ in facts if r == "friend" and p == person} | {
        p for p, r, v, _ in facts if r == "friend" and v == person
    }


def test_a_friend_question_has_exactly_one_correct_answer_in_the_context():
    friend_questions = Counter()
    for example in train_examples():
        target, asked = parse_question(example.question)
        if asked != "friend":
            continue
        friends = friends_of(target, parse_facts(example.context))
        friend_questions[example.is_impossible] += 1
        if example.is_impossible:
            assert friends == set(), example
        else:
            assert friends == {example.answers[0].text}, example
    assert friend_questions[True] > 0
    assert friend_questions[False] > 0
