"""The verdict for people: a table for the terminal, report.json for tools, and report.html, the run
report with the verdict on top (PASS/FAIL, one row per check and one per fault, details as sentences).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_qa.observe.follow import read_events
from elastic_qa.report.charts import escape
from elastic_qa.report.page import render_report

if TYPE_CHECKING:
    from elastic_qa.chaos.verify import Verdict

MANY_FAULTS = 20  # more than this: a table per kind first, the full list folded away
CHECK_TITLES = {
    "completed": "The job completed",
    "exactly_once": "Each sample trained exactly once per epoch",
    "checkpoints": "Every committed checkpoint verifies",
    "checkpoint_history": "Checkpoint history: done claims, fencing, retention",
    "faults_injected": "Every requested fault was injected",
    "same_parameters": "Every replica group ended with the same parameters",
    "matches_reference": "The final model matches a fault-free run",
}


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def plain(detail: Any) -> str:
    """Any detail as text a person reads: lists joined, mappings as `key value` pairs, no reprs."""
    if isinstance(detail, dict):
        return "; ".join(f"{str(k).replace('_', ' ')}: {plain(v)}" for k, v in detail.items())
    if isinstance(detail, (list, tuple, set)):
        return ", ".join(plain(v) for v in detail) or "none"
    return _number(detail)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def describe_check(name: str, detail: Any) -> tuple[str, list[str]]:
    """(a sentence, the problems found, one per item) for one check's detail."""
    if isinstance(detail, str):
        return detail, []
    if isinstance(detail, list):  # a list of problems
        sentence = _plural(len(detail), "problem") if detail else "no problem found"
        return sentence, [plain(p) for p in detail]
    if not isinstance(detail, dict):
        return plain(detail), []
    problems = [plain(p) for p in detail.get("problems", [])]
    if name == "exactly_once" and "discarded" in detail:  # the replica mode's ledger (replica/shares.py)
        tries = f"{detail['retried']} {'try' if detail['retried'] == 1 else 'tries'}"
        sentence = (
            f"{_plural(detail['steps'], 'step')} of the final chain of "
            f"{_plural(len(detail['lineages']), 'lineage')}, {tries} not committed and trained again, "
            f"{_plural(detail['discarded'], 'step')} of other lineages discarded"
        )
        return sentence + ("" if problems else ": each window once"), problems
    if name == "same_parameters" and "params_sha256" in detail:
        digests = detail["params_sha256"]
        if problems or len(digests) != 1:
            return f"{_plural(detail.get('groups', 0), 'train_done line')}", problems
        return (
            f"{_plural(detail['groups'], 'group')} ended with parameters sha256 {digests[0][:16]}..., "
            "and so does the final checkpoint"
        ), problems
    if name == "exactly_once" and "steps" in detail:
        sentence = (
            f"{_plural(detail['steps'], 'step')} in the ledger, "
            f"{_plural(detail.get('epochs_completed', 0), 'complete epoch')}"
        )
        return sentence + ("" if problems else ": every step present, each sample once per epoch"), problems
    if name == "checkpoint_history" and "done_claims" in detail:
        sentence = f"{_plural(detail['done_claims'], 'claim')} of done"
        tail = "; each backed by its own final checkpoint, no stale commit, nothing the policy keeps lost"
        return sentence + ("" if problems else tail), problems
    if name == "faults_injected" and "requested" in detail:
        skipped = [plain(s) for s in detail.get("skipped", [])]
        return f"{detail.get('injected')} of {detail['requested']} requested faults injected", skipped
    if name == "matches_reference":
        return _reference_sentence(detail), problems
    rest = {k: v for k, v in detail.items() if k != "problems"}
    return plain(rest) if rest else ("no problem found" if not problems else ""), problems


def _reference_sentence(detail: dict[str, Any]) -> str:
    if "skipped" in detail:
        return f"not compared: {plain(detail['skipped'])}"
    parts = []
    if "rule" in detail:
        parts.append(f"rule: {detail['rule']}")
    if "error" in detail:
        parts.append(plain(detail["error"]))
    if "relative" in detail:
        same = "bitwise equal" if detail.get("bitwise_equal") else "not bitwise equal"
        parts.append(
            f"{same}, relative parameter difference {detail['relative']:.2g} "
            f"(largest {detail.get('max_abs', float('nan')):.2g})"
        )
    if "eval_loss" in detail:
        parts.append(f"eval loss {detail['eval_loss']:.4g} vs {detail.get('reference_eval_loss', 0):.4g}")
    if "em" in detail:
        parts.append(f"EM {100 * detail['em']:.1f} vs {100 * detail.get('reference_em', 0):.1f}")
    if "world_sizes" in detail:
        parts.append(
            f"world sizes {plain(detail['world_sizes'])} "
            f"(reference {plain(detail.get('reference_world_sizes', []))})"
        )
    return "; ".join(parts) or plain(detail)


