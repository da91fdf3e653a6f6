"""The values of the storage layer: a written file's entry, a root's spec, a backend's
capabilities.

:class:`FileEntry` is what every write returns and what a manifest lists (path, size,
checksum).  :class:`StorageSpec` describes a root so that other processes (Ray workers,
the coordinator actor) can open the same :class:`~raycheckpoint.storage.Storage` there.
:class:`Capabilities` is what a backend can do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raycheckpoint.integrity import digest

if TYPE_CHECKING:
    from raycheckpoint.storage.base import Storage


@dataclass(frozen=True)
class FileEntry:
    """A written file: path relative to the storage root, byte size and checksum.

    ``digest`` is ``"blake3:<hex>"`` or a bare sha256 hex string
    (:mod:`raycheckpoint.integrity.digest`).
    """

    path: str
    size: int
    digest: str

    @property
    def algorithm(self) -> str:
        return digest.algorithm_of(self.digest)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "digest": self.digest}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FileEntry:
        return cls(path=d["path"], size=int(d["size"]), digest=d["digest"])


@dataclass(frozen=True)
class StorageSpec:
    """A picklable description of a storage root; ``open()`` builds its Storage (the
    backend for the URI's kind)."""

    uri: str
    options: dict[str, Any] = field(default_factory=dict)
    retries: int = 5
    cipher: Any = field(default=None, repr=False)  # crypto.FileCipher: encrypts data files
    checksum: str = digest.DEFAULT  # the algorithm of the files it writes
    direct_io: bool = True  # large local files with O_DIRECT where the filesystem allows

    def open(self) -> Storage:
        from raycheckpoint.storage.base import Storage

        return Storage(for_this_node(self.uri), self.options, retries=self.retries,
                       cipher=self.cipher, checksum=self.checksum, direct_io=self.direct_io)

    def child(self, name: str) -> StorageSpec:
        return StorageSpec(self.uri.rstrip("/") + "/" + name, self.options, self.retries,
                           self.cipher, self.checksum, self.direct_io)


NODE_ID = "{node_id}"  # in a local directory: the Ray node id of the process opening it


def for_this_node(uri: str) -> str:
    """``uri`` with :data:`NODE_ID` replaced by this process's Ray node id (a directory of
    each node's own, also where every node mounts one filesystem)."""
    if NODE_ID not in uri:
        return uri
    import ray

    return uri.replace(NODE_ID, ray.get_runtime_context().get_node_id())


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do: the questions code outside the storage package asks."""

    # full_path() is a path of this node's filesystem: files may be memory-mapped, paged
    # into the page cache ahead of a read, and written with O_DIRECT; where False, every
    # read is a request to a server, worth starting early
    local_paths: bool = False
    # large files can be written around the page cache (O_DIRECT)
    direct_io: bool = False
    # create_marker is atomic against a concurrent writer (link(2), a conditional PUT):
    # what a root needs to hold a job's LEASE and its checkpoints' COMMITTED markers
    atomic_create: bool = False
    # only one job's coordinator ever writes here (actors named after its durable root,
    # whose lease guards the job): create_marker may check, then write, and is allowed
    # without atomic_create; such a root is never leased itself
    job_private: bool = False
    # a `latest` symlink can be kept beside LATEST, for people
    symlinks: bool = False
    # other processes see what is written (memory:// is one process's)
    shared: bool = True
