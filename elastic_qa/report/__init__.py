"""A run after the fact, or live: what its logs and config say, drawn for people.

page.py renders the static page (`elastic-qa report RUN_DIR`; the chaos verifier puts its verdict on top),
from summary.py (attempts, idle gaps, the summary's facts), charts.py (inline SVG line charts) and ticks.py
(axis ticks and labels). It reads the logs through observe/follow.py and never runs beside training: the
trainer's own observability (log, console, breakdown, ledger, trackers) stays in observe/.
"""
