"""Worker-side saving: stage into reused host buffers, persist in a background thread.

:class:`ShardSaver` is owned by one worker (one rank of one role).  Per save:

1. ``snapshot()`` waits (bounded) for the previous persist of this worker, then copies
   the state dict into host buffers allocated on first use (or ahead of time by
   ``prepare()``) and reused afterwards (pinned when CUDA is present), in one walk
   (:mod:`raycheckpoint._internal.staging`).
   **This copy is the only time training is blocked.**
2. A background thread saves the staged copy in torch DCP's format
   (:func:`~raycheckpoint.dcp_save.save_state`: DCP's protocol, its plans agreed once)
   through :class:`~raycheckpoint.dcp_io.HashingStorageWriter` on the checkpoint process
   group, writes the rank's extra state (RNG, scheduler) as msgpack and the role's
   assets (rank 0: files such as a Hugging Face ``config.json``), and reports the
   written files to the coordinator.  After the first save of a plan to local disk, it
   moves the staged tensors of the rank's large data file into one block laid out as the
   file, which later saves write as it lies (:meth:`ShardSaver._stage_files_whole`):
   a thread started at the snapshot writes it while the copy fills it
   (:mod:`raycheckpoint._internal.write_ahead`), and the persist finds it written.
3. On failure the thread keeps the exception (``PendingPersist.error``), reports it to
   the coordinator so the save aborts, and ``PendingPersist.wait()`` re-raises it.  A
   failure on one rank fails the save on every rank of the group in their first
   agreement; a rank that could not even stage its state takes part in it through
   :meth:`ShardSaver.refuse`.

With ``overlap=True`` (``checkpoint.overlap_copy``) step 1 only builds the copy list:
the host copy itself runs in a thread of its own while training goes on, and
:meth:`ShardSaver.wait_copied` (called by the worker before its optimizer step, the
first thing that changes the saved tensors) waits for whatever is left of it.

The saver knows nothing of commits: it writes files and reports them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch.distributed._state_dict_utils import _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException

from raycheckpoint._internal import faults
from raycheckpoint._internal.staging import Staging, copy_tensors, signature, tensor_bytes, touch
from raycheckpoint._internal.write_ahead import CopyOrder, CopyProgress, WriteAhead
from raycheckpoint.dcp_io import HashingStorageWriter
from raycheckpoint.dcp_save import ReusingSavePlanner, save_state
from raycheckpoint.format import asset_file, pack, rng_file
from raycheckpoint.storage import FileEntry, StorageSpec

log = logging.getLogger(__name__)


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


def _lower_priority(nice: int) -> None:
    """Lower the calling thread's priority by ``nice`` levels, to at most nice 19 (Linux:
    a thread has its own nice value, inherited from the thread that started it).

    Relative, as ``nice -n`` is: Ray starts its workers at nice 15, so an absolute value
    under 15 would leave a persist thread level with training.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # not permitted here: run at the worker's priority
        pass


