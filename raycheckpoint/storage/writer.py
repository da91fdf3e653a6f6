"""HashingWriter: every file raycheckpoint writes streams through one of these.

It counts and hashes the bytes as they pass (:mod:`raycheckpoint.integrity.digest`:
BLAKE3 unless the storage is opened with ``checksum="sha256"``), so a file's checksum
never needs a second read, optionally encrypts them first (the storage's cipher), and
hands them to a *sink* that its backend opens (:meth:`Storage.open_sink
<raycheckpoint.storage.base.Storage.open_sink>`).  A sink has

* ``write(data)``, ``writev(views)`` (``vectored``: in as few system calls as the OS
  allows), ``flush()``, ``close()`` (the bytes are durable once it returns: fsync, or
  the upload completed) and ``abort()`` (drop what was written);
* ``hashes_itself``: the sink feeds the hasher it was given as it fills its own buffers
  (an ``O_DIRECT`` file: one update per 8 MB, see
  :class:`~raycheckpoint.storage.direct_io.DirectFile`), so the writer does not;
* ``writes_blocks``: it can write a page-aligned block straight from its memory
  (:meth:`HashingWriter.write_block`); ``direct``: its bytes go around the page cache.

A chunk of :data:`PARALLEL_HASH_BYTES` or more is hashed in a helper thread while it is
written (both release the GIL); the hash is joined before ``write`` returns, so the
caller's buffer is never read after it.  Measured in one process, 1 GB of tensor records
to local disk with sha256: 1.9-2.1 s hashing then writing, 1.45 s side by side (writing
alone: 0.85-1.7 s).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from raycheckpoint._internal import faults
from raycheckpoint.integrity import digest
from raycheckpoint.storage.spec import FileEntry

if TYPE_CHECKING:
    from raycheckpoint.storage.base import Storage

# chunks at least this large are hashed in a helper thread while they are written
PARALLEL_HASH_BYTES = 1 << 20


def _update_all(h: Any, views: list[memoryview]) -> None:
    for v in views:
        h.update(v)


class HashingWriter:
    """A write-only stream that hashes and counts what passes through it.

    Supports ``write``, ``write_many``, ``tell`` and ``close``; ``entry`` is set once
    closed, when the file is durable.  ``checksum`` overrides the storage's algorithm for
    this file; ``direct`` asks for ``O_DIRECT`` (a large data file; where the backend and
    the filesystem allow it, and the file is not encrypted).
    """

    def __init__(self, storage: Storage, rel: str, *, encrypt: bool = False,
                 checksum: str | None = None, direct: bool = False) -> None:
        self.rel = rel
        self._algorithm = checksum or storage.checksum
        self._hash = digest.new(self._algorithm)
        self._pos = 0  # plaintext bytes written (what tell() reports to DCP)
        self._stored = 0
        self.entry: FileEntry | None = None
        self.error: Exception | None = None
        self._encryptor = storage.cipher.encryptor(rel) if encrypt and storage.cipher else None
        self._hasher: ThreadPoolExecutor | None = None  # started by the first large chunk
        self._sink = storage.open_sink(rel, direct=direct and self._encryptor is None,
                                       hasher=self._hash)
        if self._encryptor is not None:
            self._store(self._encryptor.header)

    @property
    def direct(self) -> bool:
        """Whether this file's bytes go to the device with ``O_DIRECT``."""
        return self._sink.direct

    def _store(self, data) -> None:
        view = memoryview(data).cast("B")
        self._write_hashed([view], lambda: self._sink.write(data), view.nbytes)
        self._stored += view.nbytes

    def _write_hashed(self, views: list[memoryview], write: Callable[[], Any], size: int) -> None:
        """``write()`` of ``views``, hashed beside it in the helper thread for
        :data:`PARALLEL_HASH_BYTES` or more, after it otherwise (not at all by a sink that
        hashes itself); both are over once this returns (the bytes are the caller's)."""
        hash_it = None if self._sink.hashes_itself else (lambda: _update_all(self._hash, views))
        hashed = None
        if hash_it is not None and size >= PARALLEL_HASH_BYTES:
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="raycheckpoint-hash")
            hashed = self._hasher.submit(hash_it)
        try:
            write()
        except Exception as e:
            # torch's zip writer replaces a failing write with "unexpected pos": keep the
            # real cause (a full disk, a lost connection) for whoever reports the failure
            self.error = self.error or e
            raise
        finally:
            if hashed is not None:
                hashed.result()
        if hash_it is not None and hashed is None:
            hash_it()

    def write_many(self, pieces: list) -> int:
        """Write ``pieces`` (bytes-like) in order, as few system calls as the OS allows.

        To a vectored sink without encryption they go in one ``os.writev`` per
        ``IOV_MAX`` pieces, hashed in order beside the write; elsewhere one ``write``
        each.  Returns the bytes written.
        """
        views = [memoryview(p).cast("B") for p in pieces]
        total = sum(v.nbytes for v in views)
        if not views:
            return 0
        if self._encryptor is not None or not self._sink.vectored:
            for v in views:
                self.write(v)
            return total
        faults.check("storage.write", path=self.rel)
        self._write_hashed(views, lambda: self._sink.writev(views), total)
        self._pos += total
        self._stored += total
        return total

    def write_block(self, block: memoryview, hashing: Callable[[], None]) -> int:
        """Write ``block`` (``hashing``: see
        :meth:`~raycheckpoint.storage.direct_io.DirectFile.write_block`): with ``O_DIRECT``
        straight from its memory, hashed beside the writes; elsewhere the whole block once
        it may be hashed.  Returns the bytes written."""
        view = memoryview(block).cast("B")
        faults.check("storage.write", path=self.rel)
        if not self._sink.writes_blocks or self._encryptor is not None or self._pos:
            hashing()
            return self.write_many([view])
        try:
            self._sink.write_block(view, hashing)
        except Exception as e:
            self.error = self.error or e
            raise
        self._pos += view.nbytes
        self._stored += view.nbytes
        return view.nbytes

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        faults.check("storage.write", path=self.rel)
        if self._encryptor is None:
            self._store(mv)
        else:
            for sealed in self._encryptor.update(mv):
                self._store(sealed)
        self._pos += mv.nbytes
        return mv.nbytes

    def tell(self) -> int:
        return self._pos

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self._sink.flush()

    def close(self) -> FileEntry:
        if self.entry is None:
            if self._encryptor is not None:
                self._store(self._encryptor.finish())
            self._sink.close()
            self._stop_hasher()
            self.entry = FileEntry(self.rel, self._stored, digest.finish(self._algorithm, self._hash))
        return self.entry

    def _stop_hasher(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None

    def abort(self) -> None:
        """Close without committing the object (object stores drop the upload)."""
        self._stop_hasher()
        try:
            self._sink.abort()
        except Exception:  # noqa: BLE001 - best effort cleanup of a failed write
            pass

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class FsspecFile:
    """The sink of a file written through fsspec (an object store's upload): one write
    per piece; ``close`` completes the upload, ``abort`` drops it."""

    hashes_itself = False
    vectored = False
    writes_blocks = False
    direct = False

    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: Any) -> None:
        self._f.write(data)

    def writev(self, views: list[memoryview]) -> None:
        for v in views:
            self._f.write(v)

    def flush(self) -> None:
        """Nothing: an upload's parts go out as they fill."""

    def close(self) -> None:
        self._f.close()

    def abort(self) -> None:
        if hasattr(self._f, "discard"):
            self._f.discard()
        else:
            self._f.close()
