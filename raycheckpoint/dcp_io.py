"""torch DCP StorageWriter over :class:`~raycheckpoint.storage.Storage`.

The files are torch's own DCP format (``__<rank>_0.distcp``, and for a rank's small items
``__<rank>_1.distcp``, holding ``torch.save``d items at recorded offsets, plus a pickled
``.metadata``), so an unencrypted role directory also opens with
``torch.distributed.checkpoint.FileSystemReader``; :mod:`raycheckpoint.dcp_read` reads
it back, verified.

What this layer adds: every file is written through a
:class:`~raycheckpoint.storage.HashingWriter`, and the writer keeps the resulting
:class:`~raycheckpoint.storage.FileEntry` list in ``written`` for the worker to report
to the coordinator; a planner that keeps each record's pieces
(:class:`~raycheckpoint.dcp_save.ReusingSavePlanner`) has a file's records written in a
few ``os.writev`` calls (:class:`RecordLayout`).

DCP call order (all ranks unless noted): ``reset`` -> ``set_up_storage_writer`` ->
``prepare_local_plan`` -> (coordinator) ``prepare_global_plan`` -> ``write_data`` ->
(coordinator) ``finish``.
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any

from torch.distributed.checkpoint import Metadata, SavePlan, SavePlanner, StorageWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from raycheckpoint.format import DCP_METADATA
from raycheckpoint.records import contiguous_owner, save_record
from raycheckpoint.storage import FileEntry, Storage

DCP_SUFFIX = ".distcp"
# a rank whose items reach SPLIT_AT_BYTES writes its items under SMALL_ITEM_BYTES (and its
# non-tensor items) to a file of their own (HashingStorageWriter.write_data)
SPLIT_AT_BYTES = 16 << 20
SMALL_ITEM_BYTES = 64 << 10


class HashingStorageWriter(StorageWriter):
    """Writes a rank's DCP files under ``dcp_dir`` (one, or two for large and small
    items), hashing while it streams."""

    def __init__(self, storage: Storage, dcp_dir: str) -> None:
        super().__init__()
        self.storage = storage
        self.dcp_dir = dcp_dir.rstrip("/")
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
        # a planner that keeps each record's pieces between saves (dcp_save.ReusingSavePlanner)
        pieces_of = getattr(planner, "record_pieces", None)
        memo = getattr(planner, "writer_memo", None)  # and what is derived from them
        split = None if memo is None else memo.get("split")
        if split is not None and split[0] is plan:  # the plan of the last save, agreed again
            large, small = split[1], split[2]
        else:
            large, small = _split_items(plan.items)
            if memo is not None:
                memo["split"] = (plan, large, small)
        results: list[WriteResult] = []
        for k, items in ((0, large), (1, small)):
            if items:
                results += self._write_file(f"{plan.storage_data.prefix}{k}{DCP_SUFFIX}",
                                            items, planner, pieces_of, memo)
        self.results = results
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, file_name: str, items: list, planner: SavePlanner,
                    pieces_of: Any, memo: dict | None = None) -> list[WriteResult]:
        rel = f"{self.dcp_dir}/{file_name}"
        layout = None
        if memo is not None and pieces_of is not None:
            known = memo.get(("layout", file_name))
            if known is not None and known[0] is items:
                layout = known[1]
            else:
                layout = RecordLayout.of(file_name, items, pieces_of)
                memo[("layout", file_name)] = (items, layout)
        # bytes first, then tensors: the same order torch's writer uses
        items = layout.items if layout is not None else sorted(
            items, key=lambda i: i.type != WriteItemType.BYTE_IO)

        image = getattr(planner, "file_image", None)
        staged_whole = None if image is None else image(file_name, items)
        ahead = getattr(planner, "write_ahead", None)
        if ahead is not None:  # written while the snapshot's copy filled its block?
            entry = ahead.take(rel, None if staged_whole is None else staged_whole[0])
            if entry is not None:
                self.written.append(entry)
                return list(staged_whole[1])

        def write_file() -> tuple[list[WriteResult], FileEntry]:
            results: list[WriteResult] = []
            w = self.storage.open_write(rel, encrypt=True, direct=True)
            try:
                if staged_whole is not None:  # the file's bytes, staged as one block
                    with w:
                        w.write_many([staged_whole[0]])
                    return list(staged_whole[1]), w.close()
                if layout is not None:  # every record's pieces known: a few large pieces
                    pieces, results = layout.pieces(planner)
                    with w:
                        w.write_many(pieces)
                    return results, w.close()
                with w:
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
            except Exception as e:
                if w.error is not None and w.error is not e:
                    raise w.error from e  # the real cause, not torch's rewording of it
                raise
            return results, w.close()

        # the staged tensors stay in host memory until the commit: a failed upload is
        # written again from the start
        results, entry = self.storage.retrying(f"write {rel}", write_file)
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
            self.storage.write_bytes(f"{self.dcp_dir}/{DCP_METADATA}", data, encrypt=True))
        self.metadata_bytes = data

    def storage_meta(self) -> StorageMeta | None:
        """Nothing of one save in particular: ``.metadata`` then stays the same bytes from
        save to save (:mod:`raycheckpoint.dcp_save` reuses them).  Which checkpoint this
        is, the manifest and ``trainer_state.json`` say."""
        return StorageMeta()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def _split_items(items: list) -> tuple[list, list]:
    """A rank's write items as (file 0, file 1): see :meth:`HashingStorageWriter.write_data`."""
    large, small, total = [], [], 0
    for item in items:
        size = item.tensor_storage_size() if item.type != WriteItemType.BYTE_IO else None
        (small if size is None or size < SMALL_ITEM_BYTES else large).append(item)
        total += size or 0
    if not large or total < SPLIT_AT_BYTES:
        return list(items), []
    return large, small


