"""The trainer side of the verl integration: a resume that takes the newest step that
loads, verified, and never runs code from a checkpoint.

verl 0.9's trainers (``PPOTrainer`` of ``verl.trainer.ppo.v1.trainer_base``, the legacy
``RayPPOTrainer``) resume in ``_load_checkpoint`` from the step that
``latest_checkpointed_iteration.txt`` names (a file written in place), and read the
data loader's ``data.pt`` with ``torch.load(weights_only=False)``, which runs whatever
the file asks.  :func:`load_checkpoint` replaces that method
(:mod:`~raycheckpoint.integrations.verl.patch` installs it):

* ``resume_mode=auto``: the steps whose every role (``actor``, and ``critic`` where the
  job has one) has a committed full checkpoint in its raycheckpoint root, newest first;
  a step whose load fails verification, or that has no data-loader state, is passed
  over with a warning and the next one is tried.  The tracker is not read.  A
  directory that holds only checkpoints of verl's own manager is refused, not silently
  trained over from scratch;
* ``resume_mode=resume_path``: that step; its errors are raised;
* ``disable``: nothing, as in verl.

The data loader's state is committed inside the actor's checkpoint: :func:`before_save`
hands it to the actor role's rank 0 before verl's ``_save_checkpoint`` saves the roles
(:mod:`._handoff`), and the resume reads it from there, verified with the rest.  Only a
checkpoint without it (saved by the manager without the switch's trainer) falls back to
verl's ``data.pt``, read with ``torch.load(weights_only=True)``; a file that needs code
is refused, naming it, and with an encrypted root (where ``data.pt`` is not
authenticated) the step is refused instead.  The rest is verl's: ``global_steps``, the
legacy trainer's data-loader skip at an epoch boundary, v1's TransferQueue restore in
its async modes.

Under verl's ``async_save`` the managers return after the host copy (:mod:`.manager`);
:func:`after_save` runs after verl's ``_save_checkpoint`` and, at the last training
step, waits until every role's checkpoint has committed, so that training does not end
(and Ray end the workers) with the final checkpoint still persisting.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from raycheckpoint._internal.rpc import unwrap
from raycheckpoint.errors import CheckpointSaveError, IntegrityError
from raycheckpoint.integrations.verl import _handoff as handoff
from raycheckpoint.integrations.verl._root import open_step, role_cipher, role_config
from raycheckpoint.integrations.verl.manager import absolute, read_options, role_root
from raycheckpoint.protocol import catalog
from raycheckpoint.state import decode_loader_state, encode_loader_state
from raycheckpoint.storage import Storage

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"


def committed_steps(base: str, roles: list[str], options: dict[str, Any]) -> list[int]:
    """Steps with a committed full checkpoint of every role, newest first."""
    steps: set[int] | None = None
    for role in roles:
        _, storage = _role_storage(base, role, options)
        try:
            markers, _ = catalog.scan(storage)
        except FileNotFoundError:
            markers = []
        full = {m.step for m in markers if m.kind == "full"}
        steps = full if steps is None else steps & full
    return sorted(steps or (), reverse=True)


def step_folder(base: str, step: int, *rest: str) -> str:
    return os.path.join(base, f"global_step_{step}", *rest)


def _roles(trainer: Any) -> list[str]:
    return ["actor", "critic"] if getattr(trainer, "use_critic", False) else ["actor"]


def _role_storage(base: str, role: str, options: dict[str, Any]) -> tuple[str, Storage]:
    """The URL and storage of ``role``'s root under verl's ``base`` (not created)."""
    url = role_root(base, role, options)
    return url, Storage(url, dict(options.get("storage_options") or {}), create=False)


def load_checkpoint(self: Any) -> int:
    """v1 ``PPOTrainer._load_checkpoint``, resuming from the newest step that loads (see
    the module doc).  Returns ``global_steps`` (0: a fresh start)."""
    return _load(self, legacy=False)


def load_checkpoint_legacy(self: Any) -> int:
    """The legacy ``RayPPOTrainer._load_checkpoint``: as :func:`load_checkpoint`, with
    that trainer's own rules (no ``default_hdfs_dir``; the data loader is not restored at
    an epoch boundary)."""
    return _load(self, legacy=True)


def _load(self: Any, *, legacy: bool) -> int:
    cfg = self.config.trainer
    self.global_steps = 0
    mode = cfg.resume_mode
    if mode == "disable":
        return 0
    if legacy and cfg.get("default_hdfs_dir") is not None:
        raise NotImplementedError("load from hdfs is not implemented yet")  # as verl's legacy trainer
    base = absolute(cfg.default_local_dir)
    options = read_options()
    roles = _roles(self)
    if mode == "resume_path":
        path = cfg.resume_from_path
        if not isinstance(path, str) or "global_step_" not in path:
            raise ValueError(f"trainer.resume_from_path must name a global_step_<N> folder, got {path!r}")
        folder = absolute(path)
        step = int(folder.rstrip("/").split("global_step_")[-1])
        base = os.path.dirname(folder.rstrip("/"))
        _load_step(self, base, step, roles, legacy, options, strict=False)
        return step
    if mode != "auto":
        raise ValueError(f"unknown trainer.resume_mode {mode!r} (auto, resume_path or disable)")
    candidates = committed_steps(base, roles, options)
    for step in candidates:
        try:
            _load_step(self, base, step, roles, legacy, options, strict=True)
            return step
        except Exception as e:  # only damage moves on to the next step; the rest is raised
            cause = unwrap(e)
            if not isinstance(cause, IntegrityError):
                raise
            logger.warning("resume: passed over global_step_%d: %s", step, cause)
            print(f"resume: passed over global_step_{step}: {cause}", flush=True)
    if os.path.exists(os.path.join(base, TRACKER)) and not candidates:
        raise FileNotFoundError(
            f"{base}/{TRACKER} names a checkpoint, but no raycheckpoint root under {base} "
            f"holds one ({', '.join(role_root(base, r, options) for r in roles)}): those "
            "checkpoints were written by verl's own manager: carry the step over once with "
            f"`raycheckpoint import-verl {base}`, or set trainer.resume_mode=disable to start "
            "afresh")
    if candidates:
        raise IntegrityError(f"no checkpoint under {base} loads: every one of steps "
                             f"{candidates} failed verification (see the warnings)", path=base)
    print("Training from scratch", flush=True)
    self.global_steps = 0
    return 0


def _load_step(self: Any, base: str, step: int, roles: list[str], legacy: bool,
               options: dict[str, Any], *, strict: bool) -> None:
    """Load every role's checkpoint of ``step``, then the data loader (and v1's
    TransferQueue), as verl's ``_load_checkpoint`` does.  ``strict``: a step without
    data-loader state raises an IntegrityError (``auto`` passes it over); otherwise the
    loader starts afresh, with verl's warning."""
    folder = step_folder(base, step)
    loader = getattr(self, "train_dataloader", None)
    state = None if loader is None else _loader_state(base, step, options, strict=strict)
    print(f"Resuming from {folder}", flush=True)
    drop = self.config.trainer.get("del_local_ckpt_after_load", False)
    self.actor_rollout_wg.load_checkpoint(local_path=os.path.join(folder, "actor"),
                                          del_local_after_load=drop)
    if "critic" in roles:
        self.critic_wg.load_checkpoint(local_path=os.path.join(folder, "critic"),
                                       del_local_after_load=drop)
    self.global_steps = step
    per_epoch = len(loader) if legacy and loader is not None else 0
    if state is not None and per_epoch > 0 and step % per_epoch == 0:  # the legacy rule, kept
        print(f"Skipping dataloader state restore: global_steps={step} is at an epoch "
              f"boundary (steps_per_epoch={per_epoch})", flush=True)
    elif state is not None:
        loader.load_state_dict(state)
    if getattr(self, "trainer_mode", "sync") != "sync":
        tq_path = os.path.join(folder, "transfer_queue")
        if os.path.exists(tq_path):
            import transfer_queue as tq
            from verl.trainer.ppo.v1.trainer_base import _count_tq_prompt_groups

            tq.load_checkpoint(tq_path)
            self._restored_tq_prompt_count = _count_tq_prompt_groups()


