"""Tiers served by actors as roots: ``rcmem://<tier>`` (the memory tier's replica holders)
and ``rcnode://<tier>`` (per-node local directories, each served by its node's agent).

A tiered job with ``checkpoint.memory_replicas`` keeps its newest checkpoint in the host
memory of :class:`~raycheckpoint.protocol.memory.ReplicaHolder` actors, one per node
(:mod:`raycheckpoint.protocol.memory` places them and decides which holders keep which
rank's files).  This module makes the union of those holders a filesystem
(:class:`RayMemoryFileSystem`, fsspec protocol ``rcmem``), so the rest of the library
reads, verifies and loads a checkpoint of the memory tier exactly as one on disk:

* the holders of tier ``<tier>`` are the live named Ray actors ``memory-<tier>-*`` of
  the ``raycheckpoint`` namespace: a holder that died (its node lost) is simply absent,
  and so are the files only it held;
* a read is served by the first live holder that has the file; a listing is the union
  of every live holder's files;
* a write (the metadata: manifest, ``COMMITTED``, ``LATEST``, the catalog) goes to every
  live holder, so any one that survives shows the committed checkpoint; a delete
  reaches every live holder;
* option ``identity`` (a job's spec carries it): every call tells the holders the root
  identity the job's roots have now, and a holder whose files were copied under another
  one drops them, so the job never reads them (without it, an operator's look, the
  holders answer unchecked); option ``idle_ttl_s``: the lifetime of the holders a copy
  starts (:class:`~raycheckpoint.protocol.nodes.IdleLifetime`).

The exclusive create (``COMMITTED``) is a check, then a write to every live holder: not
atomic, and allowed because such a root is private to one job (``Capabilities.job_private``,
:mod:`~raycheckpoint.storage.atomic`).  Its actors are named after the job's durable
root, whose lease guards the job: a second job on that root is refused before it starts
any, so the only writer is the coordinator of the job holding that lease.  These roots
are never leased themselves, and no job's ``save_dir`` or ``local_dir`` can be one.

It needs a Ray connection (the driver's, a worker's or the coordinator's).  Shard files
are not written through here: the memory tier's replication puts each rank's files in
the holders its placement picks, verified by checksum as they arrive.

``rcnode://<tier>`` (:class:`RayNodesFileSystem`) is the same union over the agents
``nodes-<tier>-*`` (:class:`~raycheckpoint.protocol.nodes.NodeDirAgent`), each serving its
node's local directory (``checkpoint.local_dir_per_node``): the ranks write their shards
on their own node's disk, the coordinator's metadata reaches every node's directory, and
a read is served from this node's own directory when the file is there (option
``local_dir``: the directory template), else by the agent of a node that has it.
"""

from __future__ import annotations

import io
import os
import posixpath
import time
from typing import Any

from fsspec import AbstractFileSystem, register_implementation

from raycheckpoint.storage.base import Storage
from raycheckpoint.storage.spec import Capabilities, FileEntry, StorageSpec

PROTOCOL = "rcmem"
NODES_PROTOCOL = "rcnode"
HOLDERS_TTL_S = 1.0  # how long a lookup of the live holders is reused
UPLOAD_TIMEOUT_S = 3600.0  # the nodes' uploads of one checkpoint (a failure is retried)
NAMESPACE = "raycheckpoint"  # where the holders are named (the coordinators' namespace)


def holder_prefix(tier: str, kind: str = "memory") -> str:
    """The name prefix of tier ``tier``'s actors (``memory`` holders or ``nodes`` agents)."""
    return f"{kind}-{tier}-"


