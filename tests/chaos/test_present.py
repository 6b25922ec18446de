"""The verdict for people: tables of checks and faults in sentences, no Python reprs, nothing injected."""

from __future__ import annotations

import json
import re
from pathlib import Path

from elastic_qa.chaos.present import describe_check, format_table, verdict_html, write_report
from elastic_qa.chaos.verify import Verdict
from tests.report.runs import T0, write_run

CHECKS = {
    "completed": {"ok": True, "detail": "train_done at step 100 of 100, exit 0"},
    "exactly_once": {
        "ok": False,
        "detail": {"steps": 100, "epochs_completed": 1, "problems": ["step 7 missing"]},
    },
    "checkpoints": {"ok": True, "detail": []},
    "checkpoint_history": {"ok": True, "detail": {"done_claims": 1, "problems": []}},
    "faults_injected": {
        "ok": False,
        "detail": {"requested": 3, "injected": 2, "skipped": ["hup: no worker"]},
    },
    "matches_reference": {
        "ok": True,
        "detail": {
            "bitwise_equal": False,
            "relative": 7.59e-07,
            "max_abs": 3.1e-05,
            "world_sizes": [2, 3],
            "reference_world_sizes": [2],
            "rule": "relative parameter difference < 1e-4",
        },
    },
}
FAULTS = [
    {"fault": "kill-worker", "step": 20, "ts": T0 + 5, "lost": 1, "recovery_s": 7.5, "verdict": "ok",
     "note": "", "attempt": 2, "bound": 1},
    {"fault": "storage-errors", "step": 60, "ts": T0 + 25, "lost": 4, "recovery_s": None, "verdict": "FAIL",
     "note": "the group restarted <script>alert(1)</script>"},
    {"fault": "hup", "step": None, "ts": None, "lost": 0, "recovery_s": None, "verdict": "skipped",
     "note": "no worker"},
]  # fmt: skip
RECORDS = [
    {"fault": "kill-worker", "ts": T0 + 5, "step": 20, "target": "worker pid 7 of agent 1"},
    {"fault": "storage-errors", "ts": T0 + 25, "step": 60, "target": "<b>checkpoint writes</b>"},
    {"fault": "hup", "skipped": "no worker"},
]


def verdict() -> Verdict:
    return Verdict(checks=json.loads(json.dumps(CHECKS)), faults=json.loads(json.dumps(FAULTS)))


def table(page: str, heading: str) -> str:
    return page.split(f"<h2>{heading}</h2>", 1)[1].split("</table>", 1)[0]


def test_every_check_reads_as_a_sentence_with_its_problems_listed() -> None:
    assert describe_check("exactly_once", CHECKS["exactly_once"]["detail"]) == (
        "100 steps in the ledger, 1 complete epoch",
        ["step 7 missing"],
    )
    assert describe_check("faults_injected", CHECKS["faults_injected"]["detail"]) == (
        "2 of 3 requested faults injected",
        ["hup: no worker"],
    )
    sentence, _ = describe_check("matches_reference", CHECKS["matches_reference"]["detail"])
    assert "relative parameter difference 7.6e-07" in sentence
    assert "world sizes 2, 3 (reference 2)" in sentence
    assert describe_check("a_new_check", {"seen": [1, 2], "fine": True}) == ("seen: 1, 2; fine: yes", [])


def test_the_verdict_page_has_one_row_per_check_and_per_fault_and_no_python_reprs() -> None:
    page = verdict_html(verdict(), RECORDS, T0)
    assert "{'" not in page and "['" not in page and "': " not in page
    checks, faults = table(page, "Checks"), table(page, "Faults")
    assert checks.count("<tr") == 1 + len(CHECKS) and faults.count("<tr") == 1 + len(FAULTS)
    assert faults.count("class='bad'") == 1  # the failed fault, marked
    assert "FAIL" in page and "2 of 3" in page and "1 (≤ 1)" in faults and ">25.0<" in faults
    assert "&lt;script&gt;" in faults and "<script" not in page and "<b>" not in page


def test_the_terminal_table_says_the_same_without_reprs() -> None:
    text = format_table(verdict())
    assert "{'" not in text and "['" not in text
    assert "FAIL  exactly_once: 100 steps in the ledger, 1 complete epoch" in text
    assert "        - step 7 missing" in text and text.endswith("verdict: FAIL")


def test_many_faults_are_summed_up_by_kind_with_every_row_folded_below() -> None:
    many = verdict()
    many.faults = [dict(FAULTS[0], step=step) for step in range(30)]
    page = verdict_html(many, [], T0)
    kinds = table(page, "Faults")
    assert kinds.count("<tr") == 2 and ">30<" in kinds and "7.5 s / 7.5 s" in kinds
    assert page.count("<details>") == 1 and page.count("kill-worker") == 31


def test_the_written_report_puts_the_verdict_above_the_run_and_numbers_the_faults_on_its_chart(
    tmp_path: Path,
) -> None:
    run_dir = write_run(tmp_path / "run")
    (run_dir / "chaos").mkdir()
    (run_dir / "chaos" / "faults.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    json_path, page_path = write_report(run_dir, verdict(), None)
    assert json.loads(json_path.read_text())["faults_requested"] == 3
    page = page_path.read_text()
    assert page.index("<h2>Checks</h2>") < page.index("<h2>Run</h2>") < page.index("<svg")
    world = page[page.index("World size over time") :].split("</svg>")[0]
    tags = re.findall(r'fill="#d62728" font-size="11">(\d+)</text>', world)
    assert tags == ["1", "2"]  # the injected faults, numbered as in the table; the skipped one has no time
