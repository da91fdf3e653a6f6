"""DCP's save protocol for a saver that saves the same structure again and again.

``torch.distributed.checkpoint.save`` runs its whole protocol at every save: every rank
pickles its local plan (one write item per tensor) and gathers it on the coordinator,
which builds the global plan and scatters it back; after writing, every rank's write
results are gathered (pickled again), the coordinator pickles ``.metadata``, and the
outcome is broadcast.  For a rank of 788 tensors on gloo that exchange took 0.25 s of
a 0.45 s persist of 60 MB, more than writing the bytes.  A worker's staged state keeps
its structure, shapes and shard offsets from save to save, so all of it comes out the
same every time.

:func:`save_state` runs DCP's full protocol (``dcp.save``) the first time and whenever
anything may have changed, and keeps what it produced in the :class:`ReusingSavePlanner`:
this rank's final plan and write results, and on the coordinator the global metadata
and the ``.metadata`` bytes.  Later saves agree instead, with one all-reduce of a
single integer, that every rank still holds that plan, write their data with it, and
agree with a second one whether every rank's write results are the ones before; then
the coordinator writes the same ``.metadata`` bytes.  Results that changed (a non-tensor
value whose pickle grew) are gathered and ``.metadata`` is built anew; a failure on
any rank fails the save on every rank, as DCP's own protocol does, and the next save
runs the full protocol again.  The data files are byte for byte what ``dcp.save`` writes
with the same writer, and ``.metadata`` holds equal metadata.
"""

from __future__ import annotations

import io
import mmap
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import DefaultSavePlanner, Metadata, SavePlan
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from raycheckpoint.direct_io import DIRECT_ALIGN
from raycheckpoint.records import contiguous_owner, record_pieces, save_record

# what a rank says in an agreement (the all-reduce takes the minimum)
FAILED, CHANGED, SAME = 0, 1, 2
# where a data file is staged whole (ReusingSavePlanner.adopt_image), each record's tensor
# data starts on a multiple of this in the file (an allocator's alignment)
RECORD_DATA_ALIGN = 64


class ReusingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, reusing its plans and resolved tensors between saves.

    For a saver that stages into the same host buffers every time: the structure, shapes
    and shard offsets of what it saves do not change, so the local plan (one write item
    per tensor, computed in Python over every DTensor) and each item's resolved local
    tensor are computed once, and so are the pieces of each tensor's record
    (:meth:`record_pieces`) and the flattened state dict (:meth:`set_up_planner`).
    Non-tensor items are resolved anew each save (their values change).
    :func:`save_state` keeps the rest of a save's outcome here too (``reused``).
    The owner must drop the planner when its buffers change.
    """

    def __init__(self) -> None:
        super().__init__()
        self._cached_plan: SavePlan | None = None
        self._resolved: dict[Any, torch.Tensor] = {}
        self._pieces: dict[Any, tuple | None] = {}
        # the last flattened state dict, and where its non-tensor values lie in the nested
        # one (set_up_planner); None until a state without ShardedTensors was flattened
        self._flat: dict[str, Any] | None = None
        self._value_paths: list[tuple[str, tuple]] = []
        # what a storage writer derives from this planner's plan and record pieces, kept for
        # the next save (:class:`~raycheckpoint.dcp_io.HashingStorageWriter`); emptied
        # whenever the tensors move
        self.writer_memo: dict[Any, Any] = {}
        self.reused: _Outcome | None = None
        self.images: dict[str, _Image] = {}  # data files staged whole (adopt_image)
        self.tried_images = False  # whether the saver has tried to (once per planner)
        # the images' files being written while the snapshot's copy fills them, for the
        # storage writer to take (raycheckpoint._internal.write_ahead.WriteAhead)
        self.write_ahead: Any = None
        # (staging, image views, CopyOrder): the order of the copies over that staging
        # that fills these images front to back (ShardSaver._write_ahead)
        self.copy_order: tuple[Any, list[memoryview], Any] | None = None

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        """DCP's flattening of ``state_dict`` (a dict keyed by dotted paths), done once.

        DCP flattens the nested state dict at every save, walking every leaf in Python
        (3-4 ms of a persist thread's GIL at 800 tensors, on the durable path).  Here the
        tensors are the staged buffers, the same objects at the same paths from save to
        save (the planner's contract), so the last flattened dict is reused and only its
        non-tensor values (learning rates, flags) are read afresh from ``state_dict``.  A
        state whose non-tensor paths no longer resolve is flattened anew.
        """
        if self._flat is not None:
            flat = dict(self._flat)
            try:
                for fqn, path in self._value_paths:
                    value = state_dict
                    for part in path:
                        value = value[part]
                    if isinstance(value, torch.Tensor):
                        raise TypeError(fqn)  # a value turned into a tensor: not this structure
                    flat[fqn] = value
            except (KeyError, IndexError, TypeError):
                self._flat = None
            else:
                self.state_dict, self.is_coordinator = flat, is_coordinator
                return
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        flat = self.state_dict
        if self.flatten_state_dict and not any(isinstance(v, ShardedTensor) for v in flat.values()):
            self._flat = flat
            self._value_paths = [(fqn, self.mappings[fqn]) for fqn, v in flat.items()
                                 if not isinstance(v, torch.Tensor)]

    def create_local_plan(self) -> SavePlan:
        if self._cached_plan is None:
            self._cached_plan = super().create_local_plan()
        self.plan = replace(self._cached_plan, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        tensor = self._resolved.get(write_item.index)
        if tensor is None:
            tensor = self._resolved[write_item.index] = super().resolve_data(write_item)
        return tensor

    def record_pieces(self, write_item: Any) -> tuple | None:
        """The bytes of a tensor item's record as pieces to write, the tensor's own memory in
        the middle: computed once, while that memory is the staged buffer itself.

        None for a non-tensor item, or where the record goes through torch's writer (a
        layout without a template, or a tensor that must be copied to be written whole).
        """
        if write_item.type == WriteItemType.BYTE_IO:
            return None
        if write_item.index not in self._pieces:
            tensor = self.resolve_data(write_item)
            owner = contiguous_owner(tensor)
            same_memory = owner.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
            self._pieces[write_item.index] = record_pieces(owner) if same_memory else None
        return self._pieces[write_item.index]

    def forget_tensors(self) -> None:
        """Drop every resolved tensor, record piece, image and the flattened state: the
        staged tensors moved."""
        self._resolved.clear()
        self._pieces.clear()
        self.images.clear()
        self.copy_order = None
        self._flat = None
        self.writer_memo.clear()

    def file_image(self, file_name: str, items: list[Any]) -> tuple[memoryview, list] | None:
        """``file_name``'s bytes as one page-aligned block, and the write results they give,
        where the file is staged whole (:meth:`adopt_image`) and its items are still the
        tensors in that block; None otherwise (the file is written record by record)."""
        image = self.images.get(file_name)
        if image is None or len(items) != len(image.indices):
            return None
        for item, index, at in zip(items, image.indices, image.data_ptrs, strict=True):
            if item.index != index or (at is not None and self.resolve_data(item).data_ptr() != at):
                return None
        return image.view, list(image.results)

    @torch.no_grad()
    def adopt_image(self, file_name: str, results: list[WriteResult],
                    owners: Mapping[int, torch.Tensor]) -> bool:
        """Move the staged tensors of data file ``file_name`` into one page-aligned block
        that holds the file's exact bytes, records' headers included, so that later saves
        write the file straight from it (no copy into a bounce buffer: see
        :class:`~raycheckpoint.direct_io.DirectFile`).

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
            tensor = self._resolved.get(r.index)
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
        self.images[file_name] = _Image(block, memoryview(block)[:at],
                                        [r.index for r in mine], ptrs, placed)
        return True


@dataclass
class _Image:
    """A data file staged whole: its block, the file's bytes in it, and per record (in
    write order) the item, where its tensor's data lies, and its write result."""

    block: mmap.mmap
    view: memoryview
    indices: list[Any]
    data_ptrs: list[int | None]  # None: an empty tensor
    results: list[WriteResult]


class _Outcome:
    """What a full-protocol save produced that the next saves can reuse."""

    def __init__(self, local_plan: SavePlan, final_plan: SavePlan, results: list[WriteResult],
                 metadata: Metadata | None, metadata_bytes: bytes | None) -> None:
        self.local_plan = local_plan  # the cached local plan it was agreed for
        self.final_plan = final_plan
        self.results = results
        self.metadata = metadata  # the coordinator's (global); None elsewhere
        self.metadata_bytes = metadata_bytes


def _agree(value: int, group: Any) -> int:
    """The minimum of ``value`` over the group's ranks (``value`` itself without one)."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def _raise_failed(what: str, error: BaseException | None, group: Any) -> None:
    """After an agreement some rank failed: every rank learns every rank's error (as DCP's
    own protocol tells them), so whichever rank reports first names the cause.  A rank
    that failed raises its own error; the others raise one naming the failed ranks."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    errors: list[str | None] = [mine]
    if group is not None:
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, mine, group=group)
    if error is not None:
        raise error
    failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None)
    raise RuntimeError(f"{what} failed on another rank of this role ({failed})")


