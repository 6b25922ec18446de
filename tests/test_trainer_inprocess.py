"""The trainer and its checkpoint session built in this process, on a real one-rank gloo group (a FileStore
in tmp_path), driven down their three ways out: a stop (save_for_stop), a failed collective (save_emergency
of the last completed step) and the end (save_final, verified). Judged by what the checkpoint store holds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog
import torch
import torch.distributed as dist

from elastic_qa import step_holds as holds
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.store import step_dir_name
from elastic_qa.dist import DistContext
from elastic_qa.elastic.control import PeerFailure
from elastic_qa.elastic.signals import StopRequest
from elastic_qa.models import family_for
from elastic_qa.observe.follow import read_events
from elastic_qa.observe.log import configure_logging
from elastic_qa.prep import prepare
from elastic_qa.session.hold import RunHold
from elastic_qa.train import stopped_exit_code
from elastic_qa.trainer import Trainer

# loader.py silences this at import, but pytest restores the warning filters around every test
pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning")
# Every step a control step: a stop asked during step N is agreed at step N + 1.
EVERY_STEP = "dist.control_period=0s"


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[DistContext]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        yield DistContext(0, 1, 0, torch.device("cpu"), "gloo", 1)
    finally:
        dist.destroy_process_group()


@pytest.fixture
def started(tiny_config, world_of_one: DistContext) -> Iterator[Callable[..., Trainer]]:
    """Factory: a Trainer of the tiny config (plus overrides) on the one-rank group, started (restored,
    registered), its process's log in the run directory as a worker's would be."""
    made: list[Trainer] = []

    def make(*overrides: str, stop: StopRequest | None = None) -> Trainer:
        cfg = tiny_config(EVERY_STEP, *overrides)
        configure_logging(Path(cfg.run.dir) / "logs")
        trainer = Trainer(cfg, world_of_one, prepare(cfg, family_for(cfg.model)), stop_request=stop)
        trainer.start()
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:  # a worker process would exit here: its hold's heartbeat goes with it
        trainer.session.hold.stop_heartbeat()
    structlog.reset_defaults()


def committed(trainer: Trainer) -> list[int]:
    """The committed steps of the trainer's checkpoint store, each verified."""
    store = open_store(trainer.cfg.checkpoint_dir)
    steps = [info.step for info in store.list_steps()]
    assert all(store.verify(store.path(step_dir_name(step))).ok for step in steps)
    return steps


