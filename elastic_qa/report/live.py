"""A run as it grows: its files followed byte by byte, and the state the dashboard shows, as plain JSON.

`LiveRun.refresh()` reads only what was appended since the last call, at most READ_CAP bytes a file (a
long finished run is caught up over a few polls, never in one), and only regular files inside the run
directory: a symlink is not followed, whether it points out of the run or not. It reads the workers'
logs (logs/*.jsonl), the chaos runner's records (chaos/faults.jsonl) and the local launcher's
(agents/launch.jsonl), and config.yaml. Lines are parsed as observe/follow.py parses them (torn lines
included); its LogFollower is not used here, since it reads all that is new at once and opens what a
symlink points to.

`live_state()` turns what was read into the page's state: progress and ETA, who is in the job now, the
checkpoints, faults and a timeline as plain values (the page shows them as text, never as markup), and
the report's summary, charts and attempts table as HTML rendered here, every value in it escaped.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from elastic_qa.observe.follow import parse_log_line
from elastic_qa.report.page import attempts_html, charts_html, summary_html
from elastic_qa.report.summary import attempts, read_config, run_summary

READ_CAP = 4 << 20  # bytes read from one file per refresh: the work of a poll stays bounded
RATE_WINDOW = 50  # rank 0's latest steps the ETA is measured over
RECENT = 30  # rows of the checkpoint, fault and timeline tables
CHART_STEPS = 1500  # steps drawn per chart line at most: a page redrawn every second stays small
COST_SHARE = 0.25  # at most this share of the time goes to recomputing the state of a run that grows
CHEAP_S = 0.05  # a state computed faster than this is recomputed whenever something new was read
CHECKPOINT_EVENTS = {
    "checkpoint_committed": "committed",
    "checkpoint_rejected": "rejected",
    "checkpoint_quarantined": "quarantined",
    "checkpoint_pruned": "pruned",
    "checkpoint_failed": "failed",
    "checkpoint_fenced": "fenced",
}
# What a worker's last line says about how its attempt ended (the newest attempt with one is regrouping).
ENDINGS = {
    "worker_crash": "crashed",
    "peer_failure": "lost a peer",
    "agent_lost": "lost its agent",
    "bad_input": "stopped on bad input",
    "checkpoint_fenced": "was fenced",
    "stopping": "stopped by a signal",
    "debug_kill": "killed (debug.kill_at_step)",
}


def inside(root: Path, path: Path) -> bool:
    """Whether `path` is a regular file of the run directory `root` (resolved), reached by no symlink."""
    try:
        return not path.is_symlink() and path.resolve().is_relative_to(root) and path.is_file()
    except OSError:
        return False


class Tail:
    """The complete lines appended to one file since the last call, at most READ_CAP bytes at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.behind = False  # more bytes were waiting than one read takes

    def new_rows(self) -> list[dict[str, Any]]:
        try:  # O_NOFOLLOW: a file swapped for a symlink since it was checked is not opened either
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return []
        with os.fdopen(fd, "rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read(READ_CAP)
            self.behind = bool(handle.read(1))
        complete = chunk.rfind(b"\n") + 1  # a line still being written is read next time
        if complete == 0 and len(chunk) == READ_CAP:  # one line longer than a read: skip it, not stall
            complete = len(chunk)
        self.offset += complete
        return [row for line in chunk[:complete].splitlines() if (row := parse_log_line(line)) is not None]


class LiveRun:
    """What has been read of one run directory so far; `refresh` and `state` are safe across threads."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir.resolve()
        self.events: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.launcher: list[dict[str, Any]] = []
        self.config: dict[str, Any] = {}
        self.version = 0  # grows whenever something new was read
        self._tails: dict[Path, Tail] = {}
        self._lock = threading.Lock()
        self._cached: dict[str, Any] | None = None
        self._computed_at, self._cost = 0.0, 0.0  # when the cached state was computed, in how long

    def _tail(self, path: Path) -> Tail | None:
        if path not in self._tails and inside(self.root, path):
            self._tails[path] = Tail(path)
        return self._tails.get(path)

    def refresh(self) -> None:
        with self._lock:
            events = []
            for path in sorted((self.run_dir / "logs").glob("*.jsonl")):
                if (tail := self._tail(path)) is not None:
                    events += [
                        r for r in tail.new_rows() if "event" in r and isinstance(r.get("ts"), (int, float))
                    ]
            faults: list[dict[str, Any]] = []
            launcher: list[dict[str, Any]] = []
            if (tail := self._tail(self.run_dir / "chaos" / "faults.jsonl")) is not None:
                faults = [r for r in tail.new_rows() if "fault" in r and "action" not in r]
            if (tail := self._tail(self.run_dir / "agents" / "launch.jsonl")) is not None:
                launcher = [r for r in tail.new_rows() if "event" in r]
            if not self.config and inside(self.root, self.run_dir / "config.yaml"):
                self.config = read_config(self.run_dir)
            if events or faults or launcher:
                self.events = sorted(self.events + events, key=lambda row: row["ts"])
                self.faults += faults
                self.launcher += launcher
                self.version += 1

    def behind(self) -> bool:
        """Whether some file holds more than the last refresh read."""
        return any(tail.behind for tail in self._tails.values())

    def state(self, now: float | None = None) -> dict[str, Any]:
        """The page's state (recomputed only when something new was read; the age of the newest line is
        always current)."""
        now = time.time() if now is None else now
        with self._lock:
            # A long run's state costs time to compute (0.2 s at 20,000 log lines): while it grows, the
            # state is recomputed no sooner than its cost allows, and meanwhile the last one is served.
            due = self._cost < CHEAP_S or self._computed_at + self._cost / COST_SHARE <= time.monotonic()
            if self._cached is None or (self._cached["version"] != self.version and due):
                started = time.monotonic()
                self._cached = live_state(self.events, self.faults, self.launcher, self.config)
                self._cached["version"] = self.version
                self._computed_at, self._cost = time.monotonic(), time.monotonic() - started
            state = self._cached
        last = self.events[-1]["ts"] if self.events else None
        return {
            **state,
            "idle_s": None if last is None else round(max(now - last, 0.0), 1),
            "behind": self.behind(),
        }


def _host(event: dict[str, Any]) -> str:
    """The host of a worker's line (`node` is `host[@addr]/group_rank`)."""
    return str(event.get("node", "?")).rsplit("/", 1)[0].split("@", 1)[0]


