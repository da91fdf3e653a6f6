"""The values a rank's save passes around, from the worker to its persist thread.

* :class:`Snapshot`: what a worker hands its saver (state, extra state, assets);
* :class:`SaveTarget`: which save it is for (known now, or once ``begin`` answers) and
  the coordinator its persist reports to;
* :class:`PersistJob`: everything one persist writes and where it reports (the persist
  thread's one argument);
* :class:`PendingPersist`: the handle a saver keeps on its rank's last persist (run on
  the saver's persist :class:`~raycheckpoint._internal.lanes.Lane`, below training; it
  keeps its exception, and ``wait`` re-raises it unchanged).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from raycheckpoint._internal.dcp.shard_plan import ShardPlan
from raycheckpoint._internal.lanes import Lane
from raycheckpoint.storage import FileEntry


def describe_error(e: BaseException) -> str:
    """One line naming the root cause; DCP's CheckpointException hides it per rank."""
    failures = getattr(e, "failures", None)
    if isinstance(e, CheckpointException) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"rank {rank}: {type(inner).__name__}: {inner}")
        return f"{type(e).__name__}: " + "; ".join(parts)
    return f"{type(e).__name__}: {e}"


@dataclass
class Snapshot:
    """What a worker hands its saver at a save: ``state`` (tensors, DTensors and small
    values), ``extra`` (its RNG and extra state, for a full save) and ``assets`` (rank
    0's files describing the model)."""

    kind: str
    state: dict[str, Any]
    extra: dict[str, Any] | None = None
    assets: dict[str, bytes] = field(default_factory=dict)


class SaveTarget:
    """Which save a snapshot is for, and the coordinator its persist reports to.

    The save's id and step directory are known now, or, with ``named``, once the
    coordinator's ``begin`` answers: ``named()`` returns ``(save_id, step_dir)``, or None
    when this rank is not to write the save, and raises when ``begin`` failed.  It is
    called at most once, from any thread (the snapshot's, an early write's), and let go
    once called (see :class:`_Once`).
    """

    def __init__(self, coordinator: Any, save_id: str = "", step_dir: str = "",
                 named: Callable[[], tuple[str, str] | None] | None = None) -> None:
        self.coordinator = coordinator
        self._fixed = (save_id, step_dir)
        self._named = None if named is None else _Once(named)

    @property
    def pending(self) -> bool:
        """Whether the save is not named yet."""
        return self._named is not None

    def named(self) -> tuple[str, str] | None:
        """``(save_id, step_dir)``, or None where this rank is not to write the save."""
        return self._fixed if self._named is None else self._named()


class _Once:
    """``fn()``, called at most once from any thread; its answer (or error) kept, and
    ``fn`` let go once called.

    Letting go matters for ``named``: it holds the reference to ``begin``'s answer that
    the snapshot call was lent, and the early write's thread holds this object until its
    files are written.  A worker still holding a lent reference when its call returns
    makes Ray track the borrow with the owner, the driver (two idle actors each reading
    such an answer: 4.3-4.5 ms for the round trip holding it, 2.6-2.7 ms letting go).
    An error is kept with its traceback, which may hold ``fn``: the save fails then.
    """

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn: Callable[[], Any] | None = fn
        self._lock = threading.Lock()
        self._called = False
        self._value: Any = None
        self._error: BaseException | None = None

    def __call__(self) -> Any:
        with self._lock:
            if not self._called:
                fn, self._fn = self._fn, None
                try:
                    self._value = fn()
                except BaseException as e:  # noqa: BLE001 - raised to every caller
                    self._error = e
                self._called = True
        if self._error is not None:
            raise self._error
        return self._value


class PendingPersist:
    """Handle on one background persist: ``done()``, ``wait(timeout)``, ``error``."""

    def __init__(self, save_id: str) -> None:
        self.save_id = save_id
        self.error: BaseException | None = None
        self.files: list[FileEntry] = []
        self.persist_s: float | None = None
        self._done = threading.Event()
        self._run: tuple[Lane, Callable[[], None]] | None = None  # its lane, its job
        self._started = False
        self._start_lock = threading.Lock()
        # the host copy: already made unless the save overlaps it with training
        self.copied = threading.Event()
        self.copy_error: BaseException | None = None
        self.copy_s: float | None = None

    def set_up(self, lane: Lane, job: Callable[[], None]) -> None:
        """``job`` is this persist, to run on ``lane`` once started."""
        self._run = (lane, job)

    def start(self) -> None:
        """Start the background persist: hand it to its lane (once; later calls do nothing)."""
        with self._start_lock:
            if self._run is not None and not self._started:
                self._started = True
                lane, job = self._run
                self._run = None  # the lane holds the job until it has run
                lane.submit(job)

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def started(self) -> bool:
        return self._started

    def finish(self) -> None:
        """The persist is over (its files and error are set): waiters go on."""
        self._done.set()

    def wait_done(self, timeout: float | None) -> bool:
        """Whether the persist ended within ``timeout`` (its error is not raised here)."""
        return self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> list[FileEntry]:
        self.start()
        if not self._done.wait(timeout):
            raise TimeoutError(f"persist of save {self.save_id} still running after {timeout}s")
        if self.error is not None:
            raise self.error
        return self.files


@dataclass
class PersistJob:
    """What one persist writes and where it reports: the persist thread's argument.

    ``staged``: the state over the host buffers (DCP's part); ``extra``: the rank's extra
    state and RNG (full saves), written as msgpack; ``assets``: rank 0's files describing
    the model; ``failed``: this rank cannot save (its state could not be staged), and only
    takes part in its peers' first agreement to fail the save on every rank at once;
    ``writes_tensors``: whether the rank takes part in DCP's save at all (a role with no
    state saves its extra state only); ``bounded``: the save goes through a bounded host
    buffer (:mod:`~raycheckpoint._internal.bounded_write`), released once the rank's data
    files are written (the snapshot waits for that).
    """

    pending: PendingPersist
    kind: str
    step_dir: str
    coordinator: Any
    plan: ShardPlan
    staged: dict[str, Any]
    extra: dict[str, Any] | None = None
    assets: dict[str, bytes] | None = None
    failed: BaseException | None = None
    writes_tensors: bool = True
    bounded: Any = None  # a BoundedBuffer: ``staged`` is the live state, written through it
