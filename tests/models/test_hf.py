"""The hf family on tiny random BERT- and RoBERTa-style models built at test time (no download)."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from elastic_qa.config import ConfigError, load_config, packaged_config
from elastic_qa.data.examples import Answer, QAExample
from elastic_qa.data.loader import collate
from elastic_qa.prep import synthetic
from tests.conftest import REPO

pytest.importorskip("transformers")

from elastic_qa.models import family_for, hf

MAX_LEN, QUERY, STRIDE = 48, 20, 8

CHINESE = "李白是唐代著名诗人，被称为诗仙。北京是中国的首都，位于华北平原。长江是亚洲最长的河流。"


def config(model_dir: Path, *extra: str):
    return load_config(
        packaged_config("hf-tiny"),
        [
            f"model.name_or_path={model_dir}",
            f"data.max_seq_len={MAX_LEN}",
            f"data.max_query_len={QUERY}",
            f"data.doc_stride={STRIDE}",
            *extra,
        ],
    )


def examples() -> list[QAExample]:
    english = synthetic.generate("eval", 6, seed=3, unanswerable_fraction=0.3)
    long_context = " ".join(e.context for e in english)  # several windows; answer deep inside
    answer = english[4].answers[0] if english[4].answers else english[0].answers[0]
    shift = long_context.index(answer.text)
    start = CHINESE.index("北京")
    return [
        *english,
        QAExample("long", english[4].question, long_context, (Answer(answer.text, shift),)),
        QAExample("zh", "首都是哪里？", CHINESE, (Answer("北京", start),)),
        QAExample("zh-none", "谁是诗仙？", CHINESE, ()),
        QAExample(
            "zh-long",
            "长江有多长？",
            CHINESE * 3,
            (Answer("长江", 2 * len(CHINESE) + CHINESE.index("长江")),),
        ),
    ]


def standard_windows(tok, example: QAExample, style: str) -> list[dict]:
    """transformers' QA recipe written out by hand: question and context tokenised on their own, the
    context cut into windows of the room left, consecutive windows sharing STRIDE tokens."""
    question = tok(example.question.strip(), add_special_tokens=False)["input_ids"]
    assert len(question) <= QUERY  # what a cut keeps is tested on its own
    context = tok(example.context, add_special_tokens=False, return_offsets_mapping=True)
    ids, spans = context["input_ids"], []
    for s, e in context["offset_mapping"]:
        while s < e and example.context[s].isspace():
            s += 1
        spans.append((s, e))
    sep = [tok.sep_token_id] * (1 if style == "bert" else 2)
    head = [tok.cls_token_id, *question, *sep]
    room = MAX_LEN - len(head) - 1
    windows, first = [], 0
    while True:
        last = min(first + room, len(ids))
        window_spans = spans[first:last]
        start = end = 0
        if example.answers:
            a = example.answers[0]
            a_start, a_end = a.start, a.start + len(a.text)
            inside = [i for i, (s, e) in enumerate(window_spans) if s < a_end and e > a_start]
            if window_spans[0][0] <= a_start and window_spans[-1][1] >= a_end and inside:
                start, end = len(head) + min(inside), len(head) + max(inside)
        offsets = (
            [(-1, -1)] * len(head) + window_spans + [(-1, -1)] * (MAX_LEN - len(head) - len(window_spans))
        )
        windows.append(
            {
                "ids": [*head, *ids[first:last], tok.sep_token_id],
                "start": start,
                "end": end,
                "offsets": offsets,
            }
        )
        if last >= len(ids):
            return windows
        first += room - STRIDE


@pytest.mark.parametrize("style", ["bert", "roberta"])
def test_features_equal_the_standard_recipe_on_english_chinese_and_unanswerable_examples(hf_models, style):
    cfg = config(hf_models[style])
    batch = examples()
    features = family_for(cfg.model).features(batch, cfg)
    tok = hf.load_tokenizer(str(hf_models[style]))
    expected = [(i, w) for i, example in enumerate(batch) for w in standard_windows(tok, example, style)]
    assert len(features) == len(expected)
    assert len([i for i, _ in expected if i == 6]) >= 3  # the long context really spans several windows
    for row, (index, window) in enumerate(expected):
        length = len(window["ids"])
        assert features.example_index[row] == index
        assert features.lengths[row] == length
        assert features.input_ids[row, :length].tolist() == window["ids"]
        assert (features.input_ids[row, length:] == tok.pad_token_id).all()
        assert (features.start_positions[row], features.end_positions[row]) == (
            window["start"],
            window["end"],
        )
        assert features.offsets[row].tolist() == [list(span) for span in window["offsets"]]
        assert features.segment_ids[row].tolist() == [int(s >= 0) for s, _ in window["offsets"]]
    answered = {batch[i].id for i in features.example_index[features.start_positions > 0]}
    assert {"long", "zh", "zh-long"} <= answered and "zh-none" not in answered
    for row in np.flatnonzero(features.start_positions > 0):  # the target tokens spell the answer
        example = batch[features.example_index[row]]
        s, e = (
            features.offsets[row, features.start_positions[row], 0],
            features.offsets[row, features.end_positions[row], 1],
        )
        assert example.context[s:e].strip() == example.answers[0].text


def test_bert_token_types_from_segment_ids_equal_the_tokenizers_own(hf_models):
    cfg = config(hf_models["bert"])
    batch = examples()
    features = hf.features(batch, cfg)
    tok = hf.load_tokenizer(str(hf_models["bert"]))
    own = tok(
        [e.question for e in batch],
        [e.context for e in batch],
        truncation="only_second",
        max_length=MAX_LEN,
        stride=STRIDE,
        return_overflowing_tokens=True,
        padding="max_length",
    )["token_type_ids"]
    segments = torch.from_numpy(features.segment_ids).long()
    mask = torch.from_numpy(np.arange(MAX_LEN)[None, :] < features.lengths[:, None]).long()
    assert (segments.cummax(dim=1).values * mask).tolist() == own


@pytest.mark.parametrize("style", ["bert", "roberta"])
def test_questions_longer_than_max_query_len_keep_at_most_that_many_tokens(hf_models, style):
    cfg = config(hf_models[style])
    tok = hf.load_tokenizer(str(hf_models[style]))
    for question in ("who " * 40 + "built the tower?", "中国的首都是哪里？" * 4):
        kept = hf._question(tok, question, QUERY)
        assert question.startswith(kept) and len(kept) > 0
        assert QUERY - 3 <= len(tok(kept, add_special_tokens=False)["input_ids"]) <= QUERY
        features = hf.features([QAExample("q", question, "Alice built the tower.", ())], cfg)
        assert int(np.argmax(features.segment_ids[0])) <= QUERY + 3  # [CLS] question [SEP] ([SEP])


@pytest.mark.parametrize("style", ["bert", "roberta"])
def test_max_query_len_0_keeps_questions_whole_while_doc_stride_plus_one_context_tokens_fit(hf_models, style):
    cfg = config(hf_models[style], "data.max_query_len=0")
    tok = hf.load_tokenizer(str(hf_models[style]))
    specials = tok.num_special_tokens_to_add(pair=True)
    limit = MAX_LEN - specials - STRIDE - 1
    context = " ".join(["Alice built the tower."] * 20)

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    longer_than_query = next(q for n in range(40) if count(q := " ".join(["who"] * n) + " built it?") > QUERY)
    for question in (longer_than_query, " ".join(["who"] * 80) + " built it?"):
        tokens = count(question)
        assert tokens <= limit if question is longer_than_query else tokens > limit
        features = hf.features([QAExample("q", question, context, ())], cfg)
        first_context = int(np.argmax(features.segment_ids[0]))
        assert first_context == 1 + min(tokens, limit) + (specials - 2)  # [CLS] question [SEP] ([SEP])
        assert (features.segment_ids[:, :-1].sum(1) >= STRIDE + 1).all()  # every window: stride + 1 context


@pytest.mark.parametrize("style", ["bert", "roberta"])
def test_with_max_query_len_0_config_and_tokenizer_check_refuse_the_same_doc_stride(hf_models, style):
    """The widest doc_stride leaves room for a one-token question; the next is refused in the same words, by
    config.py for [CLS] and two [SEP]s (BERT), by the tokenizer check for RoBERTa's extra separator."""
    tok = hf.load_tokenizer(str(hf_models[style]))
    widest = MAX_LEN - 1 - tok.num_special_tokens_to_add(pair=True) - 1
    assert hf.checked_tokenizer(config(hf_models[style], "data.max_query_len=0", f"data.doc_stride={widest}"))
    refused = rf"^data\.doc_stride={widest + 1}: must be in \[0, {widest + 1}\) \(context tokens per window"
    with pytest.raises(ConfigError, match=refused):
        hf.checked_tokenizer(
            config(hf_models[style], "data.max_query_len=0", f"data.doc_stride={widest + 1}")
        )


