"""Which device a rank computes on (``trainer.device``) and moving batches to and from it.

``auto`` is cuda when this process sees a CUDA device, else cpu: a rank that Ray gave a
GPU resource on a node without a real GPU (the fake multi-node cluster, a mislabelled
node) logs that it falls back to cpu and runs there.  ``cuda`` with no device visible is
an error, raised before the rank builds anything.
"""

from __future__ import annotations

import os
from typing import Any

import torch

DEVICES = ("auto", "cuda", "cpu")


def resolve(requested: str, *, who: str = "this rank", gpus_assigned: bool = False) -> torch.device:
    """The device for ``requested`` (``auto``/``cuda``/``cpu``) in this process.

    ``gpus_assigned``: the scheduler gave this process GPU resources, so falling back to
    cpu is worth a log line.  On cuda the rank uses the first device it sees: Ray sets
    ``CUDA_VISIBLE_DEVICES`` to the GPU it assigned to the actor, so that is the rank's own.
    """
    if requested not in DEVICES:
        raise ValueError(f"trainer.device must be one of {list(DEVICES)}, got {requested!r}")
    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if requested == "cuda":
        raise RuntimeError(f"trainer.device=cuda but {who} sees no CUDA device "
                           f"(CUDA_VISIBLE_DEVICES={visible!r}); use trainer.device=cpu or auto")
    if gpus_assigned:
        print(f"trainer.device=auto: {who} was given a GPU but sees no CUDA device "
              f"(CUDA_VISIBLE_DEVICES={visible!r}); falling back to cpu", flush=True)
    return torch.device("cpu")


def ray_gpu_ids() -> list[str]:
    """The GPUs Ray assigned to this actor (none outside Ray)."""
    try:
        import ray

        if not ray.is_initialized():
            return []
        return [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    except Exception:  # noqa: BLE001 - outside a Ray worker: no assignment
        return []


def rank_device(requested: str, who: str) -> tuple[torch.device, list[str]]:
    """A Ray actor rank's device for ``requested``, and the GPUs Ray assigned it."""
    gpu_ids = ray_gpu_ids()
    return resolve(requested, who=who, gpus_assigned=bool(gpu_ids)), gpu_ids


def backend(device: torch.device) -> str:
    """torch.distributed backend of a role's group: NCCL for the GPU tensors, gloo for the
    CPU ones (object collectives; the checkpoint's own collectives use a separate gloo group)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``batch`` with its tensors on ``device`` (other values unchanged)."""
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A result tensor as the driver receives it: on cpu."""
    return t.detach().cpu()
