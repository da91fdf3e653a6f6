"""One host slab per kind of save: a rank's staging buffers as views into one allocation.

torch's pinned allocator rounds every allocation up to a power of two, so a buffer per
tensor (or one pinned buffer the size of a shard) costs up to twice the shard in page-locked
host memory.  :func:`host_copy_of` lays a state dict's tensors out in one flat ``uint8``
tensor instead, each tensor's data on a multiple of :data:`SLAB_ALIGN`, and returns the
same structure over views into it: tensors as tensors, DTensors as DTensors over such a
local view (same spec), anything else as it is.  Where CUDA is present the slab is
allocated as plain memory and page-locked as it is (``cudaHostRegister``, no rounding);
``Slab.is_pinned()`` asks the memory itself.

Each view is made with ``Tensor.set_`` over the slab's storage, so it has no ``_base``
and can be moved elsewhere with ``set_`` like any tensor (a data file staged whole);
:func:`repack` then gives the buffers left behind a slab of their own size.  A
:class:`Slab` is kept by its :class:`~raycheckpoint._internal.staging.HostStager`; the
memory lives as long as the slab or any view of it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

# each tensor's data starts on a multiple of this in its slab (an allocator's alignment)
SLAB_ALIGN = 64


class Slab:
    """One flat host allocation (``flat``: a ``uint8`` tensor of ``nbytes``)."""

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        self.nbytes = nbytes
        self.flat = _allocate(max(nbytes, 1), pin)

    def is_pinned(self) -> bool:
        return bool(self.nbytes) and self.flat.is_pinned()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in this slab."""
        return t.untyped_storage().data_ptr() == self.flat.untyped_storage().data_ptr()

    def view(self, at: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``dtype`` tensor of ``shape`` at byte ``at`` (a multiple of the
        element size)."""
        out = torch.empty(0, dtype=dtype)
        return out.set_(self.flat.untyped_storage(), at // out.element_size(), shape)


def _allocate(nbytes: int, pin: bool) -> torch.Tensor:
    flat = torch.empty(nbytes, dtype=torch.uint8)
    if not pin:
        return flat
    try:  # page-locked as allocated: the caching pinned allocator would round it up
        from torch.cuda import _pin_memory_utils

        _pin_memory_utils.pin_memory(flat.data_ptr(), nbytes)
        weakref.finalize(flat, _pin_memory_utils.unpin_memory, flat.data_ptr())
        return flat
    except (ImportError, AttributeError, RuntimeError) as e:
        log.debug("registering a %d-byte host slab failed (%s); torch's pinned allocator "
                  "holds it", nbytes, e)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _aligned(at: int) -> int:
    return -(-at // SLAB_ALIGN) * SLAB_ALIGN


def _locals(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, dict):
        for v in obj.values():
            _locals(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _locals(v, out)
    elif isinstance(obj, DTensor):
        _locals(obj._local_tensor, out)
    elif isinstance(obj, torch.Tensor) and obj.numel():  # empty ones: no place in a slab
        out.append(obj)


def slab_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of a slab holding ``tensors``, each aligned."""
    at = 0
    for t in tensors:
        at = _aligned(at) + t.numel() * t.element_size()
    return at


def host_copy_of(state: dict[str, Any], *, pin: bool) -> tuple[dict[str, Any], Slab]:
    """Buffers of ``state``'s structure over one new slab (see the module doc)."""
    tensors: list[torch.Tensor] = []
    _locals(state, tensors)
    slab = Slab(slab_bytes(tensors), pin=pin)
    offsets = iter(_offsets(tensors))

    def build(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: build(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(build(v) for v in obj)
        if isinstance(obj, DTensor):
            return DTensor(build(obj._local_tensor), obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            if not obj.numel():  # its own (empty) tensor: never at another's address
                return torch.empty(obj.shape, dtype=obj.dtype)
            return slab.view(next(offsets), obj.shape, obj.dtype)
        return obj

    with torch.no_grad():
        return build(state), slab


def _offsets(tensors: list[torch.Tensor]) -> list[int]:
    out, at = [], 0
    for t in tensors:
        at = _aligned(at)
        out.append(at)
        at += t.numel() * t.element_size()
    return out


@torch.no_grad()
def repack(tensors: list[torch.Tensor], old: Slab, *, pin: bool) -> Slab:
    """The tensors of ``tensors`` still in ``old`` moved (``set_``) into a new slab of
    their size, so ``old`` is freed once its holder lets go; ``old`` itself where none
    moved out of it."""
    tensors = [t for t in tensors if t.numel()]
    left = [t for t in tensors if old.holds(t)]
    if len(left) == len(tensors):
        return old
    new = Slab(slab_bytes(left), pin=pin)
    for t, at in zip(left, _offsets(left), strict=True):
        view = new.view(at, t.shape, t.dtype)
        view.copy_(t)
        t.set_(view.untyped_storage(), view.storage_offset(), t.shape)
    return new
