"""The RL job's options as verl-style dotted keys: ``python -m drivers.main_ppo key=value``.

:data:`DEFAULTS` lists every key the driver knows with its default; a command-line
override must name one of them (or a ``checkpoint.*`` key, handed to
:class:`raycheckpoint.CheckpointConfig`, whose seed-style names are accepted).
"""

from __future__ import annotations

import difflib
import json
from typing import Any

DEFAULTS: dict[str, Any] = {
    "algorithm.adv_estimator": "grpo",          # grpo | gae (PPO with a critic)
    "algorithm.gamma": 1.0,
    "algorithm.lam": 0.95,
    "actor_rollout_ref.model.path": None,       # a Hugging Face directory (config, safetensors,
                                                # tokenizer) for actor, reference and rollout;
                                                # null: a small model built from the keys below
    "actor_rollout_ref.model.arch": "llama",    # llama | qwen2
    "actor_rollout_ref.model.hidden_size": 64,
    "actor_rollout_ref.model.intermediate_size": 128,
    "actor_rollout_ref.model.num_layers": 2,
    "actor_rollout_ref.model.num_heads": 1,
    "actor_rollout_ref.actor.optim.lr": 0.01,
    "actor_rollout_ref.actor.optim.end_factor": 0.5,   # linear LR decay to lr * end_factor
    "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.kl_loss_coef": 0.01,
    "actor_rollout_ref.actor.use_kl_loss": True,   # false: no KL term (kl_loss_coef ignored)
    "actor_rollout_ref.actor.fsdp_config.param_offload": False,      # refused when true
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": False,  # refused when true
    "actor_rollout_ref.actor.checkpoint.save_contents": ["model", "optimizer", "extra"],
    "actor_rollout_ref.actor.checkpoint.load_contents": ["model", "optimizer", "extra"],
    "actor_rollout_ref.rollout.name": "hf",     # hf | vllm
    "actor_rollout_ref.rollout.n": 4,
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.response_length": 8,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,   # vllm on cuda
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,     # vllm on cuda
    "actor_rollout_ref.rollout.enable_prefix_caching": True,     # vllm (off in the async
                                                                 # mode's deterministic schedule)
    "critic.model.path": None,                  # null: the actor's model with a value head
    "critic.optim.lr": 0.01,
    "reward_model.model.path": None,            # null: the actor's model with a value head
    "reward_model.rm_coef": 0.1,
    "data.train_files": None,                   # default: generated under default_local_dir
    "data.train_batch_size": 8,
    "data.num_prompts": 256,
    "data.num_targets": 4,
    "data.seed": 0,
    "trainer.total_epochs": 1,                  # used when total_training_steps is null
    "trainer.total_training_steps": 10,
    "trainer.save_freq": 5,                     # full checkpoint every N steps (-1: never)
    "trainer.default_local_dir": "./checkpoints/grpo",
    "trainer.resume_mode": "auto",              # auto | disable | resume_path
    "trainer.resume_from_path": None,
    "trainer.max_actor_ckpt_to_keep": None,     # full checkpoints kept (null: the library's rule)
    "trainer.max_critic_ckpt_to_keep": None,    # the same checkpoints: must equal the actor's
    "trainer.del_local_ckpt_after_load": False,  # refused when true
    "trainer.default_hdfs_dir": None,           # refused: give an fsspec URI in default_local_dir
    "trainer.seed": 0,
    "trainer.debug": False,                     # print a resume report when resuming
    "trainer.device": "auto",                   # auto | cuda | cpu (auto: cuda where GPUs are)
    "trainer.colocate": False,                  # rank i of every role on GPU i (hybrid engine)
    "trainer.n_gpus_per_node": 2,
    "trainer.nnodes": 1,
    "trainer.worker_resources": None,           # JSON dict: custom resources per worker actor;
                                                # set, each role gets a placement group
    "trainer.cpus_per_worker": 0,
    "trainer.placement_strategy": "PACK",       # PACK | SPREAD | STRICT_SPREAD (ranks on distinct nodes)
    "trainer.metrics_file": None,               # default: <default_local_dir>/metrics.jsonl
    "trainer.storage_options": None,            # JSON dict of fsspec options (e.g. endpoint_url)
    "trainer.save_with_step": True,             # a save due at a step rides on its update:
                                                # each rank snapshots right after it (false:
                                                # between steps, after the step's last call)
    # the asynchronous mode (drivers/async_ppo.py; verl's fully-async recipe's names where it
    # has them): rollout ranks generate token by token beside training, into a sample queue
    "async_training.enable": False,
    "async_training.staleness_threshold": 1,    # most policy versions a trained sample's
                                                # oldest token may lag (1: one step off; a
                                                # fraction, as verl's 0.1: that share of a
                                                # version's batches generated ahead)
    "async_training.trigger_parameter_sync_step": 1,  # training steps per weight sync
    "async_training.require_batches": 1,        # batches of train_batch_size groups per
                                                # step, one update on each (LR: once a step)
    "async_training.partial_rollout": True,     # in flight at a sync: continue under the new
                                                # weights (false: finish under the old ones)
    "async_training.schedule": "free",          # free: rollout ranks generate on their own;
                                                # deterministic: reproducible bit for bit
    "async_training.decode_steps_per_step": None,  # tokens each sequence advances per
                                                # training step (null: response_length)
    "rollout.n_gpus_per_node": None,            # rollout ranks of the asynchronous mode
    "rollout.nnodes": 1,                        # (null: as many as the trainer's)
    "checkpoint.rollout_state": "full",         # full | drop: keep only the data position
    "trainer.crash_at_step": None,              # testing aid: SIGKILL the driver after this step
    "trainer.crash_once_committed": False,      # testing aid: ... once that step's saves committed
                                                # (else the kill may come while they persist)
    "trainer.step_delay_s": 0.0,                # testing aid: sleep after each step
}

