"""The machine's limits for one bench rank's bytes: a host copy, a write + fsync, a read.

A mixin of :class:`bench._ranks._BenchRank` (it uses the rank's ``state()``, ``rank``,
``device`` and storage ``options``): the same bytes, storage and ranks as the saves it is
compared with.
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Any

import fsspec
import torch
import torch.distributed as dist

from raycheckpoint.storage.direct_io import DIRECT_ALIGN, O_DIRECT
from raycheckpoint.worker import local_tensors


def _fs(url: str, options: dict[str, Any]) -> tuple[Any, str, bool]:
    fs, path = fsspec.core.url_to_fs(url, **options)
    return fs, path, fs.protocol in ("file", ("file", "local"))


def host_buffers(src: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host memory for a copy of ``src``, allocated and touched (pinned for a GPU's)."""
    return [torch.zeros_like(t, device="cpu", pin_memory=t.is_cuda) for t in src]


@torch.no_grad()
def timed_copy(buffers: list[torch.Tensor], src: list[torch.Tensor]) -> float:
    """Seconds to copy ``src`` into ``buffers``: on the CPU one ``torch._foreach_copy_``
    for every tensor, as raycheckpoint's own host copy makes it; from a GPU,
    device-to-host on one stream, waited for at the end."""
    cuda = any(t.is_cuda for t in src)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if cuda:
        for buf, t in zip(buffers, src, strict=True):
            buf.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
    else:
        torch._foreach_copy_(buffers, src)
    return time.perf_counter() - t0


class Limits:
    """Host copy, raw write + fsync and raw read of this rank's state (see ``measure_limits``)."""

    _copy_buffers: list[torch.Tensor] | None = None
    _raw: mmap.mmap | None = None
    _raw_bytes = 0

    def _tensors(self) -> list[torch.Tensor]:
        return [t for _, t in sorted(local_tensors(self.state()).items())]

    @torch.no_grad()  # a bare copy: no autograd bookkeeping for parameters that need grad
    def host_copy(self, fresh: bool = False) -> float:
        """Copy this rank's state into preallocated (or, with ``fresh``, new) host memory
        (:func:`timed_copy`: a Python loop of ``copy_`` would cost ~1 µs a tensor more on
        the CPU, which the saves no longer pay)."""
        src = self._tensors()
        if fresh:
            dist.barrier()
            t0 = time.perf_counter()
            copies = [torch.empty_like(t, device="cpu").copy_(t) for t in src]
            elapsed = time.perf_counter() - t0
            del copies
            return elapsed
        if self._copy_buffers is None:  # allocated and touched
            self._copy_buffers = host_buffers(src)
        dist.barrier()
        return timed_copy(self._copy_buffers, src)

    def _raw_aligned(self) -> memoryview:
        """This rank's bytes in page-aligned memory, zero-padded to a whole page (what an
        ``O_DIRECT`` write needs; the buffered write and the read use the same memory)."""
        if self._raw is None:
            local = [t.reshape(-1).view(torch.uint8) for t in self._tensors()]
            self._raw_bytes = sum(t.numel() for t in local)
            self._raw = mmap.mmap(-1, -(-self._raw_bytes // DIRECT_ALIGN) * DIRECT_ALIGN)
            flat = torch.frombuffer(self._raw, dtype=torch.uint8)
            at = 0
            for t in local:
                flat[at:at + t.numel()].copy_(t)
                at += t.numel()
            del flat
        return memoryview(self._raw)

    def _raw_buffer(self) -> memoryview:
        return self._raw_aligned()[:self._raw_bytes]

    def free_limit_buffers(self, keep_copy: bool = False) -> None:
        """Drop the limits' buffers (a copy of this rank's state each) once measured;
        ``keep_copy``: all but the host copy's, measured again beside the saves."""
        self._raw = None
        if not keep_copy:
            self._copy_buffers = None

    def raw_write(self, url: str, chunk: int = 8 << 20, direct: bool = False) -> float | None:
        """Sequential write of this rank's bytes to one file (fsync on local disk).

        ``direct``: with ``O_DIRECT`` from page-aligned memory (local disk only; None
        elsewhere, or where the filesystem refuses it), the tail padded to a page and the
        file truncated to the length, as raycheckpoint writes its data files."""
        data = self._raw_buffer()
        fs, path, local = _fs(f"{url}/raw_{self.rank}.bin", self.options)
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        if direct and (not local or not O_DIRECT):
            return None
        aligned = self._raw_aligned()
        dist.barrier()
        t0 = time.perf_counter()
        if direct:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
            except OSError:
                return None
            try:
                for i in range(0, aligned.nbytes, chunk):
                    os.write(fd, aligned[i:i + chunk])
                os.ftruncate(fd, data.nbytes)
                os.fsync(fd)
            finally:
                os.close(fd)
        elif local:
            with open(path, "wb") as f:
                for i in range(0, data.nbytes, chunk):
                    f.write(data[i:i + chunk])
                f.flush()
                os.fsync(f.fileno())
        else:
            with fs.open(path, "wb") as f:
                for i in range(0, data.nbytes, chunk):
                    f.write(data[i:i + chunk])
        return time.perf_counter() - t0

    def raw_read(self, url: str, chunk: int = 8 << 20) -> float:
        data = self._raw_buffer()
        fs, path, local = _fs(f"{url}/raw_{self.rank}.bin", self.options)
        dist.barrier()
        t0 = time.perf_counter()
        with (open(path, "rb", buffering=0) if local else fs.open(path, "rb")) as f:
            pos = 0
            while pos < data.nbytes:
                n = f.readinto(data[pos:pos + chunk])
                if not n:
                    raise EOFError(f"{path}: {pos} of {data.nbytes} bytes")
                pos += n
        return time.perf_counter() - t0
