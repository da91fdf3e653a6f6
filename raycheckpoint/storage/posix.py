"""LocalStorage: a root on this node's filesystem (a plain path or ``file://``).

Atomicity through the filesystem:

* :meth:`~LocalStorage.write_pointer` writes a temp file beside the target, fsyncs it and
  ``os.replace``s it over the target;
* :meth:`~LocalStorage.create_marker` writes a fsynced temp file and ``os.link``s it to
  the target name, which fails if the target exists; readers therefore never see a half
  marker.  Either way the directory is fsynced, so the name is durable.

A file is fsynced before its writer's ``close`` returns.  A large file
(``open_write(..., direct=True)``: the shards' data files) is written with ``O_DIRECT``
(:class:`~raycheckpoint.storage.direct_io.DirectFile`): through two page-aligned bounce
buffers, one copied into while the other is written, or straight from the caller's
memory where it lies on page boundaries (a data file staged whole).  Its bytes go from
the staging buffers to the device without passing through the page cache: the kernel
neither copies nor caches them, and a save does not evict the node's page cache.  Such
a file is hashed a buffer (or a block) of
:data:`~raycheckpoint.storage.direct_io.DIRECT_CHUNK` at a time, in the thread that
writes it.  Where the filesystem refuses ``O_DIRECT``, or ``StorageSpec(direct_io=False)``,
it is written buffered, as every other file is, with ``os.writev`` for many pieces.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from raycheckpoint._internal import faults
from raycheckpoint.storage.base import Storage
from raycheckpoint.storage.direct_io import DirectFile
from raycheckpoint.storage.spec import Capabilities

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

logger = logging.getLogger(__name__)


class LocalStorage(Storage):
    """A root on this node's filesystem: system calls, not fsspec, on every hot path."""

    caps = Capabilities(local_paths=True, direct_io=True, atomic_create=True,
                                symlinks=True)

    def __init__(self, uri: str, options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(uri, options, **kwargs)
        if not isinstance(self.fs, LocalFileSystem):
            raise ValueError(f"{uri!r} is not a local path (fsspec gives {type(self.fs).__name__})")

    def _create_root(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def url(self, rel: str = "") -> str:
        return self.full_path(rel)

    # ---- writes -------------------------------------------------------------------------

    def open_sink(self, rel: str, *, direct: bool, hasher: Any) -> Any:
        full = self.full_path(rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        if direct and self.direct_io:
            try:  # it hashes each bounce buffer once filled: one call per 8 MB
                return DirectSink(DirectFile(full, hasher))
            except OSError as e:  # this filesystem has no O_DIRECT: buffered, then
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
        return LocalFile(full)

    def _replace(self, full: str, data: bytes) -> None:
        _publish(full, data, os.replace)

    def _create_once(self, full: str, data: bytes) -> None:
        _publish(full, data, os.link)  # link is atomic and fails if the marker exists

    def symlink(self, rel: str, target: str) -> None:
        full = self.full_path(rel)
        if os.path.lexists(full) and not os.path.islink(full):
            # `latest` is for people; a file or directory there (a root copied with the link
            # followed) is theirs: it is left alone, and never fails a commit
            logger.warning("%s is not a symbolic link (a copy of the root?): not pointed at %s",
                           full, target)
            return
        tmp = f"{full}.tmp-{os.getpid()}"
        _unlink_quietly(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, full)

    # ---- reads --------------------------------------------------------------------------

    def _read_once(self, rel: str, start: int | None, end: int | None) -> bytes:
        with open(self.full_path(rel), "rb") as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(end - (start or 0))

    def _open_size(self, rel: str, f: Any) -> int:
        return os.fstat(f.fileno()).st_size

    def open_read(self, rel: str) -> Any:
        return open(self.full_path(rel), "rb")

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self.full_path(rel))

    def size(self, rel: str) -> int:
        return os.stat(self.full_path(rel)).st_size

    def list_dir(self, rel: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self.full_path(rel)))
        except FileNotFoundError:
            return []

    def _forget_listing(self, full: str) -> None:
        """Nothing: local listings are not cached."""

    # ---- deletes ------------------------------------------------------------------------

    def delete(self, rel: str) -> None:
        faults.check("storage.delete", path=rel)
        _unlink_quietly(self.full_path(rel))

    def delete_tree(self, rel: str) -> None:
        faults.check("storage.delete", path=rel)
        full = self.full_path(rel)
        if os.path.islink(full) or os.path.isfile(full):
            _unlink_quietly(full)
        elif os.path.exists(full):
            shutil.rmtree(full)


class LocalFile:
    """The sink of a local file written buffered: fsynced on ``close``."""

    hashes_itself = False
    vectored = True
    writes_blocks = False
    direct = False

    def __init__(self, full: str) -> None:
        self._f = open(full, "wb")  # noqa: SIM115 - closed in close() / abort()

    def write(self, data: Any) -> None:
        self._f.write(data)

    def writev(self, views: list[memoryview]) -> None:
        self._f.flush()  # what went through the buffered file lies before these
        _writev_all(self._f.fileno(), views)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()


class DirectSink:
    """The sink of a local file written with ``O_DIRECT``: a
    :class:`~raycheckpoint.storage.direct_io.DirectFile`, which hashes its buffers."""

    hashes_itself = True
    vectored = True
    writes_blocks = True

    def __init__(self, file: DirectFile) -> None:
        self.file = file

    @property
    def direct(self) -> bool:
        return self.file.direct

    def write(self, data: Any) -> None:
        self.file.write([memoryview(data).cast("B")])

    def writev(self, views: list[memoryview]) -> None:
        self.file.write(views)

    def write_block(self, view: memoryview, hashing: Any) -> None:
        self.file.write_block(view, hashing)

    def flush(self) -> None:
        """Nothing: a DirectFile buffers only what is not yet a whole chunk."""

    def close(self) -> None:
        self.file.close()

    def abort(self) -> None:
        self.file.abort()


def _writev_all(fd: int, views: list[memoryview]) -> None:
    """``os.writev`` until every byte of ``views`` is written (a call may write fewer)."""
    i, n = 0, len(views)
    while i < n:
        written = os.writev(fd, views[i:i + IOV_MAX])
        if written == 0 and any(v.nbytes for v in views[i:i + IOV_MAX]):
            raise OSError(f"writev wrote nothing to fd {fd}")
        while i < n and written >= views[i].nbytes:
            written -= views[i].nbytes
            i += 1
        if written:  # a piece written in part: the rest of it goes next
            views[i] = views[i][written:]


def _publish(full: str, data: bytes, publish) -> None:
    """Write ``data`` to a fsynced temp file beside ``full``, then ``publish(tmp, full)``.

    ``os.replace`` replaces atomically, ``os.link`` creates exclusively; either way a reader
    sees the whole file or none of it.  The directory is fsynced so the name is durable.
    """
    directory = os.path.dirname(full)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, full)
    finally:
        _unlink_quietly(tmp)
    _fsync_dir(directory)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
