"""The roots a job writes: its durable root and, for a tiered job, its local tier (and
its memory tier, with ``checkpoint.memory_replicas``).

``save_dir`` is the durable root (any fsspec URI).  With ``checkpoint.local_dir`` set
the job is tiered (DESIGN section 7): the workers write and the coordinator commits in
the local directory, and committed checkpoints are replicated to ``save_dir`` in the
background (:mod:`raycheckpoint.protocol.replicate`).  Each root is guarded by its own
lease, taken before anything under it is touched.

The local tier is one directory that every rank and the coordinator see (a machine's
own disk when the job runs on one node, or a filesystem every node mounts), or, with
``checkpoint.local_dir_per_node``, each node's own directory: the ranks write there and
the coordinator commits through the union of per-node agents
(:mod:`raycheckpoint.protocol.nodes`, ``rcnode://``).  For a shared directory,
:meth:`JobRoots.check_visible` proves it at start (a file the coordinator writes, which
every rank must read) and refuses a job whose ranks would each see their own disk,
naming ``local_dir_per_node``.  Per-node directories hold no lease of their own: the
durable root's lease guards the job.

Once leased, each root's identity is read, or created where the root has none
(:mod:`~raycheckpoint.protocol.identity`): the memory tier's holders serve the job only
what was copied under the identities its roots have now, so a wiped root starts afresh.
The job's driver keeps the tiers' actors (the holders, the per-node agents) alive while
it runs: at start (:meth:`JobRoots.place`) and then every
:func:`~raycheckpoint.protocol.nodes.keep_alive_interval` it touches them, and they end
themselves once no job has touched or used them for ``checkpoint.memory_idle_ttl_s``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from raycheckpoint.config import CheckpointConfig
from raycheckpoint.protocol.candidates import Tier
from raycheckpoint.protocol.identity import read_identity, root_identity
from raycheckpoint.protocol.lease import Lease
from raycheckpoint.storage import Storage, StorageSpec

logger = logging.getLogger(__name__)

PROBE_PREFIX = ".visible-"  # the file check_visible writes and every rank must see


@dataclass
class JobRoots:
    durable: StorageSpec
    local: StorageSpec | None = None
    memory: StorageSpec | None = None  # the memory tier (memory_replicas): protocol/memory.py
    nodes: StorageSpec | None = None  # per-node local directories, as one root (their agents)
    leases: dict[str, Lease] = field(default_factory=dict)  # "durable" / "local" -> lease
    identities: dict[str, str] = field(default_factory=dict)  # "durable" / "local" -> identity
    idle_ttl_s: float = 3600.0  # the tiers' actors end this long after their last use
    _keeper: threading.Event | None = field(default=None, repr=False)  # set: keep-alive stops

    @property
    def write(self) -> StorageSpec:
        """Where the workers write."""
        return self.local or self.durable

    @property
    def commit(self) -> StorageSpec:
        """Where the coordinator commits and the loader reads (the union of the per-node
        directories, or where the workers write)."""
        return self.nodes or self.write

    def place(self, groups: dict[str, list[Any]], timeout_s: float) -> dict[str, list[str]] | None:
        """Where each rank runs (role -> node ids), for the tiers that need it (None where
        none does); the agents of per-node directories started on those nodes; the tiers'
        actors touched (holders of a wiped root drop their copies now) and kept alive
        from now until :meth:`release`."""
        if self.memory is None and self.nodes is None:
            return None
        from raycheckpoint.protocol import memory, nodes

        where = memory.rank_nodes(groups, timeout_s, warn=self.memory is not None)
        if self.nodes is not None:
            nodes.ensure_on_nodes(nodes.NodeDirAgent, "nodes", self.nodes.open().root,
                                  [n for ns in where.values() for n in ns],
                                  self.nodes.options["local_dir"], self.idle_ttl_s,
                                  timeout_s=timeout_s)
        self.keep_alive(timeout_s)  # holders of a wiped root drop their copies now
        self._start_keeping_alive(timeout_s)
        return where

    def _actors(self) -> list[tuple[str, str, str | None]]:
        """(tier, kind, identity to check) of each tier served by actors."""
        out = []
        if self.memory is not None:
            out.append((self.memory.open().root, "memory", self.memory.options.get("identity")))
        if self.nodes is not None:
            out.append((self.nodes.open().root, "nodes", None))
        return out

    def keep_alive(self, timeout_s: float = 60.0) -> int:
        """Touch the tiers' live actors (see the module doc); how many answered."""
        from raycheckpoint.protocol import nodes

        return sum(nodes.keep_alive(tier, kind, idle_ttl_s=self.idle_ttl_s, identity=identity,
                                    timeout_s=timeout_s)
                   for tier, kind, identity in self._actors())

    def _start_keeping_alive(self, timeout_s: float) -> None:
        from raycheckpoint.protocol.nodes import keep_alive_interval

        if self._keeper is not None or not self._actors():
            return
        stop = self._keeper = threading.Event()
        interval = keep_alive_interval(self.idle_ttl_s)

        def run() -> None:
            import ray

            while not stop.wait(interval) and ray.is_initialized():  # ended with the driver's Ray
                try:
                    self.keep_alive(min(timeout_s, interval * 2))
                except Exception as e:  # noqa: BLE001 - a heartbeat missed; the next one tries again
                    logger.warning("could not touch the memory tier's holders / the nodes' "
                                   "agents (they end %.0f s after their last use): %s",
                                   self.idle_ttl_s, e)

        threading.Thread(target=run, daemon=True, name="raycheckpoint-keep-alive").start()

    def _stop_keeping_alive(self) -> None:
        if self._keeper is not None:
            self._keeper.set()
            self._keeper = None

    def end_actors(self) -> None:
        """End the memory tier's holders and the per-node agents (a job's clean end)."""
        from raycheckpoint.protocol import nodes

        self._stop_keeping_alive()
        for tier, kind, _ in self._actors():
            nodes.release(tier, kind)

    def lease_id(self, tier: str) -> str | None:
        lease = self.leases.get(tier)
        return None if lease is None else lease.job_id

    def release(self) -> None:
        """The job's end: its leases released, its actors no longer kept alive (they end
        themselves ``idle_ttl_s`` after their last use unless a job uses them)."""
        self._stop_keeping_alive()
        for lease in self.leases.values():
            lease.release()

    def write_probe(self) -> str | None:
        """Write the file every rank must see in the local tier (None: not tiered, or
        per-node directories)."""
        if self.local is None or self.nodes is not None:
            return None
        probe = PROBE_PREFIX + uuid.uuid4().hex[:12]
        self.local.open().write_pointer(probe, b"raycheckpoint: every rank must see this file")
        return probe

    def check_visible(self, probe: str | None, seen: list[tuple[str, bool]]) -> None:
        """``seen``: (rank, whether it found ``probe``); refuse when any did not."""
        if probe is None:
            return
        self.local.open().delete(probe)
        blind = [who for who, ok in seen if not ok]
        if blind:
            raise ValueError(
                f"checkpoint.local_dir={self.local.uri} is not one directory every rank sees: "
                f"{', '.join(blind)} cannot see what the driver wrote there (a disk of its own "
                "node).  The local tier must be this machine's disk on a one-node job, or a "
                "filesystem every node mounts; for a disk of each node's own, set "
                "checkpoint.local_dir_per_node=true")


