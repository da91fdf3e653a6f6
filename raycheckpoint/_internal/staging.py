"""Host staging: a rank's host buffers, and how a state dict is staged into them.

:class:`HostStager` owns a rank's buffers per kind of save and makes the copies.
:class:`Staging` is compiled once per structure (the state dict a worker's
``ckpt_state_dict`` returns, over the buffers allocated for it) and walked at each save
by the stager: the walk checks that the structure is
still the one compiled (same keys, lengths, tensor shapes, dtypes and placements, no
leaf turned into a tensor or container) and lists the (destination, source) pairs of
the host copy.  :func:`signature` describes a structure for choosing (and sharing)
buffers; :func:`touch` faults fresh buffers in before a first save needs them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from raycheckpoint._internal import slab


def signature(obj: Any, prefix: str = "") -> list[tuple]:
    """Structure of a state dict: the buffers can be reused while it is unchanged."""
    if isinstance(obj, dict):
        out: list[tuple] = []
        for k in sorted(obj, key=str):
            out.extend(signature(obj[k], f"{prefix}/{k}"))
        return out
    if isinstance(obj, (list, tuple)):
        out = []
        for i, v in enumerate(obj):
            out.extend(signature(v, f"{prefix}/{i}"))
        return out
    if isinstance(obj, DTensor):
        return [(prefix, "dt", tuple(obj.to_local().shape), obj.dtype, tuple(obj.placements))]
    if isinstance(obj, torch.Tensor):
        return [(prefix, "t", tuple(obj.shape), obj.dtype)]
    return [(prefix, type(obj).__name__)]


# immutable leaves: staged as they are (anything else is deep-copied)
ATOMIC = frozenset((str, int, float, bool, type(None), bytes))
_DICT, _SEQ, _VALUES, _TENSOR, _VALUE = range(5)


class _Changed(Exception):
    """The state no longer has the structure a :class:`Staging` was built for."""


def _value(src: Any) -> Any:
    if type(src) in ATOMIC:
        return src
    if isinstance(src, (torch.Tensor, dict, list, tuple)):
        raise _Changed
    return copy.deepcopy(src)


class Staging:
    """How one state structure is staged into its host buffers: built once, walked each save.

    Building a :func:`_signature` (a tuple and a path string per leaf) to check the
    structure, then walking again to build the staged tree, cost several milliseconds of
    training's blocked time at 800 tensors.  This keeps the structure instead, one node per container
    and leaf, each tensor's node with its buffer, shape, dtype and placements and the
    detached view last copied from.  :meth:`restage` is one walk: every container must
    have the same keys (or length), every tensor the same shape, dtype and placements,
    and no leaf may turn into a tensor or container; otherwise it raises
    :class:`_Changed` and the saver builds anew.  A tensor replaced by another of the
    same layout (a loaded optimizer state) is staged into the same buffer, its view
    taken afresh; the view is reused only for the same tensor object over the same
    memory.  Until then a node keeps the last source tensor alive.
    """

    def __init__(self, state: dict[str, Any], buffers: dict[str, Any]) -> None:
        with torch.no_grad():  # a DTensor's to_local() is then no autograd op
            self.root = self._compile(state, buffers)
        self.bytes = tensor_bytes(buffers)
        self.empty = not state  # nothing to save in DCP's format (extra state only)
        self.pinned: bool | None = None  # every buffer pinned (HostStager.pinned)

    def _compile(self, src: Any, buf: Any) -> list:
        if isinstance(src, dict):
            keys = tuple(src)
            children = [self._compile(src[k], buf[k]) for k in keys]
            return [_DICT, keys, children, all(c[0] == _TENSOR for c in children)]
        if isinstance(src, (list, tuple)):
            children = [self._compile(v, b) for v, b in zip(src, buf, strict=True)]
            if all(c[0] == _VALUE for c in children):
                return [_VALUES, type(src), len(children)]
            return [_SEQ, type(src), children]
        if isinstance(src, DTensor):
            local = buf.to_local()
            return [_TENSOR, buf, local, True, local.shape, local.dtype, src.placements,
                    None, 0, None]
        if isinstance(src, torch.Tensor):
            return [_TENSOR, buf, buf, False, buf.shape, buf.dtype, None, None, 0, None]
        return [_VALUE]

    def tensors(self) -> Iterator[torch.Tensor]:
        """The staged tensors themselves (what the host copy writes into)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node[0] == _TENSOR:
                yield node[2]
            elif node[0] in (_DICT, _SEQ):
                stack.extend(node[2])

    def restage(self, state: dict[str, Any],
                copies: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any] | None:
        """``state``'s structure over the buffers, its tensor copies appended to ``copies``
        as (destination, source) pairs, for :meth:`HostStager.copy` to make now or beside
        training; None where the structure changed.  Non-tensor leaves (learning rates,
        step counters) change between saves too: they are taken anew, never from an
        earlier save."""
        try:
            return self._restage(state, self.root, copies)
        except (_Changed, KeyError):
            copies.clear()
            return None

    def _restage(self, src: Any, node: list, copies: list) -> Any:
        tag = node[0]
        if tag == _TENSOR:
            return _restage_tensor(src, node, copies)
        if tag == _DICT:
            keys, children = node[1], node[2]
            if not isinstance(src, dict) or len(src) != len(keys):
                raise _Changed
            if node[3]:  # tensors only (a model's parameters, one parameter's optimizer state)
                return {k: _restage_tensor(src[k], c, copies) for k, c in zip(keys, children, strict=True)}
            return {k: self._restage(src[k], c, copies) for k, c in zip(keys, children, strict=True)}
        if tag == _VALUES:
            if type(src) is not node[1] or len(src) != node[2]:
                raise _Changed
            if all(type(v) in ATOMIC for v in src):
                return node[1](src)
            return node[1](_value(v) for v in src)
        if tag == _SEQ:
            if type(src) is not node[1] or len(src) != len(node[2]):
                raise _Changed
            return node[1](self._restage(v, c, copies) for v, c in zip(src, node[2], strict=True))
        return _value(src)


