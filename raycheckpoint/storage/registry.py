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

# What a kind's backend needs beyond fsspec: the package, and the extra that installs it
NEEDS: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
}

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
    """The Storage class that serves ``uri``; a
    :class:`~raycheckpoint.errors.MissingDependencyError` naming the package and extra when
    the kind's client library is not installed here."""
    kind = kind_of(uri)
    if kind in NEEDS:
        package, extra = NEEDS[kind]
        try:
            importlib.import_module(package)
        except ImportError as e:
            from raycheckpoint.errors import MissingDependencyError

            raise MissingDependencyError(
                f"{uri}: a {kind}:// root needs {package}, which cannot be imported here ({e}); "
                f"install it with: pip install 'raycheckpoint[{extra}]'") from e
    target = BACKENDS.get(kind)
    if target is None:
        from raycheckpoint.storage.base import Storage

        return Storage
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
