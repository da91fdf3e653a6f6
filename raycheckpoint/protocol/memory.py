"""The memory tier: the newest checkpoint in host memory, on the rank's node and on others.

With ``checkpoint.memory_replicas=R`` (a tiered job: ``checkpoint.local_dir`` set), every
committed full checkpoint of the local tier is copied into the memory of
:class:`ReplicaHolder` actors, one per node that runs ranks:

* each rank's files go to the holder of the rank's own node (a crashed worker process
  loses nothing) and to the holders of the next ``R`` nodes in the ring of the job's
  nodes (sorted by node id), so that losing any ``R`` nodes loses no shard;
* the files no rank wrote (trainer state, version, DCP metadata, assets) and the commit
  metadata go to every holder;
* a holder checks each file against the manifest's checksum as it arrives and refuses a
  mismatch; the checkpoint is then committed in the memory tier with the usual protocol
  (manifest, ``COMMITTED``, ``LATEST``, catalog: :func:`~raycheckpoint.protocol.commit.mark_committed`),
  through :mod:`raycheckpoint.storage.raymem`, which shows the holders as one root;
* the memory tier keeps the newest committed checkpoint only (and what it references);
  a newer one queued while a copy runs replaces any older one still waiting.

Holders are detached named actors (``memory-<tier>-<node>`` in the ``raycheckpoint``
namespace, :mod:`~raycheckpoint.protocol.nodes`): they outlive the worker groups, the
coordinator and the driver, so a job restarted after losing a node finds them.  A holder
whose node died is re-created on the next copy to a node that runs ranks; :func:`release`
ends them all (a job's clean end), and a holder no job has used for
``checkpoint.memory_idle_ttl_s`` ends itself (:class:`~raycheckpoint.protocol.nodes.IdleLifetime`).

A tier is named after the durable root's URL, which outlives what the root holds.  So
each holder also records the root identity its copies were made under
(:func:`memory_identity`: the durable root's :mod:`~raycheckpoint.protocol.identity`, and
the local tier's when it is one directory), and every call a job makes carries the
identity its roots have now (the ``identity`` option of the ``rcmem://`` spec): a holder
asked under another identity drops what it holds and answers as an empty holder, so a
wiped root starts afresh and the job reads the next tier.  Calls without an identity (an
operator's ``raycheckpoint ls --memory``) are served unchecked and change nothing.
Resume reads a checkpoint of the memory tier only when every file is held by a live
holder, and every byte is verified against the manifest as it is read: a replica whose
checksum does not match is passed over for the local or durable copy.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from typing import Any

from raycheckpoint.errors import IntegrityError
from raycheckpoint.integrity.verify import verify_bytes
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.checkpoint import read_committed
from raycheckpoint.protocol.commit import mark_committed
from raycheckpoint.protocol.nodes import IdleLifetime, ensure_on_nodes
from raycheckpoint.protocol.nodes import release as release_actors
from raycheckpoint.protocol.paths import CheckpointPaths, root_id
from raycheckpoint.protocol.replicate import TargetMismatchError
from raycheckpoint.protocol.root import RootState
from raycheckpoint.storage import FileEntry, Storage
from raycheckpoint.storage.raymem import PROTOCOL

logger = logging.getLogger(__name__)


def tier_id(durable_url: str) -> str:
    """The memory tier of the job whose durable root is ``durable_url``."""
    return root_id(durable_url)


def tier_uri(tier: str) -> str:
    return f"{PROTOCOL}://{tier}"


def memory_identity(durable: str, local: str | None = None) -> str:
    """The root identity a job's memory tier serves under: its durable root's identity,
    and its local tier's where that is one directory (the tier's copies come from it)."""
    return durable if local is None else f"{durable}+{local}"


class ReplicaHolder(IdleLifetime):
    """Files in host memory on this node (run as a detached Ray actor, one per node).

    Each file is put in Ray's object store once, owned by this actor: a reader on this
    node maps it without a copy, one on another node fetches it through Ray's transfer,
    and serving it costs this process no copy.  ``identity`` on a call: the root identity
    the caller's roots have now (see the module doc); None: an unchecked look.
    """

    def __init__(self, tier: str, node_id: str, idle_ttl_s: float | None = None) -> None:
        self.tier, self.node_id = tier, node_id
        self.identity: str | None = None  # the root identity its files were copied under
        self._files: dict[str, tuple[Any, int]] = {}  # path -> (ObjectRef of a uint8 array, size)
        self._lock = threading.Lock()
        self._start_lifetime(idle_ttl_s)

    def _admit(self, identity: str | None) -> None:
        """Serve a caller under ``identity`` (``_lock`` held): what was copied under
        another root identity is dropped first (never served again)."""
        if identity is None or identity == self.identity:
            return
        dropped = len(self._files)
        if dropped:
            logger.warning("replica holder %s: dropping %d files copied under root identity "
                           "%s: the root now has identity %s (it was wiped or replaced)",
                           self.tier, dropped, self.identity or "(none)", identity)
        self._files.clear()
        self.identity = identity

    def _check_identity(self, identity: str | None) -> None:
        with self._lock:
            self._admit(identity)

    def put(self, path: str, data: bytes, entry: dict[str, Any] | None = None,
            identity: str | None = None) -> int:
        """Hold ``data`` as ``path``; with ``entry`` (a manifest entry) only if the bytes
        match its size and checksum (IntegrityError otherwise: nothing is kept)."""
        import numpy as np
        import ray

        with self._use():
            held = np.frombuffer(bytes(data), dtype=np.uint8)
            if entry is not None:
                verify_bytes(path, memoryview(held), FileEntry.from_dict(entry), checksums=True)
            ref = ray.put(held)
            with self._lock:
                self._admit(identity)
                self._files[path] = (ref, held.nbytes)
            return held.nbytes

    def get(self, path: str, start: int | None = None, end: int | None = None,
            identity: str | None = None) -> Any:
        """``[ObjectRef]`` of the whole of ``path`` (the reader gets it from the object
        store), its bytes from ``start`` to ``end``, or None when this holder lacks it."""
        import ray

        with self._use():
            with self._lock:
                self._admit(identity)
                held = self._files.get(path)
            if held is None:
                return None
            if start is None and end is None:
                return [held[0]]
            return bytes(ray.get(held[0])[start:end])

    def listing(self, prefix: str = "", identity: str | None = None) -> dict[str, int]:
        """``{path: size}`` of the files at or below ``prefix``."""
        with self._use(), self._lock:
            self._admit(identity)
            return {p: size for p, (_, size) in self._files.items()
                    if not prefix or p == prefix or p.startswith(prefix.rstrip("/") + "/")}

    def delete(self, path: str, recursive: bool = False, identity: str | None = None) -> int:
        with self._use(), self._lock:
            self._admit(identity)
            doomed = [p for p in self._files
                      if p == path or (recursive and p.startswith(path.rstrip("/") + "/"))]
            for p in doomed:
                del self._files[p]
        return len(doomed)

    def where(self) -> dict[str, Any]:
        idle = self.idle_s()
        with self._lock:
            return {"node_id": self.node_id, "files": len(self._files),
                    "bytes": sum(size for _, size in self._files.values()),
                    "identity": self.identity, "idle_s": idle, "idle_ttl_s": self._idle_ttl_s}

    def _on_end(self) -> None:
        with self._lock:
            self._files.clear()


def ensure_holders(tier: str, nodes: list[str], timeout_s: float = 60.0, *,
                   idle_ttl_s: float | None = None) -> dict[str, Any]:
    """A live holder on each of ``nodes`` (node id -> handle), started where missing (a
    new one ends itself after ``idle_ttl_s`` unused)."""
    return ensure_on_nodes(ReplicaHolder, "memory", tier, nodes, idle_ttl_s, timeout_s=timeout_s)


def release(tier: str) -> int:
    """End every holder of ``tier`` (their memory is freed); how many there were."""
    return release_actors(tier, "memory")


def rank_nodes(groups: dict[str, list[Any]], timeout_s: float, *,
               warn: bool = True) -> dict[str, list[str]]:
    """role -> the node id of each rank of ``groups`` (role -> worker actors by rank);
    ``warn``: when they all run on one node (no other node for a memory replica)."""
    import ray

    from raycheckpoint._internal.rpc import get

    ranks = [(role, w) for role, ws in groups.items() for w in ws]
    nodes = get([w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                 for _, w in ranks], timeout_s)
    if warn and len(set(nodes)) < 2:
        warnings.warn("checkpoint.memory_replicas: every rank runs on one node, so the memory "
                      "tier has no other node to keep replicas on: it survives a worker crash, "
                      "not the loss of the node", RuntimeWarning, stacklevel=3)
    out: dict[str, list[str]] = {}
    for (role, _), node in zip(ranks, nodes, strict=True):
        out.setdefault(role, []).append(node)
    return out


def placement(rank_nodes: dict[str, list[str]], replicas: int) -> dict[tuple[str, int], list[str]]:
    """(role, rank) -> the nodes whose holders keep its files: its own node, then the next
    ``replicas`` nodes of the ring of the job's nodes."""
    ring = sorted({n for nodes in rank_nodes.values() for n in nodes})
    out = {}
    for role, nodes in rank_nodes.items():
        for rank, node in enumerate(nodes):
            i = ring.index(node)
            out[(role, rank)] = [ring[(i + k) % len(ring)]
                                 for k in range(min(replicas, len(ring) - 1) + 1)]
    return out


