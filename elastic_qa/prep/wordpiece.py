"""`data.tokenizer: wordpiece`: subwords of a vocabulary trained on the training texts (tokenizers library).

The vocabulary is trained when the feature cache is built, in the building process, and stored with the
cache as tokenizer.json; checkpoints carry its text and exports its file, so a model never depends on the
cache that trained it. `data.vocab_file` names a tokenizer.json to use instead. Either way [PAD], [CLS],
[SEP] and [UNK] are ids 0-3, the ids data.tokenizer reserves. `tokenizers` is imported on first use: the
core install does without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from elastic_qa.config import ConfigError
from elastic_qa.prep.files import open_regular
from elastic_qa.prep.tokenizer import CLS, PAD, SEP, UNK

SPECIALS = {"[PAD]": PAD, "[CLS]": CLS, "[SEP]": SEP, "[UNK]": UNK}
INSTALL = "pip install 'elastic-qa[hf]' (or pip install tokenizers)"
# Bump when the training recipe below changes what it trains (part of the feature cache's key).
RECIPE = 1

_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(f"data.tokenizer='wordpiece': needs tokenizers: {INSTALL}") from None
    return tokenizers


class WordPieceTokenizer:
    """A fast (Rust) tokenizer's ids and exact character spans into the text it was given."""

    name = "wordpiece"

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if _LONE_SURROGATE.search(text):  # Rust strings cannot hold one; U+FFFD keeps every offset
            text = _LONE_SURROGATE.sub("\ufffd", text)
        # No [CLS]/[SEP] here: the window builder adds its own. Offsets count characters of `text`.
        encoding = self.backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets


def _untrained(tk: Any, lowercase: bool) -> Any:
    backend = tk.Tokenizer(tk.models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = tk.normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    backend.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    backend.decoder = tk.decoders.WordPiece()
    return backend


def _continuing(tk: Any, texts: Iterable[str], lowercase: bool) -> list[str]:
    """Every "##c" the trainer can make of the texts: the normalised characters that can continue a word
    (probed after an "a": whitespace, punctuation and Chinese characters always stand alone), sorted."""
    chars: set[str] = set()
    for text in texts:
        chars.update(text)
    probe = _untrained(tk, lowercase)
    found = set()
    for char in chars:
        for word, _ in probe.pre_tokenizer.pre_tokenize_str(probe.normalizer.normalize_str("a" + char)):
            found.update(word[1:])
    return sorted(f"##{char}" for char in found)


def train(texts: Callable[[], Iterable[str]], vocab_size: int, lowercase: bool) -> str:
    """A WordPiece vocabulary of up to `vocab_size` entries trained on the texts, as tokenizer.json text.

    BERT's normaliser (Chinese characters split, accents stripped when lower-casing) and pre-tokeniser;
    the special tokens first, so that their ids are 0-3. `texts` is called twice: the trainer numbers the
    word-continuing characters ("##a") in hash-map order, which differs from run to run and decides how
    ties between equally frequent merges break, so a first pass collects them and they are numbered in
    sorted order before training. The same texts give byte-identical JSON, whatever the threads.
    """
    tk = _tokenizers()
    continuing = _continuing(tk, texts(), lowercase)
    backend = _untrained(tk, lowercase)
    trainer = tk.trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=[*SPECIALS, *continuing], show_progress=False
    )
    backend.train_from_iterator(texts(), trainer)
    definition = json.loads(backend.to_str())
    singles = {t for t in definition["model"]["vocab"] if t.startswith("##") and len(t) == 3}
    if not singles <= set(continuing):  # the probe missed one: the result would not be reproducible
        raise RuntimeError(
            f"wordpiece: the probe missed continuing characters {sorted(singles - set(continuing))}"
        )
    # The continuing characters went in as special tokens only to be numbered first: in the vocabulary
    # they stay, as text to match they go.
    definition["added_tokens"] = [t for t in definition["added_tokens"] if t["content"] in SPECIALS]
    return json.dumps(definition, ensure_ascii=False)


def parse(text: str | bytes, where: str) -> WordPieceTokenizer:
    """A tokenizer.json's tokenizer; ConfigError naming `where` unless it loads with the specials at 0-3."""
    tk = _tokenizers()
    try:
        raw = text.decode("utf-8") if isinstance(text, bytes) else text
        backend = tk.Tokenizer.from_str(raw)
    except Exception as err:  # noqa: BLE001 - the Rust side raises a plain Exception for a bad definition
        detail = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise ConfigError(f"{where}: not a tokenizer.json ({detail})") from None
    found = {token: backend.token_to_id(token) for token in SPECIALS}
    wrong = {token: i for token, i in found.items() if i != SPECIALS[token]}
    if wrong:
        listed = ", ".join(
            f"{token} is {'missing' if i is None else f'id {i}'}" for token, i in wrong.items()
        )
        raise ConfigError(f"{where}: [PAD], [CLS], [SEP], [UNK] must be ids 0, 1, 2, 3 ({listed})")
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = True  # "[SEP]" written in a text is text, not a window boundary
    return WordPieceTokenizer(backend)


def read_vocab_file(url: str) -> bytes:
    """The bytes of `data.vocab_file`; ConfigError naming it when it cannot be read."""
    try:
        with open_regular(url) as handle:
            return handle.read()
    except FileNotFoundError:
        raise ConfigError(f"data.vocab_file={url!r}: file not found") from None
    except (OSError, ValueError, ImportError) as err:
        raise ConfigError(f"data.vocab_file={url!r}: cannot read ({err})") from None


def vocab_file_sha256(url: str) -> str:
    return hashlib.sha256(read_vocab_file(url)).hexdigest()


# Parsed tokenizers of this process, by file and version: feature workers tokenise chunk after chunk with
# one vocabulary (a forked worker inherits the building process's entry).
_LOADED: dict[tuple, WordPieceTokenizer] = {}


def _version(url: str) -> tuple:
    """What tells a changed file from the one parsed before, without reading it (local files)."""
    if "://" in url and not url.startswith("file://"):
        return (url,)  # a remote vocabulary is read once per process
    try:
        stat = os.stat(os.path.expanduser(url.removeprefix("file://")))
    except OSError:
        return (url, None)
    return (url, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def load(url: str) -> WordPieceTokenizer:
    """The tokenizer of a tokenizer.json file (path or fsspec URL), parsed once per process."""
    version = _version(url)
    if version not in _LOADED:
        if len(_LOADED) >= 8:
            _LOADED.clear()
        _LOADED[version] = parse(read_vocab_file(url), f"data.vocab_file={url!r}")
    return _LOADED[version]


def materialise(text: str, directory: Path) -> Path:
    """`text` as a tokenizer.json under `directory`, named by its sha256 (concurrent writers agree)."""
    digest = hashlib.sha256(text.encode()).hexdigest()
    path = directory / "vocabularies" / f"{digest}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        staging.write_text(text, encoding="utf-8")
        os.replace(staging, path)
    return path
