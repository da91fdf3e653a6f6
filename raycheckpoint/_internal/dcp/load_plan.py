"""DCP's load plan, worked out once per distinct tensor layout, and its copies.

``dcp.load`` plans before it reads: for every tensor of the state dict, DCP's default
planner works out which part of the tensor this rank holds
(``compute_local_shape_and_global_offset`` for a DTensor) and which saved chunks overlap
it (``create_read_items_for_chunk_list``).  At 788 tensors a rank that took 40-50 ms of a
resharded load's ~240 ms, with the disk idle, and it is the same arithmetic over and over:
a model's layers repeat a handful of shapes, and every tensor of one shape is split the
same way, at save and at load.

:class:`LayoutCachingLoadPlanner` asks DCP's own functions once per distinct layout and
gives every other tensor of that layout the same answer under its own name.  A layout is
everything DCP's answer depends on: for the local part, the global shape, the device mesh
and the placements (a plain tensor: its shape); for the reads, the saved chunks' offsets
and sizes and the local chunks'.  The plan is item for item the one DCP's
:class:`~torch.distributed.checkpoint.DefaultLoadPlanner` makes; anything outside the
common cases (a key the checkpoint lacks, sharded tensors, non-tensor items) goes to DCP's
own code unchanged.  Nothing outlives one load.

:func:`copy_run` then copies most items with one ``memmove`` each, where DCP's way is
half a dozen torch calls an item.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan, Metadata
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import (
    _create_chunk_list,
    _create_read_items,
    create_read_items_for_chunk_list,
)
from torch.distributed.tensor import DTensor

# a read item of a layout, less its name: (type, dest chunk offsets, dest chunk index,
# dest offsets, saved chunk offsets, saved chunk index, storage offsets, lengths)
_Pattern = tuple[Any, Any, Any, torch.Size, Any, Any, torch.Size, torch.Size]
_UNCACHED: list = []  # a tensor kind whose local chunks depend on more than its layout


class LayoutCachingLoadPlanner(DefaultLoadPlanner):
    """A :class:`~torch.distributed.checkpoint.DefaultLoadPlanner` whose local plan is
    computed once per distinct tensor layout (:func:`local_load_plan`)."""

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise AssertionError("create_local_plan needs the checkpoint's metadata")
        if self.flatten_state_dict and not self.metadata.state_dict_metadata.keys() <= (
                self.state_dict.keys()):
            # keys the state dict lacks: DCP tells an older checkpoint's key format from
            # a partial load, and may switch to that format first
            return super().create_local_plan()
        return local_load_plan(self.state_dict, self.metadata, strict=not self.allow_partial_load)


def local_load_plan(state_dict: dict[str, Any], metadata: Metadata, *,
                    strict: bool = True) -> LoadPlan:
    """What ``create_default_local_load_plan(state_dict, metadata, strict)`` returns,
    asking DCP once per distinct layout."""
    local_memo: dict[tuple, list] = {}
    mesh_memo: dict[int, bool] = {}
    read_memo: dict[tuple, list[_Pattern]] = {}
    requests: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        md = metadata.state_dict_metadata.get(fqn)
        if md is None:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        if (isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None
                and md.size != obj.size()):
            raise ValueError(
                f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        if isinstance(obj, DTensor) and not _on_mesh(obj, mesh_memo):
            continue  # a DTensor on a mesh this rank is not part of
        local = (_local_chunks(obj, local_memo)
                 if isinstance(md, TensorStorageMetadata) and isinstance(obj, torch.Tensor)
                 else _UNCACHED)
        if local is _UNCACHED:
            requests += _create_read_items(fqn, md, obj)  # DCP's own, with its checks
            continue
        key = (tuple((c.offsets, c.sizes) for c in md.chunks),
               tuple((c.offsets, c.sizes) for c in local))
        patterns = read_memo.get(key)
        if patterns is None:
            patterns = read_memo[key] = [
                (r.type, r.dest_index.offset, r.dest_index.index, r.dest_offsets,
                 r.storage_index.offset, r.storage_index.index, r.storage_offsets, r.lengths)
                for r in create_read_items_for_chunk_list(fqn, md, local)]
        requests += [ReadItem(type=kind, dest_index=MetadataIndex(fqn, d_off, d_idx),
                              dest_offsets=d_offsets,
                              storage_index=MetadataIndex(fqn, s_off, s_idx),
                              storage_offsets=s_offsets, lengths=lengths)
                     for kind, d_off, d_idx, d_offsets, s_off, s_idx, s_offsets, lengths
                     in patterns]
    return LoadPlan(requests)


def _on_mesh(obj: DTensor, memo: dict[int, bool]) -> bool:
    """Whether this rank is part of ``obj``'s device mesh (DCP skips the DTensors of a
    mesh it is not part of); the mesh object stays alive while the state dict does."""
    mesh = obj.device_mesh
    if id(mesh) not in memo:
        memo[id(mesh)] = mesh.get_coordinate() is not None
    return memo[id(mesh)]


def _local_chunks(obj: torch.Tensor, memo: dict[tuple, list]) -> list:
    """DCP's local chunk list for ``obj``, from ``memo`` where its layout was seen, or
    :data:`_UNCACHED` where DCP's answer depends on more than the layout."""
    if isinstance(obj, DTensor):
        if hasattr(obj._local_tensor, "__create_chunk_list__"):
            return _UNCACHED  # a sharded local tensor describes its own chunks
        # DCP's DTensor chunk is compute_local_shape_and_global_offset(shape, mesh,
        # placements) on this rank
        key: tuple = (obj.shape, id(obj.device_mesh), obj.placements)
    elif type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter):
        key = ("tensor", obj.shape)
    else:
        return _UNCACHED  # a ShardedTensor or another tensor subclass
    if key not in memo:
        memo[key] = _create_chunk_list(obj)
    return memo[key]


