"""Ends a driver's embedded local Ray when the driver ends, however it ends.

    python -m drivers._reaper DRIVER_PID DRIVER_START_TIME TEMP_DIR
    python -m drivers._reaper --stop TEMP_DIR    # `ray stop` of deploy/bin/ray

:func:`drivers._ray.init_ray` starts this beside a local Ray instance, in a session of
its own (a signal to the driver's process group does not reach it).  While the driver
lives, it records the driver's descendants (GCS, raylet, agents, workers) by PID and
start time, every :data:`POLL_S`.  Once the driver is gone (a normal exit, an exception,
SIGKILL), it ends every recorded process still alive and every process that has a file,
its working directory or its command line under the session's ``TEMP_DIR`` (Ray keeps
its sockets and logs there, and a worker's stdout and stderr are files there), SIGTERM
first and SIGKILL after :data:`GRACE_S`, until none is left; then it removes
``TEMP_DIR``.  Processes are never matched by name: another user's Ray on the machine
is not touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import psutil

POLL_S = 0.5
GRACE_S = 3.0
GIVE_UP_S = 60.0


def _alive(pid: int, started: float) -> psutil.Process | None:
    """The process ``pid`` if it is still the one that started at ``started``."""
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - started) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
            return p
    except psutil.Error:
        pass
    return None


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def uses_dir(p: psutil.Process, root: str) -> bool:
    """Whether ``p`` has its working directory, a file or its command line under ``root``."""
    try:
        if any(root in part for part in p.cmdline()):
            return True
        if _under(p.cwd(), root):
            return True
        fd_dir = f"/proc/{p.pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                if _under(os.readlink(f"{fd_dir}/{fd}"), root):
                    return True
            except OSError:
                continue
    except (psutil.Error, OSError):
        return False
    return False


def session_processes(root: str, recorded: dict[int, float]) -> list[psutil.Process]:
    """The processes of the session under ``root``: recorded ones still alive, and any
    other process using ``root``."""
    me = os.getpid()
    found = {p.pid: p for pid, started in recorded.items() if (p := _alive(pid, started))}
    for p in psutil.process_iter():
        if p.pid != me and p.pid not in found and uses_dir(p, root):
            found[p.pid] = p
    return [p for p in found.values() if p.pid != me]


def end_processes(procs: list[psutil.Process], grace_s: float = GRACE_S) -> None:
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(procs, timeout=grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=grace_s)


def watch(driver: int, started: float, root: str) -> int:
    recorded: dict[int, float] = {}
    while (p := _alive(driver, started)) is not None:
        try:
            for child in p.children(recursive=True):
                recorded.setdefault(child.pid, child.create_time())
        except psutil.Error:
            pass
        time.sleep(POLL_S)
    deadline = time.monotonic() + GIVE_UP_S
    while (procs := session_processes(root, recorded)) and time.monotonic() < deadline:
        end_processes(procs)
    shutil.rmtree(root, ignore_errors=True)
    return 0 if not procs else 1


def stop(root: str) -> int:
    """End every process using ``root`` now (what ``ray stop`` does, for one Ray only)."""
    deadline = time.monotonic() + GIVE_UP_S
    ended = 0
    while (procs := session_processes(root, {})) and time.monotonic() < deadline:
        ended += len(procs)
        end_processes(procs)
    print(f"ended {ended} process(es) using {root}" + (f"; {len(procs)} left" if procs else ""))
    return 0 if not procs else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["--stop"]:
        return stop(os.path.realpath(argv[1]))
    driver, started, root = int(argv[0]), float(argv[1]), os.path.realpath(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C meant for the driver is not ours
    return watch(driver, started, root)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