@pytest.mark.parametrize("style", ["bert", "roberta"])
def test_model_returns_the_pretrained_models_own_float32_logits_at_every_position(hf_models, style):
    """No position is masked: the loss trains all of them, as transformers' recipe does."""
    cfg = config(hf_models[style])
    family = family_for(cfg.model)
    features = family.features(examples(), cfg)
    model = family.build_model(cfg, family.tokenizer(cfg).vocab_size).eval()
    assert model.token_types == (style == "bert")  # RoBERTa has one token type: it is given none
    batch = collate(features, np.arange(6), full_width=family.full_width)
    assert batch["input_ids"].shape[1] == MAX_LEN and (batch["attention_mask"] == 0).any()  # padding kept
    start, end = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")})
    assert start.dtype == end.dtype == torch.float32
    tok = hf.load_tokenizer(str(hf_models[style]))
    own = tok(
        [e.question for e in examples()],
        [e.context for e in examples()],
        truncation="only_second",
        max_length=MAX_LEN,
        stride=STRIDE,
        return_overflowing_tokens=True,
        padding="max_length",
        return_tensors="pt",
    )
    own = {k: v[:6] for k, v in own.items() if k in tok.model_input_names}  # the tokenizer's own inputs
    assert torch.equal(own["input_ids"], batch["input_ids"])
    with torch.no_grad():
        inner = model.model(**own)
    assert torch.equal(start, inner.start_logits) and torch.equal(end, inner.end_logits)


