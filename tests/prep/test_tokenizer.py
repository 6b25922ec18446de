"""Tokenisers keep exact character offsets in any language, and word ids do not depend on the process."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_qa.prep.tokenizer import NUM_SPECIAL, ByteTokenizer, WordTokenizer, build_tokenizer

REPO = Path(__file__).resolve().parents[2]

ENGLISH = "Mr. O'Neil paid $3.50 for (two) e-books -- didn't he?  Yes!"
CHINESE = "北京是中国的首都，也是全国的政治中心。"
MIXED = "Apple在2007年发布了iPhone，价格是499美元。"
TEXTS = [
    ENGLISH,
    CHINESE,
    MIXED,
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines",
    "café naïve 東京タワー",
]


def word_pieces(text: str, **kwargs) -> list[str]:
    _, spans = WordTokenizer(4096, **kwargs).encode(text)
    return [text[s:e] for s, e in spans]


@pytest.mark.parametrize("text", TEXTS)
def test_word_spans_are_exact_ordered_and_cover_every_non_space_character(text):
    ids, spans = WordTokenizer(4096).encode(text)
    assert len(ids) == len(spans)
    assert all(0 <= s < e <= len(text) for s, e in spans)
    assert all(e1 <= s2 for (_, e1), (s2, _) in itertools.pairwise(spans))
    covered = {i for s, e in spans for i in range(s, e)}
    assert covered == {i for i, ch in enumerate(text) if not ch.isspace()}


def test_english_punctuation_marks_are_tokens_of_their_own():
    assert word_pieces(ENGLISH) == [
        "Mr", ".", "O", "'", "Neil", "paid", "$", "3", ".", "50", "for", "(", "two", ")",
        "e", "-", "books", "-", "-", "didn", "'", "t", "he", "?", "Yes", "!",
    ]  # fmt: skip


def test_each_han_character_is_its_own_token():
    pieces = word_pieces(CHINESE)
    assert pieces == [ch for ch in CHINESE]
    assert len(pieces) == len(CHINESE)


def test_mixed_text_splits_latin_words_digits_and_han_characters():
    assert word_pieces(MIXED) == [
        "Apple", "在", "2007", "年", "发", "布", "了", "iPhone",
        "，", "价", "格", "是", "499", "美", "元", "。",
    ]  # fmt: skip


def test_word_ids_are_in_range_and_above_the_special_tokens():
    tokenizer = WordTokenizer(300)
    ids = [i for text in TEXTS for i in tokenizer.encode(text)[0]]
    assert ids
    assert all(NUM_SPECIAL <= i < 300 for i in ids)


def test_lowercase_maps_case_variants_to_one_id():
    lower = WordTokenizer(4096, lowercase=True)
    assert lower.encode("Paris PARIS paris")[0] == [lower.encode("paris")[0][0]] * 3
    cased = WordTokenizer(4096, lowercase=False)
    assert len(set(cased.encode("Paris PARIS paris")[0])) == 3


def test_the_same_word_gets_the_same_id_from_fresh_tokenizers():
    assert WordTokenizer(4096).encode(MIXED)[0] == WordTokenizer(4096).encode(MIXED)[0]


_ID_SCRIPT = """
import json, sys
from elastic_qa.prep.tokenizer import WordTokenizer
texts = json.loads(sys.stdin.read())
print(json.dumps([WordTokenizer(8192).encode(t)[0] for t in texts]))
"""


def ids_in_subprocess(texts: list[str], hash_seed: str) -> list[list[int]]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _ID_SCRIPT],
        input=json.dumps(texts),
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)


def test_word_ids_are_the_same_in_processes_with_different_hash_seeds():
    texts = [*TEXTS, " ".join(f"word{i}" for i in range(200))]
    first = ids_in_subprocess(texts, "1")
    second = ids_in_subprocess(texts, "4242")
    assert first == second
    assert first == [WordTokenizer(8192).encode(t)[0] for t in texts]
    # sanity: the seeds really change Python's str hash, which the tokenizer must not use
    probe = [sys.executable, "-c", "print(hash('word'))"]
    hashes = {
        subprocess.run(
            probe, env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True
        ).stdout
        for seed in ("1", "4242")
    }
    assert len(hashes) == 2


def test_byte_tokenizer_maps_every_byte_of_a_character_to_that_character():
    text = "a 北京 é!"
    ids, spans = ByteTokenizer().encode(text)
    assert len(ids) == len(text.replace(" ", "").encode("utf-8"))
    expected = []
    for index, char in enumerate(text):
        if not char.isspace():
            expected += [(index, index + 1)] * len(char.encode("utf-8"))
    assert spans == expected
    assert ids == [NUM_SPECIAL + b for b in text.replace(" ", "").encode("utf-8")]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_spans_decode_back_to_the_characters(text):
    ids, spans = ByteTokenizer().encode(text)
    raw = bytes(i - NUM_SPECIAL for i in ids)
    assert raw.decode("utf-8") == "".join(ch for ch in text if not ch.isspace())
    assert all(NUM_SPECIAL <= i < ByteTokenizer.vocab_size for i in ids)
    # consecutive bytes of one character share its span; the span holds exactly that character
    chars = [text[s:e] for s, e in dict.fromkeys(spans)]
    assert "".join(chars) == "".join(ch for ch in text if not ch.isspace())


def test_build_tokenizer_picks_the_kind_and_rejects_unknown_ones():
    word = build_tokenizer("word", 1000, lowercase=False)
    assert isinstance(word, WordTokenizer)
    assert (word.vocab_size, word.lowercase) == (1000, False)
    assert isinstance(build_tokenizer("byte", 1000, lowercase=True), ByteTokenizer)
    with pytest.raises(ValueError, match="bpe"):
        build_tokenizer("bpe", 1000, lowercase=True)
