"""Writing a data file staged whole while the host copy fills it (an overlapped write).

After a plan's first save, a rank's large data file is staged as one page-aligned block
laid out as the file (:meth:`~raycheckpoint._internal.dcp.shard_plan.ShardPlan.adopt_image`).
At the next snapshot the copy fills that block front to back, tensor by tensor, and a
thread of the saver writes each chunk of the file once the copy has filled it
(:class:`OverlappedWrite`), so the file's write overlaps the copy instead of following
it.  The persist's storage writer then takes the written file in place of writing it
(:meth:`OverlappedWrite.take`); a file it does not take (the plan changed, the save
failed) is removed when the persist ends (:meth:`OverlappedWrite.end`).  The config
option that turns it on and off is ``checkpoint.write_ahead``.

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
from raycheckpoint.storage.direct_io import address

if TYPE_CHECKING:
    from raycheckpoint._internal.lanes import Lane

log = logging.getLogger(__name__)

# a waiting writer is woken at least this often as the copy fills its block
NOTIFY_BYTES = 8 << 20


class CopyFailed(RuntimeError):
    """The host copy into a block failed; its file cannot be written."""


class CopyProgress:
    """How far one host copy has filled each block it copies into.

    Made by :meth:`CopyOrder.apply`; :meth:`copy` makes the copies and tells of each
    point reached, writers call :meth:`wait`.
    """

    def __init__(self, first: list[int], points: list[tuple[int, int, int]]) -> None:
        self._filled = list(first)  # per block: its first bytes that are final
        self._points = points  # (copy index, block, its bytes final once that copy is made)
        self._cond = threading.Condition()
        self._over = False
        self._error: BaseException | None = None
        self._released = False  # the rank may spend a core on hashing (release)

    def copy(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make ``copies`` (in the order :meth:`CopyOrder.apply` gave), telling the
        writers at each point; :meth:`finish` at the end, whatever happens."""
        error = None
        try:
            start = 0
            for at, k, filled in self._points:  # the copies up to a point, then tell of it
                copy_tensors(copies[start:at + 1])
                start = at + 1
                with self._cond:
                    self._filled[k] = filled
                    self._cond.notify_all()
            copy_tensors(copies[start:])
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

    def wait(self, k: int, n: int, timeout: float) -> None:
        """Block until block ``k``'s first ``n`` bytes are final.  Raises
        :class:`CopyFailed` if the copy failed, ``TimeoutError`` after ``timeout``."""
        self._until(lambda: self._over or self._filled[k] >= n,
                    "the host copy still filling a block", timeout)

    def wait_hashing(self, timeout: float) -> None:
        """Block until the copy is over and hashing released.  Raises
        :class:`CopyFailed` if the copy failed, ``TimeoutError`` after ``timeout``."""
        self._until(lambda: self._over and self._released,
                    "hashing a data file written early not released", timeout)


class CopyOrder:
    """The order of a snapshot's copies that fills each block front to back, one block
    after another, the copies into no block last; and the points of that order at which
    the writers are told how far each block is final.  Between two copies into a block
    lie only bytes that no copy changes (records' headers, alignment gaps), final already.

    Built once per staging and blocks (0.8 ms at 788 tensors) and applied at each save.
    """

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]],
                 blocks: list[memoryview]) -> None:
        spans = [(address(b), b.nbytes) for b in blocks]
        inside: list[list[tuple[int, int]]] = [[] for _ in blocks]  # (offset, copy index)
        rest = []
        for i, (dst, _) in enumerate(copies):
            p = dst.data_ptr()
            for k, (base, n) in enumerate(spans):
                if base <= p < base + n:
                    inside[k].append((p - base, i))
                    break
            else:
                rest.append(i)
        self.order: list[int] = []
        self.points: list[tuple[int, int, int]] = []
        self.first: list[int] = []
        self._check: list[tuple[int, int]] = []  # (copy index, destination address)
        for k, got in enumerate(inside):
            got.sort()
            n = spans[k][1]
            self.first.append(got[0][0] if got else n)
            told = self.first[-1]
            for j, (_, i) in enumerate(got):
                filled = got[j + 1][0] if j + 1 < len(got) else n
                if filled - told >= NOTIFY_BYTES or filled == n:
                    self.points.append((len(self.order), k, filled))
                    self._check.append((i, spans[k][0] + got[j][0]))
                    told = filled
                self.order.append(i)
        self.order += rest

    def apply(self, copies: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], CopyProgress] | None:
        """``copies`` in this order, and a progress to make them with; None where they
        are not the copies this order was built for."""
        if len(copies) != len(self.order) or any(copies[i][0].data_ptr() != p
                                                 for i, p in self._check):
            return None
        return ([copies[i] for i in self.order],
                CopyProgress(self.first, self.points))


class OverlappedWrite:
    """The data files one snapshot writes while its host copy fills them.

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
            where = dcp_dir()
            if where is None:
                return
            for k, (file_name, view) in enumerate(self.files):
                rel = f"{where}/{file_name}"
                with storage.open_write(rel, encrypt=True, direct=True) as w:
                    w.write_as_filled(view, lambda n, k=k: self.progress.wait(k, n, self.timeout_s),
                                      lambda: self.progress.wait_hashing(self.timeout_s))
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


def start_early_write(saver: Any, kind: str, copies: list[tuple[torch.Tensor, torch.Tensor]],
                      target: Any, timeout_s: float) -> tuple[list, CopyProgress | None]:
    """Start writing ``saver``'s data files of ``kind`` staged whole while the copy fills
    them (a :class:`~raycheckpoint._internal.shard_saver.ShardSaver`; ``target``: its
    snapshot's :class:`~raycheckpoint._internal.persist.SaveTarget`): their write then
    overlaps the copy, and the persist finds them written.  Returns the copies in the
    order that fills the files front to back, and the progress the copy tells; None
    where no file is written early (the first save of a plan, or its files are written
    record by record)."""
    from raycheckpoint.protocol.paths import CheckpointPaths

    plan = saver.plans.get(kind)
    if not saver.writes_ahead or plan is None or not plan.images or plan.outcome is None:
        return copies, None
    files = [(name, image.view) for name, image in sorted(plan.images.items())]
    views = [view for _, view in files]
    staging = saver.stager.staging.get(kind)
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
    early = saver._early[kind] = OverlappedWrite(files, progress, timeout_s)

    def dcp_dir() -> str | None:
        named = target.named()
        return None if named is None else CheckpointPaths(named[1]).role_dir(saver.role)

    # below training, as the persist is (the lane's level): the copy beside it is
    # training's stall
    early.start(saver.lanes.write_ahead, saver.storage, dcp_dir)
    return copies, progress


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
