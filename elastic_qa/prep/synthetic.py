"""A seeded synthetic QA task, embedded so the default job needs no download.

Each context is a shuffled list of facts about three people. The question names one person and one
relation; the answer is the value of that fact. Every context holds distractors of both kinds (the same
relation for another person, other relations for the same person), so a model has to read the question's
person *and* relation to pick the right span. A share of questions asks for a relation the person does
not have in the context: unanswerable, SQuAD v2 style.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from elastic_qa.data.examples import Answer, QAExample

_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
_JOBS = [
    "baker",
    "nurse",
    "pilot",
    "farmer",
    "teacher",
    "lawyer",
    "painter",
    "software engineer",
    "bus driver",
    "chemist",
    "tailor",
    "fire fighter",
    "dentist",
    "ship captain",
    "librarian",
]
_FOODS = [
    "apples",
    "rice",
    "noodles",
    "fresh bread",
    "green beans",
    "cheese",
    "fish soup",
    "dumplings",
    "mangoes",
    "tomato salad",
    "olives",
    "sweet potatoes",
    "chocolate cake",
    "plums",
]
_COLOURS = ["red", "blue", "green", "black", "white", "yellow", "purple", "silver"]
_THINGS = ["bicycle", "boat", "car", "guitar", "piano", "camera", "tent", "horse", "kite", "lamp"]
_LANGUAGES = ["french", "swahili", "korean", "dutch", "arabic", "hindi", "finnish", "greek", "turkish"]

# relation: (statement templates, question templates); {e} is the person, {v} the value.
_RELATIONS: dict[str, tuple[list[str], list[str]]] = {
    "lives_in": (["{e} lives in {v} .", "{e} has a house in {v} ."], ["where does {e} live ?"]),
    "works_as": (["{e} works as a {v} .", "{e} is employed as a {v} ."], ["what is the job of {e} ?"]),
    "born_in": (["{e} was born in {v} .", "in {v} , {e} was born ."], ["when was {e} born ?"]),
    "owns": (["{e} owns a {v} .", "{e} bought a {v} ."], ["what does {e} own ?"]),
    "eats": (
        ["{e} likes to eat {v} .", "the favourite food of {e} is {v} ."],
        ["what does {e} like to eat ?"],
    ),
    "friend": (["{e} is friends with {v} .", "{v} is a friend of {e} ."], ["who is a friend of {e} ?"]),
    "speaks": (["{e} speaks {v} .", "{e} grew up speaking {v} ."], ["which language does {e} speak ?"]),
    "age": (["{e} is {v} years old .", "the age of {e} is {v} ."], ["how old is {e} ?"]),
}


class _World:
    """Vocabularies drawn once from the generator seed (shared by both splits)."""

    def __init__(self, rng: random.Random) -> None:
        self.people = sorted({self._name(rng, 2, 3) for _ in range(400)})
        self.cities = sorted(
            {self._name(rng, 2, 3) for _ in range(60)} | {f"port {self._name(rng, 2, 2)}" for _ in range(20)}
        )

    @staticmethod
    def _name(rng: random.Random, low: int, high: int) -> str:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(low, high)))

    def value(self, relation: str, rng: random.Random, person: str, target: str) -> str:
        if relation == "lives_in":
            return rng.choice(self.cities)
        if relation == "works_as":
            return rng.choice(_JOBS)
        if relation == "born_in":
            return str(rng.randint(1900, 2015))
        if relation == "owns":
            return f"{rng.choice(_COLOURS)} {rng.choice(_THINGS)}"
        if relation == "eats":
            return rng.choice(_FOODS)
        if relation == "friend":
            # Never the question's person: "x is friends with <target>" would answer "who is a friend of
            # <target>?" too (friendship reads both ways), making the label wrong.
            return rng.choice([p for p in rng.sample(self.people, 3) if p not in (person, target)])
        if relation == "speaks":
            return rng.choice(_LANGUAGES)
        return str(rng.randint(18, 95))


def _example(world: _World, rng: random.Random, qid: str, unanswerable: bool) -> QAExample:
    relations = sorted(_RELATIONS)
    target, *others = rng.sample(world.people, 3)
    asked = rng.choice(relations)
    # The target gets 2-3 facts (its asked fact unless unanswerable); the asked relation also appears
    # for at least one other person, so a model that ignores the person picks the wrong span.
    target_relations = rng.sample([r for r in relations if r != asked], rng.randint(1, 2))
    if not unanswerable:
        target_relations.append(asked)
    facts = [(target, r) for r in target_relations]
    facts.append((others[0], asked))
    for person in others:
        facts += [(person, r) for r in rng.sample(relations, rng.randint(0, 1)) if (person, r) not in facts]
    # Half the time the target's name also appears inside another person's fact, so "the sentence that
    # mentions the name" is not enough either.
    # Not when the question asks for a friend: the mention would then be a second correct answer.
    mention = rng.random() < 0.5 and asked != "friend" and (others[1], "friend") not in facts
    if mention:
        facts.append((others[1], "friend"))
    rng.shuffle(facts)

    context, answer = "", None
    for person, relation in facts:
        value = (
            target
            if mention and (person, relation) == (others[1], "friend")
            else world.value(relation, rng, person, target)
        )
        template = rng.choice(_RELATIONS[relation][0])
        sentence = template.format(e=person, v=value)
        if context:
            context += " "
        if person == target and relation == asked:
            answer = Answer(value, len(context) + template.format(e=person, v="\0").index("\0"))
        context += sentence
    question = rng.choice(_RELATIONS[asked][1]).format(e=target)
    return QAExample(qid, question, context, (answer,) if answer else ())


def iter_examples(split: str, count: int, seed: int, unanswerable_fraction: float) -> Iterator[QAExample]:
    """`count` examples of `split` ("train" or "eval"), one at a time; the same arguments, the same ones."""
    world = _World(random.Random(f"world-{seed}"))
    rng = random.Random(f"{split}-{seed}")
    for i in range(count):
        yield _example(world, rng, f"syn-{split}-{i:07d}", rng.random() < unanswerable_fraction)


def generate(split: str, count: int, seed: int, unanswerable_fraction: float) -> list[QAExample]:
    """`count` examples of `split` ("train" or "eval"); the same arguments give identical examples."""
    return list(iter_examples(split, count, seed, unanswerable_fraction))


# ---- SQuAD-shaped files of any size (benchmarks, tests of the streaming reader) -------------------------
_PARAGRAPH_PEOPLE = 8
_QUESTIONS_PER_PARAGRAPH = 5
_PARAGRAPHS_PER_ARTICLE = 10
_ASKABLE = sorted(r for r in _RELATIONS if r != "friend")  # a friend could answer two ways


def _paragraph(world: _World, rng: random.Random, prefix: str, unanswerable_fraction: float) -> dict:
    """About 120 words of facts on eight people and five questions on them (SQuAD v2 JSON shape)."""
    people = rng.sample(world.people, _PARAGRAPH_PEOPLE)
    facts = [(p, r) for p in people for r in rng.sample(_ASKABLE, rng.randint(2, 3))]
    rng.shuffle(facts)
    context, where = "", {}
    for person, relation in facts:
        value = world.value(relation, rng, person, person)
        template = rng.choice(_RELATIONS[relation][0])
        if context:
            context += " "
        where[person, relation] = (value, len(context) + template.format(e=person, v="\0").index("\0"))
        context += template.format(e=person, v=value)
    qas = []
    for q, (person, relation) in enumerate(rng.sample(facts, _QUESTIONS_PER_PARAGRAPH)):
        if rng.random() < unanswerable_fraction:  # ask for a relation this person has no fact of
            missing = [r for r in _ASKABLE if (person, r) not in where]
            relation = rng.choice(missing)
        question = rng.choice(_RELATIONS[relation][1]).format(e=person)
        found = where.get((person, relation))
        answers = [{"text": found[0], "answer_start": found[1]}] if found else []
        qas.append(
            {"id": f"{prefix}-{q}", "question": question, "answers": answers, "is_impossible": not found}
        )
    return {"context": context, "qas": qas}


def _articles(questions: int, seed: int, unanswerable_fraction: float) -> Iterator[tuple[int, list[dict]]]:
    """(index of the first paragraph, paragraphs) per article of a generated file of `questions`."""
    world = _World(random.Random(f"world-{seed}"))
    rng = random.Random(f"file-{seed}")
    paragraphs = -(-questions // _QUESTIONS_PER_PARAGRAPH)
    for first in range(0, paragraphs, _PARAGRAPHS_PER_ARTICLE):
        count = min(_PARAGRAPHS_PER_ARTICLE, paragraphs - first)
        yield (
            first,
            [
                _paragraph(world, rng, f"gen-{i:08d}", unanswerable_fraction)
                for i in range(first, first + count)
            ],
        )


def write_squad_file(path: str, questions: int, seed: int, unanswerable_fraction: float = 0.15) -> int:
    """Write a SQuAD v2.0 JSON file of `questions` (rounded up to whole paragraphs) as a stream.

    Contexts of about 120 words, five questions each, ten paragraphs an article. `.jsonl` in the name
    writes JSON Lines (one question a line) instead, `.parquet` the hub's squad_v2 rows (pyarrow). The same
    seed gives the same questions in every format. Returns the number of questions written.
    """
    articles = _articles(questions, seed, unanswerable_fraction)
    written = -(-questions // _QUESTIONS_PER_PARAGRAPH) * _QUESTIONS_PER_PARAGRAPH
    if path.endswith(".parquet"):
        _write_parquet(path, articles)
        return written
    lines = path.endswith(".jsonl")
    with open(path, "w", encoding="utf-8") as out:
        out.write("" if lines else '{"version": "v2.0", "data": [\n')
        for first, article in articles:
            if lines:
                for p in article:
                    out.writelines(json.dumps({"context": p["context"], **qa}) + "\n" for qa in p["qas"])
            else:
                out.write(
                    (",\n" if first else "")
                    + json.dumps({"title": f"article {first}", "paragraphs": article})
                )
        out.write("" if lines else "\n]}\n")
    return written


PARQUET_ROW_GROUP = 10_000  # rows: about 10 MB of SQuAD-sized records a row group


def _write_parquet(path: str, articles: Iterator[tuple[int, list[dict]]]) -> None:
    """Rows `id, title, context, question, answers: {text: [...], answer_start: [...]}`, written a row
    group at a time (the file is never whole in memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("id", pa.string()),
            ("title", pa.string()),
            ("context", pa.string()),
            ("question", pa.string()),
            ("answers", pa.struct([("text", pa.list_(pa.string())), ("answer_start", pa.list_(pa.int32()))])),
        ]
    )
    rows: list[dict] = []
    with pq.ParquetWriter(path, schema) as writer:
        for first, article in articles:
            for p in article:
                for qa in p["qas"]:
                    answers = qa["answers"]
                    rows.append(
                        {
                            "id": qa["id"],
                            "title": f"article {first}",
                            "context": p["context"],
                            "question": qa["question"],
                            "answers": {
                                "text": [a["text"] for a in answers],
                                "answer_start": [a["answer_start"] for a in answers],
                            },
                        }
                    )
            if len(rows) >= PARQUET_ROW_GROUP:
                writer.write_table(pa.Table.from_pylist(rows, schema))
                rows = []
        if rows:
            writer.write_table(pa.Table.from_pylist(rows, schema))
