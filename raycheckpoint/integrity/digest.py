"""File checksums: the algorithms a manifest's digests are made with.

A file's digest is the checksum of its stored bytes, written ``"blake3:<hex>"``, or for
sha256 as the bare hex string format 1 used: a checkpoint saved with
``checkpoint.checksum_algorithm=sha256`` stays readable by releases that read format 1.

BLAKE3 is the default.  Like sha256 it is a 256-bit cryptographic hash; it runs about
twice as fast on one core (3.1 against 1.55 GB/s with SHA-NI on this project's test
machines) and can hash one file on several cores.  A load verifies every byte it reads,
and on one core sha256 was its slowest step (1.3 GB/s beside the tensor copies, where
a warm 500 MB load took 453 ms with sha256, 291 ms with BLAKE3 and 117 ms without a
check).  Both release the GIL.

Kept free of torch and Ray, like :mod:`raycheckpoint.integrity.verify`.  The ``blake3``
package is imported where a BLAKE3 digest is made, not before: a machine without it
(a GPU node with no package index, say) still writes and reads sha256 checkpoints, and
is told what is missing the moment it needs BLAKE3.
"""

from __future__ import annotations

import hashlib
from typing import Any

from raycheckpoint.errors import MissingDependencyError

ALGORITHMS = ("blake3", "sha256")
DEFAULT = "blake3"
# the oldest on-disk format whose readers know each algorithm (see format.version_info)
READABLE_SINCE = {"sha256": 1, "blake3": 2}
# threads=AUTO: as many as the machine has (BLAKE3 only; sha256 is one stream)
AUTO = -1


def check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}: use one of {ALGORITHMS}")
    return algorithm


def available(algorithm: str) -> bool:
    """Whether this process can make ``algorithm``'s digests."""
    if check_algorithm(algorithm) == "sha256":
        return True
    try:
        _blake3()
    except MissingDependencyError:
        return False
    return True


def _blake3() -> Any:
    try:
        import blake3
    except ImportError as e:
        raise MissingDependencyError(
            "BLAKE3 checksums need the blake3 package, which this Python cannot import "
            f"({e}): install it (pip install blake3), or write with "
            "checkpoint.checksum_algorithm=sha256") from e
    return blake3


def new(algorithm: str, *, threads: int = 1) -> Any:
    """A hasher (``update``, ``hexdigest``) for ``algorithm``; ``threads``: BLAKE3's, for
    one large input (1 in a background save, which shares the cores with training)."""
    if check_algorithm(algorithm) == "sha256":
        return hashlib.sha256()
    blake3 = _blake3()
    return blake3.blake3(max_threads=blake3.blake3.AUTO if threads == AUTO else max(1, threads))


def finish(algorithm: str, hasher: Any) -> str:
    """The digest string of a finished hasher, as the manifest holds it."""
    hexdigest = hasher.hexdigest()
    return hexdigest if algorithm == "sha256" else f"{algorithm}:{hexdigest}"


def algorithm_of(digest: str) -> str:
    """Which algorithm made ``digest`` (a bare hex string is sha256, as format 1 wrote)."""
    algorithm, sep, _ = digest.partition(":")
    return check_algorithm(algorithm) if sep else "sha256"


def of(data: Any, algorithm: str, *, threads: int = 1) -> str:
    """The digest of ``data`` (bytes-like) with ``algorithm``."""
    h = new(algorithm, threads=threads)
    h.update(data)
    return finish(algorithm, h)


def like(data: Any, expected: str, *, threads: int = 1) -> str:
    """The digest of ``data`` made as ``expected`` was, to compare with it."""
    return of(data, algorithm_of(expected), threads=threads)
