"""Writing a new local file with ``O_DIRECT``: its bytes go to the device without the
page cache (used by :class:`raycheckpoint.storage.HashingWriter` for the shards' data
files; see :mod:`raycheckpoint.storage`)."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading

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


def _take_bounce() -> mmap.mmap:
    """A page-aligned buffer of :data:`DIRECT_CHUNK` bytes, touched, reused across files
    (at most one per file being written at once is ever allocated)."""
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
    """A new local file written with ``O_DIRECT`` through a page-aligned bounce buffer.

    Pieces are copied into the buffer and written in :data:`DIRECT_CHUNK` writes; the tail
    is written padded to :data:`DIRECT_ALIGN` and the file then truncated to its length,
    and ``close`` fsyncs it (for the file's size and the device's cache).  The bytes never
    enter the page cache.  A filesystem that opens with ``O_DIRECT`` but refuses such a
    write (``EINVAL``) gets the rest of the file buffered.  ``open`` raises ``OSError``
    where ``O_DIRECT`` cannot be opened at all (the caller writes buffered then).
    """

    def __init__(self, path: str) -> None:
        if not O_DIRECT:
            raise OSError(errno.EOPNOTSUPP, "no O_DIRECT on this platform", path)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                          | O_DIRECT, 0o644)
        self._buf: mmap.mmap | None = _take_bounce()
        self._view = memoryview(self._buf)
        self._array = np.frombuffer(self._buf, dtype=np.uint8)
        self._fill = 0  # bytes in the buffer
        self._size = 0  # bytes of the file, written or in the buffer
        self.direct = True

    def write(self, views: list[memoryview]) -> None:
        for v in views:
            n, at = v.nbytes, 0
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
                    self._write_out(DIRECT_CHUNK)
        self._size += sum(v.nbytes for v in views)

    def _write_out(self, length: int) -> None:
        """Write the buffer's first ``length`` bytes (a multiple of the alignment)."""
        done = 0
        while done < length:
            try:
                written = os.write(self.fd, self._view[done:length])
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
        self._fill = 0

    def _buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
        self.direct = False

    def close(self) -> None:
        try:
            if self._fill:
                padded = -(-self._fill // DIRECT_ALIGN) * DIRECT_ALIGN
                self._view[self._fill:padded] = bytes(padded - self._fill)
                self._write_out(padded)
                os.ftruncate(self.fd, self._size)
            os.fsync(self.fd)
        finally:
            self.abort()

    def abort(self) -> None:
        if self._buf is not None:
            self._array = None
            self._view.release()
            _give_bounce(self._buf)
            self._buf = None
            os.close(self.fd)