def _restage_tensor(src: Any, node: list, copies: list) -> torch.Tensor:
    """A tensor node of :meth:`Staging.restage`: check ``src`` against it, append its
    copy, return its buffer.

    A DTensor's placements and local tensor are read as attributes. Through
    ``to_local()`` a parameter (FSDP2's sharded parameters are DTensor parameters) gives
    a new view of its local tensor at every call, even under ``no_grad``, so the node
    never found the source it copied from last time and took a new view of every
    parameter at every save (a walk of 788 tensors in one process, two runs each:
    0.97-1.49 ms against 0.59-1.27 ms now).  Called once per tensor at every save,
    inside a dict of tensors without a call of the walk's own in between."""
    if node[3]:
        if not isinstance(src, DTensor):
            raise _Changed
        placements = src._spec.placements
        if placements is not node[6] and placements != node[6]:
            raise _Changed
        local = src._local_tensor
    elif isinstance(src, torch.Tensor) and not isinstance(src, DTensor):
        local = src
    else:
        raise _Changed
    if local.shape != node[4] or local.dtype != node[5]:
        raise _Changed
    if local is not node[7] or local.data_ptr() != node[8]:
        node[7], node[8], node[9] = local, local.data_ptr(), local.detach()
    copies.append((node[2], node[9]))
    return node[1]


