"""CheckpointManager: the driver-side facade (step, save_checkpoint, load_checkpoint, stats).

* ``step(step, epoch=, metrics=, is_last=)``, once per training step, makes every save
  the config asks for (:mod:`raycheckpoint.autosave`): the loop holds no save logic.

The manager starts the job's :class:`~raycheckpoint.protocol.coordinator.CheckpointCoordinator`
actor, sets up the workers' savers, and drives the protocol:

* ``save_checkpoint(tag=None, kind="full")`` asks the coordinator to ``begin`` and, in
  the same moment, each trainable role's workers to snapshot (``ckpt_snapshot_begun``:
  they copy while ``begin`` runs and read its answer after); a frozen role's workers
  snapshot once ``begin`` has said whether their weights are reused.  Each worker starts
  its persist as it answers (after its host copy); once every worker has answered, the
  manager sends the coordinator's ``await_save`` without waiting, and returns a
  :class:`SaveHandle` on that call's answer at once; persisting and committing go on in
  the background.
  ``handle.wait(timeout)`` returns the commit result or raises the error.
* ``load_checkpoint(ref, strict=True)`` resolves, verifies and loads a checkpoint into
  every worker (resharding when the world size changed), then restores the driver's
  RNG and data loader; ``"auto"`` skips checkpoints that fail verification.
  ``load_model_weights(ref)`` loads weights only (light or full checkpoints).  Both are
  the job's :class:`~raycheckpoint.loader.CheckpointLoader`.
* ``fingerprint``: the job's config as it must match for a strict resume (stored in each
  checkpoint's ``trainer_state.json``); its ``"absent_means"`` entry
  (:data:`raycheckpoint.resume.ABSENT`) gives, for keys added in a later release of the
  job, the value their absence in an older checkpoint stands for.

Workers are any Ray actors mixing in :class:`~raycheckpoint.worker.CheckpointableWorker`,
grouped by role (rank = position in the list).
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from typing import Any

import ray

from raycheckpoint import verifier
from raycheckpoint._internal.rpc import get as _get
from raycheckpoint._internal.save_round import SaveRound
from raycheckpoint.autosave import StepSave, StepSaver
from raycheckpoint.config import CheckpointConfig
from raycheckpoint.integrity.crypto import FileCipher, load_key
from raycheckpoint.loader import CheckpointLoader, LoadResult
from raycheckpoint.metrics import CheckpointMetrics
from raycheckpoint.protocol import coordinator_actor
from raycheckpoint.roots import open_roots
from raycheckpoint.save_handle import SaveHandle, SaveTracker

__all__ = ["CheckpointManager", "LoadResult", "SaveHandle"]

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Driver-side checkpointing for one job's worker groups."""

    def __init__(self, config: CheckpointConfig, worker_groups: dict[str, list[Any]], *,
                 dataloader: Any = None, rollout_state: Any = None,
                 fingerprint: dict[str, Any] | None = None,
                 frozen_roles: tuple[str, ...] | list[str] = (),
                 prepare_buffers: bool = True) -> None:
        self.config = config
        # the key is read here, from the environment or a file; only its id is ever stored
        self.cipher = (FileCipher(load_key(config.encryption_key))
                       if config.encryption_key is not None else None)
        # save_dir (durable) and, for a tiered job, local_dir: each leased (roots.py)
        self.roots = open_roots(config, self.cipher)
        self.spec = self.roots.durable
        self.storage = self.spec.open()
        self.groups = {role: list(ws) for role, ws in worker_groups.items()}
        unknown = sorted(set(frozen_roles) - set(self.groups))
        if unknown:
            raise ValueError(f"frozen_roles {unknown} are not among the worker groups "
                             f"{sorted(self.groups)}")
        self.frozen_roles = tuple(frozen_roles)
        self._identities: dict[str, str] = {}
        self.dataloader = dataloader
        self.rollout_state = rollout_state
        self.fingerprint = dict(fingerprint or {})
        self.global_step = 0
        self.epoch = 0
        self.metrics: dict[str, Any] = {}
        self._metrics = CheckpointMetrics(
            config.job_name, window=config.anomaly_window, stall_warn_factor=config.stall_warn_factor,
            size_warn_factor=config.size_warn_factor, slow_warn_factor=config.slow_warn_factor,
            publish=config.publish_metrics)
        self._saves = SaveTracker(self._metrics)
        self._record = self._saves.record
        self.verifications: list[dict[str, Any]] = []  # background verification results
        self._stepper = StepSaver(self)
        self._loader = CheckpointLoader(
            self.roots.commit.open(), config, self.groups, cipher=self.cipher,
            fingerprint=self.fingerprint, dataloader=dataloader, rollout_state=rollout_state,
            workers_loaded=self._refresh_identities,
            durable=self.spec if self.roots.local is not None else None, memory=self.roots.memory,
            workers_see_root=self.roots.nodes is None)
        try:
            self._start(config, prepare_buffers)
        except BaseException:
            self.roots.release()
            raise

    def _start(self, config: CheckpointConfig, prepare_buffers: bool) -> None:
        roots = self.roots
        tiered = roots.local is not None
        rpc = config.rpc_timeout_s
        rank_nodes = roots.place(self.groups, rpc)  # per-node agents started: before commits
        self._coordinator = coordinator_actor.start(
            roots.commit, config, roots.lease_id("local" if tiered else "durable"),
            verifier=verifier.start if config.verify_interval else None,
            durable=roots.durable if tiered else None, durable_lease_job_id=roots.lease_id("durable"),
            memory=roots.memory)
        probe = roots.write_probe()
        ranks = [(role, rank, w) for role, ws in self.groups.items() for rank, w in enumerate(ws)]
        seen = _get([w.ckpt_setup.remote(
            role=role, rank=rank, world_size=len(self.groups[role]), storage=roots.write,
            probe=probe, report_timeout_s=rpc, persist_nice=config.persist_nice,
            freeze_gc=config.freeze_gc, coordinator=self._coordinator,
            write_ahead=config.write_ahead, host_buffer_bytes=config.host_buffer_bytes)
            for role, rank, w in ranks], rpc)
        roots.check_visible(probe, [(f"{role}/{rank}", ok)
                                    for (role, rank, _), ok in zip(ranks, seen, strict=True)])
        _get(self._coordinator.register_workers.remote(self.workers, rank_nodes), rpc)
        self._refresh_identities()
        if prepare_buffers:  # first-touch the host buffers now, not in the first save's stall
            _get([w.ckpt_prepare.remote("full") for role, ws in self.groups.items()
                  if role not in self.frozen_roles for w in ws], rpc)

    # ---- helpers --------------------------------------------------------------------------------

    @property
    def workers(self) -> list[Any]:
        return [w for ws in self.groups.values() for w in ws]

    @property
    def world_sizes(self) -> dict[str, int]:
        return {role: len(ws) for role, ws in self.groups.items()}

    @property
    def coordinator(self) -> Any:
        return self._coordinator

    def update(self, *, step: int | None = None, epoch: int | None = None,
               metrics: dict[str, Any] | None = None) -> None:
        """Tell the manager where training is; saves record these values."""
        if step is not None:
            self.global_step = step
        if epoch is not None:
            self.epoch = epoch
        if metrics is not None:
            self.metrics = dict(metrics)

    def step(self, step: int, *, epoch: int | None = None, metrics: dict[str, Any] | None = None,
             is_last: bool = False) -> SaveHandle | None:
        """Call once per training step, after its metrics are known: records where training
        is and makes the saves the config asks for (requests from outside, triggers,
        preemption; see :mod:`raycheckpoint.autosave`).  Returns the step's full save, else
        its light one, else None; ``last_saves`` lists them all.  Once a SIGTERM's save
        has committed, ``should_stop`` is True."""
        handle = self._stepper.step(step, epoch=epoch, metrics=metrics, is_last=is_last)
        self._take_verifications()
        return handle

    def watch_preemption(self) -> None:
        """Install the SIGTERM handler now (``step()`` does on its first call): a signal
        that arrives before the first step is acted on at that step."""
        self._stepper.arm()

    @property
    def last_saves(self) -> list[SaveHandle]:
        return list(self._stepper.saves)

    @property
    def should_stop(self) -> bool:
        """True once a preemption signal arrived and its save committed."""
        return self._stepper.stop_requested

    @property
    def stop_signal(self) -> int | None:
        """The signal that asked the job to stop (``should_stop``), if any."""
        flag = self._stepper.preemption
        return None if flag is None else flag.signum

    def _take_verifications(self) -> None:
        """Background verification results since the last call: published, failures warned."""
        if not self.config.verify_interval:
            return
        for r in _get(self._coordinator.take_verifications.remote(), self.config.rpc_timeout_s):
            self.verifications.append(r)
            self._metrics.verified(r)
            if not r["ok"]:
                warnings.warn(f"checkpoint {r['name']} failed background verification: "
                              f"{r['error']}; resume ('auto') skips it", RuntimeWarning,
                              stacklevel=3)

    def _refresh_identities(self) -> None:
        """Hash the frozen roles' weights (per rank, no collective) to detect reuse."""
        for role in self.frozen_roles:
            per_rank = _get([w.ckpt_identity.remote() for w in self.groups[role]],
                            self.config.rpc_timeout_s)
            self._identities[role] = hashlib.sha256("".join(per_rank).encode()).hexdigest()

    def poll_requests(self) -> list[dict[str, Any]]:
        """Save requests made from outside the job (``python -m raycheckpoint.request``)."""
        return _get(self._coordinator.take_requests.remote(), self.config.rpc_timeout_s)

    def catalog(self) -> dict[str, Any]:
        return _get(self._coordinator.catalog.remote(), self.config.rpc_timeout_s)

    def gc(self) -> dict[str, list[str]]:
        return _get(self._coordinator.gc.remote(), self.config.rpc_timeout_s)

    @property
    def checkpoint_stats(self) -> list[dict[str, Any]]:
        """Per finished save: bytes, stall_s, persist_s, total_s, throughput_mb_s, ok, anomalies.

        The same figures are published as Ray metrics (see :mod:`raycheckpoint.metrics`).
        """
        self._saves.poll()
        self._take_verifications()
        return list(self._saves.stats)

    # ---- save -------------------------------------------------------------------------------------

    def save_checkpoint(self, tag: str | None = None, kind: str = "full", *,
                        step: int | None = None, metrics: dict[str, Any] | None = None,
                        replicate: bool = False) -> SaveHandle:
        """Snapshot every worker (blocking only for the host copy) and commit in the background.

        ``replicate``: a tiered job copies this checkpoint to the durable tier whatever
        ``replicate_every`` says (tagged checkpoints always are)."""
        if kind not in ("full", "light"):
            raise ValueError(f"kind must be 'full' or 'light', got {kind!r}")
        riding = self._stepper.riding
        if riding is not None:  # its commit waits for step(); this save's begin, for it
            raise RuntimeError(f"save_checkpoint: the save begun with step {riding.step} "
                               "(step_save) is completed by step() first")
        self._saves.poll()
        step = self.global_step if step is None else step
        metrics = dict(self.metrics if metrics is None else metrics)
        return SaveRound(self, step=step, kind=kind, tag=tag, metrics=metrics,
                         replicate=replicate).finish()

    def step_save(self, step: int, *, epoch: int | None = None,
                  is_last: bool = False) -> StepSave | None:
        """The save the triggers ask of ``step`` by its number or the clock (intervals,
        minutes, train end), begun now, to ride on the step's training calls: None when
        none is due.  Call it once the step has drawn its data, and call ``snapshot()``
        on the answer right after sending the step's last training calls (each worker
        snapshots as soon as those end, before anything sent later); ``step()`` then
        completes it.  See :class:`~raycheckpoint.autosave.StepSave`."""
        return self._stepper.begin_step(step, epoch=epoch, is_last=is_last)

    def wait_for_saves(self, timeout: float | None = None) -> None:
        """Wait for every save in flight; raise the first failure not yet observed."""
        self._saves.wait_all(timeout)

    # ---- load -------------------------------------------------------------------------------------

    def load_checkpoint(self, ref: str | int = "auto", strict: bool = True) -> LoadResult | None:
        """Resume from ``ref`` (path, step, tag, ``"latest"`` or ``"auto"``).

        Returns None when ``ref == "auto"`` and the root holds no checkpoint (fresh start).
        """
        result = self._loader.load(ref, strict)
        if result is None:
            return None
        # the job now holds this checkpoint's state (a save of its step reuses it, and
        # sets any other checkpoint of that step aside); what `auto` passed over for its
        # own bytes is quarantined
        holds = (result.kind == "full" and not result.skipped
                 and result.tier != "root of the path given")
        _get(self._coordinator.loaded.remote(
            result.name if holds else None,
            [(p.name, p.tier.label, p.why) for p in result.passed_over]), self.config.rpc_timeout_s)
        if result.kind == "full":  # a light one loads weights only
            self.update(step=result.step, epoch=result.trainer_state.get("epoch"),
                        metrics=result.metrics)
            self._stepper.triggers.load_state_dict(result.trainer_state.get("triggers") or {})
        return result

    def load_model_weights(self, ref: str | int = "latest") -> LoadResult:
        """Load only model weights from a light or full checkpoint into every worker."""
        return self._loader.load_weights(ref)

    def wait_for_cleanup(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Wait for the clean-up that follows the newest commit; return what it did.

        A save is committed (``handle.wait()`` returns) before retention deletes older
        checkpoints and leftovers of aborted saves are collected.  Returns
        ``{"name", "deleted", "collected", "error", "cleanup_s"}``, or None when the newest
        save did not commit.
        """
        rpc = self.config.rpc_timeout_s
        return _get(self._coordinator.wait_cleanup.remote(timeout),
                    None if timeout is None else timeout + rpc)

    def replication(self) -> dict[str, Any] | None:
        """A tiered job's replication to its durable tier: ``{"pending", "last_error",
        "replicated", "durable"}``; None when the job has one tier."""
        return _get(self._coordinator.replication.remote(), self.config.rpc_timeout_s)

    def _wait_replication(self, timeout: float | None) -> None:
        wait_s = self.config.save_wait_timeout_s if timeout is None else timeout
        if not _get(self._coordinator.wait_replication.remote(wait_s),
                    wait_s + self.config.rpc_timeout_s):
            warnings.warn(f"closing with checkpoints not yet in the durable tier "
                          f"{self.config.save_dir}: {self.replication()}; they stay in "
                          f"{self.config.local_dir} and the next run copies the newest",
                          RuntimeWarning, stacklevel=3)

    def close(self, timeout: float | None = None, *, release_memory: bool = True) -> None:
        """Wait for saves in flight, their clean-up and (tiered) their replication, then stop
        the coordinator actor.  The memory tier's holders (and per-node directories' agents)
        are ended too when all of that succeeded and ``release_memory`` (False: a job
        started next on this root finds the newest checkpoint in memory)."""
        try:
            self.wait_for_saves(timeout)
            self.wait_for_cleanup(timeout)
            self._wait_replication(timeout)
            if release_memory:
                self.roots.end_actors()
        finally:
            ray.kill(self._coordinator)
            self.roots.release()
