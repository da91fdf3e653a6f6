"""Named fault points for fault-injection tests (armed through :mod:`raycheckpoint.testing`).

Production code calls :func:`check` at each named step of the save protocol
(``storage.write``, ``worker.before_report`` ...).  Nothing happens unless a test
armed that point in this process, either with :func:`arm` or through the
``RAYCHECKPOINT_FAULTS`` environment variable (``point=action[,point=action]``).

Actions: ``raise`` (raise :class:`InjectedFault`), ``hang:<seconds>`` (sleep), and
``kill`` (``os._exit(137)``, the process dies like a SIGKILL).  A point may be
limited to paths containing a substring: ``storage.write@actor/__1_=raise``.
"""

from __future__ import annotations

import os
import threading
import time

from raycheckpoint.errors import InjectedFault

_lock = threading.Lock()
_armed: dict[str, tuple[str, str]] = {}


def _parse_env() -> None:
    spec = os.environ.get("RAYCHECKPOINT_FAULTS", "")
    for part in filter(None, (p.strip() for p in spec.split(","))):
        point, _, action = part.partition("=")
        arm(point, action or "raise")


def arm(point: str, action: str = "raise") -> None:
    """Arm ``point`` (``name`` or ``name@path-substring``) with ``action``."""
    name, _, match = point.partition("@")
    with _lock:
        _armed[name] = (action, match)


def disarm(point: str | None = None) -> None:
    with _lock:
        if point is None:
            _armed.clear()
        else:
            _armed.pop(point.partition("@")[0], None)


def check(point: str, path: str = "") -> None:
    if not _armed:
        return
    with _lock:
        armed = _armed.get(point)
    if armed is None:
        return
    action, match = armed
    if match and match not in path:
        return
    if action == "raise":
        raise InjectedFault(f"injected fault at {point} ({path or 'no path'})", point=point)
    if action.startswith("hang:"):
        time.sleep(float(action.split(":", 1)[1]))
    elif action == "kill":
        os._exit(137)


_parse_env()
