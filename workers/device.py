"""Which device a rank computes on (``trainer.device``) and moving batches to and from it.

``auto`` is cuda when this process sees a CUDA device, else cpu: a rank that Ray gave a
GPU resource on a node without a real GPU (the fake multi-node cluster, a mislabelled
node) logs that it falls back to cpu and runs there.  ``cuda`` with no device visible is
an error, raised before the rank builds anything.

A rank's CUDA device is the GPU Ray assigned it (:func:`cuda_index`): Ray normally sets
``CUDA_VISIBLE_DEVICES`` to that GPU, so it is ``cuda:0``; with
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` the process sees every GPU of the node and
the assigned one is ``cuda:<its position among them>``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

DEVICES = ("auto", "cuda", "cpu")


def cuda_index(assigned: list[str], visible: str | None) -> int:
    """The CUDA device index, in this process, of the GPU Ray assigned it.

    ``assigned``: Ray's GPU ids for this actor (``get_accelerator_ids()["GPU"]``; none:
    the first device).  ``visible``: this process's ``CUDA_VISIBLE_DEVICES``.  CUDA numbers
    the visible devices in the order that variable lists them, so the index is the
    assigned id's position there: 0 when Ray set the variable to the assigned GPU (its
    default), the id's position among the node's GPUs when Ray left it alone
    (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``), and the id itself when the
    variable is unset (every GPU visible, in id order).
    """
    if not assigned:
        return 0
    gpu = str(assigned[0]).strip()
    if visible is None or not visible.strip():
        if not gpu.isdigit():
            raise RuntimeError(f"Ray assigned GPU {gpu!r}, which is no device index, and "
                               "CUDA_VISIBLE_DEVICES is unset: set CUDA_VISIBLE_DEVICES on the node")
        return int(gpu)
    listed = [v.strip() for v in visible.split(",")]
    if gpu not in listed:
        raise RuntimeError(f"Ray assigned GPU {gpu!r}, which CUDA_VISIBLE_DEVICES={visible!r} "
                           "does not list: the rank cannot tell which device is its own "
                           "(unset RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, or start the "
                           "node with the GPUs it declares visible)")
    return listed.index(gpu)


def resolve(requested: str, *, who: str = "this rank", gpus_assigned: bool = False,
            gpu_ids: list[str] | None = None) -> torch.device:
    """The device for ``requested`` (``auto``/``cuda``/``cpu``) in this process.

    ``gpus_assigned``: the scheduler gave this process GPU resources, so falling back to
    cpu is worth a log line.  ``gpu_ids``: the GPUs Ray assigned (:func:`ray_gpu_ids`); on
    cuda the rank takes the device :func:`cuda_index` maps the first of them to (the first
    device it sees when none was assigned) and makes it the current one.
    """
    if requested not in DEVICES:
        raise ValueError(f"trainer.device must be one of {list(DEVICES)}, got {requested!r}")
    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        index = cuda_index(list(gpu_ids or []), os.environ.get("CUDA_VISIBLE_DEVICES"))
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"{who} was assigned GPU {gpu_ids[0]!r}, device cuda:{index}, but "
                               f"sees {torch.cuda.device_count()} CUDA device(s) "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
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
    return resolve(requested, who=who, gpus_assigned=bool(gpu_ids), gpu_ids=gpu_ids), gpu_ids


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