class PendingPersist:
    """Handle on one background persist: ``done()``, ``wait(timeout)``, ``error``."""

    def __init__(self, save_id: str) -> None:
        self.save_id = save_id
        self.error: BaseException | None = None
        self.files: list[FileEntry] = []
        self.persist_s: float | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        # the host copy: already made unless the save overlaps it with training
        self.copied = threading.Event()
        self.copy_error: BaseException | None = None
        self.copy_s: float | None = None

    def start(self) -> None:
        """Start the background persist (once; later calls do nothing)."""
        with self._start_lock:
            if self._thread is not None and self._thread.ident is None:
                self._thread.start()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> list[FileEntry]:
        self.start()
        if not self._done.wait(timeout):
            raise TimeoutError(f"persist of save {self.save_id} still running after {timeout}s")
        if self.error is not None:
            raise self.error
        return self.files


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
        self.pin_memory = torch.cuda.is_available()
        self._buffers: dict[str, tuple[list[tuple], dict[str, Any]]] = {}
        self._staging: dict[str, Staging] = {}
        self._planners: dict[str, ReusingSavePlanner] = {}
        self.pending: PendingPersist | None = None
        self._copy_stream: Any = None
        self.copy_wait_s = 0.0  # total time callers were blocked in wait_copied()
        # write a data file staged whole while the copy fills it (_write_ahead)
        self.writes_ahead = True

    def _buffers_for(self, kind: str, state: dict[str, Any]) -> dict[str, Any]:
        """The host buffers for ``state``'s structure, allocated on first use."""
        sig = signature(state)
        cached = self._buffers.get(kind)
        if cached is not None and cached[0] == sig:
            return cached[1]
        buffers = None
        for _, other in self._buffers.values():  # light = the model part of full: share it
            if set(state) <= set(other) and all(
                    signature({k: state[k]}) == signature({k: other[k]}) for k in state):
                buffers = {k: other[k] for k in state}
                break
        if buffers is None:
            buffers = _create_cpu_state_dict(state, pin_memory=self.pin_memory)
        self._buffers[kind] = (sig, buffers)
        self._planners.pop(kind, None)  # its cached plan and tensors were for other buffers
        return buffers

    def prepare(self, kind: str, state: dict[str, Any]) -> int:
        """Allocate and touch the buffers now, so the first save's stall is a plain copy.

        Fresh memory costs a page fault per page on first write (about 10x a copy into
        memory already touched); paying it here keeps it out of training's blocked time.
        Returns the bytes prepared.
        """
        with torch.no_grad():
            buffers = self._buffers_for(kind, state)
            touch(buffers)
            return tensor_bytes(buffers)

    def _plan_stage(self, kind: str, state: dict[str, Any]) -> tuple[dict[str, Any], list, Any]:
        """The staged structure, its tensor copies still to make, and (GPU) the event the
        copies must wait for: the training stream's work that produced the state."""
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        staging = self._staging.get(kind)
        staged = None if staging is None else staging.restage(state, copies)
        if staged is None:  # first save of this kind, or the structure changed
            staging = Staging(state, self._buffers_for(kind, state))
            staged = staging.restage(state, copies)
            if staged is None:
                raise RuntimeError(f"{self.role}/{self.rank}: the state changed while staged")
            self._staging[kind] = staging
        ready = None
        if self.pin_memory:
            ready = torch.cuda.Event()
            ready.record()
        return staged, copies, ready

    def _copy(self, copies: list[tuple[torch.Tensor, torch.Tensor]], ready: Any,
              progress: CopyProgress | None = None) -> None:
        """Make the host copies (GPU: on a stream of its own, after ``ready``);
        ``progress`` is told of each copy, and of the end (whatever happens)."""
        if progress is not None:
            progress.copy(copies)
            return
        if ready is None:
            copy_tensors(copies)
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(ready)
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
        self._copy_stream.synchronize()

    def _stage(self, kind: str, state: dict[str, Any]) -> dict[str, Any]:
        staged, copies, ready = self._plan_stage(kind, state)
        self._copy(copies, ready)
        return staged

    def _write_ahead(self, kind: str, copies: list[tuple[torch.Tensor, torch.Tensor]],
                     step_dir: str, named: Callable[[], tuple[str, str] | None] | None,
                     timeout_s: float) -> tuple[list, CopyProgress | None]:
        """Start writing the data files staged whole while the copy fills them
        (:mod:`raycheckpoint._internal.write_ahead`): their write then overlaps the
        copy, and the persist finds them written.  Returns the copies in the order that
        fills the files front to back, and the progress the copy tells; None where no
        file is written early (the first save of a plan, or its files are written record
        by record)."""
        planner = self._planners.get(kind)
        if (not self.writes_ahead or planner is None or not planner.images
                or planner.reused is None):
            return copies, None
        files = [(name, image.view) for name, image in sorted(planner.images.items())]
        views = [view for _, view in files]
        staging = self._staging.get(kind)
        kept = planner.copy_order
        got = None
        if (kept is not None and kept[0] is staging and len(kept[1]) == len(views)
                and all(a is b for a, b in zip(kept[1], views, strict=True))):
            got = kept[2].apply(copies)
        if got is None:  # first early write over this staging and these blocks
            order = CopyOrder(copies, views)
            planner.copy_order = (staging, views, order)
            got = order.apply(copies)
            assert got is not None
        copies, progress = got
        ahead = WriteAhead(files, progress, timeout_s)
        planner.write_ahead = ahead

        def dcp_dir() -> str | None:
            where = step_dir
            if named is not None:
                named_as = named()
                if named_as is None:
                    return None
                where = named_as[1]
            return f"{where}/{self.role}"

        # below training, as the persist thread is: the copy beside it is training's stall
        ahead.start(self.storage, dcp_dir, f"raycheckpoint-write-ahead-{self.role}-{self.rank}",
                    before=lambda: _lower_priority(self.persist_nice))
        return copies, progress

    def _end_write_ahead(self, kind: str) -> None:
        """Wait for the early writes of ``kind``'s last snapshot; remove what no persist
        took (:meth:`WriteAhead.end`)."""
        planner = self._planners.get(kind)
        ahead = None if planner is None else planner.write_ahead
        if ahead is not None:
            planner.write_ahead = None
            ahead.end(self.storage)

    def wait_previous(self, timeout: float) -> None:
        """Wait for the previous persist; its error was already reported to the coordinator.

        A persist whose start was deferred and never asked for (the driver died between
        the snapshot and ``start_persist``) is started here, so it cannot block forever.
        """
        if self.pending is not None:
            self.pending.start()
        if self.pending is not None and not self.pending._done.wait(timeout):
            raise TimeoutError(
                f"{self.role}/{self.rank}: previous save {self.pending.save_id} still persisting "
                f"after {timeout}s")

    @torch.no_grad()  # no autograd bookkeeping for the copies from parameters that need grad
    def snapshot(self, *, save_id: str, step_dir: str, kind: str, state: dict[str, Any],
                 extra: dict[str, Any] | None, coordinator: Any,
                 wait_timeout_s: float = 1800.0,
                 assets: dict[str, bytes] | None = None, start: bool = True,
                 overlap: bool = False,
                 named: Callable[[], tuple[str, str] | None] | None = None) -> dict[str, Any]:
        """Stage ``state`` and set up its persist; ``start=False`` defers the persist's start.

        Deferring lets the caller answer its RPC before the persist thread competes with it
        (and with the other ranks' copies): ``start_persist`` then starts it.  With
        ``overlap`` the tensors are copied by a thread started here, and the caller must
        call :meth:`wait_copied` before anything changes them (the optimizer step).

        ``named``: the save is not named yet (``save_id`` and ``step_dir`` are ignored).
        It is called once the copy is made (with ``overlap``, once it has started) and
        returns ``(save_id, step_dir)``, or None when this rank is not to write this save:
        nothing is persisted then and the answer has ``"dropped": True``.  If it raises,
        the error is raised once the copy is over.  If staging fails, the save is refused
        (:meth:`refuse`) and the error raised.
        """
        t0 = time.perf_counter()
        self.wait_previous(wait_timeout_s)
        self._end_write_ahead(kind)  # ended by its persist or snapshot already: never beside
        pending = PendingPersist(save_id)
        if named is not None:  # asked by this thread, and by an early write's
            named = _Once(named)
        try:
            faults.check("worker.snapshot", path=f"{self.role}/{self.rank}")
            staged, copies, ready = self._plan_stage(kind, state)
            copies, progress = self._write_ahead(kind, copies, step_dir, named, wait_timeout_s)
            if overlap:
                threading.Thread(target=self._copy_beside_training,
                                 args=(pending, copies, ready, progress), daemon=True,
                                 name=f"raycheckpoint-copy-{self.role}-{self.rank}").start()
            else:
                t_copy = time.perf_counter()
                self._copy(copies, ready, progress)
                pending.copy_s = time.perf_counter() - t_copy
                pending.copied.set()
        except BaseException as e:
            self.refuse(kind, e, save_id=save_id, step_dir=step_dir, coordinator=coordinator,
                        named=named)
            raise
        if named is not None:
            try:
                got = named()
            except BaseException:
                pending.copied.wait()  # the buffers are the next snapshot's: let the copy end
                self._end_write_ahead(kind)
                raise
            if got is None:
                pending.copied.wait()
                self._end_write_ahead(kind)
                return {"stall_s": time.perf_counter() - t0, "bytes": 0, "dropped": True}
            pending.save_id, step_dir = got
        stall_s = time.perf_counter() - t0
        self._set_up_persist(pending, kind, step_dir, staged, extra, coordinator,
                             dict(assets or {}), start=start, writes_tensors=bool(staged))
        return {"stall_s": stall_s, "bytes": self._staging[kind].bytes}

    def _set_up_persist(self, pending: PendingPersist, kind: str, step_dir: str,
                        staged: dict[str, Any], extra: dict[str, Any] | None, coordinator: Any,
                        assets: dict[str, bytes], *, start: bool, writes_tensors: bool,
                        failed: BaseException | None = None) -> None:
        """Make ``pending`` this saver's persist (its thread started now, or deferred);
        ``writes_tensors``: whether it takes part in DCP's save (a role with no state
        saves its extra state only)."""
        self.pending = pending
        pending._thread = threading.Thread(
            target=self._persist, name=f"raycheckpoint-persist-{self.role}-{self.rank}",
            args=(pending, kind, step_dir, staged, extra, coordinator, assets,
                  self._planners.setdefault(kind, ReusingSavePlanner()), failed,
                  writes_tensors), daemon=True)
        if start:
            pending.start()

    def refuse(self, kind: str, error: BaseException, *, save_id: str, step_dir: str,
               coordinator: Any, named: Callable[[], tuple[str, str] | None] | None = None
               ) -> None:
        """This rank could not stage its state for the save: fail it on every rank at once.

        Its peers that staged are persisting, and wait for this rank in their first
        agreement (:func:`~raycheckpoint.dcp_save.save_state`): without an answer they
        would wait out the process group's timeout, and hold up the next save as long.
        A persist is started here that gives that agreement ``error`` and reports it to
        ``coordinator``.  Nothing is started where the save is not this rank's to write
        (``named`` answers None, or raises).  Call after :meth:`wait_previous`.
        """
        if named is not None:
            try:
                got = named()
            except Exception:  # the save was never named: no peer persists it
                log.debug("%s/%s: a refused save was never named", self.role, self.rank,
                          exc_info=True)
                return
            if got is None:
                return
            save_id, step_dir = got
        pending = PendingPersist(save_id)
        pending.copied.set()
        staging = self._staging.get(kind)
        # whether the peers meet in an agreement: they do where the state holds anything
        # (a role with none saves its extra state only); before a first staging, assume so
        writes_tensors = True if staging is None else not staging.empty
        self._set_up_persist(pending, kind, step_dir, {}, None, coordinator, {}, start=True,
                             failed=error, writes_tensors=writes_tensors)

    def _copy_beside_training(self, pending: PendingPersist,
                              copies: list[tuple[torch.Tensor, torch.Tensor]], ready: Any,
                              progress: CopyProgress | None) -> None:
        """The host copy of an overlapped save, in a thread of its own."""
        t0 = time.perf_counter()
        try:
            faults.check("worker.copy", path=f"{self.role}/{self.rank}")
            self._copy(copies, ready, progress)
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

    def _stage_files_whole(self, kind: str, planner: ReusingSavePlanner, results: list) -> None:
        """After the first save of a plan, move the staged tensors of each large data file
        into one page-aligned block laid out as the file
        (:meth:`~raycheckpoint.dcp_save.ReusingSavePlanner.adopt_image`): later saves
        write it to local disk with ``O_DIRECT`` straight from the block, with no copy
        into a bounce buffer, and hash it a block at a time.

        Only for local storage written with ``O_DIRECT`` and without encryption; not with
        pinned (CUDA) staging, which keeps one pinned buffer per tensor; and not for a
        kind whose buffers another kind shares (a light save's model buffers are the full
        save's): its files are written record by record, and no block is left holding
        memory that moved on.  Runs once per plan, in the persist thread, before the next
        snapshot may start.
        """
        storage = self.storage
        if (self._planners.get(kind) is not planner or planner.tried_images or not storage.is_posix
                or not storage.direct_io or storage.cipher is not None or self.pin_memory):
            return
        planner.tried_images = True
        try:
            owners = {t.data_ptr(): t for t in self._staging[kind].tensors()}
            # no other kind's buffers may move: their planners resolved them
            shared = {id(t) for other, staging in self._staging.items() if other != kind
                      for t in staging.tensors()}
            if any(id(t) in shared for t in owners.values()):
                return
            for name in sorted({r.storage_data.relative_path for r in results}):
                planner.adopt_image(name, results, owners)
        except Exception as e:  # noqa: BLE001 - the files are written record by record then
            log.warning("%s/%s: staging the data files whole failed (%s: %s); they are "
                        "written record by record", self.role, self.rank, type(e).__name__, e)
            planner.forget_tensors()  # some tensors may have moved

    def _persist(self, pending: PendingPersist, kind: str, step_dir: str, staged: dict[str, Any],
                 extra: dict[str, Any] | None, coordinator: Any, assets: dict[str, bytes],
                 planner: ReusingSavePlanner, failed: BaseException | None,
                 writes_tensors: bool) -> None:
        t0 = time.perf_counter()
        _lower_priority(self.persist_nice)
        if planner.write_ahead is not None:  # the snapshot answered: its early write may hash
            planner.write_ahead.progress.release()
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
            if writes_tensors:  # a role without tensors (rollout) saves its extra state only
                writer = HashingStorageWriter(self.storage, f"{step_dir}/{self.role}")
                # raises on every rank of the group if any rank failed
                save_state(staged, writer, planner, self.process_group, failed=failed)
                files = list(writer.written)
            elif failed is not None:
                raise failed
            if extra is not None:
                files.append(self.storage.write_bytes(
                    f"{step_dir}/{rng_file(self.role, self.rank)}", pack(extra), encrypt=True))
            for asset, data in sorted(assets.items()):
                files.append(self.storage.write_bytes(
                    f"{step_dir}/{asset_file(self.role, asset)}", data))
            faults.check("worker.before_report", path=f"{self.role}/{self.rank}")
            pending.files = files
            pending.persist_s = time.perf_counter() - t0
            ray.get(coordinator.report.remote(
                pending.save_id, self.role, self.rank, [f.to_dict() for f in files], None,
                pending.persist_s), timeout=self.report_timeout_s)
            if writes_tensors and planner.reused is not None:
                self._stage_files_whole(kind, planner, writer.results)
        except BaseException as e:  # noqa: BLE001 - kept, reported and re-raised by wait()
            pending.error = e
            text = f"{describe_error(e)}\n{traceback.format_exc(limit=6)}"
            try:
                ray.get(coordinator.report.remote(pending.save_id, self.role, self.rank, [], text,
                                                  None), timeout=self.report_timeout_s)
            except Exception as report_error:  # noqa: BLE001
                e.add_note(f"also failed to report this error to the coordinator: {report_error}")
        finally:
            try:
                ahead, planner.write_ahead = planner.write_ahead, None
                if ahead is not None:
                    ahead.end(self.storage)
            finally:
                pending._done.set()
