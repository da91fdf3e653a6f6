"""One role's raycheckpoint root as the verl manager's ranks see it (:mod:`.manager`):
leased by rank 0 with its coordinator; the save's ``begin`` and commit, the load's plan
and its last checks; and ``raycheckpoint.json``, which names in verl's ``local_path``
the checkpoint saved for it.
"""

from __future__ import annotations

import json
import posixpath
import time
from typing import Any

from raycheckpoint._internal.rpc import get
from raycheckpoint.config import CheckpointConfig
from raycheckpoint.errors import CheckpointNotFoundError, IntegrityError, LightCheckpointError
from raycheckpoint.integrations.verl import _handoff as handoff
from raycheckpoint.integrity.crypto import FileCipher, check_key, load_key
from raycheckpoint.integrity.verify import verify_files
from raycheckpoint.loader import role_requests
from raycheckpoint.policy.retention import RetentionPolicy
from raycheckpoint.protocol import coordinator_actor
from raycheckpoint.protocol.candidates import Tier, first_that_opens, resume_candidates
from raycheckpoint.protocol.checkpoint import open_verified
from raycheckpoint.roots import open_roots
from raycheckpoint.state import capture_rng
from raycheckpoint.storage import FileEntry

POINTER = "raycheckpoint.json"  # written into verl's local_path: which checkpoint it is


def _pointer_fs(local_path: str, root: RoleRoot) -> tuple[Any, str]:
    """The filesystem and path of verl's ``local_path`` (the root's storage options where
    it is a URL too)."""
    import fsspec

    options = root.config.storage_options if "://" in local_path else {}
    return fsspec.core.url_to_fs(local_path, **options)


def write_pointer(local_path: str, root: RoleRoot, name: str, step: int, seconds: float) -> None:
    """``local_path/raycheckpoint.json``: where verl's directory for the role has its state."""
    fs, path = _pointer_fs(local_path, root)
    fs.makedirs(path, exist_ok=True)
    doc = {"root": root.url, "checkpoint": name, "step": step, "save_s": round(seconds, 3),
           "note": "written by raycheckpoint; the checkpoint itself is in the root"}
    fs.pipe_file(posixpath.join(path, POINTER), (json.dumps(doc, indent=1) + "\n").encode())


def pointed_step(local_path: str, root: RoleRoot) -> int:
    """The step ``local_path/raycheckpoint.json`` names, for a path with no
    ``global_step_<N>``; it must name this role's root (it only picks a step there)."""
    fs, path = _pointer_fs(local_path, root)
    pointer = posixpath.join(path, POINTER)
    try:
        doc = json.loads(fs.cat_file(pointer))
        named, step = doc["root"], int(doc["step"])
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{local_path}: neither global_step_<N> in the path nor a {POINTER} in it "
            "(nothing was saved there by this manager)", ref=local_path) from None
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"{local_path}/{POINTER}: unreadable ({type(e).__name__}: {e})",
                             path=pointer) from None
    if named != root.url:
        raise IntegrityError(f"{local_path}/{POINTER} names root {named!r}, but this role's "
                             f"root is {root.url!r}", path=pointer)
    return step


