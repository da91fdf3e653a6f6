"""Writing a data file staged whole as soon as the host copy has filled it (an early write).

After a plan's first save, a rank's large data file is staged as one page-aligned block
laid out as the file (:meth:`~raycheckpoint._internal.dcp.shard_plan.ShardPlan.adopt_image`).
At the next snapshot the copy fills that block, and once the copy is over a thread of the
saver writes the file from it (:class:`OverlappedWrite`) while the rank answers and its
persist starts, so the file's write overlaps the persist's agreements instead of
following them.  The persist's storage writer then takes the written file in place of
writing it (:meth:`OverlappedWrite.take`); a file it does not take (the plan changed, the
save failed) is removed when the persist ends (:meth:`OverlappedWrite.end`).  The config
option that turns it on and off is ``checkpoint.write_ahead``.

The write never runs beside the copy.  A block is staged whole only where the staging is
not pinned (:func:`stage_files_whole`), so the copy is the host's own, on its cores and
memory bus; writing each chunk as the copy filled it lengthened that copy, training's
blocked time, by 1.1-2.2x on a 2-core host (2 x 134 MB riding on the step: 24 ms against
11 ms with the write after the copy), and made the save durable no sooner.

Only the bytes are written early: what the file is for (DCP's agreement, ``.metadata``,
the report and the commit) is unchanged, and a file whose early write failed is written
again by the usual path.  The file lies in the save's uncommitted step directory like
every other, invisible until the commit.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from raycheckpoint._internal.staging import copy_tensors

if TYPE_CHECKING:
    from raycheckpoint._internal.lanes import Lane

log = logging.getLogger(__name__)


class CopyFailed(RuntimeError):
    """The host copy into a block failed; its file cannot be written."""


class CopyProgress:
    """Whether one host copy is over, and whether hashing may start.

    The snapshot makes the copy through :meth:`copy` (or tells :meth:`finish`); the
    early write waits for it (:meth:`wait`), its hashing for the release too.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._over = False
        self._error: BaseException | None = None
        self._released = False  # the rank may spend a core on hashing (release)

    def copy(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make ``copies``; :meth:`finish` at the end, whatever happens."""
        error = None
        try:
            copy_tensors(copies)
        except BaseException as e:
            error = e
            raise
        finally:
            self.finish(error)

    def finish(self, error: BaseException | None = None) -> None:
        """The copy is over (``error``: it failed)."""
        with self._cond:
            self._over, self._error = True, error
            self._cond.notify_all()

    def release(self) -> None:
        """Hashing may start once the copy is over: the snapshot has answered, and its
        persist is started (until then a core spent on hashing would slow this rank's
        answer and the other ranks' copies)."""
        with self._cond:
            self._released = True
            self._cond.notify_all()

    def _until(self, done: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._error is None and not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what} after {timeout}s")
                self._cond.wait(left)
            if self._error is not None:
                raise CopyFailed(f"the host copy failed: {self._error!r}") from self._error

    def wait(self, timeout: float) -> None:
        """Block until the copy is over.  Raises :class:`CopyFailed` if it failed,
        ``TimeoutError`` after ``timeout``."""
        self._until(lambda: self._over, "the host copy still filling a block", timeout)

    def wait_hashing(self, timeout: float) -> None:
        """Block until the copy is over and hashing released.  Raises
        :class:`CopyFailed` if the copy failed, ``TimeoutError`` after ``timeout``."""
        self._until(lambda: self._over and self._released,
                    "hashing a data file written early not released", timeout)


class OverlappedWrite:
    """The data files one snapshot writes once its host copy has filled them.

    ``files``: (file name, block view) of the files staged whole; ``dcp_dir``: called in
    the writing thread, returns the directory the save's DCP files go to, or None where
    this rank is not to write the save (nothing is written then).
    """

    def __init__(self, files: list[tuple[str, memoryview]], progress: CopyProgress,
                 timeout_s: float) -> None:
        self.files = files
        self.progress = progress
        self.timeout_s = timeout_s
        self.written: dict[str, tuple[memoryview, Any]] = {}  # rel -> (block, FileEntry)
        self.error: BaseException | None = None
        self._done = threading.Event()

    def start(self, lane: Lane, storage: Any, dcp_dir: Callable[[], str | None]) -> None:
        """Write the files on ``lane`` (a :class:`~raycheckpoint._internal.lanes.Lane`)."""
        lane.submit(functools.partial(self._run, storage, dcp_dir))

    def _run(self, storage: Any, dcp_dir: Callable[[], str | None]) -> None:
        rel = None
        try:
            # nothing beside the copy: not even the step directory's name or the open
            self.progress.wait(self.timeout_s)
            where = dcp_dir()
            if where is None:
                return
            for file_name, view in self.files:
                rel = f"{where}/{file_name}"
                with storage.open_write(rel, encrypt=True, direct=True) as w:
                    w.write_block(view, lambda: self.progress.wait_hashing(self.timeout_s))
                self.written[rel] = (view, w.close())
        except BaseException as e:  # noqa: BLE001 - the file is written by the usual path then
            self.error = e
            if rel is not None and rel not in self.written:
                self._remove(storage, rel)  # what it wrote of the file
        finally:
            self._done.set()

    @staticmethod
    def _remove(storage: Any, rel: str) -> None:
        try:
            storage.delete(rel)
        except Exception:  # the step directory is aborted as a whole
            log.debug("could not remove an unused early write %s", rel, exc_info=True)

    def _wait(self) -> None:
        if not self._done.wait(self.timeout_s):
            raise TimeoutError(f"a data file's early write still running after {self.timeout_s}s")

    def take(self, rel: str, block: memoryview | None) -> Any:
        """The entry of ``rel`` written from ``block``, or None (then write it as usual).
        Waits for the early writes to end first, so none runs beside the usual write
        (their hashing released: the persist asking is running)."""
        self.progress.release()
        self._wait()
        got = self.written.pop(rel, None)
        if got is None:
            if self.error is not None and not isinstance(self.error, CopyFailed):
                log.debug("early write before %s failed; written again", rel,
                          exc_info=self.error)
            return None
        view, entry = got
        return entry if view is block else None

    def end(self, storage: Any) -> None:
        """Wait for the early writes; remove each file that no storage writer took."""
        self.progress.release()
        self._wait()
        for rel in list(self.written):
            self._remove(storage, rel)
        self.written.clear()


def start_early_write(saver: Any, kind: str, target: Any, timeout_s: float
                      ) -> CopyProgress | None:
    """Hand ``saver``'s data files of ``kind`` staged whole to its early-write lane, to be
    written once the snapshot's copy is over (a
    :class:`~raycheckpoint._internal.shard_saver.ShardSaver`; ``target``: its snapshot's
    :class:`~raycheckpoint._internal.persist.SaveTarget`): the persist then finds them
    written.  Returns the progress the copy must tell; None where no file is written
    early (the first save of a plan, or its files are written record by record)."""
    from raycheckpoint.protocol.paths import CheckpointPaths

    plan = saver.plans.get(kind)
    if not saver.writes_ahead or plan is None or not plan.images or plan.outcome is None:
        return None
    files = [(name, image.view) for name, image in sorted(plan.images.items())]
    progress = CopyProgress()
    early = saver._early[kind] = OverlappedWrite(files, progress, timeout_s)

    def dcp_dir() -> str | None:
        named = target.named()
        return None if named is None else CheckpointPaths(named[1]).role_dir(saver.role)

    # below training, as the persist is (the lane's level)
    early.start(saver.lanes.write_ahead, saver.storage, dcp_dir)
    return progress


def stage_files_whole(saver: Any, kind: str, plan: Any, results: list) -> bool:
    """After the first save of a plan, move ``saver``'s staged tensors of each large data
    file of ``kind`` into one page-aligned block laid out as the file
    (:meth:`~raycheckpoint._internal.dcp.shard_plan.ShardPlan.adopt_image`): later
    saves write it to local disk with ``O_DIRECT`` straight from the block, with no
    copy into a bounce buffer, and hash it a block at a time.  Returns whether any
    tensor moved.

    Only where the storage writes with ``O_DIRECT`` and without encryption; not with
    pinned (CUDA) staging, whose slab stays page-locked as it is; and not for a kind
    whose buffers another kind shares (a light save's model buffers are the full
    save's): its files are written record by record, and no block is left holding
    memory that moved on.  Runs once per plan, in the persist thread, before the next
    snapshot may start.
    """
    storage = saver.storage
    if (saver.plans.get(kind) is not plan or plan.tried_images or not storage.writes_direct
            or storage.cipher is not None or saver.pin_memory):
        return False
    plan.tried_images = True
    try:
        owners = {t.data_ptr(): t for t in saver.stager.staging[kind].tensors()}
        # no other kind's buffers may move: their plans resolved them
        shared = {id(t) for other, staging in saver.stager.staging.items() if other != kind
                  for t in staging.tensors()}
        if any(id(t) in shared for t in owners.values()):
            return False
        moved = False
        for name in sorted({r.storage_data.relative_path for r in results}):
            moved = plan.adopt_image(name, results, owners) or moved
        return moved
    except Exception as e:  # noqa: BLE001 - the files are written record by record then
        log.warning("%s/%s: staging the data files whole failed (%s: %s); they are "
                    "written record by record", saver.role, saver.rank, type(e).__name__, e)
        plan.forget_tensors()  # some tensors may have moved
        return True
