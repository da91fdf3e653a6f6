"""Vouching for an encrypted checkpoint whose marker has no MAC: ``raycheckpoint reseal``.

With a key, a reader refuses a checkpoint whose ``COMMITTED`` carries no MAC
(:mod:`~raycheckpoint.integrity.crypto`), such as those an encrypted job wrote before
markers were authenticated.  An operator who trusts one seals it with :func:`reseal`,
which first checks everything the key can check:

1. ``COMMITTED`` exists, the manifest matches its size and sha256, and the manifest
   records this key (its key id);
2. every file the manifest lists is there, with its size and checksum;
3. every data file (a role's DCP directory, the ranks' state files) is encrypted and
   authenticates, chunk by chunk, under the key at its own path: the key's holder wrote
   it there;

then replaces ``COMMITTED`` (atomically) with the same marker and its MAC.  The files
left in the clear (trainer state, version, assets) the key cannot vouch for: running the
command vouches for them.  A marker with a MAC is left alone when the MAC is right and
refused when it is wrong: an altered checkpoint is never sealed.  Refused while a job
holds the root's lease.  A tiered job's tiers are separate roots: reseal each.
Called by the ``raycheckpoint`` command; free of Ray and torch.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from raycheckpoint.errors import LeaseHeldError
from raycheckpoint.integrity.crypto import (
    HEADER,
    MAGIC,
    TAG_BYTES,
    AuthenticationError,
    EncryptionKeyError,
    check_key,
)
from raycheckpoint.integrity.verify import verify_files
from raycheckpoint.protocol.checkpoint import read_committed
from raycheckpoint.protocol.format import Manifest
from raycheckpoint.protocol.lease import read_lease
from raycheckpoint.protocol.paths import RNG_DIR, CheckpointPaths
from raycheckpoint.storage import Storage

# plaintext bytes authenticated per read of a data file
WINDOW_BYTES = 64 << 20


def reseal(storage: Storage, name: str) -> dict[str, Any]:
    """Check committed checkpoint ``name`` of ``storage`` (opened with the key) and seal
    its marker (see the module doc).  Returns ``{"name", "sealed", "data_files", "files"}``
    (``sealed`` False: it already carried the right MAC)."""
    cipher = storage.cipher
    if cipher is None:
        raise EncryptionKeyError("reseal needs the checkpoint's key: pass --encryption-key")
    lease = read_lease(storage)
    if lease is not None and lease.fresh():
        raise LeaseHeldError(f"{storage.url()} is in use by {lease.describe()}; reseal its "
                             "checkpoints once the job has stopped", holder=lease.job_name)
    marker, _, manifest = read_committed(storage, name, authenticate=False)
    paths = CheckpointPaths(name)
    rel = paths.manifest
    check_key(manifest.encryption, cipher, name, path=rel)
    result = {"name": name, "files": len(manifest.files)}
    if marker.mac is not None:
        if not cipher.authentic(asdict(marker)):
            raise AuthenticationError(
                f"{paths.committed}: carries an authentication code that does not match: the "
                "checkpoint was altered; it is not sealed again", path=paths.committed)
        return {**result, "sealed": False, "data_files": 0}
    verify_files(storage, manifest.files)
    data_files = sorted(p for p in manifest.files if _is_data_file(p, manifest))
    for path in data_files:
        _authenticate(storage, path, manifest.files[path].size)
    sealed = replace(marker, mac=cipher.marker_mac(asdict(marker)))
    storage.write_pointer(paths.committed, sealed.to_bytes())
    return {**result, "sealed": True, "data_files": len(data_files)}


def _is_data_file(path: str, manifest: Manifest) -> bool:
    """Whether ``path`` is written encrypted under a key: a file of a role's DCP directory
    or a rank's state file."""
    parts = path.split("/")
    return (len(parts) > 2 and parts[1] == RNG_DIR) or any(
        path.startswith(layout.dcp_dir + "/") for layout in manifest.roles.values())


def _authenticate(storage: Storage, rel: str, size: int) -> None:
    """Raise unless ``rel`` (``size`` stored bytes) is encrypted and every chunk of it
    authenticates under the storage's key; reads :data:`WINDOW_BYTES` at a time."""
    cipher = storage.cipher
    head = storage.read_bytes(rel, 0, min(size, HEADER.size))
    if head[:len(MAGIC)] != MAGIC:
        raise AuthenticationError(f"{rel}: stored in the clear, but every data file of an "
                                  "encrypted checkpoint is encrypted; it is not sealed",
                                  path=rel)
    chunk = HEADER.unpack(head)[1] if len(head) == HEADER.size else 1
    count = max(1, -(-(size - HEADER.size) // (chunk + TAG_BYTES)))
    plain = size - HEADER.size - count * TAG_BYTES
    window = max(chunk, WINDOW_BYTES // chunk * chunk)
    for start in range(0, max(plain, 1), window):
        cipher.decrypt_range(rel, lambda a, b: storage.read_bytes(rel, a, b), size, start,
                             min(plain, start + window))