def save_state(state: dict[str, Any], writer: Any, planner: ReusingSavePlanner,
               process_group: Any = None, *, failed: BaseException | None = None) -> None:
    """``dcp.save(state, storage_writer=writer, planner=planner, process_group=...)``,
    with the plans and metadata of the previous save reused where every rank agrees.

    ``writer`` is a :class:`~raycheckpoint.dcp_io.HashingStorageWriter`.  Every rank of
    the group calls this for the same save; an error on any rank raises on every rank.
    ``failed``: this rank cannot save (its state could not be staged, or its host copy
    failed): it takes part in the first agreement only, so that every rank fails the
    save at once instead of waiting for this one, and ``failed`` is raised here.
    """
    group = process_group
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    coordinator = group is None or dist.get_rank(group) == 0
    ready, error = SAME, None
    try:
        if failed is not None:
            raise failed
        writer.reset()
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(),
                               is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator)
        writer.prepare_local_plan(planner.create_local_plan())
        outcome = planner.reused
        if outcome is None or outcome.local_plan is not planner._cached_plan:
            ready = CHANGED
    except BaseException as e:  # noqa: BLE001 - agreed on below, then raised
        ready, error = FAILED, e
    agreed = _agree(ready, group)
    if agreed == FAILED:
        planner.reused = None
        _raise_failed("planning the save", error, group)
    if agreed == CHANGED:  # the full protocol, remembered for the next saves
        planner.reused = None
        metadata = dcp.save(state, storage_writer=writer, planner=planner, process_group=group,
                            no_dist=group is None)
        planner.reused = _Outcome(planner._cached_plan, planner.plan, writer.results,
                                  metadata if coordinator else None,
                                  writer.metadata_bytes if coordinator else None)
        return
    _save_agreed(writer, planner, outcome, group, coordinator)


def _save_agreed(writer: Any, planner: ReusingSavePlanner, outcome: _Outcome, group: Any,
                 coordinator: bool) -> None:
    """Write this rank's data with the agreed plan; then ``.metadata`` on the coordinator."""
    error: BaseException | None = None
    status = FAILED
    try:
        results = writer.write_data(planner.finish_plan(outcome.final_plan), planner).value()
        status = SAME if results == outcome.results else CHANGED
    except BaseException as e:  # noqa: BLE001 - agreed on below, then raised
        error = e
    agreed = _agree(status, group)
    if agreed == FAILED:
        planner.reused = None  # the next save runs the full protocol on every rank
        _raise_failed("writing the shards", error, group)
    try:
        if agreed == CHANGED:  # some rank's offsets moved: build .metadata from everyone's
            gathered = [None] * dist.get_world_size(group) if coordinator and group else None
            if group is not None:
                dist.gather_object(results, gathered, group=group, group_dst=0)
            else:
                gathered = [results]
            if coordinator:
                writer.finish(metadata=outcome.metadata, results=gathered)
                outcome.metadata_bytes = writer.metadata_bytes
            outcome.results = results
        elif coordinator:
            writer.write_metadata(outcome.metadata_bytes)
    except BaseException:
        planner.reused = None
        raise
