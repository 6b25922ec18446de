"""Where a recovery's seconds go, read back from one kill's run directory (`bench recovery --work-dir`).

    python -m elastic_qa.bench.recovery_timeline WORK_DIR [WORK_DIR ...]

Each run directory holds bench-kill.json (the kill's time) and the logs of every process. From them, in
seconds after the kill:

    noticed      a survivor's collective failed (its `emergency_checkpoint` line)
    saved        the survivor's emergency save is done and it leaves (`peer_failure`)
    born         the new rank 0 process is created: the agents noticed, the rendezvous round ran, the
                 agent spawned it (the birth its `startup` event gives; absent for a version without it)
    probed       the new rank 0's freeze is decided (`frozen_parameters`: probed, or taken from the
                 checkpoint)
    started      it restored and registered (`worker_start`)
    then the new rank 0's start-up phases (observe/startup.py), grouped:
        imports         interpreter and imports
        config_cache    config, logging, feature cache (for an hf model: transformers and the tokenizer)
        process_group   init_process_group and the groups
        model           the model built (pretrained weights read), moved, wrapped
        probe           the freeze probe, or the answer the checkpoint carried
        optimizer       optimizer and the rest of the trainer (torch._dynamo's import, where not overlapped)
        restore         checkpoint read and applied, attempt registered
        first_step      the loader and the first step, with the all-reduce that waits for the slowest rank
    first_step   the new group's first step (what `bench recovery` reports)

Missing events leave their figure out (a node loss may have no survivor save; a version without the
`startup` event has no phases). Directories of the bare floor (no worker of the product) are skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from elastic_qa.observe.events import Event, StepProgressRecord, records
from elastic_qa.observe.follow import read_events

GROUPS = {
    "imports": ("interpreter_s", "imports_s"),
    "config_cache": ("config_s", "cache_open_s"),
    "process_group": ("process_group_s",),
    "model": ("model_build_s",),
    "probe": ("probe_s",),
    "optimizer": ("optimizer_s", "trainer_init_s"),
    "restore": ("restore_read_s", "restore_apply_s", "register_s"),
    "first_step": ("first_step_s",),
}
MILESTONES = ("noticed", "saved", "born", "probed", "started")
COLUMNS = (*MILESTONES, *GROUPS, "first_step_at")


def timeline(run_dir: Path) -> dict[str, float] | None:
    """One kill's figures (see the module), or None for a directory without a product kill."""
    kill_file = run_dir / "bench-kill.json"
    if not kill_file.exists():
        return None
    killed = float(json.loads(kill_file.read_text())["ts"])
    events = read_events(run_dir)
    old = {row.get("pid") for row in events if row.get("ts", 0) < killed}
    steps = [row for row in records(events, StepProgressRecord) if row.get("ts", 0) >= killed]
    # A new rank 0 also writes the lines the old one had in flight (`recovered`): not the new group's steps.
    new_steps = [row for row in steps if row.get("pid") not in old and not row.get("recovered")]
    if not new_steps or not any(row["event"] == Event.TRAIN_START for row in events):
        return None  # the bare floor's trivial worker, or a kill the group never recovered from
    first = min(new_steps, key=lambda row: row["ts"])
    figures: dict[str, float] = {"first_step_at": first["ts"] - killed}
    after = [row for row in events if row.get("ts", 0) >= killed]
    for name, event in (("noticed", Event.EMERGENCY_CHECKPOINT), ("saved", Event.PEER_FAILURE)):
        rows = [row for row in after if row["event"] == event and row.get("pid") in old]
        if rows:
            figures[name] = rows[0]["ts"] - killed
    mine = [row for row in after if row.get("pid") == first.get("pid")]
    for name, event in (("probed", Event.FROZEN_PARAMETERS), ("started", Event.WORKER_START)):
        rows = [row for row in mine if row["event"] == event]
        if rows:
            figures[name] = rows[0]["ts"] - killed
    startup = next((row for row in mine if row["event"] == Event.STARTUP), None)
    if startup is None:
        return figures
    figures["born"] = startup["ts"] - startup["total_s"] - killed
    for group, phases in GROUPS.items():
        figures[group] = sum(float(startup.get(phase, 0.0)) for phase in phases)
    return figures


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """The median of each figure over the kills that have it."""
    return {
        column: statistics.median(row[column] for row in rows if column in row)
        for column in COLUMNS
        if any(column in row for row in rows)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_qa.bench.recovery_timeline", description=__doc__)
    parser.add_argument("work_dirs", nargs="+", type=Path, help="bench recovery --work-dir directories")
    args = parser.parse_args(argv)
    for work in args.work_dirs:
        found = {run.name: timeline(run) for run in sorted(work.iterdir()) if run.is_dir()}
        rows = {name: row for name, row in found.items() if row is not None}
        for name, row in rows.items():
            print(name, json.dumps({key: round(value, 2) for key, value in row.items()}))
        if rows:
            middle = medians(list(rows.values()))
            print(work, "median", json.dumps({key: round(value, 2) for key, value in middle.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