def signal_when_held(run_dir: Path, step: int, signum: int) -> threading.Thread:
    """Send this process `signum` once its trainer logs that it holds after `step` (step_holds.py)."""

    def watch() -> None:
        deadline = time.monotonic() + 120
        while not any(e.get("event") == "hold" and e.get("hold") == step for e in read_events(run_dir)):
            if time.monotonic() > deadline:
                return  # the test then fails on the trainer's outcome, with its log
            time.sleep(0.05)
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_sigterm_commits_the_step_the_ranks_agree_to_stop_at_and_exits_as_a_shell_expects(
    started, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # alone: no agent to regroup
    holds.arm(tmp_path / "holds", [3])
    stop, before = StopRequest(), signal.getsignal(signal.SIGTERM)
    trainer = started("train.max_steps=20", f"debug.hold_dir={tmp_path / 'holds'}", stop=stop)
    watcher = signal_when_held(Path(trainer.cfg.run.dir), 3, signal.SIGTERM)
    result = trainer.train()
    watcher.join()
    # Asked while held after step 3: the ranks agree at step 4, which is trained and then committed.
    assert result == {"stopped": True, "step": 4}
    assert committed(trainer) == [4]
    assert stopped_exit_code(stop, agent_lost=False) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before  # the trainer gave the signal back


def test_a_stop_asked_from_code_exits_for_a_regroup_with_nothing_lost(started, monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    stop = StopRequest()
    trainer = started("train.max_steps=20", stop=stop)
    stop.request("test")
    assert trainer.train() == {"stopped": True, "step": 1}
    assert committed(trainer) == [1]
    assert stopped_exit_code(stop, agent_lost=False) == 75  # exits.EXIT_REGROUP


def test_a_failed_collective_commits_the_last_completed_step_as_an_emergency(started) -> None:
    trainer = started("train.max_steps=20")
    agree = trainer.control.all_reduce
    assert agree is not None

    def lost_peer(flags: torch.Tensor):  # what gloo raises when a peer's connection closes
        if trainer.state.step == 3:
            raise dist.DistBackendError("[gloo] Connection closed by peer [127.0.0.1]:29500")
        return agree(flags)

    trainer.control.all_reduce = lost_peer
    with pytest.raises(PeerFailure, match="Connection closed by peer"):
        trainer.train()
    assert trainer.state.step == 3  # step 4's agreement failed before any of its work
    assert committed(trainer) == [3]
    store = open_store(trainer.cfg.checkpoint_dir)
    manifest = store.read_manifest(store.path(step_dir_name(3)))
    assert manifest["attempt"] == trainer.session.attempt


def test_the_end_step_is_committed_verified_and_the_run_let_go(started) -> None:
    trainer = started("train.max_steps=4", "checkpoint.every_steps=2")
    result = trainer.train()
    assert (result["stopped"], result["step"]) == (False, 4) and 0.0 <= result["f1"] <= 1.0
    assert committed(trainer) == [2, 4]
    # Done: the hold is given up, so another job may take the run at once (this process lives on).
    assert RunHold(trainer.cfg.checkpoint_dir, "another-job", trainer.cfg.run.dir).live_holder() is None
    # Started again at its end: nothing left to train, the final checkpoint stands as it is.
    again = started("train.max_steps=4", "checkpoint.every_steps=2")
    assert again.session.resumed_step == 4
    assert again.train()["step"] == 4
    assert committed(again) == [2, 4]


def test_step_lines_carried_to_a_later_agreement_come_in_order_before_what_follows_them(started) -> None:
    # Agreements in the first steps only (a long control period): the later lines' sums wait for a flush.
    trainer = started(
        "train.max_steps=12", "dist.control_period=1h", "log.every_steps=2", "train.eval_every=6"
    )
    trainer.train()
    events = [e for e in read_events(Path(trainer.cfg.run.dir)) if e.get("rank") == 0]
    names = [(e["event"], e.get("step")) for e in events if e["event"] in ("step", "eval", "train_done")]
    lines = [("step", step) for step in (2, 4, 6)] + [("eval", 6)] + [("step", step) for step in (8, 10, 12)]
    assert names == [*lines, ("eval", 12), ("train_done", 12)]
    stamps = [e["ts"] for e in events if e["event"] == "step"]
    assert stamps == sorted(stamps)  # each stamped when its step ended


def test_a_peer_lost_while_the_carried_sums_are_flushed_takes_the_emergency_path(started) -> None:
    trainer = started("train.max_steps=6", "dist.control_period=1h")
    agree = trainer.control.all_reduce
    assert agree is not None

    def lost_peer(values: torch.Tensor):
        if trainer.state.step == 6:  # no agreement after the first steps: the end's flush of the lines
            raise dist.DistBackendError("[gloo] Connection closed by peer [127.0.0.1]:29500")
        return agree(values)

    trainer.control.all_reduce = lost_peer
    with pytest.raises(PeerFailure, match="Connection closed by peer"):
        trainer.train()
    assert committed(trainer) == [6]  # the last completed step, saved as an emergency
    events = read_events(Path(trainer.cfg.run.dir))
    assert not any(e.get("event") == "train_done" for e in events)


def test_step_lines_on_their_way_when_a_peer_is_lost_are_written_once_by_the_next_start(started) -> None:
    trainer = started("train.max_steps=6", "dist.control_period=1h", "log.every_steps=1")
    agree = trainer.control.all_reduce
    assert agree is not None

    def lost_peer(values: torch.Tensor):
        if trainer.state.step == 6:  # the lines of steps 1-6 wait for the end's flush, which fails
            raise dist.DistBackendError("[gloo] Connection closed by peer [127.0.0.1]:29500")
        return agree(values)

    trainer.control.all_reduce = lost_peer
    with pytest.raises(PeerFailure):
        trainer.train()
    run_dir, first = Path(trainer.cfg.run.dir), trainer.session.attempt
    written = [e["step"] for e in read_events(run_dir) if e["event"] == "step"]  # agreed in the first steps
    assert written == list(range(1, len(written) + 1)) and len(written) < 6
    assert committed(trainer) == [6]
    trainer.session.hold.release()  # its process would exit here (rather than live on, as this one does)

    again = started("train.max_steps=6", "dist.control_period=1h", "log.every_steps=1")
    assert again.train()["step"] == 6  # resumed at its end: nothing trained again
    events = read_events(run_dir)
    lines = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in lines] == [1, 2, 3, 4, 5, 6]
    recovered = lines[len(written) :]
    assert all(e["recovered"] and e["attempt"] == first and e["loss_ranks"] == [0] for e in recovered)
    assert all(e["loss"] > 0 for e in recovered)  # a world of one: its share is the whole batch
    [restart] = [e["ts"] for e in events if e["event"] == "worker_start" and e["attempt"] > first]
    stamps = [e["ts"] for e in lines]
    assert stamps == sorted(stamps) and stamps[-1] < restart  # stamped when they were trained