def _eta(events: list[dict[str, Any]], attempt: int, step: int, max_steps: Any) -> float | None:
    """Seconds left at the pace of the newest attempt's recent steps, or None when unknown."""
    if not isinstance(max_steps, int) or max_steps <= step:
        return 0.0 if isinstance(max_steps, int) else None
    recent = [
        r
        for r in events
        if r.get("event") == "step"
        and r.get("rank") == 0
        and r.get("attempt") == attempt
        and isinstance(r.get("step"), int)
    ][-RATE_WINDOW:]
    if len(recent) < 2 or recent[-1]["ts"] <= recent[0]["ts"] or recent[-1]["step"] <= recent[0]["step"]:
        return None
    pace = (recent[-1]["step"] - recent[0]["step"]) / (recent[-1]["ts"] - recent[0]["ts"])
    return (max_steps - step) / pace


def _members(events: list[dict[str, Any]], attempt: int, t_end: float) -> list[dict[str, Any]]:
    """The workers of attempt `attempt`, one row per rank, with their last step and last word."""
    rows: dict[Any, dict[str, Any]] = {}
    for event in events:
        if event.get("attempt") != attempt or "rank" not in event:
            continue
        row = rows.setdefault(
            event["rank"],
            {
                "rank": event["rank"],
                "host": _host(event),
                "pid": event.get("pid"),
                "step": None,
                "state": "up",
            },
        )
        row["seen_s"] = round(t_end - event["ts"], 1)
        if event.get("event") == "step" and isinstance(event.get("step"), int):
            row["step"] = event["step"]
        elif event.get("event") == "train_done":
            row["state"] = "finished"
        elif event.get("event") in ENDINGS:
            row["state"] = ENDINGS[event["event"]]
    return [rows[rank] for rank in sorted(rows, key=str)]


