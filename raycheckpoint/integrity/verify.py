"""Checking stored bytes against a manifest's entries: the one verification path.

Every reader of a checkpoint (resume, ``raycheckpoint verify``, export, a worker's load)
checks what it reads through these functions, which raise
:class:`~raycheckpoint.errors.IntegrityError` naming the file:

* :func:`read_verified`: read a (small) file whole, a missing one being an
  IntegrityError, check it, decrypt it if asked: what every metadata read does;
* :func:`verify_files`: hash a set of files streamed, in bounded chunks: the one loop
  behind ``verify``, export and a full check of a checkpoint;
* :func:`check_size` and :func:`check_digest`: the two checks themselves, for readers
  that get the bytes another way (a memory-mapped file, a buffer filled by a stream).

Kept free of torch and Ray so the ``raycheckpoint`` command can verify on any machine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from raycheckpoint.errors import IntegrityError
from raycheckpoint.integrity import digest
from raycheckpoint.storage import FileEntry, Storage

CHUNK_BYTES = 8 << 20


def check_size(rel: str, size: int, expected: FileEntry | None) -> FileEntry:
    """Raise IntegrityError unless ``rel`` is listed with this ``size``; returns its entry."""
    if expected is None:
        raise IntegrityError(f"{rel}: not listed in the checkpoint's manifest; refusing to read it",
                             path=rel)
    if size != expected.size:
        raise IntegrityError(
            f"{rel}: size {size} bytes, manifest says {expected.size} (truncated or "
            "overwritten file)", path=rel)
    return expected


def check_digest(rel: str, got: str, expected: FileEntry) -> None:
    """Raise IntegrityError unless ``got`` (a digest made as ``expected``'s) is the manifest's."""
    if got != expected.digest:
        algorithm = expected.algorithm
        strip = (lambda d: d.partition(":")[2]) if algorithm != "sha256" else (lambda d: d)
        raise IntegrityError(
            f"{rel}: {algorithm} {strip(got)[:16]}... does not match the manifest's "
            f"{strip(expected.digest)[:16]}... (corrupted file)", path=rel)


def verify_bytes(rel: str, data: bytes | memoryview, expected: FileEntry | None,
                 *, checksums: bool) -> None:
    """Raise IntegrityError unless ``data`` is the file the manifest lists as ``rel``;
    ``checksums=False`` checks its size only."""
    entry = check_size(rel, len(data), expected)
    if checksums:
        check_digest(rel, digest.like(data, entry.digest), entry)


def missing(rel: str) -> IntegrityError:
    """The error for a listed file that storage does not have."""
    return IntegrityError(f"{rel}: missing from storage", path=rel)


def read_verified(storage: Storage, rel: str, expected: FileEntry | None, *,
                  checksums: bool = True, decrypt: bool = False) -> bytes:
    """``rel``'s bytes, read whole and checked against ``expected``.  ``decrypt``: a data
    file (written encrypted where the root has a key), decrypted and so authenticated; with
    a key, one stored in the clear is refused (:meth:`Storage.decrypted
    <raycheckpoint.storage.base.Storage.decrypted>`)."""
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError as e:
        raise missing(rel) from e
    verify_bytes(rel, data, expected, checksums=checksums)
    return storage.decrypted(rel, data) if decrypt else data


def verify_file(storage: Storage, rel: str, expected: FileEntry | None,
                progress: Callable[[int], None] | None = None, *,
                threads: int = digest.AUTO) -> None:
    """Hash ``rel`` in :data:`CHUNK_BYTES` reads (memory stays bounded); check size and checksum.

    ``progress(n)`` is called with the bytes of each chunk read.
    """
    if expected is None:
        raise IntegrityError(f"{rel}: not listed in the checkpoint's manifest", path=rel)
    h, size = digest.new(expected.algorithm, threads=threads), 0
    try:
        with storage.open_read(rel) as f:
            while chunk := f.read(CHUNK_BYTES):
                h.update(chunk)
                size += len(chunk)
                if progress is not None:
                    progress(len(chunk))
    except FileNotFoundError as e:
        raise missing(rel) from e
    check_size(rel, size, expected)
    check_digest(rel, digest.finish(expected.algorithm, h), expected)


def verify_files(storage: Storage, files: Mapping[str, FileEntry],
                 progress: Callable[[int], None] | None = None, *,
                 threads: int = digest.AUTO) -> None:
    """:func:`verify_file` for every file of ``files`` (path -> entry), in path order; the
    first failure is raised.  ``threads``: for a BLAKE3 hash (AUTO: every core)."""
    for path in sorted(files):
        verify_file(storage, path, files[path], progress, threads=threads)