def _roots(config: CheckpointConfig, cipher: Any) -> tuple[JobRoots, str | None]:
    """The job's roots as specs, nothing leased or read yet, and the id its tiers' actors
    are named after (None without memory tier or per-node directories)."""
    def spec(uri: str, options: dict[str, Any]) -> StorageSpec:
        return StorageSpec(uri, options, retries=config.storage_retries, cipher=cipher,
                           checksum=config.checksum_algorithm, direct_io=config.direct_io)

    roots = JobRoots(durable=spec(config.save_dir, dict(config.storage_options)),
                     idle_ttl_s=config.memory_idle_ttl_s)
    if config.local_dir is not None:
        roots.local = spec(config.local_dir, {})
    tid = None
    if config.memory_replicas or config.local_dir_per_node:
        # named after the durable root; their actors start with the job (JobRoots.place)
        from raycheckpoint.protocol import memory, nodes

        tid = memory.tier_id(roots.durable.open().url())
        if config.local_dir_per_node:
            roots.nodes = spec(nodes.tier_uri(tid), {"local_dir": config.local_dir,
                                                     "idle_ttl_s": config.memory_idle_ttl_s})
    return roots, tid


def _memory_spec(roots: JobRoots, config: CheckpointConfig, tid: str) -> StorageSpec:
    """The memory tier's spec: the holders serve it only what was copied under these
    roots' identities (``roots.identities``)."""
    from raycheckpoint.protocol import memory

    return StorageSpec(memory.tier_uri(tid), {
        "identity": memory.memory_identity(roots.identities["durable"],
                                           roots.identities.get("local")),
        "idle_ttl_s": config.memory_idle_ttl_s},
        retries=config.storage_retries, cipher=roots.durable.cipher,
        checksum=config.checksum_algorithm, direct_io=config.direct_io)


