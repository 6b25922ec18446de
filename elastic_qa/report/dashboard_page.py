"""The dashboard's one page: the report's look, and a small script that asks for /state.json every second.

The script writes what it is given as text (`textContent`), never as markup, but for the report's summary,
charts and attempts table, which the server renders with every value escaped. The page loads nothing
else: no CDN, no font, no image; its Content-Security-Policy (dashboard.py) lets only this page's own
script and style run, by a nonce drawn when the server starts.
"""

from __future__ import annotations

from elastic_qa.report.charts import escape
from elastic_qa.report.page import STYLE

POLL_MS = 1000

EXTRA_STYLE = """
.bar{height:10px;background:#e1e4e8;border-radius:5px;overflow:hidden;margin:6px 0 2px}
.bar>div{height:100%;background:#2f7d32;width:0}
.cols{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:14px}
.cols td{overflow-wrap:anywhere} #conn{color:#a11d1d;font-weight:600}
.cards{grid-template-columns:repeat(auto-fit,minmax(150px,1fr))}
"""

SCRIPT = """
const $ = (id) => document.getElementById(id);
let version = -1;
function text(id, value) { $(id).textContent = value === null || value === undefined ? "—" : String(value); }
function duration(s) {
  if (s === null || s === undefined) return "—";
  if (s < 60) return s.toFixed(0) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + String(Math.round(s % 60)).padStart(2, "0") + " s";
  return Math.floor(s / 3600) + " h " + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + " min";
}
function fill(id, rows, columns) {
  const body = $(id).tBodies[0];
  body.replaceChildren();
  for (const row of rows) {
    const tr = body.insertRow();
    for (const column of columns) {
      const value = row[column];
      const empty = value === null || value === undefined || value === "";
      tr.insertCell().textContent = empty ? "—" : String(value);
    }
  }
  $(id).closest("section").hidden = rows.length === 0;
}
function show(s) {
  version = s.version;
  document.body.dataset.version = s.version;
  text("status", s.status);
  const looks = {finished: "ok", training: "ok", regrouping: "warn", starting: "warn"};
  $("status").className = "badge " + (looks[s.status] || "fail");
  const left = s.skipped === 1 ? "1 malformed line left out" : s.skipped + " malformed lines left out";
  text("skipped", s.skipped ? left : "");
  text("step", s.step);
  text("max-steps", s.max_steps);
  const share = s.max_steps ? Math.min(1, s.step / s.max_steps) : 0;
  $("bar").style.width = (100 * share).toFixed(1) + "%";
  text("percent", s.max_steps ? (100 * share).toFixed(0) + " %" : "—");
  text("eta", s.status === "finished" ? "done" : duration(s.eta_s));
  text("world", s.world_size);
  text("attempt", s.attempt);
  text("restarts", s.restarts);
  const c = s.checkpoints;
  text("saves", c.committed);
  const kinds = ["rejected", "pruned", "failed", "quarantined", "fenced"];
  const other = kinds.filter((k) => c[k] || k === "rejected").map((k) => c[k] + " " + k);
  text("saves-more", c.committed === undefined ? "" : "committed; " + other.join(", "));
  text("eval", s.eval ? (100 * s.eval.em).toFixed(1) + " / " + (100 * s.eval.f1).toFixed(1) : null);
  text("eval-step", s.eval ? "at step " + s.eval.step : "no evaluation yet");
  text("fault-count", s.faults.length);
  const r = s.replicas;
  $("quorum").closest(".card").hidden = !r;
  text("quorum", r ? r.participants + " of " + r.groups : null);
  const lineages = r ? "lineage " + r.lineage + " (" + r.lineages + " started), " : "";
  text("quorum-more", r ? lineages + r.heals + " heals" : "");
  fill("members", s.members, ["rank", "host", "pid", "step", "state", "seen_s"]);
  fill("agents", s.agents, ["agent", "role", "pid", "state"]);
  fill("saves-table", s.checkpoint_rows.slice().reverse(), ["t", "kind", "step", "why"]);
  fill("faults", s.faults, ["index", "fault", "target", "step", "t", "skipped"]);
  fill("timeline", s.timeline.slice().reverse(), ["t", "text"]);
  $("summary").innerHTML = s.html.summary;  // rendered by the server, every value escaped
  $("charts").innerHTML = s.html.charts;
  $("attempts").innerHTML = s.html.attempts;
}
async function poll() {
  let again = __POLL_MS__;
  try {
    const answer = await fetch("state.json?since=" + version, {cache: "no-store"});
    const s = await answer.json();
    if (!s.unchanged) show(s);
    text("idle", s.idle_s === null ? "no log line yet" : "newest log line " + duration(s.idle_s) + " ago");
    text("conn", "");
    if (s.behind) again = 0;
  } catch (err) {
    text("conn", "the dashboard server does not answer; trying again");
  }
  setTimeout(poll, again);
}
poll();
"""


