"""A background thread below training on the CPU: a leaf every layer may use (persist
threads, replication threads, the per-node agents' uploads, a saver's lanes)."""

from __future__ import annotations

import os
import threading


def thread_nice() -> int:
    """The calling thread's nice value (Linux: a thread has its own, inherited from the
    thread that started it); 0 where it cannot be read."""
    if not hasattr(os, "getpriority"):
        return 0
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except OSError:
        return 0


def set_thread_nice(level: int) -> bool:
    """Set the calling thread's nice value to ``level`` (at most 19); False where not
    permitted (a level raised back needs a privilege) or not supported."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, level))
    except OSError:  # not permitted here: run at the level it has
        return False
    return True


def lower_priority(nice: int) -> None:
    """Lower the calling thread's priority by ``nice`` levels, to at most nice 19.

    Relative, as ``nice -n`` is: Ray starts its workers at nice 15, so an absolute value
    under 15 would leave a persist thread level with training.
    """
    if nice > 0:
        set_thread_nice(thread_nice() + nice)
