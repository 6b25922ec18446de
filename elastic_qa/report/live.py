"""A run as it grows: its files followed byte by byte, and the state the dashboard shows, as plain JSON.

`LiveRun.refresh()` reads only what was appended since the last call, at most READ_CAP bytes a file (a
long finished run is caught up over a few polls, never in one), and only regular files inside the run
directory, each opened from the descriptor of its directory, itself opened from the run directory's on
every refresh: a file or a directory swapped for a symlink is not followed, whenever it was swapped and
wherever it points. It reads the workers' logs (logs/*.jsonl), the chaos runner's records
(chaos/faults.jsonl), the local launcher's (agents/launch.jsonl) and its agents' torchrun logs
(agents/agent-*.log: how a worker died), and config.yaml (again only when it changed, and at most
CONFIG_CAP bytes). Lines are parsed as observe/follow.py parses them (torn lines included), then checked
field by field in live_rows.py: a malformed record is left out and counted, never raised on.

What is kept of a long run is bounded: at most KEEP_STEPS step lines of all ranks, thinned as the run
grows (every k-th step, k doubling, the same steps on every rank), each worker's first and newest lines
and newest step line, and rank 0's newest RATE_WINDOW steps for the ETA; of every other kind of line, at
most MAX_KEPT. A line longer than MAX_LINE is dropped as it is read, never held whole.

`live_state()` turns what was kept into the page's state: progress and ETA, who is in the job now, the
checkpoints, faults and a timeline as plain values (the page shows them as text, never as markup), and
the report's summary, charts and attempts table as HTML rendered here, every value in it escaped.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from elastic_qa.observe.events import (
    AgentExitRecord,
    AgentStartedRecord,
    AttemptStartRecord,
    EmergencyCheckpointRecord,
    EvalRecord,
    Event,
    HealRecord,
    JobEndRecord,
    LineageRecord,
    QuorumRecord,
    ResumeRecord,
    StepProgressRecord,
    TrainDoneRecord,
    event_of,
    record,
    records,
)
from elastic_qa.observe.follow import MAX_LINE, open_regular, parse_log_line
from elastic_qa.report import live_rows
from elastic_qa.report.page import attempts_html, charts_html, summary_html
from elastic_qa.report.summary import attempts, run_summary

READ_CAP = 4 << 20  # bytes read from one file per refresh: the work of a poll stays bounded
CONFIG_CAP = 256 << 10  # bytes: a config.yaml longer than this is not read
RATE_WINDOW = 50  # rank 0's latest steps the ETA is measured over
RECENT = 30  # rows of the checkpoint, fault and timeline tables
CHART_STEPS = 1500  # steps drawn per chart line at most: a page redrawn every second stays small
KEEP_STEPS = 16 * CHART_STEPS  # step lines kept at most, of all ranks (every k-th step, k doubling)
MAX_KEPT = 100_000  # lines of other kinds kept at most, and workers, faults, launcher records, dead pids
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


# Kinds of line the state reads besides steps; of the rest, each worker's first and newest are enough.
READ_EVENTS = {
    "worker_start", "resume", "start_fresh", "train_start", "eval", "train_done", "emergency_checkpoint",
    *CHECKPOINT_EVENTS, *ENDINGS,
    "quorum", "heal", "lineage", "lineage_fenced", "no_quorum",  # the replica-group mode's
}  # fmt: skip
# torchrun's agent, when a worker dies: "failed (exitcode: -9) local_rank: 1 (pid: 4242) of binary: ..."
AGENT_FAILURE = re.compile(rb"failed \(exitcode: (-?\d{1,4})\) local_rank: \d{1,6} \(pid: (\d{1,10})\)")


class Tail:
    """The complete lines appended to one file since the last call, at most READ_CAP bytes at a time. A
    line longer than MAX_LINE is skipped to its newline without being kept whole, and counted."""

    def __init__(self) -> None:
        self.offset = 0
        self.behind = False  # more bytes were waiting than one read takes
        self.too_long = 0  # lines skipped for their length, not yet counted by the caller
        self._skipping = False  # inside a line longer than MAX_LINE: dropped up to its newline

    def new_lines(self, fd: int) -> list[bytes]:
        chunk = os.pread(fd, READ_CAP + 1, self.offset)
        self.behind, chunk = len(chunk) > READ_CAP, chunk[:READ_CAP]
        start = 0
        if self._skipping:
            start = chunk.find(b"\n") + 1
            if start == 0:
                self.offset += len(chunk)
                return []
            self._skipping = False
        complete = chunk.rfind(b"\n", start) + 1  # a line still being written is read next time
        if complete == 0 and len(chunk) - start > MAX_LINE:  # already too long: drop it as it comes
            self._skipping = True
            self.too_long += 1
            self.offset += len(chunk)
            return []
        self.offset += max(complete, start)
        return chunk[start : complete - 1].split(b"\n") if complete else []


class LiveRun:
    """What has been kept of one run directory so far; `refresh` and `state` are safe across threads."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir.resolve()
        # Held from the start: every file is reached from this descriptor, never by a path again.
        self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.events: list[dict[str, Any]] = []  # kept lines, in time order (step lines thinned)
        self.faults: list[dict[str, Any]] = []
        self.launcher: list[dict[str, Any]] = []
        self.failures: dict[int, int] = {}  # worker pid -> exit code, as its torchrun agent logged it
        self.config: dict[str, Any] = {}
        self.skipped = 0  # lines that are not records of their file, or hold a field of the wrong kind
        self.version = 0  # grows whenever something new was read
        self._every = 1  # the step lines kept are those of every k-th step
        self._ends: dict[tuple[Any, Any], list[dict[str, Any]]] = {}  # (attempt, rank) -> first, newest
        self._last_step: dict[tuple[Any, Any], dict[str, Any]] = {}  # (attempt, rank) -> newest step line
        self._pace: list[dict[str, Any]] = []  # rank 0's newest RATE_WINDOW step lines, in time order
        self._config_key: tuple[int, int, int] | None = None
        self._tails: dict[tuple[int, int], Tail] = {}  # by (device, inode): a file, whatever its name
        self._lock = threading.Lock()
        self._cached: dict[str, Any] | None = None
        self._computed_at, self._cost = 0.0, 0.0  # when the cached state was computed, in how long

    def close(self) -> None:
        """Let go of the run directory's descriptor (a server's LiveRun holds it for its lifetime)."""
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            self.close()

    def _lines(self, folder: str, pattern: str, records: bool = True) -> list[bytes]:
        """The new complete lines of the regular files `folder`/`pattern` (no symlink followed); lines
        too long to be `records` are counted as skipped."""
        try:
            dir_fd = os.open(
                folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._root_fd
            )
        except OSError:
            return []
        lines: list[bytes] = []
        try:
            for name in sorted(os.listdir(dir_fd)):
                if name.startswith(".") or not fnmatch.fnmatchcase(name, pattern):
                    continue
                if (fd := open_regular(name, dir_fd)) is None:
                    continue
                try:
                    info = os.fstat(fd)
                    key = (info.st_dev, info.st_ino)
                    if key in self._tails or len(self._tails) < MAX_KEPT:
                        tail = self._tails.setdefault(key, Tail())
                        lines += tail.new_lines(fd)
                        self.skipped += tail.too_long if records else 0
                        tail.too_long = 0
                finally:
                    os.close(fd)
        except OSError:
            pass
        finally:
            os.close(dir_fd)
        return lines

    def _records(
        self,
        lines: list[bytes],
        check: Callable[[dict[str, Any]], dict[str, Any] | None],
        actions: bool = False,
    ) -> list[dict[str, Any]]:
        """The lines that parse and pass `check`; the others counted as skipped (but, in a file that has
        them, the chaos runner's `action` records, which are no faults)."""
        records = []
        for line in lines:
            row = parse_log_line(line)
            record = None if row is None else check(row)
            if record is not None:
                records.append(record)
            elif line.strip() and not (actions and row is not None and "action" in row):
                self.skipped += 1
        return records

    def _agent_failures(self) -> bool:
        found = False
        for line in self._lines("agents", "agent-*.log", records=False):
            match = AGENT_FAILURE.search(line) if len(line) <= MAX_LINE else None
            if match is not None and (int(match[2]) in self.failures or len(self.failures) < MAX_KEPT):
                self.failures[int(match[2])] = int(match[1])
                found = True
        return found

    def _read_config(self) -> bool:
        """Whether config.yaml changed (read again then; a longer one than CONFIG_CAP reads as none)."""
        fd = open_regular("config.yaml", self._root_fd)
        if fd is None:
            changed, self._config_key, self.config = self._config_key is not None, None, {}
            return changed
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(fd)
            key = (info.st_ino, info.st_size, info.st_mtime_ns)
            if key == self._config_key:
                return False
            self._config_key = key
            # Grown past its size since the fstat: still bounded. Larger: not read at all.
            text = handle.read(CONFIG_CAP + 1) if info.st_size <= CONFIG_CAP else b""
        raw = None
        if text and len(text) <= CONFIG_CAP:
            with contextlib.suppress(yaml.YAMLError, ValueError, RecursionError):  # not YAML: no config
                raw = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        self.config = live_rows.config(raw)
        return True

    def _keep(self, events: list[dict[str, Any]]) -> None:
        """Keep what the state reads of new log lines, within bounds (see the module's docstring)."""
        kept, pace = [], []
        others = sum(1 for e in self.events if e["event"] != Event.STEP)
        for event in sorted(events, key=lambda row: row["ts"]):
            worker = (event.get("attempt"), event.get("rank"))
            if worker in self._ends or len(self._ends) < MAX_KEPT:
                ends = self._ends.setdefault(worker, [event, event])
                ends[0] = min(ends[0], event, key=lambda e: e["ts"])
                ends[1] = max(ends[1], event, key=lambda e: e["ts"])
            if (step := record(event, StepProgressRecord)) is not None:
                if worker in self._last_step or len(self._last_step) < MAX_KEPT:
                    self._last_step[worker] = max(
                        self._last_step.get(worker, event), event, key=lambda e: e["ts"]
                    )
                if step.get("rank") == 0:
                    pace.append(event)
                if step["step"] % self._every == 0:
                    kept.append(event)
            elif event["event"] in READ_EVENTS and others < MAX_KEPT:
                kept.append(event)
                others += 1
        self._pace = sorted(self._pace + pace, key=lambda row: row["ts"])[-RATE_WINDOW:]
        self.events = sorted(self.events + kept, key=lambda row: row["ts"])
        steps = [e["step"] for e in self.events if e["event"] == Event.STEP]
        top = max(steps, default=0)
        while len(steps) > KEEP_STEPS and self._every <= top:
            self._every *= 2
            self.events = [e for e in self.events if e["event"] != Event.STEP or e["step"] % self._every == 0]
            steps = [step for step in steps if step % self._every == 0]
        if len(steps) > KEEP_STEPS:  # lines that repeat the same few steps: the newest are kept
            old = {
                id(e) for e in [e for e in self.events if e["event"] == Event.STEP][: len(steps) - KEEP_STEPS]
            }
            self.events = [e for e in self.events if id(e) not in old]

    def refresh(self) -> None:
        with self._lock:
            skipped = self.skipped
            events = self._records(self._lines("logs", "*.jsonl"), live_rows.log_event)
            faults = self._records(self._lines("chaos", "faults.jsonl"), live_rows.fault, actions=True)
            launcher = self._records(self._lines("agents", "launch.jsonl"), live_rows.launcher_record)
            died = self._agent_failures()
            if self._read_config() or events or faults or launcher or died or self.skipped != skipped:
                self._keep(events)
                self.faults += faults[: max(MAX_KEPT - len(self.faults), 0)]
                if launcher:  # the newest are kept: the newest start's records say how it stands
                    self.launcher = (self.launcher + launcher)[-MAX_KEPT:]
                self.version += 1

    def shown_events(self) -> list[dict[str, Any]]:
        """The kept lines with each worker's first and newest lines, newest step and rank 0's newest steps,
        in time order: what the state is computed from."""
        extra = [e for ends in self._ends.values() for e in ends] + [*self._last_step.values(), *self._pace]
        seen = {id(e) for e in self.events}
        unique = {id(e): e for e in extra if id(e) not in seen}
        return sorted(self.events + list(unique.values()), key=lambda row: row["ts"])

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
                events = self.shown_events()
                self._cached = live_state(events, self.faults, self.launcher, self.config, self.failures)
                self._cached["version"] = self.version
                self._computed_at, self._cost = time.monotonic(), time.monotonic() - started
            state = self._cached
            last = max((ends[1]["ts"] for ends in self._ends.values()), default=None)
        return {
            **state,
            "idle_s": None if last is None else round(max(now - last, 0.0), 1),
            "behind": self.behind(),
            "skipped": self.skipped,
        }