def _loader_state(base: str, step: int, options: dict[str, Any], *, strict: bool) -> Any:
    """The data loader's state at ``step``: from the actor's committed checkpoint
    (verified), else from verl's ``data.pt`` (without running code); None (with verl's
    warning) or, where ``strict``, an IntegrityError when neither has it."""
    import torch

    url, storage = _role_storage(base, "actor", options)
    ck = open_step(url, storage, step, role_cipher(role_config(url, options)))
    if "dataloader" in ck.trainer_state:
        return decode_loader_state(ck.trainer_state["dataloader"], f"{url}/{ck.paths.trainer_state}")
    data = step_folder(base, step, "data.pt")
    if ck.manifest.encryption:  # verl's data.pt is not authenticated: never beside a key
        raise IntegrityError(f"global_step_{step}: {url}/{ck.name} is encrypted and holds no "
                             f"data loader state; {data} is not authenticated by the key, so "
                             "it is not read", path=f"{url}/{ck.name}")
    if not os.path.exists(data):
        if strict:
            raise IntegrityError(f"global_step_{step}: no data loader state: {url}/{ck.name} "
                                 f"holds none and {data} is missing", path=data)
        logger.warning("no dataloader state at %s, will start from scratch", data)
        return None
    try:
        return torch.load(data, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a pickle asking for code, or damage
        raise IntegrityError(f"{data}: not loadable without running code or damaged "
                             f"({type(e).__name__}: {str(e)[:300]})", path=data) from None


def before_save(self: Any) -> None:
    """Before verl's ``_save_checkpoint``: hand the data loader's state at this step to
    the actor role's rank 0, which commits it inside the actor's checkpoint."""
    loader = getattr(self, "train_dataloader", None)
    if loader is None:
        return
    options = read_options()
    url = role_root(absolute(self.config.trainer.default_local_dir), "actor", options)
    handoff.publish(url, self.global_steps, encode_loader_state(loader.state_dict()))


def _async_save(self: Any) -> bool:
    cfg = self.config.get("actor_rollout_ref", {}).get("actor", {}).get("checkpoint", {}) or {}
    return bool(cfg.get("async_save", False))


def after_save(self: Any, timeout: float = 1800.0) -> None:
    """After verl's ``_save_checkpoint``: under ``async_save``, at the last training step,
    wait until every role's checkpoint of it has committed; raise if one did not."""
    total = getattr(self, "total_training_steps", None)
    if not _async_save(self) or total is None or self.global_steps < total:
        return
    import ray

    from raycheckpoint.protocol import coordinator_actor

    options = read_options()
    base = absolute(self.config.trainer.default_local_dir)
    for role in _roles(self):
        url, storage = _role_storage(base, role, options)
        coordinator = ray.get_actor(coordinator_actor.actor_name(storage),
                                    namespace=coordinator_actor.NAMESPACE)
        if ray.get(coordinator.wait_cleanup.remote(timeout), timeout=timeout + 60) is None:
            raise CheckpointSaveError(f"the last checkpoint of {role} (global_step_"
                                      f"{self.global_steps}) did not commit in {url}; the "
                                      "next resume takes the newest step every role committed",
                                      failures={role: "not committed"})
