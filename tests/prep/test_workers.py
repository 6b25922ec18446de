"""The tokenising helpers of a build: what goes wrong in one reaches the building process as an error, and
none outlives the build, however it ends (an error, a dead helper, the building process killed)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_qa.config import load_config, packaged_config
from elastic_qa.prep import build
from elastic_qa.prep.sources import ExampleReader
from elastic_qa.prep.synthetic import write_squad_file
from elastic_qa.prep.windows import BuiltinFeaturizer


class InHelpers(BuiltinFeaturizer):
    """The built-in featurizer, except in a helper process, where it does `what`."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.parent = os.getpid()  # travels with the featurizer, whether helpers are forked or spawned

    def features(self, examples, cfg):
        if os.getpid() != self.parent:
            if self.what == "raise":
                raise ValueError("no room for this window")
            if self.what == "unpicklable":
                error = ValueError("with a lock")
                error.lock = __import__("threading").Lock()  # pickling this fails
                raise error
            if self.what == "die":
                os._exit(9)
        return super().features(examples, cfg)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("inputs") / "train.json"
    write_squad_file(str(path), 3000, seed=7)  # a dozen chunks: some of them go to helpers
    return str(path)


def config():
    cfg = load_config(packaged_config("tiny"))
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, skip_malformed=False))


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for its parent to read its exit status."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def helpers_gone(workers: build.Workers, pids: list[int]) -> bool:
    return not workers.helpers and not any(running(pid) for pid in pids)


def run_to_error(what: str, source: str) -> tuple[BaseException, build.Workers, list[int]]:
    workers = build.Workers(InHelpers(what), config(), 3)
    pids: list[int] = []
    try:
        for _ in workers.map(ExampleReader(source).chunks(), evaluation=False):
            pids = pids or [helper.process.pid for helper in workers.helpers]
    except BaseException as err:  # noqa: BLE001 - the test looks at what it was
        pids = pids or [helper.process.pid for helper in workers.helpers]
        workers.close()
        return err, workers, pids
    raise AssertionError(f"{what}: the build went through")


def test_an_error_raised_in_a_helper_is_raised_by_the_build_with_its_type_and_message(source):
    error, workers, pids = run_to_error("raise", source)
    assert type(error) is ValueError and str(error) == "no room for this window"
    assert pids and helpers_gone(workers, pids)


def test_an_error_that_cannot_be_sent_back_arrives_as_its_text(source):
    error, workers, pids = run_to_error("unpicklable", source)
    assert isinstance(error, RuntimeError) and "with a lock" in str(error)
    assert pids and helpers_gone(workers, pids)


def test_a_helper_that_dies_is_an_error_naming_its_exit_code_not_a_hang(source):
    error, workers, pids = run_to_error("die", source)
    assert isinstance(error, RuntimeError) and "exit code 9" in str(error)
    assert pids and helpers_gone(workers, pids)


def test_the_same_windows_come_back_in_chunk_order_whatever_the_number_of_workers(source):
    def windows(count: int) -> list[list[int]]:
        workers = build.Workers(BuiltinFeaturizer(), config(), count)
        try:
            done = list(workers.map(ExampleReader(source).chunks(), evaluation=False))
        finally:
            workers.close()
        assert count == 1 or workers.inline < len(done)  # helpers did some of them
        return [d.features.input_ids.tolist() for d in done]

    assert windows(1) == windows(2) == windows(4)


SLOW_BUILD = """
import os, sys, time
from elastic_qa.config import load_config, packaged_config
from elastic_qa.prep import build
from elastic_qa.prep.windows import BuiltinFeaturizer
from elastic_qa.prep.sources import ExampleReader

class Slow(BuiltinFeaturizer):
    def features(self, examples, cfg):
        time.sleep(0.2)
        return super().features(examples, cfg)

workers = build.Workers(Slow(), load_config(packaged_config("tiny")), 3)
for _ in workers.map(ExampleReader(sys.argv[1]).chunks(), evaluation=False):
    if workers.helpers:
        print(" ".join(str(h.process.pid) for h in workers.helpers), flush=True)
        time.sleep(60)  # killed here, with both helpers at work
"""


def test_helpers_stop_by_themselves_when_the_building_process_is_killed(source):
    builder = subprocess.Popen([sys.executable, "-c", SLOW_BUILD, source], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in builder.stdout.readline().split()]
        assert len(pids) == 2
        builder.send_signal(signal.SIGKILL)
        builder.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(running(pid) for pid in pids):
            time.sleep(0.05)
        alive = [pid for pid in pids if running(pid)]
        assert not alive, f"helpers {alive} outlived the killed build"
    finally:
        if builder.poll() is None:
            builder.kill()
