"""The wordpiece tokenizer: a vocabulary trained the same way every time, specials at ids 0-3, and exact
character offsets into the original text in any language."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from elastic_qa.config import ConfigError
from elastic_qa.prep import wordpiece
from elastic_qa.prep.synthetic import iter_examples
from elastic_qa.prep.tokenizer import CLS, PAD, SEP, UNK

REPO = Path(__file__).resolve().parents[2]

ENGLISH = "Mr. O'Neil paid $3.50 for (two) e-books -- didn't he?  Yes!"
CHINESE = "北京是中国的首都，也是全国的政治中心。"
ACCENTED = "Café CRÈME brûlée, naïve Ångström résumé à Zürich"
EMOJI = "I ❤️ 北京 🎉🎉 party! 👩‍👩‍👧 family"
MIXED = "Apple在2007年发布了iPhone，价格是499美元。"
CORPUS = [ENGLISH, CHINESE, ACCENTED, EMOJI, MIXED, "The capital of France is Paris. Paris is large."] * 20


def corpus() -> list[str]:
    texts = [t for e in iter_examples("train", 400, 7, 0.15) for t in (e.context, e.question)]
    return texts + CORPUS


@pytest.fixture(scope="module")
def trained() -> wordpiece.WordPieceTokenizer:
    return wordpiece.parse(wordpiece.train(lambda: corpus(), 600, lowercase=True), "test")


def test_a_trained_vocabulary_has_the_special_tokens_at_ids_0_to_3(trained) -> None:
    backend = trained.backend
    assert [backend.token_to_id(t) for t in ("[PAD]", "[CLS]", "[SEP]", "[UNK]")] == [PAD, CLS, SEP, UNK]
    assert 300 < trained.vocab_size <= 600
    ids, _ = trained.encode(ENGLISH + CHINESE)
    assert ids and all(UNK <= i < trained.vocab_size for i in ids)  # never [PAD], [CLS] or [SEP]


def folded(text: str) -> str:
    """What the lower-casing BERT normaliser makes of text: lower case, no accents, no control characters
    (the emoji's zero-width joiners)."""
    dropped = ("Mn", "Cf", "Cc")
    return "".join(
        c for c in unicodedata.normalize("NFD", text.lower()) if unicodedata.category(c) not in dropped
    )


@pytest.mark.parametrize("text", [ENGLISH, CHINESE, ACCENTED, EMOJI, MIXED, "  spaces\tand\nnewlines  "])
def test_spans_are_exact_ordered_and_each_token_is_the_text_it_points_at(trained, text) -> None:
    ids, spans = trained.encode(text)
    assert len(ids) == len(spans) > 0
    assert all(0 <= s < e <= len(text) for s, e in spans)
    assert all(e1 <= s2 for (_, e1), (s2, _) in itertools.pairwise(spans))
    covered = {i for s, e in spans for i in range(s, e)}
    # every character but spaces and the emoji's invisible joiners and variation selectors is in a token
    assert covered >= {i for i, c in enumerate(text) if not c.isspace() and unicodedata.category(c) != "Cf"
                       and not 0xFE00 <= ord(c) <= 0xFE0F}  # fmt: skip
    for token_id, (s, e) in zip(ids, spans, strict=True):
        if token_id != UNK:
            assert trained.backend.id_to_token(token_id).removeprefix("##") == folded(text[s:e])


def test_each_han_character_is_a_token_of_its_own(trained) -> None:
    _, spans = trained.encode(CHINESE)
    assert [CHINESE[s:e] for s, e in spans] == list(CHINESE)


def test_case_and_accents_fold_only_when_lowercase() -> None:
    lower = wordpiece.parse(wordpiece.train(lambda: CORPUS, 400, lowercase=True), "lower")
    cased = wordpiece.parse(wordpiece.train(lambda: CORPUS, 400, lowercase=False), "cased")
    assert lower.encode("CAFÉ")[0] == lower.encode("café")[0] == lower.encode("cafe")[0]
    assert cased.encode("Paris")[0] != cased.encode("PARIS")[0]
    assert cased.encode("café")[0] != cased.encode("cafe")[0]


def test_special_tokens_written_in_a_text_are_text(trained) -> None:
    ids, spans = trained.encode("a [SEP] b [CLS] c [PAD]")
    assert PAD not in ids and CLS not in ids and SEP not in ids
    assert "".join("a [SEP] b [CLS] c [PAD]"[s:e] for s, e in spans) == "a[SEP]b[CLS]c[PAD]"


def test_a_lone_surrogate_reads_as_a_replacement_character_with_the_same_offsets(trained) -> None:
    ids, spans = trained.encode("Paris \ud800 Paris")
    assert spans[0] == (0, 5) and spans[-1] == (8, 13)
    assert ids[0] == ids[-1]


_TRAIN_SCRIPT = """
import hashlib, json, sys
from elastic_qa.prep import wordpiece
texts = json.loads(sys.stdin.read())
print(hashlib.sha256(wordpiece.train(lambda: texts, 600, lowercase=True).encode()).hexdigest())
"""


@pytest.mark.parametrize(("threads", "parallel"), [("1", "false"), ("4", "true")])
def test_training_gives_byte_identical_json_whatever_the_threads(threads, parallel) -> None:
    texts = corpus()
    here = hashlib.sha256(wordpiece.train(lambda: texts, 600, lowercase=True).encode()).hexdigest()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "RAYON_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": parallel,
    }
    out = subprocess.run(
        [sys.executable, "-c", _TRAIN_SCRIPT], input=json.dumps(texts), env=env,
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.strip() == here


def test_a_file_that_is_not_a_tokenizer_json_or_has_other_specials_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"x\.json: not a tokenizer\.json"):
        wordpiece.parse(b'{"vocab": []}', "x.json")
    with pytest.raises(ConfigError, match=r"not a tokenizer\.json"):
        wordpiece.parse(b"\xff\xfe", "x.json")
    definition = json.loads(wordpiece.train(lambda: CORPUS, 300, lowercase=True))
    vocab = definition["model"]["vocab"]
    vocab["[PAD]"], vocab["[UNK]"] = vocab["[UNK]"], vocab["[PAD]"]
    for token in definition["added_tokens"]:
        token["id"] = vocab[token["content"]]
    with pytest.raises(ConfigError) as refused:
        wordpiece.parse(json.dumps(definition), "x.json")
    assert str(refused.value) == (
        "x.json: [PAD], [CLS], [SEP], [UNK] must be ids 0, 1, 2, 3 ([PAD] is id 3, [UNK] is id 0)"
    )
    with pytest.raises(ConfigError, match=r"data.vocab_file='.*missing.json': file not found"):
        wordpiece.load(str(tmp_path / "missing.json"))


def test_a_vocabulary_file_is_parsed_once_per_process_until_it_changes(tmp_path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(wordpiece.train(lambda: CORPUS, 300, lowercase=True))
    first = wordpiece.load(str(path))
    assert wordpiece.load(str(path)) is first
    path.write_text(wordpiece.train(lambda: CORPUS, 350, lowercase=False))
    os.utime(path, ns=(1, 1))  # a new mtime even on a coarse clock
    changed = wordpiece.load(str(path))
    assert changed is not first
    assert changed.encode("Paris")[0] != first.encode("Paris")[0] or changed.vocab_size != first.vocab_size


def test_without_tokenizers_wordpiece_is_refused_at_start_up_with_exit_2_and_the_install_line(tmp_path):
    blocker = (
        "import sys; sys.modules['tokenizers'] = None; "
        "from elastic_qa.train import main; sys.exit(main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            blocker,
            "--config",
            "tiny",
            f"run.dir={tmp_path}",
            "data.tokenizer=wordpiece",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2
    assert "data.tokenizer='wordpiece': needs tokenizers" in result.stderr
    assert "pip install 'elastic-qa[hf]'" in result.stderr
    assert not (tmp_path / "checkpoints").exists()
