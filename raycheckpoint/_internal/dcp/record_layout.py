"""How a rank's DCP items are laid out in its data files, and each file's records as
pieces to write.

:func:`split_items` decides which items go to the rank's file 0 (large tensors) and
which to file 1 (small items); :class:`RecordLayout` keeps a file written record by
record as a few large pieces, laid out once.  Both are derived from a plan that does
not change between saves, and are kept in the saver's
:class:`~raycheckpoint._internal.dcp.shard_plan.ShardPlan`.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import SavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

# a rank whose items reach SPLIT_AT_BYTES writes its items under SMALL_ITEM_BYTES (and its
# non-tensor items) to a file of their own (HashingStorageWriter.write_data)
SPLIT_AT_BYTES = 16 << 20
SMALL_ITEM_BYTES = 64 << 10


def split_items(items: list) -> tuple[list, list]:
    """A rank's write items as (file 0, file 1): see
    :meth:`~raycheckpoint._internal.dcp.writer.HashingStorageWriter.write_data`."""
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
    (:meth:`~raycheckpoint._internal.dcp.shard_plan.ShardPlan.record_pieces`), laid out once.

    Written item by item, a file of 600 small records (layer norms, biases and their
    optimizer state) cost 4-6 ms of Python per save, and its ~1,800 pieces as many
    iovecs and checksum updates.  The layout keeps, in write order (non-tensor items
    first, as torch's writer has them), runs of small records to copy together into one
    piece, large records' pieces as they are, and the non-tensor items, whose records are
    made anew at each write; and the write results of the last write, which stand as long
    as the non-tensor records keep their lengths.  The pieces view the staged tensors: a
    layout is dropped with them (:meth:`ShardPlan.forget_tensors
    <raycheckpoint._internal.dcp.shard_plan.ShardPlan.forget_tensors>`).
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
