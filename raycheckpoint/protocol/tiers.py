"""The tiers a tiered job's coordinator copies its committed checkpoints to.

DESIGN section 7.  The coordinator of a tiered job commits in the local tier
(``checkpoint.local_dir``); :class:`Tiers` then queues each commit for

* the durable tier (:class:`DurableTier`, ``save_dir``): every ``replicate_every``-th
  checkpoint, and always a tagged one, one among the ``keep_best_n`` best by
  ``best_metric`` so far, the train-end and preemption saves; retention
  of the local tier keeps what still waits for it (up to ``replication_backlog``);
* the memory tier (:class:`MemoryTier`, ``memory_replicas``): every full checkpoint,
  newest only (:mod:`~raycheckpoint.protocol.memory`).

Each tier has its own :class:`~raycheckpoint.protocol.replicate.Replicator` thread, so a
slow or failed durable store never delays the memory copy, and neither delays a save;
the threads run ``persist_nice`` levels below the coordinator, as the workers' persist
threads do, so that training wins the CPU on a busy host.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from raycheckpoint.policy.retention import BestN, RetentionPolicy
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.collect import Collector
from raycheckpoint.protocol.memory import replicate_to_memory
from raycheckpoint.protocol.replicate import Replicator
from raycheckpoint.protocol.root import RootState
from raycheckpoint.storage import Storage, StorageSpec

logger = logging.getLogger(__name__)


class Tiers:
    """The copy tiers of one tiered job (see the module doc)."""

    def __init__(self, source: Storage, durable: RootState, policy: RetentionPolicy, *,
                 every: int, backlog: int, replicated: Callable[[str], None],
                 memory: StorageSpec | None = None, memory_replicas: int = 0,
                 nice: int = 0) -> None:
        self.durable = DurableTier(source, durable, policy, every=every, backlog=backlog,
                                   replicated=replicated, nice=nice)
        self.memory = (MemoryTier(source, RootState(memory.open()), memory_replicas, nice=nice)
                       if memory is not None and memory_replicas > 0 else None)

    def resume_pending(self, source_markers: list[Any]) -> list[str]:
        return self.durable.resume_pending(source_markers)

    def committed(self, name: str, *, kind: str, tag: str | None, always: bool, step: int = 0,
                  metrics: dict[str, Any] | None = None) -> None:
        """A checkpoint was committed in the local tier: queue its copies."""
        self.durable.committed(name, tag=tag, always=always,
                               entry={"name": name, "step": step, "kind": kind,
                                      "metrics": dict(metrics or {})})
        if self.memory is not None and kind == "full":
            self.memory.replicator.enqueue(name)

    def protected(self) -> dict[str, str]:
        return self.durable.protected()

    def set_rank_nodes(self, rank_nodes: dict[str, list[str]]) -> None:
        if self.memory is not None:
            self.memory.rank_nodes = {r: list(n) for r, n in rank_nodes.items()}

    def status(self) -> dict[str, Any]:
        out = self.durable.status()
        if self.memory is not None:
            out["memory"] = self.memory.status()
        return out

    def wait_idle(self, timeout: float) -> bool:
        ok = self.durable.replicator.wait_idle(timeout)
        return (self.memory is None or self.memory.replicator.wait_idle(timeout)) and ok


class MemoryTier:
    """The memory tier as the coordinator sees it: its root (the holders), its copy
    thread and where the ranks run (set by the manager: :meth:`Tiers.set_rank_nodes`)."""

    def __init__(self, source: Storage, target: RootState, replicas: int, *,
                 nice: int = 0) -> None:
        self.root = target
        self.replicas = replicas
        self.rank_nodes: dict[str, list[str]] = {}
        self.lock = threading.Lock()
        self.collector = Collector(target, RetentionPolicy(keep_last_n=1, keep_last_n_light=1))
        self.replicator = Replicator(source, target, self.collector, lock=self.lock,
                                     copy=self._copy, newest_only=True,
                                     name="raycheckpoint-memory", nice=nice)
        self.last: dict[str, Any] | None = None

    def _copy(self, source: Storage, target: RootState, name: str) -> dict[str, Any]:
        if not self.rank_nodes:
            raise RuntimeError("the memory tier does not know where the ranks run yet")
        target.sync()  # holders may have died (and their files with them) since the last copy
        result = replicate_to_memory(source, target, name, self.rank_nodes, self.replicas)
        self.last = result
        logger.info("copied %s to the memory tier: %d bytes on %d holders in %.2fs", name,
                    result["bytes"], result["holders"], result["s"])
        return result

    def status(self) -> dict[str, Any]:
        return {"pending": self.replicator.pending(), "last_error": self.replicator.last_error,
                "held": [m.name for m in self.root.sorted_markers()], "last": self.last}


class DurableTier:
    """The durable tier of a tiered job, as its coordinator sees it: the root, its
    retention, and which committed local checkpoints go there (see
    ``CheckpointConfig.replicate_every``)."""

    def __init__(self, source: Storage, target: RootState, policy: RetentionPolicy, *,
                 every: int, backlog: int,
                 replicated: Callable[[str], None] = lambda name: None, nice: int = 0) -> None:
        self.root = target
        self.every = max(1, every)
        self.backlog = backlog
        self.lock = threading.Lock()
        self.replicator: Replicator | None = None  # none before recovery: nothing copies
        self.collector = Collector(target, policy, self._copying)
        with self.lock:
            self.collector.recover()  # a copy cut short is collected here
            # keep_best_n: the best checkpoints the durable tier has or will have
            self._best_rule = (BestN(policy.best_metric, policy.best_mode, policy.keep_best_n)
                               if policy.keep_best_n else None)
            self._best = [m.to_catalog_entry() for m in target.sorted_markers() if m.kind == "full"]
            self._best = self._best_of(self._best)
        self.replicator = Replicator(source, target, self.collector, lock=self.lock,
                                     on_done=self._done, nice=nice)
        self._commits = 0
        self._replicated = replicated  # the source tier may now let it go: its retention

    def _copying(self) -> set[str]:
        return set() if self.replicator is None else set(self.replicator.pending()[:1])

    def resume_pending(self, source_markers: list[Any]) -> list[str]:
        """At start: the newest committed full checkpoint of the source tier is queued when
        the durable tier has nothing as new (replications cut short by a crash)."""
        durable = [m for m in self.root.sorted_markers() if m.kind == "full"]
        newest = max((m for m in source_markers if m.kind == "full"), key=catalog.order_key,
                     default=None)
        if newest is None or (durable and catalog.order_key(durable[-1]) >= catalog.order_key(newest)):
            return []
        self.replicator.enqueue(newest.name)
        return [newest.name]

    def _best_of(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self._best_rule is None:
            return []
        keep = self._best_rule.keep(entries)
        return [e for e in entries if e["name"] in keep]

    def committed(self, name: str, *, tag: str | None, always: bool,
                  entry: dict[str, Any] | None = None) -> bool:
        """A checkpoint was committed in the source tier; queue it when due (every
        ``every``-th, tagged, ``always``, or one of the ``keep_best_n`` best: ``entry``'s
        metrics).  True if queued."""
        self._commits += 1
        best = False
        if entry is not None and entry["kind"] == "full" and self._best_rule is not None:
            self._best = self._best_of([*self._best, entry])
            best = any(e["name"] == name for e in self._best)
        if not (always or best or tag is not None or self._commits % self.every == 0):
            return False
        self.replicator.enqueue(name)
        pending = self.replicator.pending()
        if len(pending) > self.backlog:
            logger.warning(
                "replication is behind: %d checkpoints wait for the durable tier %s (bound "
                "checkpoint.replication_backlog=%d; the oldest beyond it may leave the local "
                "tier before they are copied); last error: %s", len(pending),
                self.root.storage.url(), self.backlog, self.replicator.last_error)
        return True

    def protected(self) -> dict[str, str]:
        """Source-tier checkpoints its retention must keep: those waiting for the durable
        tier, the oldest ``backlog`` of them."""
        return {n: "waiting for replication to the durable tier"
                for n in self.replicator.pending()[:self.backlog]}

    def status(self) -> dict[str, Any]:
        return {"pending": self.replicator.pending(), "last_error": self.replicator.last_error,
                "replicated": sorted(self.replicator.results),
                "last": next(reversed(self.replicator.results.values()), None),
                "durable": [m.name for m in self.root.sorted_markers()]}

    def _done(self, name: str, result: dict[str, Any] | None, error: str | None) -> None:
        self._replicated(name)  # no longer waiting: the source tier's retention runs again
        if result is not None:
            logger.info("replicated %s to %s: %d bytes copied in %.2fs", name,
                        self.root.storage.url(), result["copied"], result["s"])