# checkpoint.* keys the driver sets unless given (the library defaults otherwise)
CHECKPOINT_DEFAULTS: dict[str, Any] = {
    "checkpoint.allow_reshard": False,
    "checkpoint.save_on_train_end": True,
}


def parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("null", "none", "~"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text[:1] in "[{":
        return json.loads(text)
    return text


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``key=value`` arguments applied over the defaults; unknown keys are refused."""
    options = {**DEFAULTS, **CHECKPOINT_DEFAULTS}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"error: expected key=value, got {arg!r}")
        key = key.lstrip("+")
        if key not in DEFAULTS and not key.startswith("checkpoint."):
            close = difflib.get_close_matches(key, list(DEFAULTS), n=3)
            raise SystemExit(f"error: unknown option {key!r}" + (f"; did you mean {close}?" if close else ""))
        options[key] = parse_value(value)
    if options["algorithm.adv_estimator"] not in ("grpo", "gae"):
        raise SystemExit("error: algorithm.adv_estimator must be 'grpo' or 'gae'")
    return options


def from_mapping(config: dict[str, Any]) -> dict[str, Any]:
    """Options from a mapping (flat dotted keys, or nested as in a YAML file) over the defaults."""
    flat: dict[str, Any] = {}

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and key not in ("trainer.storage_options",
                                                   "trainer.worker_resources"):
                walk(v, key + ".")
            else:
                flat[key] = v

    walk(config, "")
    return parse_overrides([f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                            for k, v in flat.items()])


def section(options: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in options.items() if k.startswith(prefix)}


def storage_options(options: dict[str, Any]) -> dict[str, Any]:
    """``trainer.storage_options`` as a dict (given as JSON text or a mapping): what every
    fsspec call of the job passes, for the checkpoint root, the dataset and the metrics."""
    so = options["trainer.storage_options"]
    return json.loads(so) if isinstance(so, str) else dict(so or {})
