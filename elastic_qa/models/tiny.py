"""Tiny random transformers QA models with their own trained tokenizers, for tests, smoke runs and benchmarks.

    python -m elastic_qa.models.tiny DIR --style bert|roberta [--size tiny|small|base]

writes a loadable `model.name_or_path` directory: a randomly initialised BERT-style (WordPiece, token types)
or RoBERTa-style (byte-level BPE, no token types) question-answering model, hidden size 32, 2 layers, and
a fast tokenizer trained on a small built-in text (English and Chinese) plus any text files given. Nothing
is downloaded. Needs the `hf` extra. `--size small` widens it to hidden 128, 4 layers, 4 heads (0.94M
parameters: per-step overhead at a less toy size). `--size base` gives the model bert-base's shape instead
(hidden 768, 12 layers, 12 heads, feed-forward 3072, a 30,522-row embedding, 512 positions: 108.9M
parameters) for measuring costs at real size; its tokenizer is the same small one, so only its first ids
ever occur.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from elastic_qa.prep import synthetic

if TYPE_CHECKING:  # the `hf` extra, imported where it is used
    from tokenizers import Tokenizer

STYLES = ("bert", "roberta")
# Model shapes: (transformers config sizes, positions). A `vocab_size` of None is the tokenizer's own.
SIZES: dict[str, tuple[dict[str, int | None], int]] = {
    "tiny": (
        {
            "vocab_size": None,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
        },
        128,
    ),
    "small": (  # a 4-layer BERT for per-step overhead at a less toy size (0.94M parameters)
        {
            "vocab_size": None,
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "intermediate_size": 512,
        },
        128,
    ),
    "base": (  # bert-base-uncased's shape
        {
            "vocab_size": 30522,
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "intermediate_size": 3072,
        },
        512,
    ),
}

# Chinese sentences so that the vocabulary has CJK characters (each is its own WordPiece token).
_CHINESE = [
    "北京是中国的首都，位于华北平原。",
    "长江是亚洲最长的河流，全长约六千三百公里。",
    "李白是唐代著名诗人，被称为诗仙。",
    "这座城市建于一九九零年，人口约三百万。",
    "谁是唐代的诗人？哪一条河最长？首都在哪里？",
]


def corpus(extra_files: Iterable[Path] = ()) -> list[str]:
    """The text the tokenizers are trained on: synthetic QA questions and contexts, Chinese, extra files."""
    texts = list(_CHINESE)
    for example in synthetic.generate("train", 300, seed=7, unanswerable_fraction=0.2):
        texts += [example.question, example.context]
    for path in extra_files:
        texts += Path(path).read_text(encoding="utf-8").splitlines()
    return texts


def _wordpiece(texts: list[str], vocab_size: int) -> tuple[Tokenizer, dict[str, str], list[str]]:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True, handle_chinese_chars=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tokenizer.decoder = decoders.WordPiece()
    tokens = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]"}
    return tokenizer, {**tokens, "mask_token": "[MASK]"}, ["input_ids", "token_type_ids", "attention_mask"]


def _byte_bpe(texts: list[str], vocab_size: int) -> tuple[Tokenizer, dict[str, str], list[str]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    sep, cls = tokenizer.token_to_id("</s>"), tokenizer.token_to_id("<s>")
    assert sep is not None and cls is not None  # the trainer puts every special token in the vocabulary
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", sep), ("<s>", cls), trim_offsets=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokens = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    tokens |= {"cls_token": "<s>", "sep_token": "</s>", "mask_token": "<mask>"}
    return tokenizer, tokens, ["input_ids", "attention_mask"]


def create(
    directory: Path,
    style: str = "bert",
    extra_files: Iterable[Path] = (),
    seed: int = 0,
    size: str = "tiny",
) -> Path:
    """Write a random QA model of `style` and `size` and its tokenizer into `directory` (save_pretrained)."""
    import torch
    import transformers
    from transformers import AutoModelForQuestionAnswering, BertConfig, PreTrainedTokenizerFast, RobertaConfig

    transformers.utils.logging.disable_progress_bar()  # a bar per save is noise in a script's output

    if style not in STYLES:
        raise ValueError(f"style {style!r}: must be one of {', '.join(STYLES)}")
    if size not in SIZES:
        raise ValueError(f"size {size!r}: must be one of {', '.join(SIZES)}")
    shape, max_len = SIZES[size]
    texts = corpus(extra_files)
    build = _wordpiece if style == "bert" else _byte_bpe
    backend, special_tokens, input_names = build(texts, vocab_size=1000)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=max_len,
        padding_side="right",
        model_input_names=input_names,
        **special_tokens,
    )
    sizes = {**shape, "pad_token_id": tokenizer.pad_token_id}
    sizes["vocab_size"] = shape["vocab_size"] or len(tokenizer)
    config: transformers.PretrainedConfig
    if style == "bert":
        config = BertConfig(max_position_embeddings=max_len, type_vocab_size=2, **sizes)
    else:  # RoBERTa's positions start after the padding id, hence the two extra slots
        config = RobertaConfig(
            max_position_embeddings=max_len + 2,
            type_vocab_size=1,
            bos_token_id=tokenizer.cls_token_id,
            eos_token_id=tokenizer.sep_token_id,
            **sizes,
        )
    torch.manual_seed(seed)
    model = AutoModelForQuestionAnswering.from_config(config)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_qa.models.tiny", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("directory", type=Path, help="where to write the model and tokenizer")
    parser.add_argument("--style", choices=STYLES, default="bert", help="WordPiece or byte BPE")
    parser.add_argument("--text", type=Path, action="append", default=[], help="more tokenizer training text")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    parser.add_argument(
        "--size",
        choices=list(SIZES),
        default="tiny",
        help="tiny (hidden 32, 2 layers), small (hidden 128, 4 layers) or base (bert-base's shape)",
    )
    args = parser.parse_args(argv)
    try:
        path = create(args.directory, args.style, args.text, args.seed, args.size)
    except ImportError as err:
        print(f"error: {err.name or err} is not installed: pip install 'elastic-qa[hf]'", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