def replicate_to_memory(source: Storage, target: RootState, name: str,
                        rank_nodes: dict[str, list[str]], replicas: int,
                        timeout_s: float = 600.0) -> dict[str, Any]:
    """Copy committed checkpoint ``name`` of ``source`` into the memory tier ``target``
    (see the module doc) and commit it there.  Returns ``{"name", "bytes", "files", "s"}``."""
    import ray

    t0 = time.perf_counter()
    marker, manifest_bytes, manifest = read_committed(source, name)
    paths = CheckpointPaths(name)
    tier = target.storage.root
    where = placement(rank_nodes, replicas)
    missing = sorted(set(manifest.roles) - {role for role, _ in where})
    if missing or any(rank >= len(rank_nodes[r]) for r in manifest.roles
                      for rank in manifest.roles[r].ranks):
        raise ValueError(f"{name}: the memory tier knows no node for some ranks of roles "
                         f"{sorted(manifest.roles)} (ranks run on {rank_nodes})")
    holders = ensure_holders(tier, [n for nodes in where.values() for n in nodes],
                             idle_ttl_s=target.storage.idle_ttl_s)
    identity = target.storage.identity
    owners: dict[str, list[str]] = {}
    for role, layout in manifest.roles.items():
        for rank, files in layout.ranks.items():
            for path in files:
                owners.setdefault(path, [])
                owners[path] += [n for n in where[(role, rank)] if n not in owners[path]]
    held = target.storage.list_files(name)
    if catalog.read_marker(target.storage, name) is not None and all(
            held.get(p) == e.size for p, e in manifest.files.items() if paths.holds(p)):
        return {"name": name, "bytes": 0, "files": len(manifest.files), "holders": len(holders),
                "s": time.perf_counter() - t0, "already": True}
    if held:  # a copy cut short, or one that lost files with a holder
        target.delete_step(name, target.referenced(target.markers))
    for path, entry in sorted(manifest.files.items()):
        data = source.read_bytes(path)
        verify_bytes(path, data, entry, checksums=True)  # never spread a bad source copy
        ref = ray.put(data)
        del data
        to = [holders[n] for n in owners.get(path, holders)]  # unowned files: every holder
        try:
            ray.get([h.put.remote(target.storage.full_path(path), ref, entry.to_dict(),
                                  identity=identity) for h in to], timeout=timeout_s)
        except IntegrityError as e:  # verified here before it left: the transfer went wrong
            raise TargetMismatchError(f"a replica holder refused {path}: {e}") from e
    m_entry = target.storage.write_bytes(paths.manifest, manifest_bytes, checksum="sha256")
    if m_entry.digest != marker.manifest_sha256:
        raise IntegrityError(f"{target.storage.url(paths.manifest)}: written bytes do not match "
                             "the marker", path=paths.manifest)
    # the memory tier keeps no tags: it holds the newest checkpoint only
    mark_committed(target, dataclasses.replace(marker, tag=None), manifest, point="memory")
    return {"name": name, "bytes": marker.bytes, "files": len(manifest.files),
            "holders": len(holders), "s": time.perf_counter() - t0}
