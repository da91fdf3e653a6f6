"""SaveHandle: the driver's handle on one save in flight.

Returned by :meth:`CheckpointManager.save_checkpoint
<raycheckpoint.manager.CheckpointManager.save_checkpoint>` once every worker holds its
host copy.  ``done()`` asks the local object store whether the coordinator's answer has
arrived; ``wait(timeout)`` returns the commit result or raises the save's error
unchanged (orbax's and DCP's async handles do the same).  The first outcome observed is
handed to the manager's recorder (``checkpoint_stats``, metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from raycheckpoint._internal.rpc import get as _get
from raycheckpoint.errors import RayCheckpointError

# records a save's outcome: (handle, result or None, error or None)
Recorder = Callable[["SaveHandle", "dict[str, Any] | None", "BaseException | None"], None]


class SaveHandle:
    """A save in flight: ``done()``, ``wait(timeout)``; errors are re-raised unchanged."""

    def __init__(self, record: Recorder, *, save_id: str | None, name: str, step: int,
                 kind: str, stall_s: float, worker_stall_s: float, existing: dict | None = None,
                 finished: ray.ObjectRef | None = None):
        self._record = record
        self.save_id, self.name, self.step, self.kind = save_id, name, step, kind
        self.stall_s, self.worker_stall_s = stall_s, worker_stall_s
        self._result: dict[str, Any] | None = existing
        self._error: BaseException | None = None
        self.observed = existing is not None
        # the coordinator's answer to await_save(): ready when the save has finished, so
        # done() asks the local object store, not the coordinator
        self._finished = finished

    @classmethod
    def failed(cls, record: Recorder, *, name: str, step: int, kind: str, stall_s: float,
               error: BaseException) -> SaveHandle:
        """A save that failed before any worker wrote: recorded now, raised by ``wait()``."""
        handle = cls(record, save_id=None, name=name, step=step, kind=kind, stall_s=stall_s,
                     worker_stall_s=0.0)
        handle._error, handle.observed = error, True
        record(handle, None, error)
        return handle

    def done(self) -> bool:
        # a handle without an answer to wait for holds its result or error from the start
        if self._result is not None or self._error is not None:
            return True
        ready, _ = ray.wait([self._finished], timeout=0)
        return bool(ready)

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        self.observed = True
        if self._error is not None:
            raise self._error
        if self._result is None:
            try:
                self._result = _get(self._finished, timeout)
            except ray.exceptions.GetTimeoutError:  # still running: not a failure of the save
                raise TimeoutError(f"save {self.name} ({self.save_id}) not finished after "
                                   f"{timeout}s") from None
            except RayCheckpointError as e:
                self._error = e
                self._record(self, None, e)
                raise
            self._record(self, self._result, None)
        return self._result

    @property
    def error(self) -> BaseException | None:
        return self._error