def contiguous_span(sizes: tuple[int, ...], offsets: tuple[int, ...] | torch.Size,
                    lengths: tuple[int, ...] | torch.Size) -> tuple[int, int] | None:
    """``(first element, count)`` of the block ``offsets`` + ``lengths`` of a contiguous
    tensor of ``sizes``, where that block is one run of elements; else None.

    A block is one run when, before its last partial dimension, it takes a single index of
    each dimension, and after it every index: FSDP's even split on dim 0 gives such blocks
    on both sides of a resharded load (a saved chunk, or leading rows of one, into a run
    of rows of the local shard).  A block reaching past ``sizes`` is refused too.
    """
    if len(sizes) != len(offsets) or len(sizes) != len(lengths):
        return None
    start, stride, partial = 0, 1, False
    for n, at, length in zip(reversed(sizes), reversed(offsets), reversed(lengths), strict=True):
        if at < 0 or length < 0 or at + length > n:
            return None
        if partial and length != 1:
            return None  # a second dimension that is not whole, inside a partial one
        if length != n:
            partial = True
        start += at * stride
        stride *= n
    count = 1
    for length in lengths:
        count *= length
    return start, count


def copy_run(target: torch.Tensor, dtype: torch.dtype, sizes: tuple[int, ...], req: ReadItem,
             source: int) -> bool:
    """Copy read item ``req`` from a saved chunk of ``dtype`` and ``sizes`` whose data
    starts at address ``source`` into ``target`` (the local tensor it names), with one
    ``memmove``, where both sides are one run of elements (:func:`contiguous_span`).

    Returns False, having copied nothing, where it cannot: a target that is not a plain,
    contiguous CPU tensor of the saved dtype, or a block that is not one run.  The
    reader then takes DCP's way (views, ``narrow``, ``copy_``).  For the hundreds of small
    tensors (norms, biases, steps) a checkpoint holds, an item took ~20 us that way
    against ~14 us this way, lookups and checks included (warm, one thread, on this
    project's test machines), and with several reader threads on few cores each torch
    call was also a hand-off of the GIL: ``memmove`` runs without it.  The target's
    version counter moves as a ``copy_`` would move it.
    """
    if (type(target) is not torch.Tensor and type(target) is not torch.nn.Parameter) or (
            target.dtype != dtype or target.device.type != "cpu"
            or not target.is_contiguous() or target.is_conj() or target.is_neg()):
        return False
    src = contiguous_span(sizes, req.storage_offsets, req.lengths)
    dst = contiguous_span(tuple(target.shape), req.dest_offsets, req.lengths)
    if src is None or dst is None or src[1] != dst[1]:
        return False
    if dst[1]:
        size = dtype.itemsize
        ctypes.memmove(target.data_ptr() + dst[0] * size, source + src[0] * size, dst[1] * size)
    increment_version(target)
    return True
