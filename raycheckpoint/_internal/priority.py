"""A background thread below training on the CPU: a leaf every layer may use (persist
threads, replication threads, the per-node agents' uploads)."""

from __future__ import annotations

import os
import threading


def lower_priority(nice: int) -> None:
    """Lower the calling thread's priority by ``nice`` levels, to at most nice 19 (Linux:
    a thread has its own nice value, inherited from the thread that started it).

    Relative, as ``nice -n`` is: Ray starts its workers at nice 15, so an absolute value
    under 15 would leave a persist thread level with training.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # not permitted here: run at the worker's priority
        pass