def _agents(launcher: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The local launcher's agents (agents/launch.jsonl; a multi-node job has no such file)."""
    agents: dict[Any, dict[str, Any]] = {}
    for record in launcher:
        name = record.get("event")
        if name == "agent_started":
            role = "store host" if record.get("is_host") else "agent"
            number = record.get("agent")
            agents[number] = {"agent": number, "pid": record.get("pid"), "role": role, "state": "started"}
        elif name in ("agent_leave", "agent_stop") and record.get("agent") in agents:
            agents[record["agent"]]["state"] = "left" if name == "agent_leave" else "stopped"
        elif name == "agent_exit" and record.get("agent") in agents:
            agent = agents[record["agent"]]
            if agent["state"] == "started":  # one that left or was stopped keeps saying so
                agent["state"] = f"exited {record.get('code', '?')}"
        elif name == "job_end":
            codes = record.get("exit_codes")
            codes = codes if isinstance(codes, dict) else {}
            for number, agent in agents.items():
                if agent["state"] == "started":
                    agent["state"] = f"exited {codes.get(str(number), '?')}"
    return list(agents.values())


def _timeline(events: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    """The moments that change the job: attempts starting, resumes, failures, emergency saves, the end."""
    rows = []
    for event in events:
        name, rank = event.get("event"), event.get("rank")
        if name == "worker_start" and rank == 0:
            size = event.get("world_size")
            text = f"attempt {event.get('attempt')} started with {size} worker{'' if size == 1 else 's'}"
        elif name == "resume" and rank == 0:
            saved = event.get("saved_world_size")
            text = f"resumed from step {event.get('step')}" + (
                f" (saved at world size {saved})" if saved else ""
            )
        elif name in ENDINGS:
            detail = event.get("error") or event.get("reason") or ""
            text = f"rank {rank} on {_host(event)} {ENDINGS[name]}" + (f": {detail}" if detail else "")
        elif name == "emergency_checkpoint" and rank == 0:
            text = f"emergency checkpoint of step {event.get('step')}"
        elif name == "train_done" and rank == 0:
            text = f"finished at step {event.get('step')}"
        else:
            continue
        rows.append({"t": round(event["ts"] - t0, 1), "text": text[:300]})
    return rows[-RECENT:]


def _thinned(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events with at most about CHART_STEPS step lines per rank and attempt (every k-th step, the same
    steps on every rank), for the charts: drawn a few hundred pixels wide, more points show nothing more."""
    steps = sum(1 for e in events if e.get("event") == "step" and e.get("rank") == 0)
    every = -(-steps // CHART_STEPS)
    if every <= 1:
        return events
    return [
        e
        for e in events
        if e.get("event") != "step" or not isinstance(e.get("step"), int) or e["step"] % every == 0
    ]


def live_state(
    events: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    launcher: list[dict[str, Any]],
    config: dict[str, Any],
) -> dict[str, Any]:
    """The dashboard's state from a run's log events (in time order, each with a `ts`), its chaos fault
    records, its launcher records and its config."""
    name = "waiting for the first log line"
    state: dict[str, Any] = {
        "status": name, "step": 0, "max_steps": None, "eta_s": None, "world_size": 0, "attempt": None,
        "restarts": 0, "members": [], "agents": _agents(launcher), "checkpoints": {}, "checkpoint_rows": [],
        "eval": None, "faults": [], "timeline": [], "html": {"summary": "", "charts": "", "attempts": ""},
    }  # fmt: skip
    if not events:
        return state
    t0 = events[0]["ts"]
    facts = run_summary(events, config)
    runs = attempts(events, t0)
    newest = runs[-1] if runs else None
    attempt = newest.attempt if newest else None
    members = _members(events, attempt, events[-1]["ts"]) if attempt is not None else []
    if facts["finished"]:
        name = "finished"
    elif any(r.get("event") == "job_end" for r in launcher):
        name = "ended without finishing"
    elif any(m["state"] not in ("up", "finished") for m in members):
        name = "regrouping"
    else:
        name = "training"
    counts = {kind: 0 for kind in CHECKPOINT_EVENTS.values()}
    saves = []
    for event in events:
        if (kind := CHECKPOINT_EVENTS.get(event.get("event", ""))) is not None:
            counts[kind] += 1
            why = event.get("reason") or event.get("error") or ""
            saves.append({"t": round(event["ts"] - t0, 1), "kind": kind, "step": event.get("step"),
                          "why": str(why)[:300]})  # fmt: skip
    evals = [r for r in events if r.get("event") == "eval" and "em" in r]
    injected = [
        {"index": i, "fault": f.get("fault"), "target": f.get("target", ""), "step": f.get("step"),
         "t": round(f["ts"] - t0, 1) if isinstance(f.get("ts"), (int, float)) else None,
         "skipped": f.get("skipped", "")}
        for i, f in enumerate(faults, start=1)
    ]  # fmt: skip
    state.update(
        status=name,
        step=facts["step"],
        max_steps=facts["max_steps"],
        eta_s=_eta(events, attempt or 0, facts["step"], facts["max_steps"]) if name == "training" else None,
        world_size=newest.world_size if newest else 0,
        attempt=attempt,
        restarts=facts["restarts"],
        members=members,
        checkpoints=counts,
        checkpoint_rows=saves[-RECENT:],
        eval={k: evals[-1].get(k) for k in ("step", "em", "f1")} if evals else None,
        faults=injected[-RECENT:],
        timeline=_timeline(events, t0),
        html={
            "summary": summary_html(facts),
            "charts": "".join(charts_html(_thinned(events), config, None, faults)),
            "attempts": attempts_html(events),
        },
    )
    return state
