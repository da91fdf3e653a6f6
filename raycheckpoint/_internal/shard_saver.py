"""Worker-side saving: stage into reused host buffers, persist in a background thread.

:class:`ShardSaver` is owned by one worker (one rank of one role).  Per save:

1. :meth:`ShardSaver.snapshot` waits (bounded) for the previous persist of this worker,
   then copies the state dict into the rank's host buffers
   (:class:`~raycheckpoint._internal.staging.HostStager`: allocated on first use or by
   ``prepare()``, reused afterwards, pinned when CUDA is present).
   **This copy is the only time training is blocked.**
2. A background thread (:meth:`ShardSaver._persist`, one :class:`PersistJob`, run on the
   saver's persist lane: :mod:`~raycheckpoint._internal.lanes`) saves the
   staged copy in torch DCP's format (:func:`~raycheckpoint._internal.dcp.save.save_state`:
   DCP's protocol, its plans agreed once) through
   :class:`~raycheckpoint._internal.dcp.writer.HashingStorageWriter` on the checkpoint
   process group, writes the rank's extra state (RNG, scheduler) as msgpack and the
   role's assets (rank 0: files such as a Hugging Face ``config.json``), and reports the
   written files to the coordinator.  After the first save of a plan to local disk, it
   moves the staged tensors of the rank's large data file into one block laid out as the
   file (:meth:`ShardSaver._stage_files_whole`): the snapshot hands its write to another
   lane, which writes it once the copy has filled it
   (:mod:`~raycheckpoint._internal.overlapped_write`), and the persist finds it written.
3. On failure the thread keeps the exception (``PendingPersist.error``), reports it to
   the coordinator so the save aborts, and ``PendingPersist.wait()`` re-raises it.  A
   failure on one rank fails the save on every rank of the group in their first
   agreement; a rank that could not even stage its state takes part in it through
   :meth:`ShardSaver.refuse`.

With ``overlap=True`` (``checkpoint.overlap_copy``) step 1 only builds the copy list:
the host copy itself runs on a lane of its own while training goes on, and
:meth:`ShardSaver.wait_copied` (called by the worker before its optimizer step, the
first thing that changes the saved tensors) waits for whatever is left of it.

Each kind of save (full, light) keeps its :class:`~raycheckpoint._internal.dcp.shard_plan.ShardPlan`
from save to save.  The saver knows nothing of commits: it writes files and reports them.
"""

from __future__ import annotations

import functools
import logging
import time
import traceback
from typing import Any

import ray
import torch
import torch.distributed as dist

from raycheckpoint._internal import faults
from raycheckpoint._internal.bounded_write import BoundedBuffer, snapshot_bounded
from raycheckpoint._internal.dcp.save import save_state
from raycheckpoint._internal.dcp.shard_plan import ShardPlan
from raycheckpoint._internal.dcp.writer import HashingStorageWriter
from raycheckpoint._internal.lanes import SaverLanes
from raycheckpoint._internal.overlapped_write import (
    CopyProgress,
    OverlappedWrite,
    stage_files_whole,
    start_early_write,
)
from raycheckpoint._internal.persist import (
    PendingPersist,
    PersistJob,
    SaveTarget,
    Snapshot,
    describe_error,
)
from raycheckpoint._internal.staging import HostStager, tensor_bytes
from raycheckpoint.protocol.format import pack
from raycheckpoint.protocol.paths import CheckpointPaths
from raycheckpoint.storage import StorageSpec

log = logging.getLogger(__name__)


