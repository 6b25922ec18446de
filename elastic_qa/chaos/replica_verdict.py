"""The verdict on a replica-group run (`elastic-qa replicas`, chaos/replicas.py), from its evidence only.

A run is one of this mode when its launcher left <run.dir>/agents/replicas.jsonl; `verify_run` then hands it
here, so `elastic-qa chaos verify DIR` judges it as `chaos run --replicas` does. Checks (all must hold):

1. completed: the job exited 0 (the runner's `job_exit`, else the launcher's `job_end`) and every group
   logged `train_done` at train.max_steps;
2. exactly_once: the replica ledger verifies (replica/shares.py): the final model's chain of lineages goes
   back to step 0 and each of its steps was committed by exactly one quorum whose shares are exactly the
   step's global batch; steps of lineages off that chain are counted as discarded, never as trained;
3. same_parameters: every group's `train_done` names the same `params_sha256`, and so does the final
   checkpoint's model;
4. checkpoints: every checkpoint in place verifies and was written by a lineage of the final chain at a step
   of that lineage's segment (no state of a discarded lineage left visible); the final one is in place,
   and was committed before any group claimed done, by the lineage each group claimed done in; a
   quarantined copy of the final chain that verifies is a valid state set aside; no more are kept than
   keep_last and the milestones;
5. faults_injected: every requested fault was injected;
6. matches_reference (with a fault-free replica run to compare with): the final parameters within 1e-4
   relative (the groups' gradient sums run in another order whenever fewer groups take part in a step).

Each fault is one row with what it cost: the steps whose training did not count (`lost`: tries whose vote
said no, plus committed steps of a lineage the final model does not descend from: `discarded`) and the
seconds without a committed step of the final chain (`recovery_s`: from the fault to the next one). A
discarded step is counted against the fault before the claim of the lineage that left it behind (a restore
from an older checkpoint, the newer side of a split). Then each kind's own check:

- kill-worker: the group's torchrun started it again, it healed from a live peer, the others committed a
  step without it meanwhile, and nothing was discarded;
- kill-node: the launcher saw the group's torchrun agent exit and started the group again, and then as
  kill-worker: its new workers healed from a live peer, the others committed a step without it meanwhile,
  and nothing was discarded;
- kill-lighthouse: the launcher started a Lighthouse again at the same port, no group restarted (they
  retry their quorum requests), and the job committed steps after it (a restarted Lighthouse may give each
  group a quorum of its own for a moment: the older lineage's steps are then discarded, and counted);
- stall-replica: past max(collective, heartbeat) timeout the others committed a step without the stalled
  group; it committed no step the quorum moved past (its ledger lines) and wrote no checkpoint off the
  final chain after the stall, healed after its thaw, and nothing was discarded;
- kill-during-heal: the sender was killed while held at the heal, its group was started again, and the
  discarded steps are no more than the sender's step less the newest checkpoint committed before the kill
  (0 when a group that held the state was left).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from elastic_qa.chaos.evidence import (
    Copy,
    checkpoint_copies,
    final_parameters,
    parameter_difference,
    run_config,
)
from elastic_qa.chaos.judge import fault_row
from elastic_qa.checkpoint.policy import retained_steps
from elastic_qa.config import Config
from elastic_qa.models import family_for
from elastic_qa.observe.events import Event
from elastic_qa.observe.follow import read_events
from elastic_qa.prep import prepare
from elastic_qa.replica.shares import Verdict as LedgerVerdict
from elastic_qa.replica.shares import read_replica_ledger, verify

if TYPE_CHECKING:
    from elastic_qa.chaos.verify import Verdict

RECORDS = Path("agents") / "replicas.jsonl"
RELATIVE_BOUND = 1e-4


def is_replica_run(run_dir: Path) -> bool:
    """Whether `run_dir` was trained by `elastic-qa replicas` (its launcher's lines are there)."""
    return (Path(run_dir) / RECORDS).exists()


def launcher_records(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for line in (Path(run_dir) / RECORDS).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def params_sha256(model: dict[str, torch.Tensor]) -> str:
    """The digest a replica worker logs in `train_done` (replica/worker.py), over a saved model's tensors."""
    digest = hashlib.sha256()
    for name, tensor in model.items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class ReplicaEvidence:
    """Everything a replica run's fault rows are judged from."""

    cfg: Config
    events: list[dict[str, Any]]  # the workers' lines, in time order
    launcher: list[dict[str, Any]]  # agents/replicas.jsonl
    actions: list[dict[str, Any]]  # the runner's action lines
    ledger: list[dict[str, Any]]
    chain: LedgerVerdict
    committed: list[dict[str, Any]]  # the step lines of the final chain, in time order

    @property
    def groups(self) -> int:
        return self.cfg.replica.groups

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == event]


def verify_replica_run(run_dir: Path, reference_dir: Path | None = None) -> Verdict:
    from elastic_qa.chaos.verify import Verdict, read_actions, read_faults, requested_faults

    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    events = read_events(run_dir)
    faults, actions = read_faults(run_dir), read_actions(run_dir)
    launcher = launcher_records(run_dir)
    verdict = Verdict()

    ok, detail = _completed(cfg, events, actions, launcher)
    verdict.add("completed", ok, detail)

    ledger = read_replica_ledger(run_dir)
    windows = len(prepare(cfg, family_for(cfg.model)).train)
    chain = verify(
        ledger,
        windows,
        cfg.train.global_batch_size,
        cfg.run.seed,
        cfg.train.max_steps,
        cfg.replica.nproc_per_group,
    )
    verdict.add(
        "exactly_once",
        chain.ok,
        {
            "steps": chain.steps,
            "retried": chain.retried,
            "discarded": chain.discarded,
            "lineages": list(reversed(chain.lineages)),
            "problems": chain.problems,
        },
    )

    final = final_parameters(cfg)
    ok, same = _same_parameters(cfg, events, final)
    verdict.add("same_parameters", ok, same)

    copies = checkpoint_copies(cfg)
    problems = _checkpoint_problems(cfg, copies, events, chain)
    verdict.add("checkpoints", not problems, problems)

    committed = [
        e
        for e in events
        if e.get("event") == Event.STEP and chain.on_chain(e.get("lineage", -1), e.get("step", -1))
    ]
    evidence = ReplicaEvidence(cfg, events, launcher, actions, ledger, chain, committed)
    verdict.faults = judge_replica_faults(faults, evidence)

    requested = requested_faults(run_dir, faults)
    injected = sum(1 for row in verdict.faults if row["verdict"] != "skipped")
    skipped = [f"{row['fault']}: {row['note']}" for row in verdict.faults if row["verdict"] == "skipped"]
    verdict.add(
        "faults_injected",
        injected >= requested,
        {"requested": requested, "injected": injected, "skipped": skipped},
    )

    ok, comparison = _reference_comparison(final, reference_dir)
    verdict.add("matches_reference", ok, comparison)
    return verdict


# ---- the run's checks ----------------------------------------------------------------------------------


def _completed(
    cfg: Config, events: list[dict[str, Any]], actions: list[dict[str, Any]], launcher: list[dict[str, Any]]
) -> tuple[bool, str]:
    max_steps = cfg.train.max_steps
    exits = [a["exit_code"] for a in actions if a.get("action") == "job_exit"]
    ends = [r for r in launcher if r.get("event") == Event.JOB_END]
    if exits:
        code = exits[-1]
    elif ends:
        codes = list((ends[-1].get("exit_codes") or {}).values())
        code = 0 if codes and all(c == 0 for c in codes) else 1
    else:
        code = None
    done = {
        e.get("replica_group")
        for e in events
        if e.get("event") == Event.TRAIN_DONE and e.get("step") == max_steps
    }
    missing = [group for group in range(cfg.replica.groups) if group not in done]
    detail = (
        f"{cfg.replica.groups - len(missing)} of {cfg.replica.groups} groups logged train_done at step "
        f"{max_steps}" + ("" if code is None else f", exit {code}")
    )
    if missing:
        detail += f"; not groups {missing}"
    return code == 0 and not missing, detail


def _same_parameters(
    cfg: Config, events: list[dict[str, Any]], final: tuple[int, dict[str, torch.Tensor]] | None
) -> tuple[bool, dict[str, Any]]:
    digests = {
        f"group {e.get('replica_group')} pid {e.get('pid')}": str(e.get("params_sha256"))
        for e in events
        if e.get("event") == Event.TRAIN_DONE and e.get("step") == cfg.train.max_steps
    }
    problems = []
    if not digests:
        problems.append(f"no group logged train_done at step {cfg.train.max_steps}")
    if len(set(digests.values())) > 1:
        problems.append(
            "the groups ended with different parameters: "
            + ", ".join(f"{k} {v[:12]}" for k, v in sorted(digests.items()))
        )
    saved = None
    if final is None or final[0] != cfg.train.max_steps:
        problems.append(f"no checkpoint of step {cfg.train.max_steps} to compare with")
    else:
        saved = params_sha256(final[1])
        if digests and saved not in digests.values():
            problems.append(f"the final checkpoint's parameters ({saved[:12]}) are none of the groups'")
    detail: dict[str, Any] = {
        "groups": len(digests),
        "params_sha256": sorted(set(digests.values())),
        "problems": problems,
    }
    if saved is not None:
        detail["final_checkpoint"] = saved
    return not problems, detail


def _checkpoint_problems(
    cfg: Config, copies: list[Copy], events: list[dict[str, Any]], chain: LedgerVerdict
) -> list[str]:
    problems = []
    in_place = [c for c in copies if not c.quarantined]
    for copy in in_place:
        if not copy.ok:
            problems.append(f"checkpoint step {copy.step}: {copy.reason}")
        elif copy.attempt is None or not chain.on_chain(copy.attempt, copy.step):
            problems.append(
                f"checkpoint step {copy.step} was written by lineage {copy.attempt}, which the final model "
                "does not descend from there: a discarded lineage's state left visible"
            )
    for copy in copies:
        of_chain = copy.attempt is not None and chain.on_chain(copy.attempt, copy.step)
        kept = any(c.step == copy.step and c.ok and c.attempt == copy.attempt for c in in_place)
        if copy.quarantined and copy.ok and of_chain and not kept:
            problems.append(
                f"quarantined {copy.path} verifies and is of the final chain: a valid state set aside"
            )
    max_steps = cfg.train.max_steps
    final = next((c for c in in_place if c.step == max_steps), None)
    if final is None or not final.ok:
        problems.append(f"no verifying checkpoint of the final step {max_steps} in place")
    else:
        # A group that found no live peer at the end restores the final checkpoint, claims a lineage that
        # continues it with nothing left to train, and claims done in that one.
        restored_final = {
            (e.get("pid"), e.get("lineage"))
            for e in events
            if e.get("event") == Event.LINEAGE
            and e.get("restored")
            and e.get("step") == max_steps
            and e.get("parent") == final.attempt
        }
        for done in (e for e in events if e.get("event") == Event.TRAIN_DONE and e.get("step") == max_steps):
            who = f"group {done.get('replica_group')} (pid {done.get('pid')})"
            if (done.get("pid"), done.get("lineage")) in restored_final:
                continue
            if done.get("lineage") != final.attempt:
                problems.append(
                    f"{who} claimed done in lineage {done.get('lineage')}, the final checkpoint is lineage "
                    f"{final.attempt}'s"
                )
            elif final.created_ts is not None and final.created_ts > done["ts"]:
                problems.append(
                    f"{who} claimed done {final.created_ts - done['ts']:.2f} s before the final commit"
                )
    steps = [c.step for c in in_place]
    extra = sorted(
        set(steps) - retained_steps(steps, cfg.checkpoint.keep_last, cfg.checkpoint.keep_every_steps)
    )
    if extra:
        problems.append(
            f"{len(steps)} checkpoints retained, past keep_last and the milestones: extra {extra}"
        )
    return problems


def _reference_comparison(
    final: tuple[int, dict[str, torch.Tensor]] | None, reference_dir: Path | None
) -> tuple[bool, dict[str, Any]]:
    if reference_dir is None:
        return True, {"skipped": "no reference run"}
    reference = final_parameters(run_config(reference_dir))
    if final is None or reference is None:
        return False, {"error": "a final checkpoint is missing"}
    diff = parameter_difference(final[1], reference[1])
    detail = {
        **diff,
        "rule": f"within {RELATIVE_BOUND:g} relative (fewer groups in a step sum in another order)",
    }
    return diff["relative"] <= RELATIVE_BOUND, detail


# ---- the faults ----------------------------------------------------------------------------------------


def discarded_steps(ev: ReplicaEvidence) -> list[tuple[int, int, float | None]]:
    """(lineage, step, when it was left behind) for every step committed off the final chain: the claim of
    the chain's lineage that continues the one the discarded step's branch grew from (None: not known)."""
    parents = {row["lineage"]: row["parent"] for row in ev.ledger if row.get("kind") == "lineage"}
    on = [lineage for lineage, _, _ in ev.chain.segments]  # newest first
    continued_by = {older: newer for newer, older in itertools.pairwise(on)}
    claimed: dict[int, float] = {}
    for event in ev.of(Event.LINEAGE):
        if isinstance(event.get("lineage"), int):
            claimed[event["lineage"]] = min(event["ts"], claimed.get(event["lineage"], event["ts"]))
    found = set()
    for row in ev.ledger:
        if row.get("kind") != "commit" or row.get("committed") is not True:
            continue
        lineage, step = row["lineage"], row["step"]
        if step > ev.cfg.train.max_steps or ev.chain.on_chain(lineage, step):
            continue
        found.add((lineage, step))
    result = []
    for lineage, step in sorted(found):
        branch, seen = lineage, set()
        while branch not in on and branch in parents and branch not in seen:
            seen.add(branch)
            branch = parents[branch]
        left_by = continued_by.get(branch)
        result.append((lineage, step, claimed.get(left_by) if left_by is not None else None))
    return result


def judge_replica_faults(faults: list[dict[str, Any]], ev: ReplicaEvidence) -> list[dict[str, Any]]:
    """One row per fault: what it cost (lost steps, seconds without a committed step) and its kind's check."""
    starts = [f.get("first_ts", f.get("ts", 0.0)) for f in faults]
    injected = [i for i, f in enumerate(faults) if not f.get("skipped")]
    discarded = discarded_steps(ev)
    rows = []
    for index, fault in enumerate(faults):
        row = fault_row(fault)
        rows.append(row)
        if fault.get("skipped"):
            continue
        later = [i for i in injected if i > index]
        window = Window(
            starts[index],
            min((starts[i] for i in later), default=float("inf")),
            min((int(faults[i].get("step") or 0) for i in later), default=ev.cfg.train.max_steps),
        )
        since, until = window.since, window.until
        # Tries whose vote said no (each group that tried logs one: counted once per step and quorum).
        refused = {
            (e.get("step"), e.get("quorum"))
            for e in ev.of(Event.STEP_NOT_COMMITTED)
            if since <= e["ts"] < until
        }
        left = [
            (lineage, step) for lineage, step, when in discarded if when is not None and since <= when < until
        ]
        row.update(not_committed=len(refused), discarded=len(left), lost=len(refused) + len(left))
        after = next((e for e in ev.committed if e["ts"] > fault["ts"]), None)
        if after is not None:
            row["recovery_s"] = round(after["ts"] - fault["ts"], 2)
        case = Case(fault, ev, window, row)
        case.notes.append(
            f"cost: {len(refused)} step {'try' if len(refused) == 1 else 'tries'} not committed, "
            f"{len(left)} committed step{'' if len(left) == 1 else 's'} discarded; "
            + (
                "no committed step after it"
                if after is None
                else f"{row['recovery_s']:.1f} s without a committed step"
            )
        )
        judge = _KIND_CHECKS.get(fault["fault"])
        if judge is None:
            case.problems.append(f"{fault['fault']} is no fault of the replica-group mode")
        else:
            judge(case)
        if after is None:
            case.problems.append("the job committed no step of the final chain after the fault")
        if case.problems:
            row.update(verdict="FAIL", note="; ".join(case.problems))
        else:
            row["note"] = "; ".join(case.notes)
    return rows


class Window(NamedTuple):
    """A fault's share of the run: from its start to the next fault's, and the steps up to that one's."""

    since: float
    until: float
    last_step: int


@dataclass
class Case:
    """One injected fault under judgement: its record, the run's evidence, its window and its report row;
    its kind's check appends problems (any fails the row) and notes (the row's story when it passes)."""

    fault: dict[str, Any]
    ev: ReplicaEvidence
    window: Window
    row: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ts(self) -> float:
        return float(self.fault["ts"])

    @property
    def group(self) -> int:
        """The group the fault took out (kill-during-heal: the sender)."""
        group = self.fault.get("group")
        assert isinstance(group, int), self.fault
        return group

    @property
    def pids(self) -> set[int]:
        """The processes the fault killed or stopped."""
        return set(self.fault.get("pids", []))


def _restarts(
    ev: ReplicaEvidence, group: int, after: float, until: float, gone: set[int]
) -> list[dict[str, Any]]:
    """worker_start lines of `group` by processes not in `gone`, between `after` and `until`."""
    return [
        e
        for e in ev.of(Event.WORKER_START)
        if e.get("replica_group") == group and e.get("pid") not in gone and after <= e["ts"] < until
    ]


def _heals(ev: ReplicaEvidence, group: int, after: float, until: float) -> list[dict[str, Any]]:
    return [e for e in ev.of(Event.HEAL) if e.get("replica_group") == group and after < e["ts"] < until]


def _without(ev: ReplicaEvidence, after: float, until: float) -> list[dict[str, Any]]:
    """Steps of the final chain committed by fewer than every group, between `after` and `until`."""
    return [e for e in ev.committed if after < e["ts"] < until and (e.get("participants") or 0) < ev.groups]


def _kill_worker(case: Case) -> None:
    ev, group, gone = case.ev, case.group, case.pids
    if not _restarts(ev, group, case.ts, case.window.until, gone):
        case.problems.append(f"group {group}'s workers were not started again")
    heals = [e for e in _heals(ev, group, case.ts, case.window.until) if e.get("pid") not in gone]
    if not heals:
        case.problems.append(f"group {group}'s restarted workers did not heal from a live peer")
    else:
        case.notes.append(
            f"group {group} healed {heals[0]['ts'] - case.ts:.1f} s after the kill, at step "
            f"{heals[0].get('step')}"
        )
        if not _without(ev, case.ts, heals[0]["ts"]):
            case.problems.append(f"the other groups committed no step while group {group} was out")
    if case.row["discarded"]:
        case.problems.append(
            f"{case.row['discarded']} committed steps discarded: the survivors held the state, nothing may be"
        )


def _kill_node(case: Case) -> None:
    """The launcher replaced the group (a `group_started` line after the killed agent's), then as
    kill-worker: the workers of the new agent healed from a live peer."""
    group, agent = case.group, case.fault.get("agent")
    started = [
        r for r in case.ev.launcher if r.get("event") == Event.GROUP_STARTED and r.get("group") == group
    ]
    pids = [r.get("pid") for r in started]
    if agent not in pids or pids.index(agent) == len(pids) - 1:
        case.problems.append(f"the launcher did not start group {group} again after its agent {agent} died")
    else:
        again = started[pids.index(agent) + 1]
        case.notes.append(
            f"the launcher started group {group} again {again['ts'] - case.ts:.1f} s after the kill"
        )
    _kill_worker(case)


def _kill_lighthouse(case: Case) -> None:
    fault, window = case.fault, case.window
    again = [
        r
        for r in case.ev.launcher
        if r.get("event") == Event.LIGHTHOUSE_STARTED
        and r.get("pid") != fault.get("pid")
        and r["ts"] > case.ts - 1
    ]
    if not again:
        case.problems.append("the launcher did not start the Lighthouse again")
        return
    if again[0].get("port") != fault.get("port"):
        case.problems.append(
            f"the Lighthouse came back at port {again[0].get('port')}, not {fault.get('port')}"
        )
    case.notes.append(f"the Lighthouse listened again {again[0]['ts'] - case.ts:.1f} s after the kill")
    # A group whose request the new Lighthouse never answered gives up after replica.quorum_timeout: it
    # commits the state it holds and restarts (the others train on), then heals. Said, not failed: the
    # final checks say whether anything was lost.
    gave_up = sorted(
        {
            e.get("replica_group", -1)
            for e in case.ev.of(Event.NO_QUORUM)
            if window.since <= e["ts"] < window.until and isinstance(e.get("replica_group"), int)
        }
    )
    if gave_up:
        case.notes.append(
            f"group{'' if len(gave_up) == 1 else 's'} {', '.join(map(str, gave_up))} got no quorum within "
            "replica.quorum_timeout: saved what it held, restarted and rejoined"
        )
    if case.row["discarded"]:
        case.notes.append(
            "the restarted Lighthouse gave the groups quorums of their own for a moment: the older "
            "lineage's steps were discarded"
        )


def _stall_replica(case: Case) -> None:
    ev, group, pids, stall_s = case.ev, case.group, case.pids, case.fault.get("stall_s") or 0
    thaws = [
        a["ts"]
        for a in ev.actions
        if a.get("action") == "thawed" and a.get("group") == group and a["ts"] >= case.ts
    ]
    thawed = min(thaws, default=case.ts + float(stall_s))
    replica = ev.cfg.replica
    bound = max(replica.collective_timeout, replica.heartbeat_timeout).total_seconds()
    moved_on = _without(ev, case.ts, thawed)
    if stall_s >= bound and not moved_on:
        case.problems.append(
            f"the others committed no step in the {stall_s} s group {group} was stopped (past {bound:g} s "
            "they must move on)"
        )
    if moved_on:
        steps = f"{len(moved_on)} step{'' if len(moved_on) == 1 else 's'}"
        case.notes.append(f"the others committed {steps} without group {group} while it was stopped")
        heals = _heals(ev, group, thawed, case.window.until)
        if not heals:
            case.problems.append(f"group {group} did not heal after its thaw")
        else:
            how = "in the same process" if heals[0].get("pid") in pids else "after a restart"
            case.notes.append(f"group {group} healed {how}, {heals[0]['ts'] - thawed:.1f} s after its thaw")
    files = {f"pid-{pid}." for pid in pids}
    stale = sorted(
        {
            (r["lineage"], r["step"])
            for r in ev.ledger
            if r.get("kind") == "commit"
            and r.get("committed") is True
            and (case.fault.get("step") or 0) < r.get("step", 0) <= case.window.last_step
            and any(f in r.get("file", "") for f in files)
            and not ev.chain.on_chain(r["lineage"], r["step"])
        }
    )
    if stale:
        case.problems.append(
            f"the stalled group committed steps the quorum moved past (lineage, step): {stale[:5]}"
        )
    saved = [
        e
        for e in ev.of(Event.CHECKPOINT_COMMITTED)
        if e.get("pid") in pids
        and e["ts"] > case.ts
        and not ev.chain.on_chain(e.get("attempt", -1), e.get("step", -1))
    ]
    if saved:
        case.problems.append(
            "the stalled group committed a checkpoint off the final chain: steps "
            f"{[e.get('step') for e in saved]}"
        )
    if case.row["discarded"] and not stale:
        case.problems.append(f"{case.row['discarded']} committed steps discarded: a stall must cost none")


def _kill_during_heal(case: Case) -> None:
    ev, fault, sender, pids = case.ev, case.fault, case.group, case.pids
    held = [
        e
        for e in ev.events
        if e.get("event") == Event.HOLD
        and e.get("heal") is True
        and e.get("pid") in pids
        and e.get("released") is False
    ]
    if not held or not fault.get("held_at_heal"):
        case.problems.append(f"group {sender} was not killed while held sending its state")
    if not _restarts(ev, sender, case.ts, case.window.until, pids):
        case.problems.append(f"the sending group {sender} was not started again")
    kept = ev.groups - len({sender, fault.get("victim_group")})  # groups that still held the state
    step = int(fault.get("sender_step") or fault.get("step") or 0)
    saved = [
        e.get("step", 0)
        for e in ev.of(Event.CHECKPOINT_COMMITTED)
        if e["ts"] < case.ts and e.get("step", 0) <= step
    ]
    newest = max(saved, default=0)
    bound = 0 if kept else step - newest
    case.row["bound"] = case.row["not_committed"] + bound
    resumed = [e.get("step") for e in ev.of(Event.RESUME) if case.ts < e["ts"] < case.window.until]
    if kept:
        case.notes.append(f"{kept} groups still held the state")
    else:
        how = f"resumed from step {resumed[0]}" if resumed else "resumed"
        case.notes.append(
            f"no group held the state of step {step} any more: the job {how} (newest checkpoint before "
            f"the kill: {newest})"
        )
    discarded = case.row["discarded"]
    if discarded > bound:
        case.problems.append(
            f"{discarded} committed steps discarded, bound {bound} (the sender's step {step} less the "
            f"newest checkpoint before the kill, {newest})"
            if not kept
            else f"{discarded} committed steps discarded, bound 0: {kept} groups still held the state"
        )


_KIND_CHECKS = {
    "kill-worker": _kill_worker,
    "kill-node": _kill_node,
    "kill-lighthouse": _kill_lighthouse,
    "stall-replica": _stall_replica,
    "kill-during-heal": _kill_during_heal,
}
