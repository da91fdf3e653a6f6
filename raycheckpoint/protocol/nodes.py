"""Actors on the job's nodes: starting them where missing, ending them, and the agent of
a node's own local directory (``checkpoint.local_dir_per_node``).

Two kinds of per-node actors serve a tier as one root
(:mod:`raycheckpoint.storage.raymem`): the memory tier's replica holders
(:mod:`~raycheckpoint.protocol.memory`) and the agents of per-node local directories
(:class:`NodeDirAgent`).  Both are detached named actors ``<kind>-<tier>-<node>`` in the
``raycheckpoint`` namespace, reserving no CPU, pinned to their node: they outlive the
worker groups, the coordinator and the driver, so a job restarted on the same root finds
them; :func:`ensure_on_nodes` starts the missing ones and :func:`release` ends them.

With per-node local directories, every rank writes its shards to ``checkpoint.local_dir``
on its own node (``{node_id}`` in the path becomes the node's id: one directory per node
also on a filesystem every node mounts).  The coordinator commits through the union of
the agents: the manifest, ``COMMITTED``, ``LATEST`` and the catalog reach every node's
directory, retention deletes on every node, and a file is read from the node that has
it.  A node lost takes its ranks' files with it: its checkpoints are then incomplete in
the local tier, and resume reads them from the memory or durable tier.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from raycheckpoint._internal.priority import lower_priority
from raycheckpoint.integrity.verify import verify_bytes
from raycheckpoint.storage import FileEntry, Storage, StorageSpec
from raycheckpoint.storage.raymem import NAMESPACE, NODES_PROTOCOL, holder_prefix, live_holders
from raycheckpoint.storage.spec import NODE_ID

logger = logging.getLogger(__name__)

PERSIST_NICE = 10  # nice levels below Ray's workers for an agent's uploads (persist_nice's default)


def ensure_on_nodes(cls: type, kind: str, tier: str, nodes: list[str], *args: Any,
                    timeout_s: float = 60.0) -> dict[str, Any]:
    """A live ``cls(tier, node, *args)`` actor of ``kind`` on each of ``nodes`` (node id ->
    handle), started where missing."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    out = {}
    for node in sorted(set(nodes)):
        if node not in alive:
            raise OSError(f"node {node[:12]} is not alive: no {kind} actor can run there")
        name = holder_prefix(tier, kind) + node[:16]
        try:
            out[node] = ray.get_actor(name, namespace=NAMESPACE)
            continue
        except ValueError:
            pass
        try:
            out[node] = ray.remote(cls).options(
                name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0,
                max_concurrency=8, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(tier, node, *args)
            logger.info("started %s on node %s", name, node[:12])
        except ValueError:  # started by another process meanwhile
            out[node] = ray.get_actor(name, namespace=NAMESPACE)
    ray.get([h.where.remote() for h in out.values()], timeout=timeout_s)  # started
    return out


def release(tier: str, kind: str) -> int:
    """End every actor of ``kind`` of ``tier``; how many there were."""
    import ray

    actors = live_holders(tier, kind)
    for a in actors:
        ray.kill(a)
    return len(actors)


def tier_uri(tier: str) -> str:
    return f"{NODES_PROTOCOL}://{tier}"


class NodeDirAgent:
    """One node's local directory, served to the other processes of the job (run as a
    detached Ray actor, one per node: see the module doc).  Paths are ``<tier>/<rel>``."""

    def __init__(self, tier: str, node_id: str, local_dir: str) -> None:
        self.tier, self.node_id = tier, node_id
        self.dir = local_dir.replace(NODE_ID, node_id)
        self.storage = Storage(self.dir)

    def _rel(self, path: str) -> str:
        tier, _, rel = path.partition("/")
        if tier != self.tier:
            raise ValueError(f"{path}: not a path of tier {self.tier}")
        return rel

    def put(self, path: str, data: bytes, entry: dict[str, Any] | None = None) -> int:
        data = bytes(data)
        if entry is not None:
            verify_bytes(path, data, FileEntry.from_dict(entry), checksums=True)
        self.storage.write_pointer(self._rel(path), data)  # atomic, fsynced
        return len(data)

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes | None:
        try:
            return self.storage.read_bytes(self._rel(path), start, end)
        except (FileNotFoundError, IsADirectoryError):
            return None

    def listing(self, prefix: str = "") -> dict[str, int]:
        rel = self._rel(prefix) if prefix and prefix != self.tier else ""
        full = os.path.join(self.dir, rel) if rel else self.dir
        if os.path.isfile(full):
            return {prefix: os.path.getsize(full)}
        return {f"{self.tier}/{p}": size for p, size in self.storage.list_files(rel).items()}

    def has(self, rels: list[str]) -> list[str]:
        """Which of ``rels`` (paths relative to the directory) this node holds."""
        return [r for r in rels if os.path.isfile(os.path.join(self.dir, r))]

    def upload(self, files: dict[str, dict[str, Any]], target: StorageSpec) -> list[str]:
        """Copy ``files`` (relative path -> manifest entry) from this node's directory to
        ``target``, then read them back there against their entries."""
        from raycheckpoint.errors import IntegrityError
        from raycheckpoint.integrity.verify import verify_files
        from raycheckpoint.protocol.replicate import TargetMismatchError, copy_file

        lower_priority(PERSIST_NICE)  # this actor thread: below the node's training
        entries = {p: FileEntry.from_dict(e) for p, e in files.items()}
        out = target.open()
        for rel, entry in sorted(entries.items()):
            copy_file(self.storage, out, rel, entry)
        try:
            verify_files(out, entries)
        except IntegrityError as e:  # the source matched as it was read: the copy went wrong
            raise TargetMismatchError(f"{out.url()}: read back, {e}") from e
        return sorted(entries)

    def delete(self, path: str, recursive: bool = False) -> int:
        rel = self._rel(path)
        if recursive:
            self.storage.delete_tree(rel)
        else:
            self.storage.delete(rel)
        return 1

    def where(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "dir": self.dir}