def _file_roots(roots: JobRoots) -> list[tuple[str, StorageSpec]]:
    """("durable" / "local", spec) of the roots that are one directory or prefix."""
    return [(tier, s) for tier, s in (("durable", roots.durable), ("local", roots.local))
            if s is not None and not (tier == "local" and roots.nodes is not None)]


def open_roots(config: CheckpointConfig, cipher: Any) -> JobRoots:
    """The job's roots, leased (see the module doc)."""
    roots, tid = _roots(config, cipher)
    for tier, s in _file_roots(roots):
        storage = s.open()
        if not storage.caps.shared:
            raise ValueError(f"{s.uri!r} is process-local (memory://): Ray workers run in other "
                             "processes and cannot write there; use a directory or s3://")
        try:
            storage.require_atomic_create()
            if config.lease:  # refuse (naming the holder) before touching anything under a root
                roots.leases[tier] = _lease(storage, config)
            roots.identities[tier] = root_identity(storage)
        except BaseException:
            roots.release()
            raise
    if config.memory_replicas:
        roots.memory = _memory_spec(roots, config, tid)
    return roots


def read_tiers(config: CheckpointConfig, cipher: Any) -> list[Tier]:
    """Where a job with ``config`` reads checkpoints, fastest first, as its loader does
    (:mod:`~raycheckpoint.protocol.candidates`), for the start-up check before any worker
    starts: nothing leased, created or started.  Left out: per-node local directories
    (their agents start with the workers) and the memory tier where this process has
    not joined Ray yet or the roots have no identity (a job starting on them drops
    whatever holders keep); the file tiers hold every name the memory tier may serve."""
    roots, tid = _roots(config, cipher)
    for tier, s in _file_roots(roots):
        identity = read_identity(s.open())
        if identity is not None:
            roots.identities[tier] = identity
    tiers = []
    if config.memory_replicas and "durable" in roots.identities and (
            config.local_dir is None or roots.nodes is not None or "local" in roots.identities):
        import ray

        if ray.is_initialized():
            tiers.append(Tier(_memory_spec(roots, config, tid).open(), "memory tier",
                              copy=True, memory=True))
    if roots.local is None:
        return [Tier(roots.durable.open())]
    if roots.nodes is None:
        tiers.append(Tier(roots.local.open(), "local tier", copy=True))
    return [*tiers, Tier(roots.durable.open(), "durable tier")]


def _lease(storage: Storage, config: CheckpointConfig) -> Lease:
    lease = Lease(storage, job_name=config.job_name, ttl_s=config.lease_ttl_s,
                  takeover=config.lease_takeover, wait_s=config.lease_wait_s).acquire()
    if lease.took_over is not None:
        logger.warning("took over the lease of %s from %s", storage.url(),
                       lease.took_over.describe())
    return lease
