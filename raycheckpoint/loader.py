"""The load side of a job: resolve, verify and load a checkpoint into the worker groups.

:class:`CheckpointLoader` is what :meth:`CheckpointManager.load_checkpoint
<raycheckpoint.manager.CheckpointManager.load_checkpoint>` and ``load_model_weights``
run, in the driver:

1. resolve the reference into the checkpoints to try, in order
   (:mod:`~raycheckpoint.protocol.candidates`, shared with the start-up check;
   ``"auto"``: every committed full checkpoint, newest first, skipping those that fail
   verification);
2. open it verified (:func:`~raycheckpoint.protocol.checkpoint.open_verified`) and check
   the key of an encrypted one;
3. refuse a light checkpoint, a changed config (:mod:`~raycheckpoint.resume`) or a
   missing role under ``strict=True``; list what it skips otherwise;
4. check every file of the manifest that no worker will read (assets, the RNG files of
   ranks that no longer exist, roles with no worker group here) against its checksum;
   then have every worker load its rank's part (``ckpt_load``: resharding when the world
   size changed, every byte verified as it is read), and check whatever a worker was
   handed but did not read: every file the checkpoint lists is verified once;
5. restore the driver's RNG and data loader.

``strict=False`` loads what exists and lists the rest in ``LoadResult.skipped`` (tensor
keys the checkpoint lacks included); every skipped item is logged as a WARNING.  With
``CheckpointConfig.debug`` a resume report (:attr:`LoadResult.report`) is printed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raycheckpoint._internal.rpc import get as _get
from raycheckpoint.config import CheckpointConfig
from raycheckpoint.errors import ConfigMismatchError, IntegrityError, LightCheckpointError
from raycheckpoint.integrity.crypto import check_key
from raycheckpoint.integrity.verify import read_verified, verify_files
from raycheckpoint.protocol.candidates import (
    PassedOver,
    Tier,
    bad_copies,
    first_that_opens,
    resume_candidates,
)
from raycheckpoint.protocol.checkpoint import VerifiedCheckpoint, open_verified
from raycheckpoint.protocol.paths import rng_file
from raycheckpoint.protocol.refs import locate
from raycheckpoint.resume import ResumeReport, format_differences, resume_differences
from raycheckpoint.state import decode_loader_state, restore_rng
from raycheckpoint.storage import Storage, StorageSpec

logger = logging.getLogger(__name__)


@dataclass
class LoadResult:
    name: str
    step: int
    kind: str
    epoch: int | None
    metrics: dict[str, Any]
    trainer_state: dict[str, Any] = field(repr=False)
    skipped: list[str] = field(default_factory=list)
    resharded: dict[str, tuple[int, int]] = field(default_factory=dict)
    report: list[str] = field(default_factory=list, repr=False)  # what debug prints
    tier: str = "root"  # where it was read from (tiered: "memory tier", "local tier", "durable tier")
    load_s: float = 0.0  # opened, verified and loaded into every worker
    # what ``auto`` did not take for its own bytes (quarantined by the manager)
    passed_over: list[PassedOver] = field(default_factory=list, repr=False)


class CheckpointLoader:
    """Loads checkpoints of ``storage``'s root into ``groups`` (role -> workers by rank);
    ``durable``: a tiered job's durable root, where ``storage`` is its local tier;
    ``memory``: its memory tier (``checkpoint.memory_replicas``); ``workers_see_root``:
    False where ``storage`` is the union of per-node directories (the workers are handed
    its spec, and read each file from the node that has it).

    ``workers_loaded()`` is called once every worker has loaded (the manager hashes its
    frozen roles' weights anew then); ``dataloader`` is restored from a full checkpoint.
    """

    def __init__(self, storage: Storage, config: CheckpointConfig, groups: dict[str, list[Any]],
                 *, cipher: Any, fingerprint: dict[str, Any], dataloader: Any,
                 rollout_state: Any = None,
                 workers_loaded: Callable[[], None], durable: StorageSpec | None = None,
                 memory: StorageSpec | None = None, workers_see_root: bool = True) -> None:
        self.storage = storage
        self.workers_see_root = workers_see_root
        self.durable = durable  # a tiered job's durable root (``storage`` is its local tier)
        self.memory = memory
        self._tiers: list[Tier] | None = None
        self.config = config
        self.groups = groups
        self.cipher = cipher
        self.fingerprint = fingerprint
        self.dataloader = dataloader
        self.rollout_state = rollout_state
        self.workers_loaded = workers_loaded

    @property
    def world_sizes(self) -> dict[str, int]:
        return {role: len(ws) for role, ws in self.groups.items()}

    def load(self, ref: str | int = "auto", strict: bool = True) -> LoadResult | None:
        """Resume from ``ref``; None when ``ref == "auto"`` and the root holds nothing.

        A tiered job looks in its memory tier first (when it has one), then in its local
        tier, then in the durable one: ``auto`` takes the newest checkpoint any holds,
        from the fastest tier where it is complete and verifies
        (:mod:`~raycheckpoint.protocol.candidates`, which the start-up check shares).
        ``passed_over`` of the result lists what ``auto`` did not take for its own bytes:
        the job quarantines those (:meth:`CheckpointManager.load_checkpoint
        <raycheckpoint.manager.CheckpointManager.load_checkpoint>`)."""
        storage, ref = locate(self.storage, ref, self.config.storage_options)
        candidates = resume_candidates(self.tiers(storage), ref)
        result = first_that_opens(candidates, lambda name, tier: self._load(
            tier, name, strict=strict, weights_only=False,
            passed_over=[str(p) for p in candidates.passed_over]))
        if result is not None:
            result.passed_over = bad_copies(candidates, result.name, result.tier)
        return result

    def tiers(self, storage: Storage | None = None) -> list[Tier]:
        """Where to look, fastest first: a tiered job's memory, local and durable tiers, else
        the one root (or the root a path reference names)."""
        storage = self.storage if storage is None else storage
        if storage is not self.storage or self.durable is None:
            return [Tier(storage, "root" if storage is self.storage else "root of the path given")]
        if self._tiers is None:
            memory = [] if self.memory is None else [
                Tier(self.memory.open(), "memory tier", copy=True, memory=True)]
            self._tiers = [*memory, Tier(self.storage, "local tier", copy=True),
                           Tier(self.durable.open(), "durable tier")]
        return self._tiers

    def load_weights(self, ref: str | int = "latest") -> LoadResult:
        """Load only model weights from a light or full checkpoint into every worker."""
        storage, ref = locate(self.storage, ref, self.config.storage_options)
        if ref == "auto":
            ref = "latest"
        name, tier = resume_candidates(self.tiers(storage), ref).tries[0]
        return self._load(tier, name, strict=False, weights_only=True)

    def _load(self, where: Tier, name: str, *, strict: bool, weights_only: bool,
              passed_over: list[str] = ()) -> LoadResult:
        t0 = time.perf_counter()
        storage, tier = where.storage, where.label
        ck = open_verified(storage, name)
        check_key(ck.manifest.encryption, self.cipher, name)
        report = ResumeReport(ck, passed_over)
        if self.durable is not None:
            report.check(f"read from the {tier}: {storage.url()}")
        if not weights_only and ck.kind == "light":
            if strict:
                raise LightCheckpointError(
                    f"{name} is a light checkpoint: it holds model weights only, no optimizer, "
                    "data-loader or RNG state, so it cannot resume training with strict=True. "
                    "Use load_model_weights() to load its weights.", name=name)
            weights_only = True
        skipped: list[str] = []
        diffs = resume_differences(ck, self.fingerprint, self.world_sizes,
                                   allow_reshard=self.config.allow_reshard)
        if not weights_only:
            report.check(f"config fingerprint ({len(self.fingerprint)} keys) and world sizes: "
                         + ("match" if not diffs else f"{len(diffs)} difference(s)"))
        if diffs and not weights_only:
            if strict:
                raise ConfigMismatchError(format_differences(name, diffs), differences=diffs)
            skipped.append("config differences ignored: "
                           + "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, a, b in diffs))
        missing_roles = sorted(set(self.groups) - set(ck.manifest.roles))
        if missing_roles:
            msg = f"{name} holds no state for role(s) {missing_roles} (it has {sorted(ck.manifest.roles)})"
            if strict:
                raise IntegrityError(msg, path=name)
            skipped.append(msg)
        extra_roles = sorted(set(ck.manifest.roles) - set(self.groups))
        if extra_roles:
            skipped.append(f"roles in the checkpoint with no worker group here: {extra_roles}")
        requests = self._requests(ck, weights_only=weights_only, strict=strict,
                                  storage=None if storage is self.storage and self.workers_see_root
                                  else storage.spec)
        handed = {p for _, req in requests for p in req["files"]}
        # what no worker will read is checked first: a corrupt asset refuses the checkpoint
        # before any worker's state changes
        rollout = (None if weights_only or self.rollout_state is None
                   else self._read_rollout_state(ck, storage, strict))
        rest = {p: e for p, e in ck.manifest.files.items()
                if p not in handed and p != ck.paths.rollout_state}
        verify_files(storage, rest)
        report.verified("by the driver before loading (assets, unread rank files, other roles)",
                        rest)
        answers = _get([w.ckpt_load.remote(req) for w, req in requests], self.config.rpc_timeout_s)
        read = {p for a in answers for p in a["verified"]}
        for a in answers:
            skipped.extend(a["skipped"])
        report.verified("by the workers as they read them"
                        + ("" if self.config.enable_checksum else " (sizes only: checksums off)"),
                        {p: ck.manifest.files[p] for p in read})
        unread = {p: ck.manifest.files[p] for p in sorted(handed - read)}
        verify_files(storage, unread)
        report.verified("by the driver after loading (handed to a worker, not read)", unread)
        resharded = {role: (ck.manifest.roles[role].world_size, len(ws))
                     for role, ws in self.groups.items() if role in ck.manifest.roles
                     and ck.manifest.roles[role].world_size != len(ws)}
        self.workers_loaded()
        ts = ck.trainer_state
        if not weights_only:
            skipped += [f"driver rng: {s}" for s in restore_rng(ts["rng"], ck.paths.trainer_state)]
            if self.dataloader is not None:
                if "dataloader" in ts:
                    self.dataloader.load_state_dict(
                        decode_loader_state(ts["dataloader"], ck.paths.trainer_state))
                    report.loaded("data loader: its saved position")
                elif strict:
                    raise IntegrityError(f"{name} has no data-loader state but this job has a "
                                         "data loader", path=name)
                else:
                    skipped.append("data loader: no saved state")
            if rollout is not None:
                self.rollout_state.load_state_dict(rollout)
                report.loaded("rollout state: queued samples, sequences in flight, policy version")
            elif self.rollout_state is not None:
                skipped.append("rollout state: none saved")
        for s in skipped:
            logger.warning("load %s: skipped %s", name, s)
        result = LoadResult(name=name, step=ck.step, kind=ck.kind, epoch=ts.get("epoch"),
                            metrics=ts.get("metrics") or {}, trainer_state=ts, skipped=skipped,
                            resharded=resharded, tier=tier, load_s=time.perf_counter() - t0)
        if self.durable is not None:
            report.loaded(f"every role from the {tier} in {result.load_s:.2f}s")
        result.report = report.lines(self.groups, weights_only=weights_only, result=result)
        if self.config.debug:
            print("\n".join(result.report), flush=True)
        return result

    def _read_rollout_state(self, ck: VerifiedCheckpoint, storage: Storage, strict: bool) -> Any:
        """The checkpoint's rollout state, read whole, verified and decrypted before any
        worker loads (a damaged file refuses the checkpoint: ``auto`` takes the one before);
        None where it has none and ``strict`` is off."""
        rel = ck.paths.rollout_state
        entry = ck.manifest.files.get(rel)
        if entry is None:
            if strict:
                raise IntegrityError(f"{ck.name} has no rollout state ({rel}) but this job keeps "
                                     "one (an asynchronous job)", path=rel)
            return None
        data = read_verified(storage, rel, entry, checksums=self.config.enable_checksum,
                             decrypt=True)
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise IntegrityError(f"{rel}: not JSON ({e})", path=rel) from None
        return decode_loader_state(doc, rel)

    def _requests(self, ck: VerifiedCheckpoint, *, weights_only: bool, strict: bool,
                  storage: StorageSpec | None = None) -> list[tuple[Any, dict[str, Any]]]:
        """(worker, its ``ckpt_load`` request) for every rank of a role the checkpoint has."""
        out = []
        for role, workers in self.groups.items():
            if role not in ck.manifest.roles:
                continue
            requests = role_requests(ck, role, len(workers), self.config,
                                     weights_only=weights_only, strict=strict, storage=storage)
            out += zip(workers, requests, strict=True)
        return out


def role_requests(ck: VerifiedCheckpoint, role: str, world_size: int, config: CheckpointConfig, *,
                  weights_only: bool, strict: bool,
                  storage: StorageSpec | None = None) -> list[dict[str, Any]]:
    """The ``ckpt_load`` request of each of ``world_size`` ranks of ``role`` (which ``ck``
    holds): the role's tensor files, and a rank's own RNG file (rank 0's for a rank the
    saved job did not have) unless ``weights_only``."""
    layout = ck.manifest.roles[role]
    prefix = layout.dcp_dir + "/"
    files = {p: e.to_dict() for p, e in ck.manifest.files.items() if p.startswith(prefix)}
    out = []
    for rank in range(world_size):
        src_rank = rank if rank < layout.world_size else 0
        suffix = "/" + rng_file(role, src_rank)
        rng = None if weights_only else next(
            (f for f in layout.files if f.endswith(suffix)), None)
        files_r = files if rng is None else {**files, rng: ck.manifest.files[rng].to_dict()}
        out.append({
            "dcp_dir": layout.dcp_dir, "files": files_r,
            "checksums": config.enable_checksum,
            "kind": "light" if weights_only else "full",
            "saved_world_size": layout.world_size, "rng_file": rng, "partial": not strict,
            "wait_timeout_s": config.save_wait_timeout_s, "storage": storage})
    return out
