"""SQuAD exact match and F1 with the standard answer normalisation, CJK-aware.

The official script splits on whitespace, which would make a whole Chinese answer one token; here CJK
characters count as tokens of their own (as CMRC-style evaluation does), everything else is unchanged.
"""

from __future__ import annotations

import collections
import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation) | set("，。、；：？！「」『』（）《》〈〉【】…—·")
_CJK_CHAR = re.compile(r"([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff])")


def normalize_answer(text: str) -> str:
    """Lower case, drop punctuation and English articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _tokens(text: str) -> list[str]:
    return _CJK_CHAR.sub(r" \1 ", normalize_answer(text)).split()


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = _tokens(prediction), _tokens(gold)
    if not pred or not ref:  # unanswerable: both must be empty
        return float(pred == ref)
    common = collections.Counter(pred) & collections.Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], golds: dict[str, list[str]]) -> dict[str, float]:
    """EM and F1 in [0, 1] over `golds` (an empty gold list means unanswerable: gold is "")."""
    if not golds:
        return {"em": 0.0, "f1": 0.0, "count": 0}
    em = f1 = 0.0
    for qid, answers in golds.items():
        candidates = answers or [""]
        prediction = predictions.get(qid, "")
        em += max(exact_match(prediction, a) for a in candidates)
        f1 += max(f1_score(prediction, a) for a in candidates)
    return {"em": em / len(golds), "f1": f1 / len(golds), "count": len(golds)}
