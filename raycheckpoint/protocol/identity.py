"""A root's identity: a random id that the root itself holds (``<root>/IDENTITY``).

The memory tier's holders outlive the job that filled them (:mod:`~raycheckpoint.protocol.memory`)
and are named after the durable root's URL, which outlives the root's contents: a root
wiped by hand (``rm -rf``, an emptied bucket prefix) and started afresh has the same URL.
So a job does not trust the holders by name alone: when it first leases a root, it reads
the root's identity, or creates one (a random id, with the storage's atomic exclusive
create: two jobs racing agree on the one that was written first), and the holders serve
it only what was copied under the same identity.  A wiped root gets a new identity at
its next lease; the copies made under the old one are never served again.

Called by :func:`raycheckpoint.roots.open_roots` once the root is leased.  The file is
small JSON (``{"id": ..., "created_at": ...}``) for people; an unreadable one still names
the root (the identity is then a hash of its bytes), so a damaged file never stops a job.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid

from raycheckpoint.protocol.paths import IDENTITY
from raycheckpoint.storage import Storage


def root_identity(storage: Storage) -> str:
    """The identity of ``storage``'s root, created when the root has none (see the module
    doc)."""
    try:
        return _parse(storage.read_bytes(IDENTITY))
    except FileNotFoundError:
        pass
    data = json.dumps({"id": uuid.uuid4().hex, "created_at": time.time()},
                      sort_keys=True).encode()
    try:
        storage.create_marker(IDENTITY, data)
    except FileExistsError:  # another job created it meanwhile: theirs is the root's
        return _parse(storage.read_bytes(IDENTITY))
    return _parse(data)


def read_identity(storage: Storage) -> str | None:
    """The identity of ``storage``'s root; None when it has none (never leased since it was
    created or wiped)."""
    try:
        return _parse(storage.read_bytes(IDENTITY))
    except FileNotFoundError:
        return None


def _parse(data: bytes) -> str:
    try:
        found = json.loads(data).get("id")
    except (ValueError, AttributeError):
        found = None
    if isinstance(found, str) and found:
        return found
    return "sha256:" + hashlib.sha256(data).hexdigest()[:32]
