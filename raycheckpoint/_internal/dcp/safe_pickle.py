"""Every pickle a checkpoint holds, read without running anything it names.

DCP keeps two kinds of pickle in a role's directory: ``.metadata`` (a plain pickle of
torch's ``Metadata``) and, inside the ``.distcp`` files, the non-tensor items (a learning
rate, betas) as ``torch.save`` records.  Checksums catch accidents, not forgery: anyone
who can write an unencrypted root can replace these files and re-seal the manifest and
``COMMITTED`` (DESIGN section 8), and unpickling calls whatever a pickle names.  So every
reader of a checkpoint unpickles through this module, and only through it:

* :func:`load_metadata`: ``.metadata`` through the restricted unpickler of
  :mod:`~raycheckpoint._internal.dcp.metadata_unpickler` (an allow-list of the globals
  DCP metadata holds; nothing else is imported, created or called);
* :func:`check_metadata`: the same decisions over inert stand-ins, importing no torch:
  ``raycheckpoint verify`` (:func:`check_role_metadata`) refuses what a load would;
* :func:`load_item`: an item's ``torch.save`` record through torch's own weights-only
  unpickler (:func:`~raycheckpoint._internal.dcp.torch_records.load_record`), never
  torch's full one.

A pickle refused, truncated or malformed is an :class:`~raycheckpoint.errors.IntegrityError`
naming the file, and says that nothing in it ran.  Callers: the verifying reader (a
worker's load), :class:`~raycheckpoint.export.RoleReader` (``inspect``, ``export``, the
Hugging Face export, the background verifier) and ``raycheckpoint verify``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raycheckpoint._internal.dcp.metadata_unpickler import (
    DCP_METADATA_MODULE,
    WHAT_TO_DO,
    Inert,
    RestrictedUnpickler,
)
from raycheckpoint.errors import IntegrityError
from raycheckpoint.integrity.verify import read_verified
from raycheckpoint.protocol.paths import DCP_METADATA
from raycheckpoint.storage import FileEntry, Storage


def load_metadata(data: bytes | bytearray | memoryview, rel: str) -> Any:
    """DCP's ``Metadata`` from ``.metadata``'s bytes (``rel`` names the file in errors)."""
    from torch.distributed.checkpoint import Metadata

    metadata = RestrictedUnpickler(data, rel).load()
    if not isinstance(metadata, Metadata):
        raise IntegrityError(f"{rel}: holds a {type(metadata).__name__}, not DCP metadata "
                             f"(a forged or foreign file); {WHAT_TO_DO}", path=rel)
    return metadata


def check_metadata(data: bytes | bytearray | memoryview, rel: str) -> None:
    """Raise IntegrityError unless :func:`load_metadata` would admit ``data``'s globals and
    operations; imports no torch."""
    top = RestrictedUnpickler(data, rel, inert=True).load()
    if not (type(top) is Inert and top.instance and top.name == f"{DCP_METADATA_MODULE}.Metadata"):
        raise IntegrityError(f"{rel}: does not hold DCP metadata (a forged or foreign file); "
                             f"{WHAT_TO_DO}", path=rel)


def check_role_metadata(storage: Storage, files: Mapping[str, FileEntry]) -> int:
    """:func:`check_metadata` of every DCP ``.metadata`` among ``files`` (each verified
    against its entry first); an encrypted one is left to the load, which authenticates
    it.  Returns how many were checked."""
    from raycheckpoint.integrity.crypto import MAGIC

    checked = 0
    for rel in sorted(files):
        if rel.rsplit("/", 1)[-1] != DCP_METADATA:
            continue
        data = read_verified(storage, rel, files[rel])
        if data[:len(MAGIC)] != MAGIC:
            check_metadata(data, rel)
            checked += 1
    return checked


def load_item(record: bytes | bytearray | memoryview, rel: str, fqn: str) -> Any:
    """The object a DCP item's ``torch.save`` record holds (a non-tensor item, or a chunk
    read on its own), through torch's weights-only unpickler; its tensors own their memory."""
    from raycheckpoint._internal.dcp.torch_records import load_record

    try:
        return load_record(memoryview(record if type(record) is bytearray else bytearray(record)))
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure decoding the record is the file's
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise IntegrityError(
            f"{rel}: item {fqn!r} is damaged, or holds what torch's weights-only unpickler "
            f"refuses ({first}); {WHAT_TO_DO}. (A non-tensor item saved on purpose must be "
            "a plain value: numbers, strings, lists, dicts; or of a type passed to "
            "torch.serialization.add_safe_globals.)", path=rel) from None
