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
its waiters); anything it lets out is logged, and the lane goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from raycheckpoint._internal.priority import lower_priority

log = logging.getLogger(__name__)


class Lane:
    """One daemon thread named ``name`` (started with the first job, or by
    :meth:`start`), ``nice`` levels below the thread that started it."""

    def __init__(self, name: str, nice: int = 0) -> None:
        self.name = name
        self.nice = nice
        self._jobs: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the thread now (a first save then finds it waiting)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def submit(self, job: Callable[[], object]) -> None:
        """Run ``job`` once the jobs handed before it have run; returns at once."""
        self._jobs.put(job)
        if self._thread is None:
            self.start()

    def _run(self) -> None:
        lower_priority(self.nice)  # once: the level is relative, the thread lives on
        while True:
            job = self._jobs.get()
            try:
                job()
            except BaseException:  # the lane outlives a job's escape
                log.exception("%s: a background job failed", self.name)
            finally:
                del job  # nothing of a finished save is kept alive by an idle lane


class SaverLanes:
    """The lanes of one rank's saver (``who``: ``role-rank``); the persist and the early
    write below training by ``nice``, the copy beside training at its level."""

    def __init__(self, who: str, nice: int) -> None:
        self.persist = Lane(f"raycheckpoint-persist-{who}", nice)
        self.copy = Lane(f"raycheckpoint-copy-{who}")
        self.write_ahead = Lane(f"raycheckpoint-write-ahead-{who}", nice)

    def start(self) -> None:
        for lane in (self.persist, self.copy, self.write_ahead):
            lane.start()