def _host(event: dict[str, Any]) -> str:
    """The host of a worker's line (`node` is `host[@addr]/group_rank`)."""
    return str(event.get("node", "?")).rsplit("/", 1)[0].split("@", 1)[0]


def _eta(events: list[dict[str, Any]], attempt: int, step: int, max_steps: Any) -> float | None:
    """Seconds left at the pace of the newest attempt's recent steps, or None when unknown."""
    if not isinstance(max_steps, int) or max_steps <= step:
        return 0.0 if isinstance(max_steps, int) else None
    recent = [
        r for r in records(events, StepProgressRecord) if r.get("rank") == 0 and r.get("attempt") == attempt
    ][-RATE_WINDOW:]
    if len(recent) < 2 or recent[-1]["ts"] <= recent[0]["ts"] or recent[-1]["step"] <= recent[0]["step"]:
        return None
    pace = (recent[-1]["step"] - recent[0]["step"]) / (recent[-1]["ts"] - recent[0]["ts"])
    return (max_steps - step) / pace


def _death(code: int) -> str:
    """How a worker ended, from the exit code its torchrun agent logged (negative: the signal)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited {code}"


def _members(
    events: list[dict[str, Any]], attempt: int, t_end: float, failures: dict[int, int]
) -> list[dict[str, Any]]:
    """The workers of attempt `attempt`, one row per rank, with their last step and last word (or, with no
    last word, how their agent saw them die)."""
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
        name = event_of(event)
        if (step := record(event, StepProgressRecord)) is not None:
            row["step"] = step["step"]
        elif name == Event.TRAIN_DONE:
            row["state"] = "finished"
        elif name in ENDINGS:
            row["state"] = ENDINGS[name]
    for row in rows.values():
        if row["state"] == "up" and row["pid"] in failures:
            row["state"] = _death(failures[row["pid"]])
    return [rows[rank] for rank in sorted(rows, key=str)]


def _deaths(events: list[dict[str, Any]], failures: dict[int, int], t0: float) -> list[dict[str, Any]]:
    """Timeline rows of the workers that died without a last word: as their torchrun agent logged it,
    at their last line."""
    last: dict[int, dict[str, Any]] = {}
    for event in events:
        if event.get("pid") in failures and "rank" in event:
            last[event["pid"]] = event
    spoke = {e["pid"] for e in last.values() if e["event"] in ENDINGS or e["event"] == Event.TRAIN_DONE}
    return [
        {"t": round(e["ts"] - t0, 1),
         "text": f"rank {e['rank']} on {_host(e)} (pid {pid}) {_death(failures[pid])}"[:300]}
        for pid, e in last.items()
        if pid not in spoke
    ]  # fmt: skip


def _newest_job(launcher: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the newest `start` (a run directory started again holds those of the earlier ones)."""
    starts = [i for i, record in enumerate(launcher) if record["event"] == Event.JOB_START]
    return launcher[starts[-1] :] if starts else launcher


