"""SaveHandle: the driver's handle on one save in flight; SaveTracker: all of them.

Returned by :meth:`CheckpointManager.save_checkpoint
<raycheckpoint.manager.CheckpointManager.save_checkpoint>` once every worker holds its
host copy.  ``done()`` asks the local object store whether the coordinator's answer has
arrived; ``wait(timeout)`` returns the commit result or raises the save's error
unchanged (orbax's and DCP's async handles do the same).  The first outcome observed is
handed to the manager's recorder (``checkpoint_stats``, metrics).

:class:`SaveTracker` keeps a manager's handles until they finish and the figures of
every finished save (``checkpoint_stats``), fed to
:class:`~raycheckpoint.metrics.CheckpointMetrics`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import ray

from raycheckpoint._internal.rpc import get as _get
from raycheckpoint.errors import CheckpointSaveError, RayCheckpointError
from raycheckpoint.protocol.paths import step_dir_name

# records a save's outcome: (handle, result or None, error or None)
Recorder = Callable[["SaveHandle", "dict[str, Any] | None", "BaseException | None"], None]


class SaveHandle:
    """A save in flight: ``done()``, ``wait(timeout)``; errors are re-raised unchanged."""

    def __init__(self, record: Recorder, *, save_id: str | None, name: str, step: int,
                 kind: str, stall_s: float, worker_stall_s: float, existing: dict | None = None,
                 finished: ray.ObjectRef | None = None, snapshots: list[dict] | None = None,
                 breakdown: dict[str, Any] | None = None):
        self._record = record
        self.save_id, self.name, self.step, self.kind = save_id, name, step, kind
        self.stall_s, self.worker_stall_s = stall_s, worker_stall_s
        self.host = host_figures(snapshots or [])
        # where the blocked time went, ms (raycheckpoint/_internal/breakdown.py)
        self.breakdown = dict(breakdown or {})
        self.tag: str | None = None
        self.reason = ""  # why it was saved (set by CheckpointManager.step)
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


def host_figures(snapshots: list[dict]) -> dict[str, Any]:
    """The host memory figures of a save's snapshot answers, as the stall is: the most any
    rank held (``host_bytes``, ``pinned_bytes``: staging buffers, or the bounded buffer of
    ``checkpoint.host_buffer_bytes``), and ``chunked``, whether any rank wrote through that
    buffer (training blocked until its data was written)."""
    figures = [s for s in snapshots if "host_bytes" in s]
    if not figures:
        return {}
    return {"host_bytes": max(s["host_bytes"] for s in figures),
            "pinned_bytes": max(s["pinned_bytes"] for s in figures),
            "chunked": any(s.get("chunked") for s in figures)}


class SaveTracker:
    """The saves of one manager: in flight (until observed) and finished (their figures)."""

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics
        self.handles: list[SaveHandle] = []
        self.stats: list[dict[str, Any]] = []

    def failed_before_start(self, step: int, kind: str, stall_s: float,
                            cause: BaseException) -> SaveHandle:
        """Record a save that failed before any worker wrote; training goes on.

        The error (with its cause and the storage attempts made) is recorded once in
        ``checkpoint_stats``, warned once, and raised by the returned handle's ``wait()``.
        """
        notes = "; ".join(getattr(cause, "__notes__", []))
        error = CheckpointSaveError(
            f"save of step {step} failed before any worker wrote: {type(cause).__name__}: {cause}"
            + (f" ({notes})" if notes else ""), failures={"coordinator": repr(cause)})
        handle = SaveHandle.failed(self.record, name=step_dir_name(step), step=step, kind=kind,
                                   stall_s=stall_s, error=error)
        warnings.warn(str(error), RuntimeWarning, stacklevel=4)
        return handle

    def record(self, handle: SaveHandle, result: dict[str, Any] | None,
               error: BaseException | None) -> None:
        """A :data:`Recorder`: one finished save's figures, its anomalies flagged."""
        entry = {"name": handle.name, "step": handle.step, "kind": handle.kind,
                 "stall_s": handle.stall_s, "worker_stall_s": handle.worker_stall_s,
                 "ok": error is None}
        if handle.reason:
            entry["reason"] = handle.reason
        entry.update(handle.host)
        if handle.breakdown:
            entry["breakdown_ms"] = handle.breakdown
        if result is not None:
            total = result.get("total_s") or 0.0
            entry.update(bytes=result.get("bytes", 0), persist_s=result.get("persist_s"),
                         total_s=total,
                         throughput_mb_s=(result.get("bytes", 0) / total / 1e6) if total else None)
            if "replication_pending" in result:  # a tiered job: waiting for the durable tier
                entry["replication_pending"] = result["replication_pending"]
        else:
            entry["error"] = f"{type(error).__name__}: {error}"
        entry["anomalies"] = self.metrics.record(entry)
        self.stats.append(entry)

    def poll(self) -> None:
        """Collect finished saves; warn (once) about failures nobody waited for."""
        for h in list(self.handles):
            if h.save_id is None or not h.done():
                continue
            self.handles.remove(h)
            if h.observed:
                continue
            try:
                h.wait(0)
            except RayCheckpointError as e:
                warnings.warn(f"checkpoint {h.name} (step {h.step}) failed and was not "
                              f"committed: {e}", RuntimeWarning, stacklevel=4)
                h.observed = True

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait for every save in flight; raise the first failure not yet observed."""
        first: BaseException | None = None
        for h in list(self.handles):
            self.handles.remove(h)
            if h.observed and h.error is not None:
                continue
            try:
                h.wait(timeout)
            except RayCheckpointError as e:
                first = first or e
        if first is not None:
            raise first
