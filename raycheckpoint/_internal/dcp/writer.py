"""torch DCP StorageWriter over :class:`~raycheckpoint.storage.Storage`.

The files are torch's own DCP format (``__<rank>_0.distcp``, and for a rank's small items
``__<rank>_1.distcp``, holding ``torch.save``d items at recorded offsets, plus a pickled
``.metadata``), so an unencrypted role directory also opens with
``torch.distributed.checkpoint.FileSystemReader``; :mod:`~raycheckpoint._internal.dcp.reader`
reads it back, verified.

What this layer adds: every file is written through a
:class:`~raycheckpoint.storage.HashingWriter`, and the writer keeps the resulting
:class:`~raycheckpoint.storage.FileEntry` list in ``written`` for the worker to report
to the coordinator.  Given the rank's
:class:`~raycheckpoint._internal.dcp.shard_plan.ShardPlan` (the one value a saver shares
with it), a file's records are written in a few ``os.writev`` calls
(:class:`~raycheckpoint._internal.dcp.record_layout.RecordLayout`), a file staged whole
is written as it lies, and a file the snapshot already wrote while its copy filled it
(``early``: :class:`~raycheckpoint._internal.overlapped_write.OverlappedWrite`) is taken
as written.

DCP call order (all ranks unless noted): ``reset`` -> ``set_up_storage_writer`` ->
``prepare_local_plan`` -> (coordinator) ``prepare_global_plan`` -> ``write_data`` ->
(coordinator) ``finish``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint import Metadata, SavePlan, SavePlanner, StorageWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from raycheckpoint._internal.dcp.record_layout import split_items
from raycheckpoint._internal.dcp.shard_plan import ShardPlan
from raycheckpoint._internal.dcp.torch_records import contiguous_owner, save_record
from raycheckpoint.protocol.paths import dcp_metadata
from raycheckpoint.storage import FileEntry, Storage

if TYPE_CHECKING:  # the saver hands them over; this layer does not make them
    from raycheckpoint._internal.bounded_write import BoundedBuffer
    from raycheckpoint._internal.overlapped_write import OverlappedWrite

DCP_SUFFIX = ".distcp"


class HashingStorageWriter(StorageWriter):
    """Writes a rank's DCP files under ``dcp_dir`` (one, or two for large and small
    items), hashing while it streams; ``plan``: the rank's plan kept between saves (None:
    each record through torch's writer); ``early``: the files this save's snapshot
    writes early, once its copy has filled them; ``bounded``: the state is the live tensors, their
    data written through this bounded host buffer a chunk at a time
    (:mod:`~raycheckpoint._internal.bounded_write`), released once this rank's data
    files are written."""

    def __init__(self, storage: Storage, dcp_dir: str, plan: ShardPlan | None = None,
                 early: OverlappedWrite | None = None,
                 bounded: BoundedBuffer | None = None) -> None:
        super().__init__()
        self.bounded = bounded
        self.storage = storage
        self.dcp_dir = dcp_dir.rstrip("/")
        self.plan = plan
        self.early = early
        self.written: list[FileEntry] = []
        self.results: list[WriteResult] = []  # this rank's, from the last write_data
        self.metadata_bytes: bytes | None = None  # the coordinator's, from the last finish

    def reset(self, checkpoint_id=None) -> None:
        self.written = []
        self.results = []
        self.metadata_bytes = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items to ``__<rank>_0.distcp``; a rank holding
        :data:`SPLIT_AT_BYTES` or more writes its small items (non-tensor ones, and
        tensors under :data:`SMALL_ITEM_BYTES`) to ``__<rank>_1.distcp`` instead.

        DCP stores an item every rank holds (FSDP2's per-parameter optimizer ``step``, the
        param groups) once, spread over the ranks, so a rank loading into the same world
        size needs a few such items from every other rank's files.  A file's checksum
        covers the whole file, so the reader of a few items hashes all of it: kept apart,
        those items cost a reader a file of kilobytes instead of another rank's shard.
        """
        # the plan of the last save, agreed again: its split worked out once
        large, small = split_items(plan.items) if self.plan is None else self.plan.split(plan)
        results: list[WriteResult] = []
        try:
            for k, items in ((0, large), (1, small)):
                if items:
                    name = f"{plan.storage_data.prefix}{k}{DCP_SUFFIX}"
                    results += (self._write_file(name, items, planner) if self.bounded is None
                                else self._write_bounded(name, items, planner))
        finally:
            if self.bounded is not None:  # the live tensors are read no more
                self.bounded.release()
        self.results = results
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, file_name: str, items: list, planner: SavePlanner) -> list[WriteResult]:
        rel = f"{self.dcp_dir}/{file_name}"
        shard_plan = self.plan
        pieces_of = None if shard_plan is None else shard_plan.record_pieces
        layout = None if shard_plan is None else shard_plan.layout(file_name, items)
        # bytes first, then tensors: the same order torch's writer uses
        items = layout.items if layout is not None else sorted(
            items, key=lambda i: i.type != WriteItemType.BYTE_IO)

        staged_whole = None if shard_plan is None else shard_plan.file_image(file_name, items)
        if self.early is not None:  # written while the snapshot's copy filled its block?
            entry = self.early.take(rel, None if staged_whole is None else staged_whole[0])
            if entry is not None:
                self.written.append(entry)
                return list(staged_whole[1])

        def body(w: Any) -> list[WriteResult]:
            if staged_whole is not None:  # the file's bytes, staged as one block
                w.write_many([staged_whole[0]])
                return list(staged_whole[1])
            if layout is not None:  # every record's pieces known: a few large pieces
                pieces, results = layout.pieces(planner)
                w.write_many(pieces)
                return results
            results: list[WriteResult] = []
            pending: list = []  # records not yet written: one gathered write
            at = 0  # where the next record starts
            for item in items:
                pieces = None if pieces_of is None else pieces_of(item)
                if pieces is not None:
                    length = sum(memoryview(p).nbytes for p in pieces)
                    pending.extend(pieces)
                elif item.type == WriteItemType.BYTE_IO:
                    buf = planner.resolve_data(item).getbuffer()
                    length = buf.nbytes
                    pending.append(buf)
                else:
                    w.write_many(pending)
                    pending = []
                    save_record(contiguous_owner(planner.resolve_data(item)), w)
                    length = w.tell() - at
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(file_name, at, length)))
                at += length
            w.write_many(pending)
            return results

        # the staged tensors stay in host memory until the commit: a failed upload is
        # written again from the start
        return self._write_retried(rel, body)

    def _write_bounded(self, file_name: str, items: list, planner: SavePlanner) -> list[WriteResult]:
        """Write ``file_name`` record by record, each tensor's data through the bounded
        buffer: the bytes :meth:`_write_file` writes for the same values."""
        rel = f"{self.dcp_dir}/{file_name}"
        bounded = self.bounded
        assert bounded is not None
        items = sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO)  # torch's order

        def body(w: Any) -> list[WriteResult]:
            results: list[WriteResult] = []
            for item in items:
                at = w.tell()
                if item.type == WriteItemType.BYTE_IO:
                    w.write_many([planner.resolve_data(item).getbuffer()])
                else:
                    bounded.write_record(planner.resolve_data(item), w)
                length = w.tell() - at
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(file_name, at, length)))
            return results

        # the live tensors are held until the buffer is released: a failed upload is
        # written again from the start
        return self._write_retried(rel, body)

    def _write_retried(self, rel: str, body: Callable[[Any], list[WriteResult]]
                       ) -> list[WriteResult]:
        """Write file ``rel`` with ``body(w)`` (which returns its records' results),
        from the start again where the storage retries; its entry joins :attr:`written`."""
        def write_file() -> tuple[list[WriteResult], FileEntry]:
            w = self.storage.open_write(rel, encrypt=True, direct=True)
            try:
                with w:
                    results = body(w)
            except Exception as e:
                if w.error is not None and w.error is not e:
                    raise w.error from e  # the real cause, not torch's rewording of it
                raise
            return results, w.close()

        results, entry = self.storage.retrying("write", rel, write_file)
        self.written.append(entry)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        self.write_metadata(pickle.dumps(metadata))

    def write_metadata(self, data: bytes) -> None:
        """Write ``.metadata`` (the coordinator's part of finishing a save) from its bytes."""
        self.written.append(
            self.storage.write_bytes(dcp_metadata(self.dcp_dir), data, encrypt=True))
        self.metadata_bytes = data

    def storage_meta(self) -> StorageMeta | None:
        """Nothing of one save in particular: ``.metadata`` then stays the same bytes from
        save to save (:mod:`~raycheckpoint._internal.dcp.save` reuses them).  Which checkpoint this
        is, the manifest and ``trainer_state.json`` say."""
        return StorageMeta()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False
