"""Worker-side saving: stage into reused host buffers, persist in a background thread.

:class:`ShardSaver` is owned by one worker (one rank of one role).  Per save:

1. :meth:`ShardSaver.snapshot` waits (bounded) for the previous persist of this worker,
   then copies the state dict into the rank's host buffers
   (:class:`~raycheckpoint._internal.staging.HostStager`: allocated on first use or by
   ``prepare()``, reused afterwards, pinned when CUDA is present).
   **This copy is the only time training is blocked.**
2. A background thread (:meth:`ShardSaver._persist`, one :class:`PersistJob`) saves the
   staged copy in torch DCP's format (:func:`~raycheckpoint._internal.dcp.save.save_state`:
   DCP's protocol, its plans agreed once) through
   :class:`~raycheckpoint._internal.dcp.writer.HashingStorageWriter` on the checkpoint
   process group, writes the rank's extra state (RNG, scheduler) as msgpack and the
   role's assets (rank 0: files such as a Hugging Face ``config.json``), and reports the
   written files to the coordinator.  After the first save of a plan to local disk, it
   moves the staged tensors of the rank's large data file into one block laid out as the
   file (:meth:`ShardSaver._stage_files_whole`): a thread started at the snapshot writes
   it while the copy fills it (:mod:`~raycheckpoint._internal.overlapped_write`), and the
   persist finds it written.
3. On failure the thread keeps the exception (``PendingPersist.error``), reports it to
   the coordinator so the save aborts, and ``PendingPersist.wait()`` re-raises it.  A
   failure on one rank fails the save on every rank of the group in their first
   agreement; a rank that could not even stage its state takes part in it through
   :meth:`ShardSaver.refuse`.

With ``overlap=True`` (``checkpoint.overlap_copy``) step 1 only builds the copy list:
the host copy itself runs in a thread of its own while training goes on, and
:meth:`ShardSaver.wait_copied` (called by the worker before its optimizer step, the
first thing that changes the saved tensors) waits for whatever is left of it.

Each kind of save (full, light) keeps its :class:`~raycheckpoint._internal.dcp.shard_plan.ShardPlan`
from save to save.  The saver knows nothing of commits: it writes files and reports them.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any

import ray
import torch
import torch.distributed as dist

from raycheckpoint._internal import faults
from raycheckpoint._internal.dcp.save import save_state
from raycheckpoint._internal.dcp.shard_plan import ShardPlan
from raycheckpoint._internal.dcp.writer import HashingStorageWriter
from raycheckpoint._internal.overlapped_write import CopyOrder, CopyProgress, OverlappedWrite
from raycheckpoint._internal.persist import (
    PendingPersist,
    PersistJob,
    SaveTarget,
    Snapshot,
    describe_error,
)
from raycheckpoint._internal.priority import lower_priority
from raycheckpoint._internal.staging import HostStager
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
        self.persist_nice = persist_nice
        # a kind's plan was made for its buffers: new buffers, a new plan
        self.stager = HostStager(f"{role}/{rank}", lambda kind: self.plans.pop(kind, None))
        self.plans: dict[str, ShardPlan] = {}
        self.pending: PendingPersist | None = None
        self._early: dict[str, OverlappedWrite] = {}  # kind -> the last snapshot's early write
        self.copy_wait_s = 0.0  # total time callers were blocked in wait_copied()
        # write a data file staged whole while the copy fills it (checkpoint.write_ahead)
        self.writes_ahead = True

    @property
    def pin_memory(self) -> bool:
        return self.stager.pin_memory

    def prepare(self, kind: str, state: dict[str, Any]) -> int:
        """Allocate and touch the host buffers for ``kind`` now; returns their bytes."""
        return self.stager.prepare(kind, state)

    def _start_overlapped_write(self, kind: str, copies: list[tuple[torch.Tensor, torch.Tensor]],
                                target: SaveTarget, timeout_s: float
                                ) -> tuple[list, CopyProgress | None]:
        """Start writing the data files staged whole while the copy fills them
        (:mod:`~raycheckpoint._internal.overlapped_write`): their write then overlaps the
        copy, and the persist finds them written.  Returns the copies in the order that
        fills the files front to back, and the progress the copy tells; None where no
        file is written early (the first save of a plan, or its files are written record
        by record)."""
        plan = self.plans.get(kind)
        if not self.writes_ahead or plan is None or not plan.images or plan.outcome is None:
            return copies, None
        files = [(name, image.view) for name, image in sorted(plan.images.items())]
        views = [view for _, view in files]
        staging = self.stager.staging.get(kind)
        kept = plan.copy_order
        got = None
        if (kept is not None and kept[0] is staging and len(kept[1]) == len(views)
                and all(a is b for a, b in zip(kept[1], views, strict=True))):
            got = kept[2].apply(copies)
        if got is None:  # first early write over this staging and these blocks
            order = CopyOrder(copies, views)
            plan.copy_order = (staging, views, order)
            got = order.apply(copies)
            assert got is not None
        copies, progress = got
        early = self._early[kind] = OverlappedWrite(files, progress, timeout_s)

        def dcp_dir() -> str | None:
            named = target.named()
            return None if named is None else CheckpointPaths(named[1]).role_dir(self.role)

        # below training, as the persist thread is: the copy beside it is training's stall
        early.start(self.storage, dcp_dir, f"raycheckpoint-write-ahead-{self.role}-{self.rank}",
                    before=lambda: lower_priority(self.persist_nice))
        return copies, progress

    def _end_overlapped_write(self, kind: str) -> None:
        """Wait for the early writes of ``kind``'s last snapshot; remove what no persist
        took (:meth:`OverlappedWrite.end`)."""
        early = self._early.pop(kind, None)
        if early is not None:
            early.end(self.storage)

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

        A persist whose start was deferred and never asked for (the driver died between
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
                 start: bool = True, overlap: bool = False) -> dict[str, Any]:
        """Stage ``snap`` for the save ``target`` names and set up its persist;
        ``start=False`` defers the persist's start.

        Deferring lets the caller answer its RPC before the persist thread competes with it
        (and with the other ranks' copies): ``start_persist`` then starts it.  With
        ``overlap`` the tensors are copied by a thread started here, and the caller must
        call :meth:`wait_copied` before anything changes them (the optimizer step).

        A target not named yet is asked once the copy is made (with ``overlap``, once it
        has started); where this rank is not to write the save, nothing is persisted and
        the answer has ``"dropped": True``; if asking raises, the error is raised once the
        copy is over.  If staging fails, the save is refused (:meth:`refuse`) and the
        error raised.
        """
        t0 = time.perf_counter()
        kind = snap.kind
        self.wait_previous(wait_timeout_s)
        self._end_overlapped_write(kind)  # ended by its persist or snapshot already: never beside
        save_id, step_dir = ("", "") if target.pending else target.named()
        pending = PendingPersist(save_id)
        try:
            faults.check("worker.snapshot", path=f"{self.role}/{self.rank}")
            staged, copies, ready = self.stager.plan(kind, snap.state)
            copies, progress = self._start_overlapped_write(kind, copies, target, wait_timeout_s)
            if overlap:
                threading.Thread(target=self._copy_beside_training,
                                 args=(pending, copies, ready, progress), daemon=True,
                                 name=f"raycheckpoint-copy-{self.role}-{self.rank}").start()
            else:
                t_copy = time.perf_counter()
                self.stager.copy(copies, ready, progress)
                pending.copy_s = time.perf_counter() - t_copy
                pending.copied.set()
        except BaseException as e:
            self.refuse(kind, e, target)
            raise
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
        stall_s = time.perf_counter() - t0
        self._set_up_persist(PersistJob(
            pending=pending, kind=kind, step_dir=step_dir, coordinator=target.coordinator,
            plan=self.plans.setdefault(kind, ShardPlan()), staged=staged, extra=snap.extra,
            assets=dict(snap.assets), writes_tensors=bool(staged)), start=start)
        return {"stall_s": stall_s, "bytes": self.stager.staging[kind].bytes}

    def _set_up_persist(self, job: PersistJob, *, start: bool) -> None:
        """Make ``job.pending`` this saver's persist (its thread started now, or deferred)."""
        self.pending = job.pending
        job.pending._thread = threading.Thread(
            target=self._persist, name=f"raycheckpoint-persist-{self.role}-{self.rank}",
            args=(job,), daemon=True)
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
        """The host copy of an overlapped save, in a thread of its own."""
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
        """After the first save of a plan, move the staged tensors of each large data file
        into one page-aligned block laid out as the file
        (:meth:`~raycheckpoint._internal.dcp.shard_plan.ShardPlan.adopt_image`): later
        saves write it to local disk with ``O_DIRECT`` straight from the block, with no
        copy into a bounce buffer, and hash it a block at a time.

        Only where the storage writes with ``O_DIRECT`` and without encryption; not with
        pinned (CUDA) staging, which keeps one pinned buffer per tensor; and not for a
        kind whose buffers another kind shares (a light save's model buffers are the full
        save's): its files are written record by record, and no block is left holding
        memory that moved on.  Runs once per plan, in the persist thread, before the next
        snapshot may start.
        """
        storage = self.storage
        if (self.plans.get(kind) is not plan or plan.tried_images or not storage.writes_direct
                or storage.cipher is not None or self.pin_memory):
            return
        plan.tried_images = True
        try:
            owners = {t.data_ptr(): t for t in self.stager.staging[kind].tensors()}
            # no other kind's buffers may move: their plans resolved them
            shared = {id(t) for other, staging in self.stager.staging.items() if other != kind
                      for t in staging.tensors()}
            if any(id(t) in shared for t in owners.values()):
                return
            for name in sorted({r.storage_data.relative_path for r in results}):
                plan.adopt_image(name, results, owners)
        except Exception as e:  # noqa: BLE001 - the files are written record by record then
            log.warning("%s/%s: staging the data files whole failed (%s: %s); they are "
                        "written record by record", self.role, self.rank, type(e).__name__, e)
            plan.forget_tensors()  # some tensors may have moved

    def _persist(self, job: PersistJob) -> None:
        t0 = time.perf_counter()
        pending, failed = job.pending, job.failed
        lower_priority(self.persist_nice)
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
                                              early)
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
            try:
                self._end_overlapped_write(job.kind)
            finally:
                pending.finish()
