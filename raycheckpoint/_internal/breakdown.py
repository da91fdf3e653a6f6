"""Where one save's blocked time went: the driver's and the workers' phases, in order.

The driver marks the wall-clock time at which each of its phases of a save ended
(``CheckpointManager.save_checkpoint``); every worker's snapshot answer carries its own
marks (``received`` ... ``answered``, see ``CheckpointableWorker._snapshot`` and
``ShardSaver.snapshot``).  :func:`save_breakdown` lays them end to end along the
critical path, the rank whose answer came last, in milliseconds: each figure is
the time from the previous mark to this one, so they add up to the save's blocked
time.  A phase that ran beside that path (the coordinator's ``begin``) is given apart.

The marks are ``time.time()`` of different processes: on one machine they share a
clock; across machines the two figures that cross one (``to_worker``, ``to_driver``)
carry the clocks' offset.
"""

from __future__ import annotations

from typing import Any

# (figure, the mark it ends at), in order; ``to_worker`` runs from the driver's
# ``trainer_state`` (the calls are sent then) to the worker's receipt of its call
_DRIVER_BEFORE = [("trainer_state", "trainer_state")]
_WORKER = [("to_worker", "received"), ("wait_previous", "previous"),
           ("state_dict", "state_dict"), ("rng_extra", "extra"), ("plan", "planned"),
           ("copy", "copied"), ("begin_answer", "named"), ("answer", "answered")]
_DRIVER_AFTER = [("to_driver", "snapped"), ("finish", "end")]


def save_breakdown(driver: dict[str, float], snapshots: list[tuple[str, dict[str, Any]]], *,
                   queued: bool = False) -> dict[str, Any]:
    """The breakdown of one save (ms), from the driver's ``marks`` and each writer's
    ``(who, snapshot answer)``; empty where the marks are incomplete (a dropped or
    bounded snapshot, a save that reused everything).

    ``queued``: a save riding on a training step, whose snapshots were queued behind the
    step's calls: its blocked time is the driver's request (``trainer_state``, ``send``:
    ``begin``), the rank's snapshot from its receipt, what the driver's wait for the
    answers lasted beyond that snapshot (``wait_answers``; the whole wait, which runs
    beside the snapshot: ``driver_wait_beside``) and the driver's ``finish`` after the
    answers; the time between request and snapshot (the step) is not the save's, nor the
    sending of the snapshot calls, which runs while the step's calls do
    (``send_snapshots_beside``).
    """
    marked = [(who, s["marks"]) for who, s in snapshots
              if all(m in s.get("marks", {}) for _, m in _WORKER[1:])]
    if not marked or not all(m in driver for m in ("start", "trainer_state", "snapped", "end")):
        return {}
    who, worker = max(marked, key=lambda w: w[1]["answered"])
    out: dict[str, Any] = {"rank": who, "queued": queued}
    if queued and not all(m in driver for m in ("begin_sent", "send_start", "sent", "finish")):
        return {}
    if queued:
        parts = [("trainer_state", driver["start"], driver["trainer_state"]),
                 ("send", driver["trainer_state"], driver["begin_sent"])]
        out["send_snapshots_beside"] = round((driver["sent"] - driver["send_start"]) * 1e3, 3)
        last = worker["received"]
        for name, mark in _WORKER[1:]:
            parts.append((name, last, worker.get(mark, last)))
            last = worker.get(mark, last)
        # the driver's wait for the answers (from its finish, called once it has the step's
        # answers) runs while the ranks snapshot: only what it lasted beyond the snapshot
        # is more blocked time (a frozen role's snapshot, a late `begin`)
        waited = driver["snapped"] - driver["finish"]
        out["driver_wait_beside"] = round(waited * 1e3, 3)
        parts.append(("wait_answers", 0.0, max(0.0, waited - (last - worker["received"]))))
        parts.append(("finish", driver["snapped"], driver["end"]))
    else:
        parts, last = [], driver["start"]
        for name, mark, source in ([(n, m, driver) for n, m in _DRIVER_BEFORE]
                                   + [(n, m, worker) for n, m in _WORKER]
                                   + [(n, m, driver) for n, m in _DRIVER_AFTER]):
            at = source.get(mark, last)
            parts.append((name, last, at))
            last = at
    for name, a, b in parts:
        out[name] = round((b - a) * 1e3, 3)
    out["total"] = round(sum((b - a) for _, a, b in parts) * 1e3, 3)
    if "begun" in driver and not queued:  # the coordinator's begin, beside the snapshots
        out["begin_beside"] = round((driver["begun"] - driver["trainer_state"]) * 1e3, 3)
    return out
