"""A rank's long-lived background threads: one per kind of work, each running the jobs
handed to it one after the other.

A :class:`~raycheckpoint._internal.shard_saver.ShardSaver` keeps three lanes: its
persists, the host copy beside training (``overlap_copy``) and a data file's early
write.  A thread started per save made the snapshot, in training's blocked time, wait
for the new thread's first scheduling (``Thread.start`` waits for it): a median of
50 µs on an idle machine here, 2.9 ms with both of its cores busy, which is the whole of
a save's fixed part; handing a job to a lane's waiting thread costs 2-10 µs either way.

A lane runs one job at a time, in the order handed: each kind of work never has two
jobs of one rank at once (a snapshot waits for its rank's previous persist, which has
waited for the copy and ended the early write), and two persists of one rank must not
interleave their collectives anyway.  A job ends its own errors (each keeps them for
its waiters); anything it lets out is logged, and the lane goes on.  A lane's thread
ends once the lane is closed (a worker set up anew gets a new saver) or collected,
after the jobs handed before.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable

from raycheckpoint._internal.priority import set_thread_nice, thread_nice

log = logging.getLogger(__name__)

_STOP = object()  # handed last: the thread ends


class Lane:
    """One daemon thread named ``name`` (started with the first job, or by
    :meth:`start`), ``nice`` levels below the level it started at (settable; a level
    raised back is applied where the process may, as ``nice`` would)."""

    def __init__(self, name: str, nice: int = 0) -> None:
        self.name = name
        self._level = [nice]  # shared with the thread, which holds no reference to the lane
        self._jobs: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()
        weakref.finalize(self, self._jobs.put, _STOP)  # a lane let go of ends its thread

    @property
    def nice(self) -> int:
        return self._level[0]

    @nice.setter
    def nice(self, value: int) -> None:
        self._level[0] = value  # from the next job on

    def start(self) -> None:
        """Start the thread now (a first save then finds it waiting)."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name}: the lane is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self.name, self._jobs,
                                                                 self._level),
                                            name=self.name, daemon=True)
            self._thread.start()

    def submit(self, job: Callable[[], object]) -> None:
        """Run ``job`` once the jobs handed before it have run; returns at once (raises
        on a closed lane)."""
        with self._lock:  # never behind the end a close() hands
            self._start()
            self._jobs.put(job)

    def close(self) -> None:
        """End the thread once the jobs handed before have run; no job is taken after."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(_STOP)


def _serve(name: str, jobs: queue.SimpleQueue[object], level: list[int]) -> None:
    base = applied = thread_nice()  # the level is relative to the one it started at
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        want = min(19, base + max(0, level[0]))
        if want != applied and set_thread_nice(want):
            applied = want
        try:
            job()  # type: ignore[operator]
        except BaseException:  # the lane outlives a job's escape
            log.exception("%s: a background job failed", name)
        finally:
            del job  # nothing of a finished save is kept alive by an idle lane


class SaverLanes:
    """The lanes of one rank's saver (``who``: ``role-rank``); the persist and the early
    write below training by ``nice``, the copy beside training at its level."""

    def __init__(self, who: str, nice: int) -> None:
        self.persist = Lane(f"raycheckpoint-persist-{who}", nice)
        self.copy = Lane(f"raycheckpoint-copy-{who}")
        self.write_ahead = Lane(f"raycheckpoint-write-ahead-{who}", nice)

    def all(self) -> tuple[Lane, Lane, Lane]:
        return self.persist, self.copy, self.write_ahead

    def set_nice(self, nice: int) -> None:
        self.persist.nice = self.write_ahead.nice = nice

    def start(self) -> None:
        for lane in self.all():
            lane.start()

    def close(self) -> None:
        for lane in self.all():
            lane.close()
