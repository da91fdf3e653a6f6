"""Writing a new local file with ``O_DIRECT``: its bytes go to the device without the
page cache (the sink :class:`~raycheckpoint.storage.posix.LocalStorage` gives a
:class:`~raycheckpoint.storage.writer.HashingWriter` for the shards' data files)."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

# O_DIRECT: offsets, lengths and buffer addresses in multiples of this (a page, which
# covers 512-byte and 4 KiB logical blocks alike)
DIRECT_ALIGN = 4096
# bytes gathered in a bounce buffer per O_DIRECT write
DIRECT_CHUNK = 8 << 20
# pieces at least this large are copied into the bounce buffer by numpy, which releases
# the GIL while it copies (a memoryview assignment holds it)
_GIL_FREE_COPY_BYTES = 64 << 10

O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux (and a few others)

_bounce_lock = threading.Lock()
_bounce_free: list[mmap.mmap] = []


def address(view: memoryview) -> int:
    """Where ``view``'s bytes start in memory."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _take_bounce() -> mmap.mmap:
    """A page-aligned buffer of :data:`DIRECT_CHUNK` bytes, touched, reused across files
    (at most two per file being written at once are ever allocated)."""
    with _bounce_lock:
        if _bounce_free:
            return _bounce_free.pop()
    buf = mmap.mmap(-1, DIRECT_CHUNK)
    buf.write(bytes(DIRECT_CHUNK))  # fault it in now, not during the copies
    return buf


def _give_bounce(buf: mmap.mmap) -> None:
    with _bounce_lock:
        _bounce_free.append(buf)


