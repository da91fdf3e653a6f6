"""Storage: the one place raycheckpoint touches bytes, one backend object per kind of URI.

The root is any fsspec URI (``/abs/dir``, ``file://``, ``memory://``, ``s3://bucket/p``);
``Storage(uri)`` opens the backend for its kind (:mod:`.registry`):

=====================  ==========================================  =====================
module                 backend                                     kinds
=====================  ==========================================  =====================
:mod:`.posix`          :class:`~.posix.LocalStorage`               plain paths, file://
:mod:`.s3`             :class:`~.s3.S3Storage`                     s3://, s3a://
:mod:`.memory`         :class:`~.memory.MemoryStorage`             memory://
:mod:`.raymem`         :class:`~.raymem.RayMemoryStorage`          rcmem://, rcnode://
:mod:`.base`           :class:`~.base.Storage` (generic fsspec)    anything else
=====================  ==========================================  =====================

Each declares its :class:`~.spec.Capabilities` (local paths, ``O_DIRECT``, atomic
exclusive create, private to one job, symlinks, shared), which is what code outside this
package asks.  Atomicity (pointer replace, exclusive create) lives in the backends and
nowhere else; which roots may hold ``LEASE`` and ``COMMITTED`` (an atomic exclusive
create: not the generic backend) is :mod:`.atomic`'s rule;
every write streams through a :class:`~.writer.HashingWriter`; every operation is
retried while it fails transiently (:mod:`.retry`).  A :class:`~.spec.StorageSpec` is
the picklable description other processes open.
"""

from raycheckpoint.storage.base import Storage
from raycheckpoint.storage.spec import Capabilities, FileEntry, StorageSpec
from raycheckpoint.storage.writer import HashingWriter

__all__ = ["Capabilities", "FileEntry", "HashingWriter", "Storage", "StorageSpec"]