# The age of the newest log line, and how many lines were left out as malformed (live_rows.py).
STATUS_NOTE = '<span id="idle"></span> <span id="skipped"></span>'
PROGRESS = (
    '<div class="bar"><div id="bar"></div></div><span id="percent"></span>, ETA <span id="eta">—</span>'
)


def _table(table_id: str, title: str, headings: list[str]) -> str:
    head = "".join(f"<th>{h}</th>" for h in headings)
    return (
        f'<section hidden><h2>{title}</h2><table id="{table_id}"><thead><tr>{head}</tr></thead>'
        "<tbody></tbody></table></section>"
    )


def dashboard_html(run_name: str, nonce: str) -> str:
    """The page for the run named `run_name`; `nonce` lets its script and style run under the CSP."""
    name = escape(run_name)
    cards = [
        ("Status", '<span id="status" class="badge">—</span>', STATUS_NOTE),
        ("Steps", '<span id="step">—</span> of <span id="max-steps">—</span>', PROGRESS),
        ("World size", '<span id="world">—</span>', 'attempt <span id="attempt">—</span>'),
        ("Restarts", '<span id="restarts">—</span>', "regroups after a failure or a change of workers"),
        ("Checkpoints", '<span id="saves">—</span>', '<span id="saves-more"></span>'),
        ("Last EM / F1 (%)", '<span id="eval">—</span>', '<span id="eval-step"></span>'),
        ("Faults injected", '<span id="fault-count">0</span>', "by a chaos run (chaos/faults.jsonl)"),
        ("Replica groups in the quorum", '<span id="quorum">—</span>', '<span id="quorum-more"></span>'),
    ]  # fmt: skip
    card_html = "".join(
        f'<div class="card"><div class="k">{k}</div><div class="v">{v}</div><div class="s">{s}</div></div>'
        for k, v, s in cards
    )
    body = [
        f"<h1>Live: {name}</h1>",
        '<p class="sub">updated every second from the run\'s logs <span id="conn"></span></p>',
        f'<div class="cards">{card_html}</div>',
        '<div class="cols">',
        _table(
            "members",
            "In the job now",
            ["rank", "host", "pid", "last step", "state", "silent for (s)"],
        ),
        _table("agents", "Agents of the local launcher", ["agent", "role", "pid", "state"]),
        "</div>",
        '<h2>Charts</h2><div class="charts" id="charts"></div>',
        '<div class="cols">',
        _table("saves-table", "Checkpoints (newest first)", ["s", "what", "step", "why"]),
        _table("faults", "Faults", ["#", "fault", "target", "step", "s", "skipped"]),
        "</div>",
        _table("timeline", "Timeline (newest first)", ["s", "what happened"]),
        '<h2>Run</h2><div id="summary"></div><div id="attempts"></div>',
    ]
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<link rel='icon' href='data:,'><title>Live: {name}</title>"
        f"<style nonce='{nonce}'>{STYLE}{EXTRA_STYLE}</style></head>"
        f"<body data-version='-1'>{''.join(body)}"
        f"<script nonce='{nonce}'>{SCRIPT.replace('__POLL_MS__', str(POLL_MS))}</script></body></html>"
    )