# how a RecordLayout writes a segment: pieces as they are, small records copied into one
# piece, a non-tensor item's record (resolved anew each save)
_AS_IS, _JOINED, _FRESH = range(3)
# records with less tensor data than this are copied together, in runs of up to
# JOIN_RUN_BYTES, into one piece at each write
JOIN_RECORD_BYTES = 64 << 10
JOIN_RUN_BYTES = 4 << 20


class RecordLayout:
    """A data file written record by record whose tensor records' pieces a planner keeps
    (:meth:`~raycheckpoint.dcp_save.ReusingSavePlanner.record_pieces`), laid out once.

    Written item by item, a file of 600 small records (layer norms, biases and their
    optimizer state) cost 4-6 ms of Python per save, and its ~1,800 pieces as many
    iovecs and checksum updates.  The layout keeps, in write order (non-tensor items
    first, as torch's writer has them), runs of small records to copy together into one
    piece, large records' pieces as they are, and the non-tensor items, whose records are
    made anew at each write; and the write results of the last write, which stand as long
    as the non-tensor records keep their lengths.  The pieces view the staged tensors: a
    layout is dropped with them (``writer_memo``).
    """

    def __init__(self, file_name: str, items: list,
                 segments: list[tuple[int, Any]], lengths: list[int | None]) -> None:
        self.file_name, self.items = file_name, items
        self.segments = segments
        self._lengths = lengths  # per item, None for a non-tensor one
        self._fresh_lengths: list[int] | None = None  # those, at the last write
        self._results: list[WriteResult] = []

    @classmethod
    def of(cls, file_name: str, items: list, pieces_of: Any) -> RecordLayout | None:
        """The layout of ``items``, or None where a record goes through torch's writer."""
        items = sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO)
        segments: list[tuple[int, Any]] = []
        lengths: list[int | None] = []
        run: list = []
        run_bytes = 0
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                segments.append((_FRESH, item))
                lengths.append(None)
                continue
            pieces = pieces_of(item)
            if pieces is None:
                return None
            length = sum(memoryview(p).nbytes for p in pieces)
            lengths.append(length)
            if memoryview(pieces[1]).nbytes >= JOIN_RECORD_BYTES:
                if run:
                    segments.append((_JOINED, tuple(run)))
                    run, run_bytes = [], 0
                segments.append((_AS_IS, tuple(pieces)))
                continue
            run.extend(pieces)
            run_bytes += length
            if run_bytes >= JOIN_RUN_BYTES:
                segments.append((_JOINED, tuple(run)))
                run, run_bytes = [], 0
        if run:
            segments.append((_JOINED, tuple(run)))
        return cls(file_name, items, segments, lengths)

    def pieces(self, planner: SavePlanner) -> tuple[list, list[WriteResult]]:
        """The file's bytes now, as pieces, and the write results they give."""
        out: list = []
        fresh: list[int] = []
        for how, segment in self.segments:
            if how == _AS_IS:
                out.extend(segment)
            elif how == _JOINED:
                out.append(b"".join(segment))
            else:
                buf = planner.resolve_data(segment).getbuffer()
                out.append(buf)
                fresh.append(buf.nbytes)
        if fresh != self._fresh_lengths:
            lengths = iter(fresh)
            self._results, at = [], 0
            for item, length in zip(self.items, self._lengths, strict=True):
                length = next(lengths) if length is None else length
                self._results.append(WriteResult(
                    index=item.index, size_in_bytes=length,
                    storage_data=_StorageInfo(self.file_name, at, length)))
                at += length
            self._fresh_lengths = fresh
        return out, list(self._results)
