"""What a job of ``drivers.main_ppo`` is, apart from its loop: its roles and their ranks, the
fingerprint a strict resume compares, the description ``raycheckpoint diff`` reads, the
data-loader state it saves, and how a batch is cut over a role's ranks."""

from __future__ import annotations

from typing import Any

import torch

from drivers import data
from drivers.config import DEFAULTS, from_mapping, storage_options
from raycheckpoint import ResumableSampler
from raycheckpoint.resume import ABSENT


class DataState:
    """What the checkpoint's data-loader slot holds: the sampler's position."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # checkpoints of earlier releases also hold the triggers' baselines here; the
        # manager now saves those in the trainer state itself
        self.sampler.load_state_dict(state["sampler"])


# keys of the fingerprint that earlier releases' checkpoints may lack (their default is
# what those checkpoints did)
LATER_KEYS = ("async_training.enable", "async_training.staleness_threshold",
              "async_training.trigger_parameter_sync_step", "async_training.partial_rollout",
              "async_training.require_batches")


def fingerprint(opts: dict[str, Any], data_sha: int, rows: int) -> dict[str, Any]:
    """What must not change across a strict resume (seed 003's checklist)."""
    keep = ("actor_rollout_ref.model.", "algorithm.", "actor_rollout_ref.rollout.",
            "actor_rollout_ref.actor.", "critic.", "reward_model.", "data.train_batch_size",
            "trainer.seed", "async_training.")
    # where the job runs and what its checkpoints hold are not the training's identity:
    # a checkpoint saved on cuda resumes on cpu (device-free on storage)
    free = ("actor_rollout_ref.actor.checkpoint.", "actor_rollout_ref.rollout.gpu_memory_utilization",
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            "actor_rollout_ref.rollout.enable_prefix_caching",
            # how the asynchronous mode's rollout is scheduled, not what it trains on
            "async_training.schedule", "async_training.decode_steps_per_step")
    fp = {k: v for k, v in opts.items() if k.startswith(keep) and not k.startswith(free)}
    fp["data.sha256"], fp["data.rows"] = data_sha, rows
    # checkpoints written before a key existed resume as if they held its default
    fp[ABSENT] = {k: DEFAULTS[k] for k in LATER_KEYS}
    return fp


def dataset_args(opts: dict[str, Any]) -> dict[str, int]:
    return {"num_prompts": opts["data.num_prompts"], "num_targets": opts["data.num_targets"],
            "seed": opts["data.seed"]}


def roles_of(opts: dict[str, Any]) -> list[str]:
    return ["actor", "reference", "reward", "rollout"] + (
        ["critic"] if opts["algorithm.adv_estimator"] == "gae" else [])


def role_worlds(opts: dict[str, Any]) -> dict[str, int]:
    """Each role's ranks: the trainer's ``n_gpus_per_node * nnodes``; the asynchronous
    mode's rollout its own (``rollout.n_gpus_per_node * rollout.nnodes``) when given."""
    world = opts["trainer.n_gpus_per_node"] * opts["trainer.nnodes"]
    worlds = dict.fromkeys(roles_of(opts), world)
    if opts["async_training.enable"] and opts["rollout.n_gpus_per_node"]:
        worlds["rollout"] = opts["rollout.n_gpus_per_node"] * opts["rollout.nnodes"]
    return worlds


def job_description(config: dict[str, Any]) -> dict[str, Any]:
    """What ``raycheckpoint diff REF job.yaml --fingerprint drivers.main_ppo:job_description``
    compares: the fingerprint, world sizes and reshard setting this job would resume with.

    ``config`` holds the job's options (dotted keys or nested); the dataset is read where
    the job would read it, or generated into a temporary directory (never into the root).
    """
    import tempfile

    opts = from_mapping(config)
    root = str(opts["trainer.default_local_dir"]).rstrip("/")
    path = opts["data.train_files"] or f"{root}/data/train.jsonl"
    with tempfile.TemporaryDirectory() as tmp:
        rows, sha = data.load_or_generate(path, storage_options(opts), **dataset_args(opts),
                                          scratch=tmp)
    return {"config_fingerprint": fingerprint(opts, sha, len(rows)),
            "world_sizes": role_worlds(opts),
            "allow_reshard": bool(opts["checkpoint.allow_reshard"])}


def split(t: torch.Tensor | list[Any], parts: int) -> list[Any]:
    """Contiguous per-rank slices of a tensor (along dim 0) or a list, as torch.chunk cuts."""
    if isinstance(t, torch.Tensor):
        return list(torch.chunk(t, parts, dim=0))
    size = -(-len(t) // parts)
    return [t[i * size:(i + 1) * size] for i in range(parts)]


def per_rank(group: list[Any], method: str, batch: dict[str, torch.Tensor],
             tensors: dict[str, torch.Tensor | list[Any]] | None = None, **scalars: Any) -> list[Any]:
    """Call ``method`` on every rank with its slice of ``batch`` and of each of ``tensors``
    (tensors or per-sample lists)."""
    w = len(group)
    slices = {k: split(v, w) for k, v in batch.items()}
    extra = {k: split(v, w) for k, v in (tensors or {}).items()}
    return [getattr(worker, method).remote({k: v[r] for k, v in slices.items()},
                                           **{k: v[r] for k, v in extra.items()}, **scalars)
            for r, worker in enumerate(group)]