def test_model_dropout_replaces_every_dropout_of_the_pretrained_config(hf_models):
    for dropout in (0.0, 0.25):
        cfg = config(hf_models["bert"], f"model.dropout={dropout}")
        model = hf.build_model(cfg, 10)
        probabilities = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
        assert probabilities == {dropout}


@pytest.mark.parametrize("style", ["bert", "roberta"])
def test_null_model_dropout_keeps_the_pretrained_configs_own(hf_models, style):
    described = json.loads((hf_models[style] / "config.json").read_text())
    own = {described["hidden_dropout_prob"], described["attention_probs_dropout_prob"]}
    assert own != {0.0}  # the tiny models carry BERT's default dropout, so that keeping it shows
    model = hf.build_model(config(hf_models[style], "model.dropout=null"), 10)
    assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == own


def test_cache_identity_follows_the_tokenizer_not_its_path(hf_models, tmp_path):
    bert, roberta = hf_models["bert"], hf_models["roberta"]
    copy = shutil.copytree(bert, tmp_path / "elsewhere")
    assert hf.cache_identity(config(copy)) == hf.cache_identity(config(bert))
    assert hf.cache_identity(config(roberta)) != hf.cache_identity(config(bert))
    assert hf.cache_identity(config(bert, "data.doc_stride=4")) != hf.cache_identity(config(bert))


