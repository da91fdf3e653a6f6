"""ShardPlan: one kind's save plan on one rank, kept from save to save.

It is the one value the saver, DCP's save protocol and the storage writer share (the
writer gets it as an argument, never through attributes of a planner):

* ``planner``: DCP's planner, its plans and resolved tensors computed once
  (:class:`~raycheckpoint._internal.dcp.save_plan.ReusingSavePlanner`);
* ``outcome``: what the last full-protocol save agreed (plans, write results,
  ``.metadata``), for the next saves to agree on instead
  (:mod:`~raycheckpoint._internal.dcp.save`);
* each tensor record's pieces (:meth:`ShardPlan.record_pieces`), the split of the items
  into data files and each file's :class:`~.record_layout.RecordLayout`;
* the data files staged whole (:meth:`ShardPlan.adopt_image`: one page-aligned block
  laid out as the file, written as it lies).

Everything derived from the staged tensors is dropped by :meth:`ShardPlan.forget_tensors`
when they move; the saver drops the whole plan when its buffers change.
"""

from __future__ import annotations

import io
import mmap
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint import SavePlan
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from raycheckpoint._internal.dcp.record_layout import RecordLayout, split_items
from raycheckpoint._internal.dcp.save_plan import ReusingSavePlanner
from raycheckpoint._internal.dcp.torch_records import (
    contiguous_owner,
    record_pieces,
    save_record,
    view_record_pieces,
)
from raycheckpoint.storage.direct_io import DIRECT_ALIGN

# where a data file is staged whole (ShardPlan.adopt_image), each record's tensor data
# starts on a multiple of this in the file (an allocator's alignment)
RECORD_DATA_ALIGN = 64