class RoleRoot:
    """One role's raycheckpoint root as this process sees it: on rank 0 leased, with its
    coordinator; elsewhere the coordinator's handle and where to write."""

    def __init__(self, url: str, role: str, coordinator: Any, write: Any,
                 config: CheckpointConfig) -> None:
        self.url, self.role = url, role
        self.coordinator, self.write, self.config = coordinator, write, config
        self.roots: Any = None
        self.cipher: Any = None
        self.world_size = 0

    def __reduce__(self) -> Any:  # what rank 0 hands the other ranks
        return (RoleRoot, (self.url, self.role, self.coordinator, self.write, self.config))

    @classmethod
    def open(cls, url: str, options: dict[str, Any], keep: int | None, role: str,
             world_size: int) -> RoleRoot:
        config = role_config(url, options, keep)
        cipher = role_cipher(config)
        roots = open_roots(config, cipher)
        try:
            coordinator = coordinator_actor.start(roots.commit, config, roots.lease_id("durable"))
            get(coordinator.register_workers.remote([], None), config.rpc_timeout_s)
        except BaseException:
            roots.release()
            raise
        root = cls(url, role, coordinator, roots.write, config)
        root.roots, root.cipher, root.world_size = roots, cipher, world_size
        return root

    def begin(self, step: int, kind: str) -> dict[str, Any]:
        state: dict[str, Any] = {
            "epoch": None, "config_fingerprint": {}, "world_sizes": {self.role: self.world_size},
            "saved_at": time.time(),
            "retention": RetentionPolicy.from_config(self.config).retention_rules(),
            "triggers": {}}
        if kind == "full":
            state["rng"] = capture_rng()  # rank 0's; every rank's own goes with its shard
            loader = handoff.take(self.url, step, self.config.rpc_timeout_s)
            if loader is not None:  # the trainer's data loader at this step (the actor's root)
                state["dataloader"] = loader
        rpc = self.config.rpc_timeout_s
        return get(self.coordinator.begin.remote(
            step=step, kind=kind, tag=None, metrics={}, trainer_state=state,
            expected=[(self.role, r) for r in range(self.world_size)],
            world_sizes={self.role: self.world_size}), self.config.save_wait_timeout_s + rpc)

    def await_commit(self, save_id: str, timeout: float | None = None) -> dict[str, Any]:
        """The commit's result (or its error) once every rank has its host copy."""
        if timeout is None:
            timeout = self.config.commit_timeout_s
        return get(self.coordinator.await_save.remote(save_id), timeout + self.config.rpc_timeout_s)

    def snapshotted(self, save_id: str) -> None:
        """Every rank has its host copy: the commit timeout runs from now."""
        get(self.coordinator.snapshotted.remote(save_id), self.config.rpc_timeout_s)

    def plan_load(self, local_path: str, step: int | None, world_size: int, *,
                  weights_only: bool) -> dict[str, Any]:
        """Rank 0: the committed checkpoint of ``step`` (the newest that opens verified,
        where the root holds several), checked, and every rank's ``ckpt_load`` request;
        the files no rank will read (assets, RNG files of ranks that no longer exist) are
        verified first."""
        storage = self.roots.commit.open()
        if step is None:
            step = pointed_step(local_path, self)

        def attempt(name: str, tier: Tier) -> dict[str, Any]:
            ck = open_verified(storage, name)
            check_key(ck.manifest.encryption, self.cipher, name)
            if ck.kind == "light" and not weights_only:
                raise LightCheckpointError(
                    f"{name} is a light checkpoint (model weights only): load_contents must "
                    "be ['model'] to load it", name=name)
            if self.role not in ck.manifest.roles:
                raise IntegrityError(f"{name} holds no state for role {self.role!r} (it has "
                                     f"{sorted(ck.manifest.roles)})", path=name)
            requests = role_requests(ck, self.role, world_size, self.config,
                                     weights_only=weights_only, strict=True)
            handed = {p for r in requests for p in r["files"]}
            verify_files(storage, {p: e for p, e in ck.manifest.files.items() if p not in handed})
            return {"name": ck.name, "requests": requests,
                    "files": {p: e.to_dict() for p, e in ck.manifest.files.items() if p in handed}}

        try:
            plan = first_that_opens(resume_candidates([Tier(storage)], step), attempt)
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(
                f"{local_path}: {self.url} holds no committed checkpoint of step {step} for "
                f"role {self.role!r} ({e})", ref=str(step)) from None
        return plan

    def finish_load(self, plan: dict[str, Any], answers: list[dict[str, Any]]) -> None:
        """Rank 0, once every rank loaded: verify what a rank was handed but did not read,
        and tell the coordinator the job holds this checkpoint's state (a save of the
        same step, nothing trained since, then reuses it)."""
        read = {p for a in answers for p in a["verified"]}
        unread = {p: FileEntry.from_dict(e) for p, e in plan["files"].items() if p not in read}
        verify_files(self.roots.commit.open(), unread)
        full = all(r["kind"] == "full" for r in plan["requests"])
        get(self.coordinator.loaded.remote(plan["name"] if full else None, []),
            self.config.rpc_timeout_s)

    def close(self, timeout: float | None = None) -> None:
        """Rank 0: wait (up to ``timeout``; default ``save_wait_timeout_s``) for the
        clean-up after the last commit, stop the coordinator, release the lease."""
        if self.roots is None:
            return
        import ray

        wait_s = self.config.save_wait_timeout_s if timeout is None else timeout
        roots, self.roots = self.roots, None
        try:
            get(self.coordinator.wait_cleanup.remote(wait_s), wait_s + min(wait_s, 30.0))
        finally:
            try:
                ray.kill(self.coordinator)
            finally:
                roots.release()


def role_config(url: str, options: dict[str, Any], keep: int | None = None) -> CheckpointConfig:
    """The configuration of the role root at ``url``: the options, with ``save_dir`` the
    root and verl's ``max_ckpt_to_keep`` (``keep``) as its retention."""
    settings = {k: v for k, v in options.items() if k.removeprefix("checkpoint.") != "save_dir"}
    return CheckpointConfig.from_dict({**settings, "save_dir": url,
                                       "keep_last_n": keep_last_n(keep, options)})


def role_cipher(config: CheckpointConfig) -> FileCipher | None:
    return FileCipher(load_key(config.encryption_key)) if config.encryption_key is not None else None


def open_step(url: str, storage: Any, step: int, cipher: FileCipher | None) -> Any:
    """The newest committed checkpoint of ``step`` in the root at ``url`` whose metadata
    verifies (a ``VerifiedCheckpoint``); CheckpointNotFoundError when there is none."""
    def attempt(name: str, tier: Tier) -> Any:
        ck = open_verified(storage, name)
        check_key(ck.manifest.encryption, cipher, name)
        return ck

    ck = first_that_opens(resume_candidates([Tier(storage)], step), attempt)
    if ck is None:
        raise CheckpointNotFoundError(f"{url} holds no committed checkpoint of step {step}",
                                      ref=str(step))
    return ck


def keep_last_n(max_ckpt_to_keep: int | None, options: dict[str, Any]) -> int | None:
    """verl's ``max_ckpt_to_keep`` as ``keep_last_n``: one more; where verl passes None or
    0 (keep all), the options' own ``keep_last_n``, if they name one."""
    if not max_ckpt_to_keep or max_ckpt_to_keep <= 0:
        return options.get("keep_last_n", options.get("checkpoint.keep_last_n"))
    return int(max_ckpt_to_keep) + 1