def copy_tensors(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Make the host copies ``copies`` (destination, source): one call into torch for all
    of them, which releases the GIL once, not once a tensor (at 788 tensors a Python
    loop of ``copy_`` spends ~1.2 ms on the calls alone, this ~0.5 ms)."""
    if copies:
        torch._foreach_copy_([dst for dst, _ in copies], [src for _, src in copies])


def touch(obj: Any) -> None:
    if isinstance(obj, dict):
        for v in obj.values():
            touch(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            touch(v)
    elif isinstance(obj, DTensor):
        obj.to_local().zero_()
    elif isinstance(obj, torch.Tensor):
        obj.zero_()


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return 0


class HostStager:
    """One rank's host copies: the buffers of each kind of save, each kind's
    :class:`Staging`, and the copy itself.

    Buffers are allocated on first use (or ahead of time by :meth:`prepare`) as views
    into one host slab per kind of save (:mod:`~raycheckpoint._internal.slab`), pinned
    where CUDA is present, and reused afterwards; a light save's buffers are the model
    part of the full save's.  :attr:`host_bytes`, :attr:`pinned_bytes` and
    :meth:`pinned` say what they hold.  ``on_new_buffers(kind)`` is told when a kind gets new
    buffers (whatever was derived from the old ones is stale); ``who`` names the rank
    in errors.  On a GPU the copy runs on
    a stream of its own, after the training stream's work that produced the state.
    """

    def __init__(self, who: str = "", on_new_buffers: Callable[[str], None] = lambda kind: None
                 ) -> None:
        self.who = who
        self.pin_memory = torch.cuda.is_available()
        self.staging: dict[str, Staging] = {}
        self.slabs: dict[str, slab.Slab] = {}  # kind -> the slab its buffers view
        self._buffers: dict[str, tuple[list[tuple], dict[str, Any]]] = {}
        self._on_new_buffers = on_new_buffers
        self._copy_stream: Any = None

    def buffers_for(self, kind: str, state: dict[str, Any]) -> dict[str, Any]:
        """The host buffers for ``state``'s structure, allocated on first use: views
        into one slab (:mod:`~raycheckpoint._internal.slab`)."""
        sig = signature(state)
        cached = self._buffers.get(kind)
        if cached is not None and cached[0] == sig:
            return cached[1]
        buffers = None
        for other_kind, (_, other) in self._buffers.items():  # light = the model part of full
            if set(state) <= set(other) and all(
                    signature({k: state[k]}) == signature({k: other[k]}) for k in state):
                buffers = {k: other[k] for k in state}
                self.slabs[kind] = self.slabs[other_kind]
                break
        if buffers is None:
            buffers, self.slabs[kind] = slab.host_copy_of(state, pin=self.pin_memory)
        self._buffers[kind] = (sig, buffers)
        self._on_new_buffers(kind)
        return buffers

    def _distinct_slabs(self) -> list[slab.Slab]:
        """Each slab once (a light save's kind shares the full save's)."""
        return list({id(s): s for s in self.slabs.values()}.values())

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory this stager's buffers hold (each slab once)."""
        return sum(s.nbytes for s in self._distinct_slabs())

    @property
    def pinned_bytes(self) -> int:
        """Of :attr:`host_bytes`, those that are pinned (``Tensor.is_pinned()``)."""
        return sum(s.nbytes for s in self._distinct_slabs() if s.is_pinned())

    def pinned(self, kind: str) -> bool:
        """Whether every staged buffer of ``kind`` is pinned, as ``Tensor.is_pinned()``
        says of each (False before ``kind``'s first staging, or with none).  Asked once
        per :class:`Staging`: every save answers with it, and a buffer keeps its memory's
        pinning while its staging lives (a repacked slab is pinned as the old one)."""
        staging = self.staging.get(kind)
        if staging is None:
            return False
        if staging.pinned is None:
            tensors = [t for t in staging.tensors() if t.numel()]
            staging.pinned = bool(tensors) and all(t.is_pinned() for t in tensors)
        return staging.pinned

    def repack(self, kind: str) -> None:
        """Move ``kind``'s buffers still in its slab into a slab of their own size, once
        others moved out of it (a data file staged whole: ``ShardSaver._stage_files_whole``),
        so the old slab is freed; nothing where no buffer moved."""
        old = self.slabs.get(kind)
        staging = self.staging.get(kind)
        if old is None or staging is None or any(s is old for k, s in self.slabs.items()
                                                 if k != kind):
            return
        self.slabs[kind] = slab.repack(list(staging.tensors()), old, pin=self.pin_memory)

    def prepare(self, kind: str, state: dict[str, Any]) -> int:
        """Allocate and touch the buffers now, so the first save's stall is a plain copy.

        Fresh memory costs a page fault per page on first write (about 10x a copy into
        memory already touched); paying it here keeps it out of training's blocked time.
        Returns the bytes prepared.
        """
        with torch.no_grad():
            buffers = self.buffers_for(kind, state)
            touch(buffers)
            return tensor_bytes(buffers)

    def plan(self, kind: str, state: dict[str, Any]) -> tuple[dict[str, Any], list, Any]:
        """The staged structure, its tensor copies still to make, and (GPU) the event the
        copies must wait for: the training stream's work that produced the state."""
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        staging = self.staging.get(kind)
        staged = None if staging is None else staging.restage(state, copies)
        if staged is None:  # first save of this kind, or the structure changed
            staging = Staging(state, self.buffers_for(kind, state))
            staged = staging.restage(state, copies)
            if staged is None:
                raise RuntimeError(f"{self.who}: the state changed while staged")
            self.staging[kind] = staging
        ready = None
        if self.pin_memory:
            ready = torch.cuda.Event()
            ready.record()
        return staged, copies, ready

    def copy(self, copies: list[tuple[torch.Tensor, torch.Tensor]], ready: Any,
             progress: Any = None) -> None:
        """Make the host copies (GPU: on a stream of its own, after ``ready``);
        ``progress`` (a :class:`~raycheckpoint._internal.overlapped_write.CopyProgress`)
        makes them and is told of the end (whatever happens)."""
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

    def stage(self, kind: str, state: dict[str, Any]) -> dict[str, Any]:
        """:meth:`plan` and :meth:`copy` at once: ``state`` staged."""
        staged, copies, ready = self.plan(kind, state)
        self.copy(copies, ready)
        return staged
