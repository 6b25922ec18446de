"""GET /: one self-contained page (no external resources) to type a context and a question and see the
answer highlighted in the context. Everything it shows from the server or the user is set as text
(textContent, text nodes), never parsed as HTML; its Content-Security-Policy allows its own inline script
and style only, and requests to this server only."""

from __future__ import annotations

import base64
import hashlib

STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem;
       color: #1d1d1f; }
h1 { font-size: 1.3rem; }
label { display: block; font-weight: 600; margin-top: 1rem; }
textarea, input { width: 100%; box-sizing: border-box; font: inherit; padding: .4rem; }
textarea { height: 9rem; }
button { margin-top: .8rem; font: inherit; padding: .4rem 1.2rem; }
#result { margin-top: 1.2rem; }
#answer { font-size: 1.15rem; font-weight: 600; }
#context { white-space: pre-wrap; border: 1px solid #ccc; padding: .6rem; margin-top: .6rem; }
mark { background: #ffe066; padding: 0 .1rem; }
mark.best { background: #e0e0e0; }
.muted { color: #666; font-size: .9rem; }
.error { color: #b00020; }
"""

SCRIPT = """
"use strict";
const form = document.getElementById("ask");
const status = document.getElementById("status");
function show(id, text) { document.getElementById(id).textContent = text; }
function highlight(context, start, end, kind) {
  const box = document.getElementById("context");
  box.replaceChildren();
  if (start === null || end === null) { box.append(document.createTextNode(context)); return; }
  const mark = document.createElement("mark");
  mark.className = kind;
  mark.textContent = context.slice(start, end);
  box.append(document.createTextNode(context.slice(0, start)), mark,
             document.createTextNode(context.slice(end)));
}
form.addEventListener("submit", async (event) => {
  event.preventDefault();
  const question = document.getElementById("question").value;
  const context = document.getElementById("context-input").value;
  status.className = "muted";
  show("status", "asking...");
  try {
    const reply = await fetch("v1/answer", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({question: question, context: context}),
    });
    const data = await reply.json();
    if (!reply.ok) { throw new Error(data.error || ("HTTP " + reply.status)); }
    show("asked", "Q: " + question);
    const best = data.best_span;
    if (data.answer) {
      show("answer", data.answer);
      highlight(context, data.start, data.end, "answer");
    } else {
      show("answer", "(no answer in the context)");
      highlight(context, best ? best.start : null, best ? best.end : null, "best");
    }
    show("scores", "score " + data.score.toFixed(3) + ", null odds " + data.null_odds.toFixed(3) +
         " (no answer above " + data.null_threshold + ")" + (best ? ", best span: " + best.text : ""));
    document.getElementById("result").hidden = false;
    show("status", "");
  } catch (err) {
    status.className = "error";
    show("status", String(err.message || err));
  }
});
"""

PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>elastic-qa serve</title>
<style>{STYLE}</style>
</head>
<body>
<h1>Ask the model</h1>
<form id="ask">
<label for="context-input">Context</label>
<textarea id="context-input" required placeholder="The text the answer is found in."></textarea>
<label for="question">Question</label>
<input id="question" required placeholder="A question whose answer is a span of the context.">
<button id="submit" type="submit">Ask</button>
<span id="status" class="muted" role="status"></span>
</form>
<div id="result" hidden>
<div id="asked" class="muted"></div>
<div id="answer"></div>
<div id="scores" class="muted"></div>
<div id="context"></div>
</div>
<script>{SCRIPT}</script>
</body>
</html>
"""


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


PAGE_POLICY = (
    f"default-src 'none'; script-src '{_sha256(SCRIPT)}'; style-src '{_sha256(STYLE)}'; "
    "connect-src 'self'; img-src 'none'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
)
