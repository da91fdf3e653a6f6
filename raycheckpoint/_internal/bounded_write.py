"""A rank's save through a bounded host buffer (``checkpoint.host_buffer_bytes``).

A rank whose state holds more tensor bytes than its budget does not stage a host copy
of it.  Its snapshot hands the live state (:func:`live_state`: tensors as they are,
detached; other values copied) to a persist started at once, whose storage writer
(:class:`~raycheckpoint._internal.dcp.writer.HashingStorageWriter`, given a
:class:`BoundedBuffer`) writes each tensor's record as the normal path does (the same
``torch.save`` record: :func:`~raycheckpoint._internal.dcp.torch_records.record_frame`
around its data) with the data copied from the tensor into the buffer a chunk at a time,
each chunk written (hashed, encrypted) before the next is copied.  The files, their
checksums and ``.metadata`` are what a staged save of the same values writes; a load
cannot tell them apart.

The tensors must not change until their last chunk is out of the buffer: the snapshot
(training's stall) waits for :attr:`BoundedBuffer.released`, set once the rank's data
files are written, or the save failed.  What follows (``.metadata``, the extra state,
the report) runs after the snapshot has answered.  Host memory: the buffer (at most the
budget, allocated once per saver and reused), a record's header, and the non-tensor
items.  A failure is the persist's as on the normal path: reported, the save aborted.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from raycheckpoint._internal import faults
from raycheckpoint._internal.dcp.shard_plan import ShardPlan
from raycheckpoint._internal.dcp.torch_records import contiguous_owner, record_frame, save_record
from raycheckpoint._internal.persist import PendingPersist, PersistJob, SaveTarget, Snapshot
from raycheckpoint._internal.slab import Slab
from raycheckpoint._internal.staging import ATOMIC, tensor_bytes
from raycheckpoint.errors import CheckpointSaveError


def live_state(obj: Any) -> Any:
    """``obj``'s structure over its own tensors (detached), other values copied."""
    if isinstance(obj, dict):
        return {k: live_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(live_state(v) for v in obj)
    if isinstance(obj, torch.Tensor):  # DTensors too: DCP reads their shard layout
        return obj.detach()
    return obj if type(obj) in ATOMIC else copy.deepcopy(obj)


class BoundedBuffer:
    """The host buffer of one rank's bounded saves (``nbytes``: the budget), and the
    state of the save using it (:meth:`begin` each save)."""

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        self.nbytes = nbytes
        self.pin = pin
        self._slab: Slab | None = None  # allocated at the first save
        self.released = threading.Event()
        self.ready: Any = None
        self.chunks = 0
        self.peak = 0  # most bytes of the buffer one chunk used

    def begin(self, ready: Any) -> None:
        """A new save: ``ready`` (GPU) is the event of the training work the copies wait for."""
        self.released = threading.Event()
        self.ready, self.chunks, self.peak = ready, 0, 0

    def release(self) -> None:
        """The rank's tensors are no longer read: training may change them."""
        self.released.set()

    @property
    def host_bytes(self) -> int:
        return 0 if self._slab is None else self._slab.nbytes

    @property
    def pinned(self) -> bool:
        return self._slab is not None and self._slab.is_pinned()

    def _flat(self) -> torch.Tensor:
        if self._slab is None:
            self._slab = Slab(self.nbytes, pin=self.pin)
        return self._slab.flat

    def write_record(self, tensor: torch.Tensor, w: Any) -> None:
        """Write ``tensor``'s record to ``w`` (a storage writer), its data through the
        buffer a chunk at a time."""
        t = tensor.detach()
        if isinstance(t, DTensor):
            t = t.to_local()
        frame = record_frame(t.dtype, tuple(t.shape)) if t.numel() else None
        if frame is None:
            if t.numel():
                raise CheckpointSaveError(
                    f"checkpoint.host_buffer_bytes: a {t.dtype} tensor of shape "
                    f"{tuple(t.shape)} cannot be written in chunks with this torch; unset "
                    "host_buffer_bytes (or raise it above this rank's shard)")
            save_record(contiguous_owner(t), w)  # an empty tensor: no data to copy
            return
        if not t.is_contiguous():
            t = t.contiguous()  # where the tensor lives (device memory on a GPU)
        src = t.reshape(-1).view(torch.uint8)
        flat = self._flat()
        if self.ready is not None:  # the training stream's work that produced the state
            self.ready.synchronize()
            self.ready = None
        w.write_many([frame[0]])
        step = self.nbytes
        for at in range(0, src.numel(), step):
            n = min(step, src.numel() - at)
            flat[:n].copy_(src[at:at + n])
            w.write_many([flat[:n].numpy()])  # written (hashed, encrypted) before it returns
            self.chunks += 1
            self.peak = max(self.peak, n)
        w.write_many([frame[1]])


def snapshot_bounded(saver: Any, snap: Snapshot, target: SaveTarget, t0: float,
                     wait_timeout_s: float) -> dict[str, Any]:
    """``ShardSaver.snapshot`` of a state over ``saver.host_buffer_bytes``: its persist
    starts now, writing the live tensors through the saver's bounded buffer; returns
    once they are read (``t0``: when the snapshot started)."""
    kind, pending = snap.kind, PendingPersist("")
    pending.copied.set()  # nothing is copied beside training
    try:
        faults.check("worker.snapshot", path=f"{saver.role}/{saver.rank}")
        got = target.named()
    except BaseException as e:
        saver.refuse(kind, e, target)
        raise
    if got is None:
        return {"stall_s": time.perf_counter() - t0, "bytes": 0, "dropped": True}
    pending.save_id, step_dir = got
    if saver._bounded is None or saver._bounded.nbytes != saver.host_buffer_bytes:
        saver._bounded = BoundedBuffer(saver.host_buffer_bytes, pin=saver.pin_memory)
    bounded = saver._bounded
    ready = None
    if saver.pin_memory:
        ready = torch.cuda.Event()
        ready.record()
    bounded.begin(ready)
    staged = live_state(snap.state)
    saver._set_up_persist(PersistJob(
        pending=pending, kind=kind, step_dir=step_dir, coordinator=target.coordinator,
        plan=ShardPlan(), staged=staged, extra=snap.extra, assets=dict(snap.assets),
        writes_tensors=bool(staged), bounded=bounded), start=True)
    if not bounded.released.wait(wait_timeout_s):
        raise TimeoutError(f"{saver.role}/{saver.rank}: save {pending.save_id} still writing "
                           f"through its host buffer after {wait_timeout_s}s")
    pending.copy_s = time.perf_counter() - t0
    return {"stall_s": pending.copy_s, "bytes": tensor_bytes(staged), "chunked": True,
            "chunks": bounded.chunks, "pinned": bounded.pinned, **saver.host_figures()}