def test_a_left_padding_tokenizer_or_a_missing_model_is_a_config_error(hf_models, tmp_path):
    left = shutil.copytree(hf_models["bert"], tmp_path / "left")
    settings = json.loads((left / "tokenizer_config.json").read_text())
    (left / "tokenizer_config.json").write_text(json.dumps({**settings, "padding_side": "left"}))
    with pytest.raises(ConfigError, match="pads on the left"):
        hf.features(examples()[:1], config(left))
    with pytest.raises(ConfigError, match="no such local directory"):
        hf.features(examples()[:1], config(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"data\.doc_stride=24"):
        hf.features(examples()[:1], config(hf_models["roberta"], "data.doc_stride=24"))  # room: 48 - 20 - 4


def test_without_transformers_kind_hf_is_refused_with_exit_2_and_the_install_line(tmp_path):
    blocker = (
        "import sys; sys.modules['transformers'] = None; "
        "from elastic_qa.train import main; sys.exit(main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", blocker, "--config", "hf-tiny", f"run.dir={tmp_path}", "model.name_or_path=x"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2
    assert "pip install 'elastic-qa[hf]'" in result.stderr


def test_byte_level_offsets_that_carry_the_space_are_trimmed_to_the_word(hf_models, tmp_path):
    untrimmed = shutil.copytree(hf_models["roberta"], tmp_path / "untrimmed")
    definition = json.loads((untrimmed / "tokenizer.json").read_text())
    definition["post_processor"]["trim_offsets"] = False
    definition["pre_tokenizer"]["trim_offsets"] = False
    (untrimmed / "tokenizer.json").write_text(json.dumps(definition))
    raw = hf.load_tokenizer(str(untrimmed))("Who?", "Alice built it", return_offsets_mapping=True)
    assert (5, 7) in raw["offset_mapping"]  # "Ġb" of " built": the space is part of the token
    batch = examples()
    trimmed = hf.features(batch, config(hf_models["roberta"]))
    spaced = hf.features(batch, config(untrimmed))
    assert np.array_equal(spaced.offsets, trimmed.offsets)
    assert np.array_equal(spaced.start_positions, trimmed.start_positions)


def test_the_family_pickles_by_reference_for_worker_processes(hf_models):
    cfg = config(hf_models["bert"])
    family = family_for(cfg.model)
    again = pickle.loads(pickle.dumps(family))
    assert again.features is hf.features
    first, second = again.features(examples(), cfg), hf.features(examples(), cfg)
    assert all(np.array_equal(getattr(first, c), getattr(second, c)) for c in first.COLUMNS)


def test_no_examples_give_no_windows_with_the_right_shapes(hf_models):
    features = hf.features([], config(hf_models["bert"]))
    assert (
        len(features) == 0
        and features.input_ids.shape == (0, MAX_LEN)
        and features.offsets.shape == (0, MAX_LEN, 2)
    )


def _slow_files_only(model: Path, tokenizer_config: dict | None) -> Path:
    """`model` without tokenizer.json: BERT's vocab.txt, and a tokenizer_config.json if given."""
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    (model / "tokenizer.json").unlink()
    (model / "tokenizer_config.json").unlink()
    (model / "vocab.txt").write_text("\n".join(sorted(vocab, key=vocab.get)) + "\n")
    if tokenizer_config is not None:
        (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return model


def test_a_directory_with_only_vocab_txt_gets_the_fast_tokenizer_of_its_tokenizer_json(hf_models, tmp_path):
    """transformers builds the fast tokenizer from a slow one's files: the same windows and cache key."""
    bert = hf_models["bert"]
    vocab_only = _slow_files_only(shutil.copytree(bert, tmp_path / "vocab-only"), None)
    assert hf.load_tokenizer(str(vocab_only)).is_fast
    batch = examples()
    expected, got = hf.features(batch, config(bert)), hf.features(batch, config(vocab_only))
    assert all(np.array_equal(getattr(expected, c), getattr(got, c)) for c in expected.COLUMNS)
    assert hf.cache_identity(config(vocab_only)) == hf.cache_identity(config(bert))


def test_a_tokenizer_with_no_fast_version_is_refused_naming_its_class(hf_models, tmp_path):
    python_only = shutil.copytree(hf_models["bert"], tmp_path / "byt5")
    _slow_files_only(python_only, {"tokenizer_class": "ByT5Tokenizer"})  # a Python tokenizer, no files
    with pytest.raises(
        ConfigError, match=r"ByT5Tokenizer is a slow \(Python\) tokenizer with no fast version"
    ):
        hf.load_tokenizer(str(python_only))


def headless(model: Path, out: Path) -> Path:
    """A copy of `model` without its QA head's weights: what a base (pretrained encoder) directory holds."""
    from safetensors.torch import load_file, save_file

    base = shutil.copytree(model, out)
    weights = load_file(base / "model.safetensors")
    kept = {name: t for name, t in weights.items() if not name.startswith("qa_outputs.")}
    save_file(kept, base / "model.safetensors", metadata={"format": "pt"})
    return base


def test_a_base_model_loads_without_transformers_report_and_names_the_head_it_initialises(
    hf_models, tmp_path, capfd, caplog
):
    base = headless(hf_models["bert"], tmp_path / "base")
    transformers = pytest.importorskip("transformers")
    transformers.AutoModelForQuestionAnswering.from_pretrained(base)
    assert "LOAD REPORT" in caplog.text  # what transformers says on its own, seen here
    caplog.clear()
    capfd.readouterr()
    model = hf.build_model(config(base), 10)
    assert model.newly_initialized == ("qa_outputs.bias", "qa_outputs.weight")
    hf.export(model, config(base), tmp_path / "export")
    exported, _ = hf.load_export(config(base), tmp_path / "export")
    assert exported.newly_initialized == ()
    assert capfd.readouterr() == ("", "") and caplog.records == []
