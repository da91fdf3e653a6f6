"""CheckpointCoordinator: one per job; owns commit, LATEST, the catalog and retention.

It is a plain class, run as a threaded Ray actor by the manager
(``ray.remote(CheckpointCoordinator).options(max_concurrency=...)``).  Protocol:

1. ``begin(step, kind, ...)`` reserves a step directory of its own (claimed: see
   :mod:`~raycheckpoint.protocol.paths`) and the set of expected (role, rank) reports; a
   save still in flight is waited for first (bounded), so two saves of a job never
   interleave their commits.  A committed checkpoint of the same step is reused only
   when it holds the job's state (the one it committed or loaded last: ``loaded``);
   otherwise it is quarantined.
2. The driver calls ``await_save(save_id)`` once every worker holds its host copy: the
   commit timeout counts from then, and the call answers when the save has finished, as
   ``wait`` does (it is the driver's handle on the save).  Workers call
   ``report(save_id, role, rank, files, error)`` from their persist threads.
3. A commit thread per save waits for every report (timeout: ``commit_timeout_s``; the
   error names the missing pairs), then writes, in this order: ``trainer_state.json``,
   ``version.json``, ``manifest.msgpack``, ``COMMITTED``, ``LATEST`` (full only) and the
   ``latest`` link, the tag pointer, ``catalog.json``.  The save is then committed:
   ``wait(save_id)`` returns and ``ckpt_on_committed`` is broadcast to the registered
   workers.  Clean-up follows, still under the commit lock (the next ``begin``,
   ``catalog()`` and ``gc()`` wait for it): retention deletes, then the leftovers of
   aborted saves are collected.  It is kept off the durable path because deleting a
   checkpoint costs as much as a large part of a commit (about 0.45 s for 2 GB on local
   disk); ``wait_cleanup()`` waits for it and says what it deleted.
4. Any failure aborts: no marker, ``LATEST`` unchanged, partial files left to GC; the
   error is delivered by ``wait(save_id)``.

State lives on storage: on start the coordinator rebuilds the catalog and ``LATEST``
from the markers if they disagree and collects uncommitted leftovers.  Its parts: the
root's state (:mod:`~raycheckpoint.protocol.root`), the commit sequence
(:mod:`~raycheckpoint.protocol.commit`) and collection
(:mod:`~raycheckpoint.protocol.collect`); this module tracks the saves in flight and
runs their barrier.  :func:`~raycheckpoint.protocol.coordinator_actor.start` runs it
as the job's named Ray actor.  The coordinator never looks inside tensors.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raycheckpoint._internal import exit as process_exit
from raycheckpoint.errors import CheckpointSaveError, CommitTimeoutError
from raycheckpoint.policy.retention import RetentionPolicy
from raycheckpoint.protocol.collect import Collector
from raycheckpoint.protocol.commit import SaveRecord, commit
from raycheckpoint.protocol.lineage import Lineage
from raycheckpoint.protocol.paths import step_dir_name, validate_tag
from raycheckpoint.protocol.root import RootState
from raycheckpoint.protocol.tiers import Tiers
from raycheckpoint.protocol.verification import VerificationQueue
from raycheckpoint.storage import FileEntry, StorageSpec

if TYPE_CHECKING:  # the job's config, handed down by the manager
    from raycheckpoint.config import CheckpointConfig

logger = logging.getLogger(__name__)

class CheckpointCoordinator:
    def __init__(self, storage: StorageSpec, config: CheckpointConfig, *, recover: bool = True,
                 lease_job_id: str | None = None,
                 verifier: Callable[[StorageSpec], Any] | None = None,
                 durable: StorageSpec | None = None,
                 durable_lease_job_id: str | None = None,
                 memory: StorageSpec | None = None) -> None:
        process_exit.install()  # never hang in Ray's C++ teardown (_internal/exit.py)
        self.spec = storage
        self.storage = storage.open()
        self.config = config
        self.root = RootState(self.storage, lease_job_id)
        self._cond = threading.Condition()
        self._commit_lock = threading.Lock()
        self._saves: dict[str, SaveRecord] = {}
        self._last: SaveRecord | None = None
        self._workers: list[Any] = []
        self._requests: list[dict[str, Any]] = []
        self.tiers: Tiers | None = None
        policy = RetentionPolicy.from_config(config)
        if durable is not None:  # this root is the local tier: see protocol/tiers.py
            self.tiers = Tiers(self.storage, RootState(durable.open(), durable_lease_job_id),
                               policy, every=config.replicate_every or 1,
                               backlog=config.replication_backlog,
                               replicated=self._local_retention, memory=memory,
                               memory_replicas=config.memory_replicas, nice=config.persist_nice)
            policy = RetentionPolicy(keep_last_n=config.keep_last_n_local,
                                     keep_last_n_light=config.keep_last_n_light)
        self.collector = Collector(self.root, policy, self._in_flight,
                                   also_protected=self._waiting_for_replication)
        self.lineage = Lineage(self.root, lambda: None if self.tiers is None else self.tiers.durable)
        self.recovery = self._recover() if recover else {}
        if self.tiers is not None:
            self.recovery["replication_resumed"] = self.tiers.resume_pending(
                self.root.sorted_markers())
        self._commits = 0
        self._verifications = VerificationQueue(self.spec, self.root, self._commit_lock,
                                                timeout_s=config.save_wait_timeout_s,
                                                start=verifier)

    def _recover(self, *, dry_run: bool = False, leftover_grace_s: float = 0.0,
                 quarantined: bool = False) -> dict[str, Any]:
        with self._commit_lock:
            return self.collector.recover(dry_run=dry_run, grace_s=leftover_grace_s,
                                          quarantined=quarantined)

    def _local_retention(self, name: str) -> None:
        with self._commit_lock:  # a replication is over: what was kept for it may go
            try:
                self.collector.apply_retention(self.root.sorted_markers(), dict(self.root.tags))
            except Exception:  # the next clean-up retries it
                logger.exception("local retention after replicating %s failed", name)

    def _waiting_for_replication(self) -> dict[str, str]:  # kept by the local retention
        return {} if self.tiers is None else self.tiers.protected()

    def _in_flight(self) -> set[str]:
        with self._cond:
            return {s.name for s in self._saves.values() if s.status == "pending"}

    # ---- driver API ---------------------------------------------------------------------------

    def register_workers(self, workers: list[Any],
                         rank_nodes: dict[str, list[str]] | None = None) -> None:
        """The workers to tell of commits; ``rank_nodes``: the node of each rank (role ->
        node ids by rank), where the memory tier keeps replicas."""
        self._workers = list(workers)
        if self.tiers is not None and rank_nodes:
            self.tiers.set_rank_nodes(rank_nodes)

    def request_save(self, tag: str | None = None, kind: str = "full") -> None:
        """Ask the running job's driver to save at its next step (from outside the job)."""
        if kind not in ("full", "light"):
            raise ValueError(f"kind must be 'full' or 'light', got {kind!r}")
        if tag is not None:
            validate_tag(tag)
        with self._cond:
            self._requests.append({"tag": tag, "kind": kind, "at": time.time()})

    def take_requests(self) -> list[dict[str, Any]]:
        with self._cond:
            taken, self._requests = self._requests, []
        return taken

    def take_verifications(self) -> list[dict[str, Any]]:
        """Background verification results recorded since the last call."""
        return self._verifications.take()

    def wait_verifications(self, timeout: float) -> bool:
        """Wait until no verification is running or due; False on timeout."""
        return self._verifications.wait_idle(timeout)

    def catalog(self) -> dict[str, Any]:
        with self._commit_lock:
            return self.root.doc()

    def begin(self, *, step: int, kind: str, tag: str | None, metrics: dict[str, float],
              trainer_state: dict[str, Any], expected: list[tuple[str, int]],
              world_sizes: dict[str, int], frozen: dict[str, str] | None = None,
              replicate: bool = False, held: bool = False,
              rollout_state: Any = None) -> dict[str, Any]:
        """Reserve a save.

        Returns ``{"save_id", "name", "reused"}``, or ``{"existing": entry}`` when the
        checkpoint of ``step`` this job committed or loaded last holds what is asked (the
        same state saved twice).  Any other committed checkpoint of ``step`` is
        quarantined, and the save gets a step directory no other attempt ever had
        (:mod:`~raycheckpoint.protocol.lineage`).  ``frozen``
        maps frozen roles to the identity of their weights; a role whose identical weights
        (same identity and world size) are in a committed checkpoint is not written again:
        it is listed in ``reused``, expects no reports, and the manifest references the
        earlier bytes.  ``replicate``: a tiered job copies this checkpoint to its durable
        tier whatever ``replicate_every`` says (train end, preemption).  ``held``: a save
        begun with a training step, committed only once ``await_save`` brings what the
        step's end knows (its metrics, the triggers' state); never, if that never comes.
        ``rollout_state``: an asynchronous job's rollout side (JSON-safe), committed as the
        encrypted data file ``rollout_state.json``.
        """
        if kind not in ("full", "light"):
            raise ValueError(f"kind must be 'full' or 'light', got {kind!r}")
        if tag is not None:
            validate_tag(tag)
        previous = self._last
        if previous is not None and not previous.done.wait(self.config.save_wait_timeout_s):
            raise TimeoutError(f"save {previous.name} is still in flight after "
                               f"{self.config.save_wait_timeout_s}s; not starting another")
        root = self.root
        with self._commit_lock:
            same = self.lineage.same_state(step)
            if same is not None and (same.kind == "full" or kind == "light"):
                if tag is not None:
                    root.reload_tags()
                    root.write_tag(tag, same.name)
                    root.write_catalog()
                return {"existing": same.to_catalog_entry()}
            self.lineage.supersede(step, keep=same)
            save_id = uuid.uuid4().hex[:12]
            # a light checkpoint of this very state keeps its name; the full one goes beside it
            name = root.take_dir(step_dir_name(step, upgraded=same is not None), save_id,
                                 also=None if self.tiers is None else self.tiers.durable.root)
            frozen = dict(frozen or {})
            reused = root.reusable(frozen, world_sizes)
            expected = [e for e in expected if e[0] not in reused]
            save = SaveRecord(save_id=save_id, name=name, step=step, kind=kind, tag=tag,
                         metrics=dict(metrics), trainer_state=dict(trainer_state),
                         world_sizes=dict(world_sizes), expected={tuple(e) for e in expected},
                         frozen=frozen, reused=reused, replicate=replicate, held=held,
                         rollout_state=rollout_state,
                         # until the driver says every snapshot is taken (snapshotted()),
                         # the snapshots themselves may wait for a previous persist
                         deadline=time.time() + self.config.save_wait_timeout_s
                         + self.config.commit_timeout_s)
            with self._cond:
                self._saves[save.save_id] = save
                self._last = save
        threading.Thread(target=self._run, args=(save,), daemon=True,
                         name=f"raycheckpoint-commit-{name}").start()
        return {"save_id": save.save_id, "name": name, "reused": sorted(reused)}

    def loaded(self, name: str | None, passed_over: list[tuple[str, str, str]] = ()) -> list[str]:
        """The job holds ``name``'s state now; quarantine what ``auto`` passed over
        (:meth:`Lineage.loaded <raycheckpoint.protocol.lineage.Lineage.loaded>`)."""
        with self._commit_lock:
            return self.lineage.loaded(name, list(passed_over))

    def snapshotted(self, save_id: str) -> None:
        """Every worker has its host copy: the persist/commit timeout starts now."""
        with self._cond:
            save = self._saves.get(save_id)
            if save is not None and save.status == "pending":
                save.deadline = time.time() + self.config.commit_timeout_s
                self._cond.notify_all()

    def await_save(self, save_id: str, late: dict[str, Any] | None = None) -> dict[str, Any]:
        """:meth:`snapshotted`, then answer as :meth:`wait` does once the save has finished:
        the driver holds this call's answer as its handle on the save.  ``late``: what a
        held save commits with (``metrics``; ``trainer_state`` entries), releasing it."""
        if late is not None:
            with self._cond:
                save = self._saves.get(save_id)
                if save is not None and save.status == "pending":
                    save.metrics.update(late.get("metrics") or {})
                    save.trainer_state.update(late.get("trainer_state") or {})
                    save.held, save.started = False, time.time()
        self.snapshotted(save_id)
        return self.wait(save_id)

    def report(self, save_id: str, role: str, rank: int, files: list[dict[str, Any]],
               error: str | None, persist_s: float | None = None) -> None:
        with self._cond:
            save = self._saves.get(save_id)
            if save is None or save.status != "pending":
                logger.warning("report for unknown or finished save %s from %s/%s", save_id, role,
                               rank)
                return
            key = (role, int(rank))
            if key not in save.expected:
                save.failures[f"{role}/{rank}"] = f"unexpected reporter (expected {sorted(save.expected)})"
            elif error is not None:
                save.failures[f"{role}/{rank}"] = error
            else:
                save.reports[key] = [FileEntry.from_dict(f) for f in files]
                if persist_s is not None:
                    save.persist_s[f"{role}/{rank}"] = float(persist_s)
            self._cond.notify_all()

    def abort(self, save_id: str, reason: str) -> None:
        with self._cond:
            save = self._saves.get(save_id)
            if save is not None and save.status == "pending":
                save.failures["driver"] = f"aborted: {reason}"
                self._cond.notify_all()

    def wait(self, save_id: str, timeout: float | None = None) -> dict[str, Any]:
        save = self._saves[save_id]
        if not save.done.wait(timeout):
            raise TimeoutError(f"save {save.name} ({save_id}) not finished after {timeout}s")
        if save.error is not None:
            raise save.error
        return dict(save.result or {})

    def wait_cleanup(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Wait for the clean-up after the newest save; return what it did.

        ``{"name", "deleted", "collected", "error", "cleanup_s"}``, or None when there
        was no save yet or the newest one did not commit (it has no clean-up).
        """
        save = self._last
        if save is None:
            return None
        if not save.cleaned.wait(timeout):
            raise TimeoutError(f"clean-up after {save.name} not finished after {timeout}s")
        return None if save.cleanup is None else dict(save.cleanup)

    def replication(self) -> dict[str, Any] | None:
        """A tiered job's replication (:meth:`Tiers.status`); None with one tier."""
        return None if self.tiers is None else self.tiers.status()

    def wait_replication(self, timeout: float) -> bool:
        """Wait until no replication is queued or running; False on timeout."""
        return True if self.tiers is None else self.tiers.wait_idle(timeout)

    def gc(self, *, dry_run: bool = False, leftover_grace_s: float = 0.0) -> dict[str, Any]:
        """Re-read storage, repair LATEST/catalog, collect leftovers, apply retention
        (idempotent), remove superseded quarantined checkpoints:
        :meth:`Collector.recover <raycheckpoint.protocol.collect.Collector.recover>`,
        which ``raycheckpoint gc`` runs too."""
        return self._recover(dry_run=dry_run, leftover_grace_s=leftover_grace_s,
                             quarantined=True)

    # ---- commit --------------------------------------------------------------------------------

    def _run(self, save: SaveRecord) -> None:
        try:
            self._await_reports_and_commit(save)
        finally:
            save.cleaned.set()

    def _await_reports_and_commit(self, save: SaveRecord) -> None:
        with self._cond:
            while (save.status == "pending" and not save.failures
                   and (save.held or set(save.reports) != save.expected)
                   and time.time() < save.deadline):
                self._cond.wait(min(1.0, max(0.0, save.deadline - time.time())))
            if save.held and not save.failures:
                save.failures["driver"] = ("the step this save was begun with never "
                                           "completed it (the driver's step() call)")
            failures = dict(save.failures)
            missing = sorted(save.expected - set(save.reports))
        if failures:
            self._finish(save, CheckpointSaveError(
                f"save of {save.name} aborted; failures: "
                + "; ".join(f"{who}: {msg.splitlines()[0] if msg else msg}"
                            for who, msg in sorted(failures.items())),
                failures=failures))
            return
        if missing:
            self._finish(save, CommitTimeoutError(
                f"save of {save.name} aborted: no report within {self.config.commit_timeout_s}s "
                f"from (role, rank) {missing}", missing=missing))
            return
        self._commit_and_clean_up(save)

    def _commit_and_clean_up(self, save: SaveRecord) -> None:
        t0 = time.perf_counter()
        with self._commit_lock:
            try:
                result = commit(self.root, save)
            except Exception as e:
                logger.exception("commit of %s failed", save.name)
                self._finish(save, CheckpointSaveError(
                    f"commit of {save.name} failed: {type(e).__name__}: {e}",
                    failures={"coordinator": repr(e)}))
                return
            result["commit_s"] = time.perf_counter() - t0  # all reports in -> committed
            self.lineage.committed(save.name)
            if self.tiers is not None:  # queued before any waiter hears of the commit
                self.tiers.committed(save.name, kind=save.kind, tag=save.tag,
                                     always=save.replicate, step=save.step, metrics=save.metrics)
                result["replication_pending"] = len(self.tiers.durable.replicator.pending())
            self._finish(save, None, result)  # durable and visible: waiters go on now
            for w in self._workers:
                try:
                    w.ckpt_on_committed.remote(save.name, save.step)
                except Exception as e:  # noqa: BLE001 - a dead worker must not fail a commit
                    logger.warning("broadcast of %s to a worker failed: %s", save.name, e)
            save.cleanup = self.collector.clean_up_after(save.name)
            self._commits += 1
        every = self.config.verify_interval
        if every and self._commits % every == 0:
            self._verifications.due(save.name)

    def _finish(self, save: SaveRecord, error: BaseException | None,
                result: dict[str, Any] | None = None) -> None:
        with self._cond:
            save.status = "aborted" if error is not None else "committed"
            save.error, save.result = error, result
            self._cond.notify_all()
        if error is not None:
            logger.error("%s", error)
        save.done.set()

