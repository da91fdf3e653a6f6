"""Lineage: which committed checkpoint holds the state a job has now, and what a save of
a step does with the other checkpoints of that step.

A job holds the state of the checkpoint it committed or fully loaded last (its *head*).
A save of step ``s``:

* reuses the committed checkpoint of ``s`` that is the head (the same state saved twice:
  the train-end save after a periodic one), adding its tag;
* sets every other committed checkpoint of ``s`` aside (quarantine, see
  :mod:`~raycheckpoint.protocol.paths`): a damaged one ``auto`` passed over, or one of
  the run the job diverged from by resuming an older checkpoint.  They hold another
  state, and the new save must be written, not skipped;
* writes into a step directory of its own (:meth:`RootState.take_dir
  <raycheckpoint.protocol.root.RootState.take_dir>`).

What ``auto`` passed over for its own bytes is quarantined as soon as the job has
loaded (:meth:`Lineage.loaded`), in the tier it was found in.  The coordinator owns one
:class:`Lineage` and calls it under its commit lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from raycheckpoint.protocol.format import Marker
from raycheckpoint.protocol.root import RootState

logger = logging.getLogger(__name__)


class Lineage:
    """The head of one job and the quarantines it decides (see the module doc).
    ``durable()``: a tiered job's durable tier (its RootState and lock), or None."""

    def __init__(self, root: RootState, durable: Callable[[], Any] = lambda: None) -> None:
        self.root = root
        self.durable = durable
        self.head: str | None = None  # the checkpoint whose state the job holds

    def same_state(self, step: int) -> Marker | None:
        """The committed checkpoint of ``step`` that holds the job's state, if any."""
        marker = self.root.markers.get(self.head) if self.head is not None else None
        return marker if marker is not None and marker.step == step else None

    def supersede(self, step: int, keep: Marker | None) -> list[str]:
        """Quarantine every committed checkpoint of ``step`` but ``keep``: a new save of
        ``step`` is about to be written.  Returns their names."""
        others = [m.name for m in self.root.sorted_markers() if m.step == step and m is not keep]
        for name in others:
            self.root.quarantine(name, f"superseded: a new save of step {step} by a job that "
                                 f"resumed from {self.head or 'no checkpoint'}, not from it")
        return others

    def committed(self, name: str) -> None:
        self.head = name

    def loaded(self, name: str | None, passed_over: list[tuple[str, str, str]]) -> list[str]:
        """The job holds ``name``'s state now (None: a partial load, no checkpoint's).
        ``passed_over``: (name, tier label, why) of what ``auto`` did not take for its own
        bytes; those of this root and of a tiered job's durable tier are quarantined (a
        memory replica is replaced by the next copy).  Returns what was quarantined."""
        self.head = name
        done = []
        for bad, tier, why in passed_over:  # a copy of `name` here: not the one loaded
            reason = f"passed over by resume: {why}"
            durable = self.durable()
            if tier == "durable tier" and durable is not None:
                with durable.lock:
                    q = durable.root.quarantine(bad, reason)
            elif tier in ("root", "local tier"):
                q = self.root.quarantine(bad, reason)
            else:
                continue
            if q is not None:
                done.append(f"{bad} ({tier})")
        return done