def _recovery(row: dict[str, Any]) -> str:
    return "—" if row.get("recovery_s") is None else f"{row['recovery_s']:.1f} s"


def format_table(verdict: Verdict) -> str:
    """The verdict as text for the terminal: one row per fault, one line per check, the outcome."""
    lines = [f"{'fault':<22}{'step':>6}{'lost':>6}{'recovery_s':>12}  verdict"]
    for row in verdict.faults:
        recovery = "-" if row["recovery_s"] is None else f"{row['recovery_s']:.1f}"
        note = f"  ({row['note']})" if row["note"] else ""
        lines.append(
            f"{row['fault']:<22}{row['step'] if row['step'] is not None else '-':>6}"
            f"{row['lost']:>6}{recovery:>12}  {row['verdict']}{note}"
        )
    lines.append("")
    for name, check in verdict.checks.items():
        sentence, problems = describe_check(name, check["detail"])
        lines.append(f"{'PASS' if check['ok'] else 'FAIL'}  {name}: {sentence}")
        lines += [f"        - {problem}" for problem in problems]
    injected, requested = _injected(verdict)
    lines.append(
        f"\nfaults injected: {injected} of {requested} requested, skipped: {len(verdict.faults) - injected}"
    )
    lines.append(f"verdict: {'PASS' if verdict.ok else 'FAIL'}")
    return "\n".join(lines)


def _injected(verdict: Verdict) -> tuple[int, int]:
    counts = verdict.checks.get("faults_injected", {}).get("detail", {})
    injected = sum(row["verdict"] != "skipped" for row in verdict.faults)
    requested = len(verdict.faults)
    if isinstance(counts, dict):
        requested = counts.get("requested", requested)
    return injected, requested


def _badge(ok: bool | None, text: str) -> str:
    kind = "warn" if ok is None else ("ok" if ok else "fail")
    return f'<span class="badge {kind}">{escape(text)}</span>'


def _detail_cell(sentence: str, problems: list[str]) -> str:
    items = "".join(f"<li>{escape(p)}</li>" for p in problems)
    return escape(sentence) + (f'<ul class="plain">{items}</ul>' if items else "")


def verdict_html(verdict: Verdict, records: list[dict[str, Any]], t0: float | None) -> str:
    """The verdict block: outcome cards, a table of the checks, a table of the faults (numbered as the
    markers on the charts below). `records` are the fault injection records, in the rows' order."""
    injected, requested = _injected(verdict)
    done = [row for row in verdict.faults if row["verdict"] != "skipped"]
    within = sum(row["verdict"] != "FAIL" for row in done)
    passed = sum(check["ok"] for check in verdict.checks.values())
    recoveries = [row["recovery_s"] for row in done if row.get("recovery_s") is not None]
    recovery = (
        f"{statistics.median(recoveries):.1f} s / {max(recoveries):.1f} s" if recoveries else "no restart"
    )
    cards = [
        ("Verdict", _badge(verdict.ok, "PASS" if verdict.ok else "FAIL"), "every check and every fault"),
        ("Faults injected", f"{injected} of {requested}", f"{len(verdict.faults) - injected} skipped"),
        ("Faults within bounds", f"{within} of {len(done)}", "lost work and each kind's own check"),
        ("Checks passed", f"{passed} of {len(verdict.checks)}", ""),
        ("Most steps lost", str(max((row["lost"] for row in done), default=0)), "by one fault"),
        ("Recovery", recovery, "median / max, fault to first step"),
    ]
    card_html = "".join(
        f'<div class="card"><div class="k">{escape(k)}</div><div class="v">{v}</div>'
        f'<div class="s">{escape(s)}</div></div>'
        for k, v, s in cards
    )
    check_rows = []
    for name, check in verdict.checks.items():
        sentence, problems = describe_check(name, check["detail"])
        status = _badge(check["ok"], "PASS" if check["ok"] else "FAIL")
        check_rows.append(
            f"<tr class='{'' if check['ok'] else 'bad'}'><td>{status}</td>"
            f"<td>{escape(CHECK_TITLES.get(name, name))}</td><td>{_detail_cell(sentence, problems)}</td></tr>"
        )
    faults_html = _faults_table(verdict.faults, records, t0)
    if len(verdict.faults) > MANY_FAULTS:  # a soak: the kinds first, every fault one click away
        faults_html = (
            f"{_kinds_table(verdict.faults)}<details><summary>every fault, one row each "
            f"({len(verdict.faults)})</summary>{faults_html}</details>"
        )
    return (
        f'<div class="cards">{card_html}</div>'
        "<h2>Checks</h2><table><tr><th>status</th><th>check</th><th>what was found</th></tr>"
        f"{''.join(check_rows)}</table><h2>Faults</h2>{faults_html}"
    )


