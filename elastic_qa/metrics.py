"""SQuAD v2 exact match and F1, and the no-answer threshold search, as the official evaluation defines them.

Answers are normalised (lower case, punctuation and the articles a/an/the removed, whitespace collapsed),
compared with every gold answer and the best kept; a question whose gold answers normalise to nothing is
unanswerable and its only gold answer is "". Scores are percentages, keyed as the official script keys
them (exact, f1, total, HasAns_*, NoAns_*, best_exact, best_exact_thresh, best_f1, best_f1_thresh).

`cjk=True` is the one departure, off by default: CJK characters and CJK punctuation count as tokens and
punctuation of their own (as CMRC-style evaluation does), where the official script would make a whole
Chinese answer one whitespace token.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = frozenset(string.punctuation)
_CJK_PUNCT = _PUNCT | set("，。、；：？！「」『』（）《》〈〉【】…—·")
_CJK_CHAR = re.compile(r"([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff])")


def em_f1_text(em: float, f1: float) -> str:
    """EM and F1 given as fractions (the training events' unit), said in percent as `elastic-qa eval` and
    the official script say them: every place a person reads a score shows the same number."""
    return f"EM {100 * em:.2f}  F1 {100 * f1:.2f}"


def normalize_answer(text: str, cjk: bool = False) -> str:
    """Lower case, drop punctuation, then the English articles, then collapse whitespace."""
    punctuation = _CJK_PUNCT if cjk else _PUNCT
    text = "".join(ch for ch in text.lower() if ch not in punctuation)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _tokens(text: str, cjk: bool) -> list[str]:
    normal = normalize_answer(text, cjk)
    return (_CJK_CHAR.sub(r" \1 ", normal) if cjk else normal).split()


def exact_match(prediction: str, gold: str, cjk: bool = False) -> float:
    return float(normalize_answer(prediction, cjk) == normalize_answer(gold, cjk))


def f1_score(prediction: str, gold: str, cjk: bool = False) -> float:
    pred, ref = _tokens(prediction, cjk), _tokens(gold, cjk)
    if not pred or not ref:  # unanswerable: both must be empty
        return float(pred == ref)
    common = collections.Counter(pred) & collections.Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def gold_answers(texts: Sequence[str], cjk: bool = False) -> list[str]:
    """The answers a prediction is compared with: those that normalise to something, else [""]."""
    return [t for t in texts if normalize_answer(t, cjk)] or [""]


def raw_scores(
    predictions: Mapping[str, str], golds: Mapping[str, Sequence[str]], cjk: bool = False
) -> tuple[dict[str, float], dict[str, float]]:
    """Per question: exact match and F1 (0 or 1, and in [0, 1]); a missing prediction counts as ""."""
    exact, f1 = {}, {}
    for qid, texts in golds.items():
        candidates = gold_answers(texts, cjk)
        prediction = predictions.get(qid, "")
        exact[qid] = max(exact_match(prediction, a, cjk) for a in candidates)
        f1[qid] = max(f1_score(prediction, a, cjk) for a in candidates)
    return exact, f1


def _percent(scores: Mapping[str, float], qids: Sequence[str]) -> float:
    return 100.0 * sum(scores[q] for q in qids) / len(qids) if qids else 0.0


def squad_v2_scores(
    predictions: Mapping[str, str], golds: Mapping[str, Sequence[str]], cjk: bool = False
) -> dict[str, float]:
    """exact, f1 and total over all questions, and the same over HasAns and NoAns when a split has any.

    A question is HasAns when its gold list is not empty (as the official script decides it).
    """
    exact, f1 = raw_scores(predictions, golds, cjk)
    qids = list(golds)
    out: dict[str, float] = {"exact": _percent(exact, qids), "f1": _percent(f1, qids), "total": len(qids)}
    has_answer = [q for q in qids if golds[q]]
    no_answer = [q for q in qids if not golds[q]]
    for prefix, split in (("HasAns", has_answer), ("NoAns", no_answer)):
        if split:
            out[f"{prefix}_exact"] = _percent(exact, split)
            out[f"{prefix}_f1"] = _percent(f1, split)
            out[f"{prefix}_total"] = len(split)
    return out


def find_best_threshold(
    predictions: Mapping[str, str],
    scores: Mapping[str, float],
    null_odds: Mapping[str, float],
    has_answer: Mapping[str, bool],
) -> tuple[float, float]:
    """(best score in percent, its threshold): the official search over "no answer when null_odds > t".

    Start with every question predicted unanswerable, then answer them in increasing null_odds order,
    keeping the threshold at which the running score peaked (ties keep the lower threshold; 0.0 if
    answering nothing is best).
    """
    current: float = sum(1 for qid in scores if not has_answer[qid])
    best = current
    best_threshold = 0.0
    for qid in sorted(null_odds, key=lambda q: null_odds[q]):
        if qid not in scores:
            continue
        if has_answer[qid]:
            current += scores[qid]
        elif predictions[qid]:
            current -= 1
        if current > best:
            best, best_threshold = current, null_odds[qid]
    return 100.0 * best / len(scores) if scores else 0.0, best_threshold


def best_thresholds(
    predictions: Mapping[str, str],
    golds: Mapping[str, Sequence[str]],
    null_odds: Mapping[str, float],
    cjk: bool = False,
) -> dict[str, float]:
    """best_exact, best_exact_thresh, best_f1, best_f1_thresh: `predictions` are the answers given when
    a question is answered at all (each question's best span), `null_odds` how strongly it is not."""
    exact, f1 = raw_scores(predictions, golds, cjk)
    has_answer = {qid: bool(texts) for qid, texts in golds.items()}
    answers = {qid: predictions.get(qid, "") for qid in golds}
    best_exact, exact_threshold = find_best_threshold(answers, exact, null_odds, has_answer)
    best_f1, f1_threshold = find_best_threshold(answers, f1, null_odds, has_answer)
    return {
        "best_exact": best_exact,
        "best_exact_thresh": exact_threshold,
        "best_f1": best_f1,
        "best_f1_thresh": f1_threshold,
    }


def squad_scores(
    predictions: Mapping[str, str], golds: Mapping[str, Sequence[str]], cjk: bool = False
) -> dict[str, float]:
    """EM and F1 as fractions in [0, 1] and the question count (what training logs)."""
    scores = squad_v2_scores(predictions, golds, cjk)
    return {"em": scores["exact"] / 100.0, "f1": scores["f1"] / 100.0, "count": len(golds)}