class ShardPlan:
    """One kind's save plan on one rank (see the module doc)."""

    def __init__(self) -> None:
        self.planner = ReusingSavePlanner()
        self.outcome: Any = None  # save.Outcome of the last full-protocol save, or None
        self._pieces: dict[Any, tuple | None] = {}
        self._split: tuple[SavePlan, list, list] | None = None
        self.layouts: dict[str, tuple[list, RecordLayout | None]] = {}  # file -> (items, layout)
        self.images: dict[str, FileImage] = {}  # data files staged whole (adopt_image)
        self.tried_images = False  # whether the saver has tried to (once per plan)

    def record_pieces(self, write_item: Any) -> tuple | None:
        """The bytes of a tensor item's record as pieces to write, the tensor's own memory in
        the middle: computed once, while that memory is the staged buffer itself.

        None for a non-tensor item, or where the record goes through torch's writer (a
        layout without a template, or a tensor that must be copied to be written whole).
        """
        if write_item.type == WriteItemType.BYTE_IO:
            return None
        if write_item.index not in self._pieces:
            tensor = self.planner.resolve_data(write_item)
            pieces = view_record_pieces(tensor)  # a view into a staging slab
            if pieces is None:
                owner = contiguous_owner(tensor)
                same = owner.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
                pieces = record_pieces(owner) if same else None
            self._pieces[write_item.index] = pieces
        return self._pieces[write_item.index]

    def split(self, plan: SavePlan) -> tuple[list, list]:
        """``plan``'s items as (file 0, file 1) (:func:`~.record_layout.split_items`),
        worked out once for the plan agreed at every save."""
        if self._split is None or self._split[0] is not plan:
            self._split = (plan, *split_items(plan.items))
        return self._split[1], self._split[2]

    def layout(self, file_name: str, items: list) -> RecordLayout | None:
        """The :class:`~.record_layout.RecordLayout` of ``file_name``'s ``items``, made
        once for the same list of items; None where a record goes through torch's writer."""
        known = self.layouts.get(file_name)
        if known is None or known[0] is not items:
            known = self.layouts[file_name] = (items, RecordLayout.of(file_name, items,
                                                                      self.record_pieces))
        return known[1]

    def forget_tensors(self) -> None:
        """Drop everything derived from the staged tensors (resolved tensors, record
        pieces, layouts, images, the copy order, the flattened state): they moved."""
        self.planner.forget_tensors()
        self._pieces.clear()
        self.images.clear()
        self._split = None
        self.layouts.clear()

    def file_image(self, file_name: str, items: list[Any]) -> tuple[memoryview, list] | None:
        """``file_name``'s bytes as one page-aligned block, and the write results they give,
        where the file is staged whole (:meth:`adopt_image`) and its items are still the
        tensors in that block; None otherwise (the file is written record by record)."""
        image = self.images.get(file_name)
        if image is None or len(items) != len(image.indices):
            return None
        for item, index, at in zip(items, image.indices, image.data_ptrs, strict=True):
            if item.index != index or (at is not None
                                       and self.planner.resolve_data(item).data_ptr() != at):
                return None
        return image.view, list(image.results)

    @torch.no_grad()
    def adopt_image(self, file_name: str, results: list[WriteResult],
                    owners: Mapping[int, torch.Tensor]) -> bool:
        """Move the staged tensors of data file ``file_name`` into one page-aligned block
        that holds the file's exact bytes, records' headers included, so that later saves
        write the file straight from it (no copy into a bounce buffer: see
        :class:`~raycheckpoint.storage.direct_io.DirectFile`).

        In the block each record is placed so that its tensor's data starts on a multiple
        of :data:`RECORD_DATA_ALIGN` (zeros in between, which no reader reads: an item is
        read at the offset its write result records), so the tensors moved there are
        aligned as an allocator's are.  The next save's write results, and so
        ``.metadata``, change once for that; DCP's readers read the file as before.

        ``results``: the write results of the save just made with this planner;
        ``owners``: the staged tensors (what the host copy writes into) by data pointer.
        Each is moved with ``Tensor.set_``, so every holder of the tensor sees the block;
        no other planner may have resolved them (the caller moves no buffers that another
        kind of save shares).  Returns False, moving nothing, where the file is not all
        tensor records of this planner's pieces, or a tensor is not the whole of its owner.
        """
        mine = [r for r in results if r.storage_data.relative_path == file_name]
        moves: list[tuple[torch.Tensor | None, int, bytes, bytes]] = []
        placed: list[WriteResult] = []
        at = 0
        for r in mine:
            pieces = self._pieces.get(r.index)
            tensor = self.planner.resolved(r.index)
            if tensor is None:
                return False
            if pieces is None and tensor.numel() == 0:  # an empty shard (uneven sharding)
                record = io.BytesIO()
                save_record(contiguous_owner(tensor), record)
                pieces = (record.getvalue(), memoryview(b""), b"")
            if pieces is None:
                return False
            head, data, tail = pieces
            length = len(head) + data.nbytes + len(tail)
            if not data.nbytes:  # no tensor data: the record's bytes only, anywhere
                if length != r.storage_data.length:
                    return False
                placed.append(replace(r, storage_data=replace(r.storage_data, offset=at)))
                moves.append((None, at + len(head), bytes(head), bytes(tail)))
                at += length
                continue
            at += -(at + len(head)) % RECORD_DATA_ALIGN
            placed.append(replace(r, storage_data=replace(r.storage_data, offset=at)))
            owner = owners.get(tensor.data_ptr())
            # the owner itself is moved: it must be what the item resolves to (or its base),
            # never a view, or the item would go on reading the memory left behind
            if (owner is None or owner._base is not None
                    or (tensor is not owner and tensor._base is not owner)
                    or not owner.is_contiguous() or owner.requires_grad
                    or owner.numel() * owner.element_size() != data.nbytes
                    or RECORD_DATA_ALIGN % owner.element_size()
                    or length != r.storage_data.length):
                return False
            moves.append((owner, at + len(head), bytes(head), bytes(tail)))
            at += length
        if not moves:
            return False
        self.forget_tensors()  # the pieces view the old memory, freed as the tensors move
        del tensor, pieces, head, data, tail
        block = mmap.mmap(-1, -(-at // DIRECT_ALIGN) * DIRECT_ALIGN)
        flat = torch.frombuffer(block, dtype=torch.uint8)
        ptrs: list[int | None] = []
        for owner, start, head, tail in moves:
            size = 0 if owner is None else owner.numel() * owner.element_size()
            block[start - len(head):start] = head
            block[start + size:start + size + len(tail)] = tail
            if owner is None:
                ptrs.append(None)
                continue
            flat[start:start + size].copy_(owner.reshape(-1).view(torch.uint8))
            owner.set_(flat.untyped_storage(), start // owner.element_size(), owner.size(),
                       owner.stride())
            ptrs.append(owner.data_ptr())
        self.images[file_name] = FileImage(block, memoryview(block)[:at],
                                        [r.index for r in mine], ptrs, placed)
        return True


@dataclass
class FileImage:
    """A data file staged whole: its block, the file's bytes in it, and per record (in
    write order) the item, where its tensor's data lies, and its write result."""

    block: mmap.mmap
    view: memoryview
    indices: list[Any]
    data_ptrs: list[int | None]  # None: an empty tensor
    results: list[WriteResult]
