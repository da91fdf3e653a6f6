"""Checking bytes against the manifest: in memory, or streamed in bounded chunks.

Kept free of torch and Ray so the ``raycheckpoint`` command can verify a checkpoint on
any machine.  Both functions raise :class:`~raycheckpoint.errors.IntegrityError` naming
the file.
"""

from __future__ import annotations

from collections.abc import Callable

from raycheckpoint import digest
from raycheckpoint.errors import IntegrityError
from raycheckpoint.storage import FileEntry, Storage

CHUNK_BYTES = 8 << 20


def verify_bytes(rel: str, data: bytes | memoryview, expected: FileEntry | None,
                 *, checksums: bool) -> None:
    """Raise IntegrityError unless ``data`` is the file the manifest lists as ``rel``;
    ``checksums=False`` checks its size only."""
    entry = check_size(rel, len(data), expected)
    if checksums:
        check_digest(rel, digest.like(data, entry.digest), entry)


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


def verify_file(storage: Storage, rel: str, expected: FileEntry | None,
                progress: Callable[[int], None] | None = None) -> None:
    """Hash ``rel`` in :data:`CHUNK_BYTES` reads (memory stays bounded); check size and checksum.

    ``progress(n)`` is called with the bytes of each chunk read.
    """
    if expected is None:
        raise IntegrityError(f"{rel}: not listed in the checkpoint's manifest", path=rel)
    h, size = digest.new(expected.algorithm, threads=digest.AUTO), 0
    try:
        with storage.open_read(rel) as f:
            while chunk := f.read(CHUNK_BYTES):
                h.update(chunk)
                size += len(chunk)
                if progress is not None:
                    progress(len(chunk))
    except FileNotFoundError as e:
        raise IntegrityError(f"{rel}: missing from storage", path=rel) from e
    check_size(rel, size, expected)
    check_digest(rel, digest.finish(expected.algorithm, h), expected)
