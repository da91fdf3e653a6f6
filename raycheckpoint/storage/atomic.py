"""The exclusive create (``LEASE``, ``COMMITTED``), and which roots may make it: those
whose backend has an atomic exclusive create.

The lease (one job per root) and the commit (``COMMITTED`` present means complete,
created once) rest on an exclusive create.  Made as a check followed by a write, it
lets two writers both find nothing and both write, each believing the file its own: two
jobs on one root, or a marker a dead job's coordinator overwrote.  So:

* at job start, before a lease is taken,
  :meth:`Storage.require_atomic_create <raycheckpoint.storage.base.Storage.require_atomic_create>`
  refuses a root whose backend has no atomic create (``Capabilities.atomic_create``),
  naming the root, the backend and what to use instead (:func:`refusal`).  A backend
  that can show its create works does so there, once per Storage: on S3 the store must
  refuse a second conditional PUT of a probe key (a store that ignores
  ``If-None-Match`` is refused too);
* :meth:`Storage.create_marker <raycheckpoint.storage.base.Storage.create_marker>`
  refuses the same, whoever calls it: the last line of defence.  It lets through roots
  private to one job (``Capabilities.job_private``: the memory tier's holders,
  ``rcmem://``, and the per-node agents, ``rcnode://``, named after the job's durable
  root, whose lease guards the job); such a root is never leased itself.

Today: local paths (``link(2)``), ``memory://`` (one process, under a lock) and ``s3://``
(``If-None-Match: *``) have an atomic create; every other fsspec backend (``gs://``,
``az://``, ``hdfs://``, ...) is served by the generic backend, which has none.  Tools
that only read (``raycheckpoint ls``, ``verify``, ``inspect``, ``export``) or replace
pointers and delete (``tag``, ``untag``, ``gc``) create neither file and work on any
fsspec backend.

:class:`ExclusiveCreate` is the part of :class:`~raycheckpoint.storage.base.Storage`
that does it: the checks, the create retried (recognising its own earlier write), and
the hook a backend overrides (:meth:`ExclusiveCreate._create_once`, one atomic create).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raycheckpoint._internal import faults
from raycheckpoint.errors import StorageCapabilityError

if TYPE_CHECKING:
    from raycheckpoint.storage.base import Storage

JOB_ROOT = "a job's root (its LEASE and each checkpoint's COMMITTED marker)"
# what a job's root can be instead (docs/STORAGE.md: "Where a root can live")
WORKS = ("a local path, or a filesystem every node mounts whose link(2) is atomic (NFS, "
         "Lustre, GPFS, CephFS, ...), or s3:// on a store that refuses a conditional PUT "
         "(If-None-Match: *) of an existing key (AWS S3, MinIO, Ceph's RADOS Gateway)")


def backend_name(storage: Storage) -> str:
    """``gs:// (gcsfs.GCSFileSystem)``: the URI's kind and the fsspec class serving it."""
    fs = type(storage.fs)
    return f"{storage.protocol}:// ({fs.__module__.split('.')[0]}.{fs.__name__})"


def refusal(storage: Storage, what: str, why: str | None = None) -> StorageCapabilityError:
    """The error refusing ``storage`` for ``what``; ``why``: the reason, when it is not
    that the backend has no atomic create."""
    backend = backend_name(storage)
    why = why or (f"the {backend} backend has none (its create would be a check, then a "
                  "write, which two writers can both pass, each believing the file its own)")
    return StorageCapabilityError(
        f"{storage.url()}: {what} needs an atomic exclusive create, and {why}. Put the job's "
        f"root (save_dir, checkpoint.local_dir) on {WORKS}. The tools that only read "
        "(raycheckpoint ls, verify, inspect, export) work on this root as it is.",
        uri=storage.url(), backend=backend)


class ExclusiveCreate:
    """:class:`~raycheckpoint.storage.base.Storage`'s exclusive create (see the module
    doc); it uses the Storage's ``caps``, ``fs``, ``full_path`` and ``retrying``."""

    caps: Any
    fs: Any
    _create_proven = False  # require_atomic_create found the create atomic here

    def require_atomic_create(self, what: str = JOB_ROOT) -> None:
        """Refuse this root for ``what`` unless its exclusive create is atomic
        (:mod:`~raycheckpoint.storage.atomic`): a StorageCapabilityError naming the root,
        the backend and what to use instead.  A job calls it before taking its lease; a
        backend that can show its create works (:meth:`_prove_atomic_create`) does so
        here, once."""
        if not self.caps.atomic_create:
            raise refusal(self, what)
        if not self._create_proven:
            self._prove_atomic_create(what)
            self._create_proven = True

    def _prove_atomic_create(self, what: str) -> None:
        """Raise StorageCapabilityError (:func:`refusal` for ``what``) if the exclusive
        create turns out not to be atomic here (a store ignoring a condition); nothing
        to show by default."""

    def create_marker(self, rel: str, data: bytes) -> None:
        """Create ``rel`` holding ``data``; raise FileExistsError if it already exists.

        Refused (StorageCapabilityError) where the create is not atomic and the root is
        not private to one job (:mod:`~raycheckpoint.storage.atomic`).  A create whose
        answer was lost may be retried (by :meth:`retrying`, or inside the client, as
        botocore does) and then find the file it wrote itself: a file there holding
        exactly ``data`` is taken as ours.  Callers make ``data`` unique to the writer
        (the lease's owner token, ``COMMITTED``'s manifest digest and time).
        """
        faults.check("storage.marker", path=rel)
        if not (self.caps.atomic_create or self.caps.job_private):
            raise refusal(self, f"creating {rel}")
        self._create_exclusive(rel, data)

    def _create_exclusive(self, rel: str, data: bytes) -> None:
        """:meth:`create_marker`'s create, retried, recognising our own earlier write."""
        full = self.full_path(rel)

        def once() -> None:
            try:
                self._create_once(full, data)
            except FileExistsError:
                if self._read_quietly(full) == data:
                    return
                raise

        self.retrying("create", rel, once)

    def _create_once(self, full: str, data: bytes) -> None:
        """One exclusive create of ``full``, FileExistsError if it exists: each backend
        that declares ``atomic_create`` (or ``job_private``) has its own."""
        raise NotImplementedError(f"{type(self).__name__} has no exclusive create")

    def _read_quietly(self, full: str) -> bytes | None:
        try:
            self.fs.invalidate_cache(full)
            return self.fs.cat_file(full)
        except Exception:  # noqa: BLE001 - only used to recognise our own earlier write
            return None