def live_holders(tier: str, kind: str = "memory") -> list[Any]:
    """Handles of the live actors of ``tier`` (``kind``: see :func:`holder_prefix`), in name
    order."""
    import ray

    prefix = holder_prefix(tier, kind)
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix))
    out = []
    for name in names:
        try:
            out.append(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:  # died since it was listed
            continue
    return out


class _View(io.RawIOBase):
    """A held file opened for reading: a read-only view of the bytes Ray delivered (no
    copy until the reader's own ``readinto``)."""

    def __init__(self, data: Any) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    @property
    def size(self) -> int:
        return self._view.nbytes

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._view.nbytes}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, out: Any) -> int:
        out = memoryview(out).cast("B")
        n = max(0, min(out.nbytes, self._view.nbytes - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        end = self._view.nbytes if size is None or size < 0 else min(self._view.nbytes,
                                                                      self._pos + size)
        data = self._view[self._pos:end].tobytes()
        self._pos = max(self._pos, end)
        return data


class _Upload(io.BytesIO):
    """A file opened for writing: its bytes go to every live holder when it is closed."""

    def __init__(self, fs: RayMemoryFileSystem, path: str) -> None:
        super().__init__()
        self._fs, self._path = fs, path

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            self._fs.pipe_file(self._path, data)

    def discard(self) -> None:
        super().close()


class RayMemoryFileSystem(AbstractFileSystem):
    """The files of one memory tier's holders (see the module doc)."""

    protocol = PROTOCOL
    kind = "memory"
    cachable = False  # a fresh view of which holders live on every open

    def __init__(self, timeout_s: float = 120.0, local_dir: str | None = None,
                 identity: str | None = None, idle_ttl_s: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timeout_s = timeout_s
        self.local_dir = local_dir  # rcnode: this node's directory (a template)
        self.identity = identity  # the root identity the holders must serve (see the module doc)
        self.idle_ttl_s = idle_ttl_s  # the lifetime of actors started for this root
        self._as = {} if identity is None else {"identity": identity}  # each call's keywords
        self._found: tuple[float, str, list[Any]] | None = None  # (when, tier, handles)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        prefix = cls.protocol + "://"
        path = path[len(prefix):] if path.startswith(prefix) else path
        return path.strip("/")

    # ---- the holders ------------------------------------------------------------------------

    def _holders(self, path: str, *, fresh: bool = False) -> list[Any]:
        """The live holders of ``path``'s tier.  A read reuses a lookup for HOLDERS_TTL_S
        (a call to a holder that died since is skipped where it is made); a write, a
        delete, and a read that found nothing look again (a holder started meanwhile)."""
        tier, now = path.split("/", 1)[0], time.monotonic()
        found = self._found
        if (fresh or found is None or found[1] != tier or not found[2]
                or now - found[0] > HOLDERS_TTL_S):
            found = self._found = (now, tier, live_holders(tier, self.kind))
        return found[2]

    def _each(self, path: str, call: Any, *, fresh: bool = False) -> list[Any]:
        """``call(holder)`` (an ObjectRef) on every live holder of ``path``'s tier; the
        answers of those that answered (a holder dying meanwhile is skipped)."""
        import ray

        out = []
        for h in self._holders(path, fresh=fresh):
            try:
                out.append(ray.get(call(h), timeout=self.timeout_s))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                continue
        return out

    def _listing(self, path: str) -> dict[str, int]:
        merged: dict[str, int] = {}
        for files in self._each(path, lambda h: h.listing.remote(path, **self._as)):
            merged.update(files)
        return merged

    # ---- fsspec -----------------------------------------------------------------------------

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        files = self._listing(path)
        if path in files:
            entries = [{"name": path, "size": files[path], "type": "file"}]
        else:
            prefix = path + "/"
            children: dict[str, dict[str, Any]] = {}
            for p, size in files.items():
                if not p.startswith(prefix):
                    continue
                head, _, rest = p[len(prefix):].partition("/")
                name = prefix + head
                children[name] = ({"name": name, "size": 0, "type": "directory"} if rest
                                  else {"name": name, "size": size, "type": "file"})
            if not children:
                raise FileNotFoundError(path)
            entries = [children[k] for k in sorted(children)]
        return entries if detail else [e["name"] for e in entries]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        files = self._listing(path)
        if path in files:
            return {"name": path, "size": files[path], "type": "file"}
        if any(p.startswith(path + "/") for p in files):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False,
             detail: bool = False, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        files = {p: {"name": p, "size": s, "type": "file"}
                 for p, s in self._listing(path).items() if p == path or p.startswith(path + "/")}
        return files if detail else sorted(files)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        return bytes(self._fetch(self._strip_protocol(path), start, end))

    def _fetch(self, path: str, start: int | None = None, end: int | None = None) -> Any:
        """``path``'s bytes from the first live holder that has it: a read-only buffer."""
        import ray

        mine = self._on_this_node(path)
        if mine is not None:
            return mine if start is None and end is None else mine[start:end]
        for fresh in (False, True):
            holders = self._holders(path, fresh=fresh)
            for h in holders:
                try:
                    data = ray.get(h.get.remote(path, start, end, **self._as),
                                   timeout=self.timeout_s)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    continue
                if isinstance(data, list):  # a holder's file: in the object store
                    data = ray.get(data[0], timeout=self.timeout_s)
                if data is not None:
                    return data
        raise FileNotFoundError(f"{self.protocol}://{path}: none of the {len(holders)} live "
                                f"{self.kind} actors has it")

    def _on_this_node(self, path: str) -> bytes | None:
        """``path`` read from this node's own directory, where this kind has one and the
        file is there; else None."""
        if self.local_dir is None:
            return None
        from raycheckpoint.storage.spec import for_this_node

        full = os.path.join(for_this_node(self.local_dir), path.split("/", 1)[1])
        try:
            with open(full, "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "r" in mode:
            return _View(self._fetch(path))
        return _Upload(self, path)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if not self._each(path, lambda h: h.put.remote(path, value, **self._as), fresh=True):
            raise OSError(f"{PROTOCOL}://{path}: no live replica holder to write to")

    def rm_file(self, path: str) -> None:
        path = self._strip_protocol(path)
        self._each(path, lambda h: h.delete.remote(path, False, **self._as), fresh=True)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for p in [path] if isinstance(path, str) else path:
            p = self._strip_protocol(p)
            self._each(p, lambda h, p=p: h.delete.remote(p, recursive, **self._as), fresh=True)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        """Nothing: directories are the prefixes of the held files."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Nothing: directories are the prefixes of the held files."""

    def created(self, path: str) -> Any:
        raise NotImplementedError("the memory tier records no creation times")

    def modified(self, path: str) -> Any:
        raise NotImplementedError("the memory tier records no modification times")


class RayNodesFileSystem(RayMemoryFileSystem):
    """The files of the per-node local directories of one tier (see the module doc)."""

    protocol = NODES_PROTOCOL
    kind = "nodes"
    uploads = True  # each node's agent copies its own files out (Storage.upload)


class RayMemoryStorage(Storage):
    """A root served by actors (``rcmem://<tier>``, ``rcnode://<tier>``): shared by every
    process of the Ray job that can reach them."""

    caps = Capabilities(shared=True, job_private=True)

    def url(self, rel: str = "") -> str:
        return f"{self.protocol}://{posixpath.join(self.root, rel) if rel else self.root}"

    @property
    def identity(self) -> str | None:
        """The root identity this view's holders must serve (None: unchecked)."""
        return self.fs.identity

    @property
    def idle_ttl_s(self) -> float | None:
        """The lifetime of the actors started for this root (None: until released)."""
        return self.fs.idle_ttl_s

    def _open_size(self, rel: str, f: Any) -> int:
        return f.size  # the bytes are here already: no listing of every holder

    def _create_once(self, full: str, data: bytes) -> None:
        """A check, then a write to every live holder: not atomic, and it need not be (one
        job's coordinator is the only writer: see the module doc)."""
        if self.fs.exists(full):
            raise FileExistsError(full)
        self.fs.pipe_file(full, data)

    def upload(self, files: dict[str, FileEntry], target: StorageSpec) -> set[str]:
        """Per-node directories: each node's agent copies the files it holds (a file on
        several nodes, such as the metadata, by one of them), all nodes at once, and reads
        them back from ``target``."""
        if not getattr(self.fs, "uploads", False) or not files:
            return set()
        import ray

        agents = self.fs._holders(self.root, fresh=True)
        held = ray.get([a.has.remote(sorted(files)) for a in agents], timeout=self.fs.timeout_s)
        work: list[dict[str, dict[str, Any]]] = [{} for _ in agents]
        for path in files:
            i = next((i for i, h in enumerate(held) if path in h), None)
            if i is not None:  # none: the caller copies it (and finds it missing)
                work[i][path] = files[path].to_dict()
        done = ray.get([a.upload.remote(w, target) for a, w in zip(agents, work, strict=True) if w],
                       timeout=UPLOAD_TIMEOUT_S)
        return {p for paths in done for p in paths}


register_implementation(PROTOCOL, RayMemoryFileSystem, clobber=True)
register_implementation(NODES_PROTOCOL, RayNodesFileSystem, clobber=True)