def _agents(launcher: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The local launcher's agents (agents/launch.jsonl; a multi-node job has no such file)."""
    agents: dict[Any, dict[str, Any]] = {}
    for row in _newest_job(launcher):
        name = event_of(row)
        if (started := record(row, AgentStartedRecord)) is not None:
            role = "store host" if started.get("is_host") else "agent"
            number = started["agent"]
            agents[number] = {"agent": number, "pid": started.get("pid"), "role": role, "state": "started"}
        elif name in (Event.AGENT_LEAVE, Event.AGENT_STOP) and row.get("agent") in agents:
            agents[row["agent"]]["state"] = "left" if name == Event.AGENT_LEAVE else "stopped"
        elif (ended := record(row, AgentExitRecord)) is not None and ended["agent"] in agents:
            agent = agents[ended["agent"]]
            if agent["state"] == "started":  # one that left or was stopped keeps saying so
                agent["state"] = f"exited {ended.get('code', '?')}"
        elif (end := record(row, JobEndRecord)) is not None:
            codes = end.get("exit_codes", {})
            for number, agent in agents.items():
                if agent["state"] == "started":
                    agent["state"] = f"exited {codes.get(str(number), '?')}"
    return list(agents.values())


def _timeline(events: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    """The moments that change the job: attempts starting, resumes, failures, emergency saves, the end."""
    rows = []
    for event in events:
        name, rank = event_of(event), event.get("rank")
        if (started := record(event, AttemptStartRecord)) is not None and rank == 0:
            size = started.get("world_size")
            text = f"attempt {started.get('attempt')} started with {size} worker{'' if size == 1 else 's'}"
            if "replica_group" in event:  # a replica group's worker: attempts are lineages there
                text = f"replica group {event['replica_group']} worker started"
        elif (resumed := record(event, ResumeRecord)) is not None and rank == 0:
            saved = resumed.get("saved_world_size")
            text = f"resumed from step {resumed['step']}" + (
                f" (saved at world size {saved})" if saved else ""
            )
        elif name in ENDINGS:
            detail = event.get("error") or event.get("reason") or ""
            text = f"rank {rank} on {_host(event)} {ENDINGS[name]}" + (f": {detail}" if detail else "")
        elif (saving := record(event, EmergencyCheckpointRecord)) is not None and rank == 0:
            text = f"emergency checkpoint of step {saving['step']}"
        elif (done := record(event, TrainDoneRecord)) is not None and rank == 0:
            text = f"finished at step {done['step']}"
        elif (healed := record(event, HealRecord)) is not None and rank == 0:
            text = (
                f"replica group {event.get('replica_group')} healed from a live peer: step "
                f"{healed['from_step']} -> {healed['step']} (lineage {healed['lineage']})"
            )
        elif (claimed := record(event, LineageRecord)) is not None and rank == 0:
            start = (
                f"restored step {claimed['step']}"
                if event.get("restored")
                else f"after step {claimed['step']}"
            )
            text = (
                f"replica group {event.get('replica_group')} started lineage {claimed['lineage']} ({start})"
            )
        elif name == Event.LINEAGE_FENCED and rank == 0:
            text = (
                f"replica group {event.get('replica_group')}: its lineage lost to a newer one (saves refused)"
            )
        elif name == Event.NO_QUORUM and rank == 0:
            text = f"replica group {event.get('replica_group')} found no quorum: saved and restarting"
        else:
            continue
        rows.append({"t": round(event["ts"] - t0, 1), "text": text[:300]})
    return rows[-RECENT:]


def _replicas(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The replica-group mode's view (None for a run of the default mode): the newest quorum as its
    groups saw it, how many groups ran, the lineages started and the heals."""
    quorums = [q for q in records(events, QuorumRecord) if q.get("rank") == 0]
    if not quorums:
        return None
    newest = quorums[-1]
    groups = {e["replica_group"] for e in events if isinstance(e.get("replica_group"), int)}
    steps = [e for e in records(events, StepProgressRecord) if isinstance(e.get("participants"), int)]
    return {
        "quorum": newest["quorum"],
        "participants": steps[-1]["participants"] if steps else newest["participants"],
        "groups": len(groups),
        "lineage": steps[-1].get("lineage") if steps else newest["lineage"],
        "lineages": len({c["lineage"] for c in records(events, LineageRecord)}),
        "heals": sum(1 for h in records(events, HealRecord) if h.get("rank") == 0),
    }


def _thinned(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events with at most about CHART_STEPS step lines per rank and attempt (every k-th step, the same
    steps on every rank), for the charts: drawn a few hundred pixels wide, more points show nothing more."""
    steps = sum(1 for e in records(events, StepProgressRecord) if e.get("rank") == 0)
    every = -(-steps // CHART_STEPS)
    if every <= 1:
        return events
    return [e for e in events if (step := record(e, StepProgressRecord)) is None or step["step"] % every == 0]


def live_state(
    events: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    launcher: list[dict[str, Any]],
    config: dict[str, Any],
    failures: dict[int, int] | None = None,
) -> dict[str, Any]:
    """The dashboard's state from a run's log events (in time order, each checked by live_rows), its chaos
    fault records, its launcher records, its config and the exit codes of the workers their torchrun
    agents saw die (by pid)."""
    failures = failures or {}
    name = "waiting for the first log line"
    state: dict[str, Any] = {
        "status": name, "step": 0, "max_steps": None, "eta_s": None, "world_size": 0, "attempt": None,
        "restarts": 0, "members": [], "agents": _agents(launcher), "checkpoints": {}, "checkpoint_rows": [],
        "eval": None, "faults": [], "timeline": [], "html": {"summary": "", "charts": "", "attempts": ""},
        "replicas": None,
    }  # fmt: skip
    if not events:
        return state
    t0 = events[0]["ts"]
    facts = run_summary(events, config)
    runs = attempts(events, t0)
    newest = runs[-1] if runs else None
    attempt = newest.attempt if newest else None
    members = _members(events, attempt, events[-1]["ts"], failures) if attempt is not None else []
    job = _newest_job(launcher)
    job_ts = job[0].get("ts") if job and job[0]["event"] == Event.JOB_START else None
    # A run directory started again holds the lines of the earlier starts: only the newest attempt's
    # train_done, and only the newest start's job_end, say how it stands now.
    earlier = newest is not None and job_ts is not None and job_ts > t0 + newest.start
    if not earlier and any(e["event"] == Event.TRAIN_DONE and e.get("attempt") == attempt for e in events):
        name = "finished"
    elif any(r["event"] == Event.JOB_END for r in job):
        name = "ended without finishing"
    elif earlier:
        name = "starting"  # started again; no worker of this start has written a line yet
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
    evals = [r for r in records(events, EvalRecord) if "em" in r]
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
        replicas=_replicas(events),
        timeline=sorted(_timeline(events, t0) + _deaths(events, failures, t0), key=lambda r: r["t"])[
            -RECENT:
        ],
        html={
            "summary": summary_html(facts),
            "charts": "".join(charts_html(_thinned(events), config, None, faults)),
            "attempts": attempts_html(events),
        },
    )
    return state
