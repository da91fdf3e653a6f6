"""Actors on the job's nodes: starting them where missing, ending them, and the agent of
a node's own local directory (``checkpoint.local_dir_per_node``).

Two kinds of per-node actors serve a tier as one root
(:mod:`raycheckpoint.storage.raymem`): the memory tier's replica holders
(:mod:`~raycheckpoint.protocol.memory`) and the agents of per-node local directories
(:class:`NodeDirAgent`).  Both are detached named actors ``<kind>-<tier>-<node>`` in the
``raycheckpoint`` namespace, reserving no CPU, pinned to their node: they outlive the
worker groups, the coordinator and the driver, so a job restarted on the same root finds
them; :func:`ensure_on_nodes` starts the missing ones and :func:`release` ends them.

Their lifetime (:class:`IdleLifetime`): an actor that no job has used for
``checkpoint.memory_idle_ttl_s`` ends itself, so the actors of a root nobody uses any
more (its driver killed, the job never started again) give their memory back to a
shared cluster.  Every call a job makes (a copy, a read, a listing) counts as a use, and
a live job's driver touches its actors periodically (:func:`keep_alive`, from
:class:`~raycheckpoint.roots.JobRoots`), so a job that saves rarely keeps them.

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
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from raycheckpoint._internal import exit as process_exit
from raycheckpoint._internal.priority import lower_priority
from raycheckpoint.integrity.verify import verify_bytes
from raycheckpoint.storage import FileEntry, Storage, StorageSpec
from raycheckpoint.storage.raymem import NAMESPACE, NODES_PROTOCOL, holder_prefix, live_holders
from raycheckpoint.storage.spec import NODE_ID

logger = logging.getLogger(__name__)

PERSIST_NICE = 10  # nice levels below Ray's workers for an agent's uploads (persist_nice's default)
KEEP_ALIVE_MAX_S = 60.0  # a live job touches its actors at least this often


def ensure_on_nodes(cls: type, kind: str, tier: str, nodes: list[str], *args: Any,
                    timeout_s: float = 60.0) -> dict[str, Any]:
    """A live ``cls(tier, node, *args)`` actor of ``kind`` on each of ``nodes`` (node id ->
    handle), started where missing (and where the one found was ending: idle)."""
    import ray

    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    for node in sorted(set(nodes)):
        if node not in alive:
            raise OSError(f"node {node[:12]} is not alive: no {kind} actor can run there")
    deadline = time.monotonic() + timeout_s
    out: dict[str, Any] = {}
    pending = sorted(set(nodes))
    while pending:
        found = {node: _found_or_started(cls, kind, tier, node, args) for node in pending}
        answers = {node: h.where.remote() for node, h in found.items()}  # all start at once
        pending = []
        for node, ref in answers.items():
            try:
                ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
                out[node] = found[node]
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                if time.monotonic() > deadline:
                    raise
                pending.append(node)  # it ended (idle) as it was found: its name is freed shortly
        if pending:
            time.sleep(0.5)
    return out


def _found_or_started(cls: type, kind: str, tier: str, node: str, args: tuple[Any, ...]) -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = holder_prefix(tier, kind) + node[:16]
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    try:
        handle = ray.remote(cls).options(
            name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=8,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(tier, node, *args)
        logger.info("started %s on node %s", name, node[:12])
        return handle
    except ValueError:  # started by another process meanwhile
        return ray.get_actor(name, namespace=NAMESPACE)


def release(tier: str, kind: str) -> int:
    """End every actor of ``kind`` of ``tier``; how many there were."""
    import ray

    actors = live_holders(tier, kind)
    for a in actors:
        ray.kill(a)
    return len(actors)


def keep_alive(tier: str, kind: str, *, idle_ttl_s: float, identity: str | None = None,
               timeout_s: float = 60.0) -> int:
    """Touch every live actor of ``kind`` of ``tier`` (a live job's heartbeat): each one's
    idle clock restarts and its lifetime becomes ``idle_ttl_s``; ``identity``: the root
    identity the memory tier's holders must serve (see :class:`IdleLifetime.touch`).
    How many answered."""
    import ray

    refs = [a.touch.remote(identity=identity, idle_ttl_s=idle_ttl_s)
            for a in live_holders(tier, kind)]
    answered = 0
    for ref in refs:
        try:
            ray.get(ref, timeout=timeout_s)
            answered += 1
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            continue  # ended or lost meanwhile: nothing to keep
    return answered


def keep_alive_interval(idle_ttl_s: float) -> float:
    """How often a live job touches its actors: well within their idle lifetime."""
    return min(idle_ttl_s / 4, KEEP_ALIVE_MAX_S)


class IdleLifetime:
    """The lifetime of a detached per-node actor: it ends itself once no job has used it
    for ``idle_ttl_s`` seconds (None: it lives until released).  A subclass calls
    :meth:`_start_lifetime` in its constructor and wraps each method a job calls in
    :meth:`_use`; :meth:`touch` is a job's explicit keep-alive."""

    def _start_lifetime(self, idle_ttl_s: float | None) -> None:
        process_exit.install()  # an ended actor leaves by os._exit (_internal/exit.py)
        self._idle_ttl_s = idle_ttl_s
        self._last_used = time.monotonic()
        self._busy = 0  # calls running now: never idle while one does
        self._life = threading.Condition()
        if _in_actor():  # built in a plain process (a test): nothing to end
            threading.Thread(target=self._watch_idle, daemon=True,
                             name="raycheckpoint-idle-lifetime").start()

    @contextmanager
    def _use(self) -> Iterator[None]:
        """A job's call: the idle clock restarts when it starts and when it ends."""
        with self._life:
            self._busy += 1
            self._last_used = time.monotonic()
        try:
            yield
        finally:
            with self._life:
                self._busy -= 1
                self._last_used = time.monotonic()

    def touch(self, identity: str | None = None, idle_ttl_s: float | None = None) -> dict[str, Any]:
        """A live job's keep-alive: the idle clock restarts; ``idle_ttl_s`` (the job's
        ``checkpoint.memory_idle_ttl_s``) replaces the lifetime; ``identity``: see the
        subclass (the memory tier's holders drop copies made under another root identity)."""
        with self._use():
            self._check_identity(identity)
            if idle_ttl_s is not None:
                with self._life:
                    self._idle_ttl_s = float(idle_ttl_s)
                    self._life.notify_all()
            return self.where()

    def _check_identity(self, identity: str | None) -> None:
        """Nothing here: only what holds copies of a root checks whose they are."""

    def idle_s(self) -> float:
        """Seconds since the last use."""
        with self._life:
            return 0.0 if self._busy else time.monotonic() - self._last_used

    def _remaining(self) -> float | None:
        """Seconds until this actor has been idle for its lifetime (None: no lifetime);
        called with ``_life`` held."""
        if self._idle_ttl_s is None:
            return None
        if self._busy:
            return self._idle_ttl_s
        return self._idle_ttl_s - (time.monotonic() - self._last_used)

    def _watch_idle(self) -> None:
        import ray

        while True:
            with self._life:
                remaining = self._remaining()
                while remaining is None or remaining > 0:
                    self._life.wait(timeout=remaining)
                    remaining = self._remaining()
            # the ending itself runs as a call of this actor, so Ray ends it cleanly
            ref = ray.get_runtime_context().current_actor.end_if_idle.remote()
            try:
                if ray.get(ref, timeout=60):
                    return
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                return  # ending
            except ray.exceptions.GetTimeoutError:
                logger.warning("%s: the idle actor did not answer its own end call in 60 s; "
                               "trying again", type(self).__name__)

    def end_if_idle(self) -> bool:
        """End this actor when it is still idle for its lifetime (False: used meanwhile)."""
        import ray

        with self._life:
            remaining = self._remaining()
            if remaining is None or remaining > 0:
                return False
            idle = time.monotonic() - self._last_used
        logger.info("%s on node %s: unused for %.0f s (lifetime %.0f s); ending",
                    type(self).__name__, getattr(self, "node_id", "?")[:12], idle,
                    self._idle_ttl_s)
        self._on_end()
        ray.actor.exit_actor()
        return True  # not reached: exit_actor raises

    def _on_end(self) -> None:
        """What to let go before the process ends (a subclass's held state)."""


def tier_uri(tier: str) -> str:
    return f"{NODES_PROTOCOL}://{tier}"


def _in_actor() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class NodeDirAgent(IdleLifetime):
    """One node's local directory, served to the other processes of the job (run as a
    detached Ray actor, one per node: see the module doc).  Paths are ``<tier>/<rel>``."""

    def __init__(self, tier: str, node_id: str, local_dir: str,
                 idle_ttl_s: float | None = None) -> None:
        self.tier, self.node_id = tier, node_id
        self.dir = local_dir.replace(NODE_ID, node_id)
        self.storage = Storage(self.dir)
        self._start_lifetime(idle_ttl_s)

    def _rel(self, path: str) -> str:
        tier, _, rel = path.partition("/")
        if tier != self.tier:
            raise ValueError(f"{path}: not a path of tier {self.tier}")
        return rel

    def put(self, path: str, data: bytes, entry: dict[str, Any] | None = None) -> int:
        with self._use():
            data = bytes(data)
            if entry is not None:
                verify_bytes(path, data, FileEntry.from_dict(entry), checksums=True)
            self.storage.write_pointer(self._rel(path), data)  # atomic, fsynced
            return len(data)

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes | None:
        with self._use():
            try:
                return self.storage.read_bytes(self._rel(path), start, end)
            except (FileNotFoundError, IsADirectoryError):
                return None

    def listing(self, prefix: str = "") -> dict[str, int]:
        with self._use():
            rel = self._rel(prefix) if prefix and prefix != self.tier else ""
            full = os.path.join(self.dir, rel) if rel else self.dir
            if os.path.isfile(full):
                return {prefix: os.path.getsize(full)}
            return {f"{self.tier}/{p}": size for p, size in self.storage.list_files(rel).items()}

    def has(self, rels: list[str]) -> list[str]:
        """Which of ``rels`` (paths relative to the directory) this node holds."""
        with self._use():
            return [r for r in rels if os.path.isfile(os.path.join(self.dir, r))]

    def upload(self, files: dict[str, dict[str, Any]], target: StorageSpec) -> list[str]:
        """Copy ``files`` (relative path -> manifest entry) from this node's directory to
        ``target``, then read them back there against their entries."""
        from raycheckpoint.errors import IntegrityError
        from raycheckpoint.integrity.verify import verify_files
        from raycheckpoint.protocol.replicate import TargetMismatchError, copy_file

        with self._use():
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
        with self._use():
            rel = self._rel(path)
            if recursive:
                self.storage.delete_tree(rel)
            else:
                self.storage.delete(rel)
            return 1

    def where(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "dir": self.dir, "idle_s": self.idle_s(),
                "idle_ttl_s": self._idle_ttl_s}
