"""verl's trainer and checkpoint keys: each one given verl 0.9's meaning here, or refused
with the reason in one line (before anything starts).

docs/RL_JOB.md's "verl's keys" table lists them; :func:`checkpoint_settings` is where the job's
keys become :class:`raycheckpoint.CheckpointConfig` options.
"""

from __future__ import annotations

from typing import Any

CONTENTS = ("model", "optimizer", "extra")
EXPORT = "hf_model"
SAVE_CONTENTS = "actor_rollout_ref.actor.checkpoint.save_contents"
LOAD_CONTENTS = "actor_rollout_ref.actor.checkpoint.load_contents"

# key -> (the only value accepted, why another is refused)
REFUSED: dict[str, tuple[Any, str]] = {
    "trainer.default_hdfs_dir": (None, "give the checkpoint root in trainer.default_local_dir: "
                                       "a local path, a filesystem every node mounts, or s3://; "
                                       "checkpoints are written there directly, with no local "
                                       "copy to upload (not hdfs://: fsspec gives it no atomic "
                                       "exclusive create, which LEASE and COMMITTED need)"),
    "trainer.del_local_ckpt_after_load": (False, "a loaded checkpoint stays the restart point "
                                                 "until retention (max_actor_ckpt_to_keep) drops it"),
    "actor_rollout_ref.actor.fsdp_config.param_offload": (False, "parameter offload to cpu is not "
                                                                 "supported: parameters stay on the device"),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": (False, "optimizer offload to cpu is "
                                                                     "not supported: optimizer state stays "
                                                                     "on the device"),
}
# verl's resume modes -> the library's
RESUME_MODES = {"auto": "auto", "disable": "disable", "resume_path": "path", "path": "path"}


def fail(message: str) -> None:
    raise SystemExit(f"error: {message}")


def _contents(opts: dict[str, Any], key: str) -> list[str]:
    value = opts[key]
    value = [value] if isinstance(value, str) else list(value or [])
    unknown = sorted(set(value) - {*CONTENTS, EXPORT})
    if unknown:
        fail(f"{key}: unknown item(s) {unknown}; verl's items are {[*CONTENTS, EXPORT]}")
    missing = [c for c in CONTENTS if c not in value]
    if missing:
        fail(f"{key} must hold {list(CONTENTS)} (missing {missing}): a checkpoint here is the "
             "whole training state so that resume continues bit for bit")
    return value


def validate(opts: dict[str, Any]) -> None:
    """Refuse the keys and values this job does not implement, one line each."""
    for key, (accepted, reason) in REFUSED.items():
        if opts[key] != accepted and not (accepted is False and opts[key] in (None, False)):
            fail(f"{key}={opts[key]!r} is not supported: {reason}")
    if EXPORT in _contents(opts, SAVE_CONTENTS) and opts.get("checkpoint.local_dir"):
        fail(f"{SAVE_CONTENTS}: {EXPORT!r} with checkpoint.local_dir (tiered checkpoints) is not "
             "available in this release: the export would not travel to the durable tier")
    if EXPORT in _contents(opts, LOAD_CONTENTS):
        fail(f"{LOAD_CONTENTS}: {EXPORT!r} is an export written beside a checkpoint, not part "
             "of what a resume loads")
    actor, critic = opts["trainer.max_actor_ckpt_to_keep"], opts["trainer.max_critic_ckpt_to_keep"]
    if actor is not None and critic is not None and actor != critic:
        fail(f"trainer.max_actor_ckpt_to_keep={actor} and max_critic_ckpt_to_keep={critic} differ: "
             "one checkpoint holds every role, so they keep the same checkpoints")
    if opts["trainer.resume_mode"] not in RESUME_MODES:
        fail(f"trainer.resume_mode must be auto, disable or resume_path, got "
             f"{opts['trainer.resume_mode']!r}")
    given = opts.get("checkpoint.resume_mode")
    if given is not None and given not in RESUME_MODES:
        fail(f"checkpoint.resume_mode must be auto, disable or path, got {given!r}")
    if opts["trainer.total_training_steps"] is None and not opts["trainer.total_epochs"]:
        fail("set trainer.total_training_steps or trainer.total_epochs")


def resume_mode(opts: dict[str, Any]) -> str:
    """The library's resume mode: ``checkpoint.resume_mode`` when given, else
    ``trainer.resume_mode`` (when both are set away from ``auto``, they must agree)."""
    trainer = RESUME_MODES[opts["trainer.resume_mode"]]
    given = opts.get("checkpoint.resume_mode")
    if given is None:
        return trainer
    mode = RESUME_MODES[given]
    if trainer != "auto" and mode != trainer:
        fail(f"checkpoint.resume_mode={given} and trainer.resume_mode={opts['trainer.resume_mode']} "
             "disagree; give one")
    return mode


def resume_from(opts: dict[str, Any]) -> str | None:
    return opts.get("checkpoint.resume_from") or opts["trainer.resume_from_path"]


def exports_hf(opts: dict[str, Any]) -> bool:
    """``hf_model`` in save_contents: each committed checkpoint gets a Hugging Face export."""
    return EXPORT in _contents(opts, SAVE_CONTENTS)


def total_steps(opts: dict[str, Any], steps_per_epoch: int) -> int:
    """verl's rule: ``total_training_steps`` when set, else epochs x batches per epoch."""
    if opts["trainer.total_training_steps"] is not None:
        return int(opts["trainer.total_training_steps"])
    return int(opts["trainer.total_epochs"]) * max(1, steps_per_epoch)


JOB_KEYS = ("checkpoint.rollout_state",)  # checkpoint.* keys of the job, not the library's


def checkpoint_settings(opts: dict[str, Any]) -> dict[str, Any]:
    """The CheckpointConfig options of a job (the ``checkpoint.*`` keys win)."""
    keep = opts["trainer.max_actor_ckpt_to_keep"]
    if keep is None:
        keep = opts["trainer.max_critic_ckpt_to_keep"]
    ck = {"save_full_interval": opts["trainer.save_freq"] if opts["trainer.save_freq"] > 0 else None,
          "keep_last_n": keep, "resume_from": resume_from(opts), "debug": opts["trainer.debug"],
          **{k: v for k, v in opts.items() if k.startswith("checkpoint.") and k not in JOB_KEYS},
          "resume_mode": resume_mode(opts)}
    return {k: v for k, v in ck.items() if v is not None}
