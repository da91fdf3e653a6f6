"""How this project's Ray worker processes end: never inside Ray's own C++ teardown.

A Ray worker that leaves through the interpreter's normal exit runs Ray's C++ exit
handler (``CoreWorkerProcess::HandleAtExit`` -> ``~CoreWorkerProcessImpl`` -> the
io_context's ``shutdown`` -> ``~Publisher``), which now and then deadlocks on a lock it
already holds: the process then lives on, its raylet long gone, holding its memory (on a
GPU node, its CUDA context and GPU memory).  Ray ended its own workers with ``os._exit``
for the same kind of hang (ray-project/ray#18899).  The interpreter's module teardown is
also where bindings torch imported print dozens of ``nanobind: leaked ...`` lines into the
driver's output.

:func:`install` (once per process, from each of our actors' constructors) therefore:

* registers an ``atexit`` hook.  ``atexit`` runs hooks last registered first, and Ray
  registers its own when the worker connects, before any actor is built: ours runs first.
  It runs the cleanups registered with :func:`on_exit` (a rank's persist thread joined,
  for at most :data:`CLEANUP_S`; a save not finished by then has no ``COMMITTED`` and is
  collected by the next run, like any aborted save), flushes the standard streams and
  logging, and ends the process with ``os._exit``: Ray's C++ teardown and the module
  teardown never run.  What a normal exit would still have done (closing files, joining
  threads) is done by the cleanups; the OS releases the rest, GPU memory included.
* starts a watchdog thread that takes the same path when the process's parent (the
  raylet that started it) is gone, so a worker orphaned by a killed raylet ends within
  :data:`WATCH_S` seconds instead of waiting for a message that never comes.

A worker killed with ``ray.kill`` or SIGKILL never reaches either; nothing of ours needs
to run then (a checkpoint is committed or invisible).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

CLEANUP_S = 10.0  # at most this long for all cleanups together
WATCH_S = 1.0  # how often the watchdog looks for the parent

_lock = threading.Lock()
_cleanups: list[Callable[[float], None]] = []
_installed = False
_exiting = False


def on_exit(cleanup: Callable[[float], None]) -> None:
    """Run ``cleanup(timeout_s)`` when the process ends through :func:`install`'s path."""
    with _lock:
        _cleanups.append(cleanup)


def _in_ray_actor() -> bool:
    """Whether this process is a Ray actor's (never a driver's, never a plain process)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - no Ray here, or not one we can ask: not an actor
        return False


def install() -> None:
    """In a Ray actor's process, make it end by ``os._exit`` after its cleanups (see the
    module doc); anywhere else (a driver, a test building the class in-process), nothing."""
    global _installed
    with _lock:
        if _installed or not _in_ray_actor():
            return
        _installed = True
    atexit.register(_exit, 0, "interpreter exit")
    parent = os.getppid()
    threading.Thread(target=_watch, args=(parent,), daemon=True,
                     name="raycheckpoint-exit-watch").start()


def _watch(parent: int) -> None:
    while True:
        time.sleep(WATCH_S)
        if os.getppid() != parent:  # reparented: whoever started us is gone
            logger.warning("process %d: parent %d is gone; exiting", os.getpid(), parent)
            _exit(1, f"parent {parent} gone")


def _exit(code: int, why: str) -> None:
    global _exiting
    with _lock:
        if _exiting:
            return
        _exiting = True
        cleanups = list(_cleanups)
    deadline = time.monotonic() + CLEANUP_S
    for cleanup in reversed(cleanups):
        try:
            cleanup(max(0.0, deadline - time.monotonic()))
        except BaseException:  # exiting regardless; say what failed
            logger.exception("cleanup at exit (%s) failed", why)
    try:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    finally:
        os._exit(code)
