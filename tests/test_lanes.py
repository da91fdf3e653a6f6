"""A rank's saver lanes (``raycheckpoint/_internal/lanes.py``): long-lived threads that
run the jobs handed to them in order, below training where asked."""

from __future__ import annotations

import os
import threading
import time

import pytest

from raycheckpoint._internal.lanes import Lane
from raycheckpoint._internal.persist import PendingPersist


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_a_lane_runs_its_jobs_in_order_on_one_thread_and_submit_never_waits():
    lane = Lane("raycheckpoint-test-lane")
    release, ran, threads = threading.Event(), [], set()

    def job(i: int) -> None:
        if i == 0:
            assert release.wait(10)
        threads.add(threading.get_ident())
        ran.append(i)

    t0 = time.perf_counter()
    for i in range(5):
        lane.submit(lambda i=i: job(i))
    assert time.perf_counter() - t0 < 1.0 and ran == []  # the first job still waits
    release.set()
    deadline = time.monotonic() + 10
    while len(ran) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == [0, 1, 2, 3, 4]
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert [t.name for t in threading.enumerate()].count("raycheckpoint-test-lane") == 1


def test_a_job_that_raises_leaves_the_lane_running(caplog):
    lane = Lane("raycheckpoint-test-raising")
    done = threading.Event()
    lane.submit(lambda: 1 / 0)
    lane.submit(done.set)
    assert done.wait(10)
    assert "a background job failed" in caplog.text and "ZeroDivisionError" in caplog.text


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread nice values here")
def test_a_lane_is_lowered_once_however_many_jobs_it_runs():
    """The level is relative (``lower_priority``): lowered per job, a lane kept for the
    process's life would sink to 19 after a few saves."""
    lane = Lane("raycheckpoint-test-nice", nice=2)
    seen: list[int] = []
    done = threading.Event()
    before = _nice()
    for _ in range(4):
        lane.submit(lambda: seen.append(_nice()))
    lane.submit(done.set)
    assert done.wait(10)
    assert seen == [min(19, before + 2)] * 4
    assert _nice() == before  # the caller's level is its own


def test_a_persist_is_handed_to_its_lane_once():
    lane = Lane("raycheckpoint-test-persist")
    pending = PendingPersist("s1")
    runs: list[int] = []

    def persist() -> None:
        runs.append(1)
        pending.finish()

    pending.set_up(lane, persist)
    assert not pending.started
    pending.start()
    pending.start()
    assert pending.started and pending.wait_done(10)
    time.sleep(0.05)
    assert runs == [1]
    PendingPersist("s2").start()  # nothing set up: nothing to start


def _alive(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())


def _until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_closed_lane_runs_what_it_was_handed_then_its_thread_ends():
    """A worker set up for another root replaces its saver: the old saver's threads must
    not outlive its last persist."""
    name = "raycheckpoint-test-closed"
    lane = Lane(name)
    release, ran = threading.Event(), []
    lane.submit(lambda: (release.wait(10), ran.append(1)))
    lane.submit(lambda: ran.append(2))
    lane.close()
    with pytest.raises(RuntimeError, match="closed"):
        lane.submit(lambda: ran.append(3))
    assert _alive(name) == 1
    release.set()
    assert _until(lambda: _alive(name) == 0)
    assert ran == [1, 2]


def test_a_lane_let_go_of_ends_its_thread():
    import gc

    name = "raycheckpoint-test-dropped"
    done = threading.Event()
    lane = Lane(name)
    lane.submit(done.set)
    assert done.wait(10) and _alive(name) == 1
    del lane
    gc.collect()
    assert _until(lambda: _alive(name) == 0)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread nice values here")
def test_a_lanes_level_set_later_applies_from_its_next_job():
    lane = Lane("raycheckpoint-test-renice", nice=1)
    seen: list[int] = []
    done = threading.Event()
    before = _nice()
    lane.submit(lambda: seen.append(_nice()))
    lane.submit(done.set)
    assert done.wait(10)
    lane.nice = 3
    done.clear()
    lane.submit(lambda: seen.append(_nice()))
    lane.submit(done.set)
    assert done.wait(10)
    assert seen == [min(19, before + 1), min(19, before + 3)]