class ShardSaver:
    """Stages and persists one rank's shard of one role."""

    def __init__(self, *, role: str, rank: int, world_size: int, storage: StorageSpec,
                 process_group: dist.ProcessGroup | None = None,
                 report_timeout_s: float = 300.0, persist_nice: int = 0) -> None:
        self.role = role
        self.rank = rank
        self.world_size = world_size
        self.storage_spec = storage
        self.storage = storage.open()
        self.process_group = process_group
        self.report_timeout_s = report_timeout_s
        # its background threads, kept from save to save (a thread per save cost the
        # snapshot the new thread's first scheduling: up to ms on busy cores)
        self.lanes = SaverLanes(f"{role}-{rank}", persist_nice)
        # a kind's plan was made for its buffers: new buffers, a new plan
        self.stager = HostStager(f"{role}/{rank}", lambda kind: self.plans.pop(kind, None))
        self.plans: dict[str, ShardPlan] = {}
        self.pending: PendingPersist | None = None
        self._early: dict[str, OverlappedWrite] = {}  # kind -> the last snapshot's early write
        self.copy_wait_s = 0.0  # total time callers were blocked in wait_copied()
        # write a data file staged whole once the copy fills it (checkpoint.write_ahead)
        self.writes_ahead = True
        # checkpoint.host_buffer_bytes: a larger state is saved through a bounded buffer
        self.host_buffer_bytes: int | None = None
        self._bounded: BoundedBuffer | None = None

    @property
    def persist_nice(self) -> int:
        """How many nice levels below training the persist (and the early write) runs."""
        return self.lanes.persist.nice

    @persist_nice.setter
    def persist_nice(self, nice: int) -> None:
        self.lanes.set_nice(nice)

    @property
    def pin_memory(self) -> bool:
        return self.stager.pin_memory

    def prepare(self, kind: str, state: dict[str, Any]) -> int:
        """Allocate and touch the host buffers for ``kind`` now (none for a state over
        ``host_buffer_bytes``: saved through the bounded buffer), and start the saver's
        background threads; returns the buffers' bytes."""
        self.lanes.start()
        if self.host_buffer_bytes is not None and tensor_bytes(state) > self.host_buffer_bytes:
            return 0
        return self.stager.prepare(kind, state)

    def host_figures(self) -> dict[str, Any]:
        """The host memory this rank's saves hold: staging slabs, data files staged whole,
        the bounded buffer; and of it, what is pinned."""
        images = sum(len(i.block) for p in self.plans.values() for i in p.images.values())
        bounded = self._bounded
        extra = 0 if bounded is None else bounded.host_bytes
        return {"host_bytes": self.stager.host_bytes + images + extra,
                "pinned_bytes": self.stager.pinned_bytes
                + (extra if bounded is not None and bounded.pinned else 0)}

    def _start_overlapped_write(self, kind: str, target: SaveTarget, timeout_s: float
                                ) -> CopyProgress | None:
        """:func:`~raycheckpoint._internal.overlapped_write.start_early_write` for ``kind``."""
        return start_early_write(self, kind, target, timeout_s)

    def _end_overlapped_write(self, kind: str) -> None:
        """Wait for the early writes of ``kind``'s last snapshot; remove what no persist
        took (:meth:`OverlappedWrite.end`)."""
        early = self._early.pop(kind, None)
        if early is not None:
            early.end(self.storage)

    def retire(self) -> None:
        """This saver is replaced (its worker set up anew): its threads end once the
        jobs handed to them have run."""
        self.lanes.close()

    def close(self, timeout: float) -> None:
        """At process exit: wait at most ``timeout`` for a running persist.  One never
        started is dropped: its save cannot commit without this rank, and its files are
        collected like any aborted save's."""
        pending = self.pending
        if pending is None or not pending.started or pending.wait_done(timeout):
            return
        log.warning("%s/%s: exiting while save %s still persists; it will not commit",
                       self.role, self.rank, pending.save_id)

    def wait_previous(self, timeout: float) -> None:
        """Wait for the previous persist; its error was already reported to the coordinator.

        A persist whose start was deferred and never asked for (its caller died between
        the snapshot and ``start_persist``) is started here, so it cannot block forever.
        """
        if self.pending is not None:
            self.pending.start()
        if self.pending is not None and not self.pending.wait_done(timeout):
            raise TimeoutError(
                f"{self.role}/{self.rank}: previous save {self.pending.save_id} still persisting "
                f"after {timeout}s")

    @torch.no_grad()  # no autograd bookkeeping for the copies from parameters that need grad
    def snapshot(self, snap: Snapshot, target: SaveTarget, *, wait_timeout_s: float = 1800.0,
                 start: bool = True, overlap: bool = False,
                 marks: dict[str, float] | None = None) -> dict[str, Any]:
        """Stage ``snap`` for the save ``target`` names and set up its persist;
        ``start=False`` defers the persist's start.  ``marks`` gets the wall-clock time
        each phase ended at (``planned``, ``copied``, ``named``: a save's breakdown).

        Deferring lets the caller finish its answer first (the worker's
        ``ckpt_snapshot_begun`` starts it as its last step) or leave the start to its own
        caller (``ckpt_snapshot(defer_persist=True)``, then :meth:`start_persist`).  With
        ``overlap`` the tensors are copied by a thread started here, and the caller must
        call :meth:`wait_copied` before anything changes them (the optimizer step).

        A target not named yet is asked once the copy is made (with ``overlap``, once it
        has started); where this rank is not to write the save, nothing is persisted and
        the answer has ``"dropped": True``; if asking raises, the error is raised once the
        copy is over.  If staging fails, the save is refused (:meth:`refuse`) and the
        error raised.
        """
        t0 = time.perf_counter()
        marks = {} if marks is None else marks
        kind = snap.kind
        self.wait_previous(wait_timeout_s)
        self._end_overlapped_write(kind)  # ended by its persist or snapshot already: never beside
        if self.host_buffer_bytes is not None:  # a peer's bounded save needs this persist now
            start = True
            if tensor_bytes(snap.state) > self.host_buffer_bytes:
                return snapshot_bounded(self, snap, target, t0, wait_timeout_s)
        save_id, step_dir = ("", "") if target.pending else target.named()
        pending = PendingPersist(save_id)
        try:
            faults.check("worker.snapshot", path=f"{self.role}/{self.rank}")
            staged, copies, ready = self.stager.plan(kind, snap.state)
            progress = self._start_overlapped_write(kind, target, wait_timeout_s)
            marks["planned"] = time.time()
            if overlap:
                self.lanes.copy.submit(functools.partial(
                    self._copy_beside_training, pending, copies, ready, progress))
            else:
                t_copy = time.perf_counter()
                self.stager.copy(copies, ready, progress)
                pending.copy_s = time.perf_counter() - t_copy
                pending.copied.set()
        except BaseException as e:
            self.refuse(kind, e, target)
            raise
        marks["copied"] = time.time()  # with overlap: the copy's thread started
        if target.pending:
            try:
                got = target.named()
            except BaseException:
                pending.copied.wait()  # the buffers are the next snapshot's: let the copy end
                self._end_overlapped_write(kind)
                raise
            if got is None:
                pending.copied.wait()
                self._end_overlapped_write(kind)
                return {"stall_s": time.perf_counter() - t0, "bytes": 0, "dropped": True}
            pending.save_id, step_dir = got
        marks["named"] = time.time()
        stall_s = time.perf_counter() - t0
        self._set_up_persist(PersistJob(
            pending=pending, kind=kind, step_dir=step_dir, coordinator=target.coordinator,
            plan=self.plans.setdefault(kind, ShardPlan()), staged=staged, extra=snap.extra,
            assets=dict(snap.assets), writes_tensors=bool(staged)), start=start)
        return {"stall_s": stall_s, "bytes": self.stager.staging[kind].bytes, "chunked": False,
                "pinned": self.stager.pinned(kind), **self.host_figures()}

    def _set_up_persist(self, job: PersistJob, *, start: bool) -> None:
        """Make ``job.pending`` this saver's persist (handed to its lane now, or deferred)."""
        self.pending = job.pending
        job.pending.set_up(self.lanes.persist, functools.partial(self._persist, job))
        if start:
            job.pending.start()

    def refuse(self, kind: str, error: BaseException, target: SaveTarget) -> None:
        """This rank could not stage its state for the save: fail it on every rank at once.

        Its peers that staged are persisting, and wait for this rank in their first
        agreement (:func:`~raycheckpoint._internal.dcp.save.save_state`): without an
        answer they would wait out the process group's timeout, and hold up the next save
        as long.  A persist is started here that gives that agreement ``error`` and
        reports it to the target's coordinator.  Nothing is started where the save is not
        this rank's to write (the target names no save for it, or naming it raises).
        Call after :meth:`wait_previous`.
        """
        try:
            got = target.named()
        except Exception:  # the save was never named: no peer persists it
            log.debug("%s/%s: a refused save was never named", self.role, self.rank,
                      exc_info=True)
            return
        if got is None:
            return
        save_id, step_dir = got
        pending = PendingPersist(save_id)
        pending.copied.set()
        staging = self.stager.staging.get(kind)
        # whether the peers meet in an agreement: they do where the state holds anything
        # (a role with none saves its extra state only); before a first staging, assume so
        writes_tensors = True if staging is None else not staging.empty
        self._set_up_persist(PersistJob(
            pending=pending, kind=kind, step_dir=step_dir, coordinator=target.coordinator,
            plan=self.plans.setdefault(kind, ShardPlan()), staged={}, failed=error,
            writes_tensors=writes_tensors), start=True)

    def _copy_beside_training(self, pending: PendingPersist,
                              copies: list[tuple[torch.Tensor, torch.Tensor]], ready: Any,
                              progress: CopyProgress | None) -> None:
        """The host copy of an overlapped save, on the copy lane."""
        t0 = time.perf_counter()
        try:
            faults.check("worker.copy", path=f"{self.role}/{self.rank}")
            self.stager.copy(copies, ready, progress)
        except BaseException as e:  # noqa: BLE001 - the persist reports it; the save aborts
            pending.copy_error = e
            if progress is not None:  # the early write stops (told already by a failed copy)
                progress.finish(e)
        finally:
            pending.copy_s = time.perf_counter() - t0
            pending.copied.set()

    def wait_copied(self, timeout: float | None = None) -> float:
        """Block until the last save's host copy is complete; returns the seconds blocked.

        A failed copy is not raised here (training goes on; the save aborts and its
        error comes from the persist).
        """
        pending = self.pending
        if pending is None or pending.copied.is_set():
            return 0.0
        t0 = time.perf_counter()
        if not pending.copied.wait(timeout):
            raise TimeoutError(f"{self.role}/{self.rank}: host copy of save {pending.save_id} "
                               f"still running after {timeout}s")
        waited = time.perf_counter() - t0
        self.copy_wait_s += waited
        return waited

    def start_persist(self, save_id: str, *, if_staged: bool = False) -> None:
        pending = self.pending
        if pending is None or pending.save_id != save_id:
            if if_staged:
                return
            raise RuntimeError(f"{self.role}/{self.rank}: no staged save {save_id} to persist "
                               f"(the last one is {pending and pending.save_id})")
        pending.start()

    def _stage_files_whole(self, kind: str, plan: ShardPlan, results: list) -> None:
        """:func:`~raycheckpoint._internal.overlapped_write.stage_files_whole`, then the
        buffers left in ``kind``'s slab repacked (the slab freed)."""
        if stage_files_whole(self, kind, plan, results):
            self.stager.repack(kind)

    def _persist(self, job: PersistJob) -> None:
        t0 = time.perf_counter()
        pending, failed = job.pending, job.failed
        early = self._early.get(job.kind)
        if early is not None:  # the snapshot answered: its early write may hash
            early.progress.release()
        paths = CheckpointPaths(job.step_dir)
        try:
            try:
                pending.copied.wait()  # set by the copy thread whatever happens to it
                if pending.copy_error is not None:
                    raise pending.copy_error
                faults.check("worker.persist", path=f"{self.role}/{self.rank}")
            except BaseException as e:  # noqa: BLE001 - the peers learn it in the agreement
                if failed is None:
                    failed = e
            files = []
            if job.writes_tensors:  # a role without tensors (rollout) saves its extra state only
                writer = HashingStorageWriter(self.storage, paths.role_dir(self.role), job.plan,
                                              early, job.bounded)
                # raises on every rank of the group if any rank failed
                save_state(job.staged, writer, job.plan, self.process_group, failed=failed)
                files = list(writer.written)
            elif failed is not None:
                raise failed
            if job.extra is not None:
                files.append(self.storage.write_bytes(paths.rng(self.role, self.rank),
                                                      pack(job.extra), encrypt=True))
            for asset, data in sorted((job.assets or {}).items()):
                files.append(self.storage.write_bytes(paths.asset(self.role, asset), data))
            faults.check("worker.before_report", path=f"{self.role}/{self.rank}")
            pending.files = files
            pending.persist_s = time.perf_counter() - t0
            ray.get(job.coordinator.report.remote(
                pending.save_id, self.role, self.rank, [f.to_dict() for f in files], None,
                pending.persist_s), timeout=self.report_timeout_s)
            if job.writes_tensors and job.plan.outcome is not None:
                self._stage_files_whole(job.kind, job.plan, writer.results)
        except BaseException as e:  # noqa: BLE001 - kept, reported and re-raised by wait()
            pending.error = e
            text = f"{describe_error(e)}\n{traceback.format_exc(limit=6)}"
            try:
                ray.get(job.coordinator.report.remote(pending.save_id, self.role, self.rank, [],
                                                      text, None), timeout=self.report_timeout_s)
            except Exception as report_error:  # noqa: BLE001
                e.add_note(f"also failed to report this error to the coordinator: {report_error}")
        finally:
            if job.bounded is not None:  # failed before its data was written: let go
                job.bounded.release()
            try:
                self._end_overlapped_write(job.kind)
            finally:
                pending.finish()
