"""Whether a holder is provably gone: pid plus its start time and the boot id on this host, the heartbeat's
age for another host, pid plus age for records that predate the start time."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from elastic_qa import liveness
from elastic_qa.liveness import HOST, Holder, judge, judge_all, this_process

STALE = 120.0


def test_this_process_is_alive_and_the_same_pid_with_another_start_time_is_not() -> None:
    me = this_process()
    assert me.start is not None and me.boot_id
    assert not judge(me, STALE).gone
    reused = Holder(HOST, os.getpid(), me.boot_id, me.start - 1, time.time())
    verdict = judge(reused, STALE)
    assert verdict.gone and "reused" in verdict.why


def test_a_recycled_pid_1_with_an_old_start_time_is_gone_even_with_a_fresh_heartbeat() -> None:
    # A dead builder's record whose pid now belongs to init: its start time cannot match any later process.
    assert liveness.pid_runs(1)
    record = Holder(HOST, 1, liveness.boot_id(), (liveness.start_time(1) or 0) + 12345, time.time())
    assert judge(record, STALE).gone


def test_a_process_that_ended_is_gone_and_a_zombie_too() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    record = this_process(child.pid)
    deadline = time.monotonic() + 60
    while liveness.pid_runs(child.pid) and time.monotonic() < deadline:  # a zombie until reaped below
        time.sleep(0.01)
    assert judge(record, STALE).gone
    child.wait()
    assert judge(record, STALE).gone


def test_another_boot_of_this_host_is_gone() -> None:
    me = this_process()
    assert judge(Holder(HOST, me.pid, "another-boot", me.start, time.time()), STALE).gone


def test_another_host_is_judged_by_its_heartbeat_only() -> None:
    now = time.time()
    assert not judge(Holder("elsewhere", 1, "b", 5, now - STALE + 5), STALE, now).gone
    assert judge(Holder("elsewhere", os.getpid(), "b", 5, now - STALE - 5), STALE, now).gone


def test_an_older_record_without_start_time_is_judged_by_pid_and_age() -> None:
    now = time.time()
    assert not judge(Holder(HOST, 1, heartbeat=now - 10), STALE, now).gone  # pid runs, beat recently
    assert judge(Holder(HOST, 1, heartbeat=now - 3600), STALE, now).gone  # pid runs, no beat for 1 h
    assert judge(Holder(HOST, 2**22 + 7, heartbeat=now), STALE, now).gone  # pid does not run


def test_a_group_is_gone_only_when_every_process_in_it_is() -> None:
    me, now = this_process(), time.time()
    dead = Holder(HOST, 1, me.boot_id, (liveness.start_time(1) or 0) + 1, now)
    assert not judge_all([dead, me], STALE, now).gone
    assert judge_all([dead], STALE, now).gone
    assert judge_all([], STALE, now).gone


def test_a_record_round_trips_and_an_old_one_reads() -> None:
    me = this_process()
    assert Holder.from_dict(me.to_dict(), me.heartbeat) == me
    old = Holder.from_dict({"host": "h", "pid": 3, "token": "x"}, 7.0)
    assert (old.start, old.boot_id, old.heartbeat) == (None, None, 7.0)


def test_a_heartbeat_that_is_no_time_or_far_ahead_of_this_clock_is_no_sign_of_life() -> None:
    now = time.time()
    for beat in (float("nan"), float("inf"), now + STALE + 60):
        assert judge(Holder("another-host", 1, "b", 5, beat), STALE, now).gone, beat
        assert judge(Holder(HOST, os.getpid(), None, None, beat), STALE, now).gone, beat  # no start time
    assert not judge(Holder("another-host", 1, "b", 5, now + 30), STALE, now).gone  # clocks a little apart
