"""Which backend serves which kind of URI: one line per backend.

A URI's kind is its fsspec protocol (``s3://b/p`` is ``s3``; a plain path is ``file``).
Kinds not listed here are served by :class:`~raycheckpoint.storage.base.Storage` itself,
through plain fsspec calls (``gs://``, ``az://``, ``hdfs://``, ...): it has no atomic
exclusive create, so such a root serves the operator tools but not a job
(:mod:`~raycheckpoint.storage.atomic`).  A backend for another kind is one module with a
:class:`~raycheckpoint.storage.base.Storage` subclass (its
:class:`~raycheckpoint.storage.spec.Capabilities` and the operations it does
differently, such as an atomic exclusive create), and a line here.  Backends are imported on
first use, so a root on local disk never imports s3fs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import fsspec

if TYPE_CHECKING:
    from raycheckpoint.storage.base import Storage

BACKENDS: dict[str, str] = {
    "file": "raycheckpoint.storage.posix:LocalStorage",
    "local": "raycheckpoint.storage.posix:LocalStorage",
    "s3": "raycheckpoint.storage.s3:S3Storage",
    "s3a": "raycheckpoint.storage.s3:S3Storage",
    "memory": "raycheckpoint.storage.memory:MemoryStorage",
    "rcmem": "raycheckpoint.storage.raymem:RayMemoryStorage",
    "rcnode": "raycheckpoint.storage.raymem:RayMemoryStorage",
}


def kind_of(uri: str) -> str:
    """The kind of ``uri``: its protocol, ``file`` for a plain path."""
    protocol, _ = fsspec.core.split_protocol(uri)
    return protocol or "file"


def backend_for(uri: str) -> type[Storage]:
    """The Storage class that serves ``uri``."""
    target = BACKENDS.get(kind_of(uri))
    if target is None:
        from raycheckpoint.storage.base import Storage

        return Storage
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