class DirectFile:
    """A new local file written with ``O_DIRECT`` through page-aligned bounce buffers.

    Pieces are copied into a buffer and written in :data:`DIRECT_CHUNK` writes; the tail
    is written padded to :data:`DIRECT_ALIGN` and the file then truncated to its length,
    and ``close`` fsyncs it (for the file's size and the device's cache).  The bytes never
    enter the page cache.

    An ``O_DIRECT`` write returns once the device has the bytes, so one buffer at a time
    would leave the device idle while the next chunk is copied.  A full buffer is written
    by a thread of the file's own instead, while the caller copies into a second one; the
    writes stay in order (one at a time), and a failed one is raised by the next
    ``write`` or by ``close``.

    A piece that starts on a page boundary while the file so far is a whole number of
    pages (nothing waiting in a buffer) is written straight from its own memory, its
    whole pages in :data:`DIRECT_CHUNK` writes, with no copy; only its last partial page
    goes through a buffer.  A saver that stages a data file's exact bytes in one
    page-aligned block (:meth:`raycheckpoint._internal.dcp.shard_plan.ShardPlan.adopt_image`)
    has the whole file written that way.  ``write`` returns once such writes are over.

    ``hasher`` (``update(buffer)``), where given, is fed each buffer once it is full, in
    the calling thread, before the buffer is handed on: one call, and one release of the
    GIL, per :data:`DIRECT_CHUNK`, over bytes just copied.  Hashing the pieces as they
    come, in a helper thread, took the GIL a few thousand times per save at 800 tensors,
    and a training thread in the same process waits for it at every such handoff: beside
    back-to-back persists of 122 MB in 788 records, a CPU training loop's step slowed by
    38-46% that way and by 21-31% this way, the persist itself as fast.

    A filesystem that opens with ``O_DIRECT`` but refuses such a write (``EINVAL``) gets
    the rest of the file buffered.  ``open`` raises ``OSError`` where ``O_DIRECT`` cannot
    be opened at all (the caller writes buffered then).
    """

    def __init__(self, path: str, hasher: Any = None) -> None:
        if not O_DIRECT:
            raise OSError(errno.EOPNOTSUPP, "no O_DIRECT on this platform", path)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                          | O_DIRECT, 0o644)
        self._buf: mmap.mmap | None = None
        self._bind(_take_bounce())
        self._size = 0  # bytes of the file, written or in a buffer
        self._hasher = hasher  # updated with each buffer's bytes once it is filled
        self.direct = True
        self._writer: ThreadPoolExecutor | None = None  # started by the first full buffer
        self._in_flight: tuple[Future, mmap.mmap] | None = None

    def _bind(self, buf: mmap.mmap) -> None:
        """Fill ``buf`` next."""
        self._buf = buf
        self._view = memoryview(buf)
        self._array = np.frombuffer(buf, dtype=np.uint8)
        self._fill = 0  # bytes in the buffer

    def _unbind(self) -> mmap.mmap:
        buf, self._buf = self._buf, None
        self._array = None
        self._view.release()
        return buf

    def write(self, views: list[memoryview]) -> None:
        for v in views:
            n, at = v.nbytes, 0
            if not self._fill and n >= DIRECT_ALIGN and address(v) % DIRECT_ALIGN == 0:
                at = self._write_through(v)
            while at < n:
                k = min(DIRECT_CHUNK - self._fill, n - at)
                if k >= _GIL_FREE_COPY_BYTES:
                    self._array[self._fill:self._fill + k] = np.frombuffer(
                        v[at:at + k], dtype=np.uint8)
                else:
                    self._view[self._fill:self._fill + k] = v[at:at + k]
                self._fill += k
                at += k
                if self._fill == DIRECT_CHUNK:
                    self._send()
        self._size += sum(v.nbytes for v in views)
        if self._in_flight is not None and self._in_flight[1] is None:
            self._settle()  # it writes from the caller's memory: done with it before returning

    def _write_through(self, v: memoryview) -> int:
        """Write ``v``'s whole pages straight from its memory (page-aligned, and the file's
        bytes so far a whole number of pages): no copy into a bounce buffer.  Returns the
        bytes written; the rest of ``v`` goes through a buffer.
        """
        whole = v.nbytes - v.nbytes % DIRECT_ALIGN
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="raycheckpoint-direct")
        for at in range(0, whole, DIRECT_CHUNK):
            piece = v[at:min(at + DIRECT_CHUNK, whole)]
            if self._hasher is not None:
                self._hasher.update(piece)
            spare = self._settle()
            if spare is not None:
                _give_bounce(spare)
            self._in_flight = (self._writer.submit(self._write_out, piece, piece.nbytes), None)
        return whole

    def write_block(self, view: memoryview, hashing: Callable[[], None]) -> None:
        """Write ``view``, a page-aligned block, straight from its memory.

        Each whole chunk is queued to the file's writer thread, which writes the chunks
        from ``view`` one after another.  Hashing waits until ``hashing()`` returns (it
        blocks until the rank is free to spend a core on it), then runs here while the
        queued writes go out: no write waits for it.  Hashing between two writes, with one write in
        flight, would leave the disk idle whenever a hash outlasts that write (9 of the
        93 ms a 120 MB file's writes took, measured).  The file so far must be a whole
        number of pages, nothing waiting in a buffer.  Returns once every write from
        ``view`` is over.
        """
        if self._fill or self._size % DIRECT_ALIGN or address(view) % DIRECT_ALIGN:
            raise ValueError("write_block needs a page-aligned block at a page boundary")
        n = view.nbytes
        whole = n - n % DIRECT_ALIGN
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="raycheckpoint-direct")
        queued: list[Future] = []
        try:
            spare = self._settle()
            if spare is not None:
                _give_bounce(spare)
            for at in range(0, whole, DIRECT_CHUNK):
                end = min(at + DIRECT_CHUNK, whole)
                queued.append(self._writer.submit(self._write_out, view[at:end], end - at))
            if self._hasher is not None:
                hashing()
                for at in range(0, whole, DIRECT_CHUNK):
                    self._hasher.update(view[at:min(at + DIRECT_CHUNK, whole)])
            for future in queued:  # they write from the caller's memory: over before returning
                future.result()
            self._size += whole
        except BaseException:
            for future in queued:
                future.cancel()
            self.abort()  # its writer's shutdown waits for the write running from the block
            raise
        if whole < n:  # the last partial page, through a buffer (hashed with it)
            self.write([view[whole:]])

    def _send(self) -> None:
        """Hash the full buffer, hand it to the writer thread; go on filling the other one."""
        if self._hasher is not None:
            self._hasher.update(self._view)
        spare = self._settle()  # the previous write's buffer, free again (or its error)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="raycheckpoint-direct")
        full = self._unbind()
        self._bind(spare if spare is not None else _take_bounce())
        try:
            self._in_flight = (self._writer.submit(self._write_out, full, DIRECT_CHUNK), full)
        except BaseException:
            _give_bounce(full)
            raise

    def _settle(self) -> mmap.mmap | None:
        """Wait for the write in flight; its buffer, or None where none was in flight.
        A failed write is raised here (its buffer back in the pool)."""
        if self._in_flight is None:
            return None
        future, buf = self._in_flight
        self._in_flight = None
        try:
            future.result()
        except BaseException:
            if buf is not None:
                _give_bounce(buf)
            raise
        return buf

    def _write_out(self, buf: mmap.mmap | memoryview, length: int) -> None:
        """Write ``buf``'s first ``length`` bytes (a multiple of the alignment)."""
        with memoryview(buf) as view:
            done = 0
            while done < length:
                try:
                    written = os.write(self.fd, view[done:length])
                except OSError as e:
                    if e.errno != errno.EINVAL or not self.direct:
                        raise
                    self._buffered()  # this filesystem takes O_DIRECT opens, not such writes
                    continue
                if written <= 0:
                    raise OSError(f"write wrote nothing to fd {self.fd}")
                done += written
                if done < length and done % DIRECT_ALIGN and self.direct:
                    self._buffered()  # a short write left the offset unaligned

    def _buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
        self.direct = False

    def close(self) -> None:
        try:
            spare = self._settle()
            if spare is not None:
                _give_bounce(spare)
            if self._fill and self._hasher is not None:
                with self._view[:self._fill] as tail:
                    self._hasher.update(tail)
            if self._fill:
                padded = -(-self._fill // DIRECT_ALIGN) * DIRECT_ALIGN
                self._view[self._fill:padded] = bytes(padded - self._fill)
                self._write_out(self._buf, padded)
                os.ftruncate(self.fd, self._size)
            os.fsync(self.fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Give the buffers back and close the file (after the write in flight, if any)."""
        if self._in_flight is not None:
            future, buf = self._in_flight
            self._in_flight = None
            try:
                future.result()  # its buffer is reused once the write is over
            except OSError:
                pass  # the file is being abandoned for an error the caller already has
            if buf is not None:
                _give_bounce(buf)
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None
        if self._buf is not None:
            _give_bounce(self._unbind())
            os.close(self.fd)