def _faults_table(rows: list[dict[str, Any]], records: list[dict[str, Any]], t0: float | None) -> str:
    fault_rows = []
    for number, row in enumerate(rows, start=1):
        record = records[number - 1] if number - 1 < len(records) else {}
        ok = None if row["verdict"] == "skipped" else row["verdict"] != "FAIL"
        when = "—"  # a skipped fault's time is when the runner gave up on it: not an injection
        if t0 is not None and isinstance(row.get("ts"), (int, float)) and ok is not None:
            when = f"{row['ts'] - t0:.1f}"
        bound = f" (≤ {row['bound']})" if row.get("bound") is not None else ""
        fault_rows.append(
            f"<tr class='{'bad' if ok is False else ''}'><td class='n'>{number}</td>"
            f"<td class='name'>{escape(row['fault'])}</td>"
            f"<td class='n'>{'—' if row.get('step') is None else escape(plain(row['step']))}</td>"
            f"<td class='n'>{when}</td><td>{escape(plain(record.get('target', '')))}</td>"
            f"<td class='n'>{row['lost']}{bound}</td><td class='n'>{_recovery(row)}</td>"
            f"<td>{_badge(ok, row['verdict'])}</td><td>{escape(row.get('note') or '')}</td></tr>"
        )
    return (
        "<table><tr><th>#</th><th>fault</th><th>step</th><th>at (s)</th><th>target</th>"
        "<th>steps lost (bound)</th><th>recovery</th><th>verdict</th><th>note</th></tr>"
        f"{''.join(fault_rows) or '<tr><td colspan=9>no fault</td></tr>'}</table>"
    )


def _kinds_table(rows: list[dict[str, Any]]) -> str:
    """One row per kind of fault: how many, how many failed, the most steps lost, recovery times."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        kinds.setdefault(row["fault"], []).append(row)
    lines = []
    for kind, group in sorted(kinds.items(), key=lambda item: -len(item[1])):
        done = [r for r in group if r["verdict"] != "skipped"]
        failed = sum(r["verdict"] == "FAIL" for r in done)
        recoveries = [r["recovery_s"] for r in done if r.get("recovery_s") is not None]
        recovery = (
            f"{statistics.median(recoveries):.1f} s / {max(recoveries):.1f} s" if recoveries else "no restart"
        )
        lines.append(
            f"<tr class='{'bad' if failed else ''}'><td class='name'>{escape(kind)}</td>"
            f"<td class='n'>{len(group)}</td><td class='n'>{len(group) - len(done)}</td>"
            f"<td class='n'>{failed}</td><td class='n'>{max((r['lost'] for r in done), default=0)}</td>"
            f"<td class='n'>{recovery}</td></tr>"
        )
    return (
        "<table><tr><th>fault</th><th>count</th><th>skipped</th><th>failed</th><th>most steps lost</th>"
        f"<th>recovery median / max</th></tr>{''.join(lines)}</table>"
    )


def write_report(run_dir: Path, verdict: Verdict, reference_dir: Path | None) -> tuple[Path, Path]:
    """Write <run_dir>/chaos/report.json and report.html; return their paths."""
    from elastic_qa.chaos.verify import read_faults

    out_dir = Path(run_dir) / "chaos"
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = verdict.checks.get("faults_injected", {}).get("detail", {})
    report = {
        "ok": verdict.ok,
        "faults_requested": counts.get("requested"),
        "faults_injected": counts.get("injected"),
        "checks": verdict.checks,
        "faults": verdict.faults,
    }
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(report, indent=1, default=str))
    records = read_faults(Path(run_dir))
    stamps = [e["ts"] for e in read_events(Path(run_dir)) if isinstance(e.get("ts"), (int, float))]
    header = verdict_html(verdict, records, min(stamps, default=None))
    page = render_report(
        Path(run_dir), out_dir / "report.html", reference_dir, records, header, title="Chaos verdict"
    )
    return json_path, page
