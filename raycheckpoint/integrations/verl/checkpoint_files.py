"""Reading a checkpoint that verl's own ``FSDPCheckpointManager`` wrote (verl 0.9).

verl writes one role (``global_step_N/actor``, ``global_step_N/critic``) as, for each
rank ``r`` of the job's global world size ``W``::

    model_world_size_{W}_rank_{r}.pt        torch.save(model.state_dict())
    optim_world_size_{W}_rank_{r}.pt        torch.save(optimizer.state_dict())
    extra_state_world_size_{W}_rank_{r}.pt  {"lr_scheduler": ..., "rng": ...}

plus ``fsdp_config.json`` (``{"FSDP_version": 1|2, "world_size": W}``) and a
``huggingface/`` directory (config, tokenizer).  Under FSDP2 every tensor of the model
and of the optimizer's state is a DTensor: its local shard, its placements on the device
mesh and its global shape.  :func:`read_role` rebuilds whole tensors from the ``W``
files, reading them with ``torch.load(weights_only=True)``: a file that needs anything
else to unpickle (code) is refused, naming it.

FSDP1 files hold ``ShardedTensor``s, which ``weights_only`` refuses (their pickle calls
``getattr``), and an FSDP1 optimizer's raw state is keyed by flat parameters whose
layout depends on the wrapping policy: :func:`read_role` refuses FSDP1 with that reason.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.tensor  # lets weights_only load DTensors
from torch.distributed.tensor import DTensor, Replicate, Shard

KINDS = ("model", "optim", "extra_state")


class VerlCheckpointError(ValueError):
    """A verl checkpoint this module cannot read; the message names the file."""


@dataclass
class VerlRole:
    """One role of a verl checkpoint, whole: ``model`` (name -> tensor), ``optimizer``
    (torch's ``optimizer.state_dict()`` layout, whole tensors, or None), ``extra`` (rank
    0's ``extra_state``: the LR scheduler's state, the RNG; or None), per-rank RNG.
    ``params``: the model's parameters in the order of ``module.parameters()``, which
    the optimizer's state is keyed by (FSDP2 makes every parameter a DTensor and leaves
    buffers alone; a tied parameter is listed once, under its first name)."""

    path: str
    world_size: int
    fsdp_version: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None
    rank_rng: list[Any] = field(default_factory=list)
    params: list[str] = field(default_factory=list)


def rank_file(path: str, kind: str, world_size: int, rank: int) -> str:
    return os.path.join(path, f"{kind}_world_size_{world_size}_rank_{rank}.pt")


def _numpy_globals() -> list[Any]:
    """What a numpy array's pickle names (verl's RNG state holds ``np.random.get_state()``,
    a uint32 array): the array's reconstruction, its type and its dtype's; an array's
    items come through the same restricted unpickler."""
    import numpy as np

    multiarray = getattr(np, "_core", None) or np.core
    return [multiarray.multiarray._reconstruct, np.ndarray, np.dtype,
            type(np.dtype(np.uint32))]


def _load(path: str) -> Any:
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise VerlCheckpointError(f"{path}: holds more than tensors and plain data, so it is "
                                  f"not read (that would run code from the file): {e}") from e
    except (RuntimeError, EOFError) as e:
        raise VerlCheckpointError(f"{path}: not a readable torch.save file: {e}") from e


def _config(path: str) -> tuple[int, int]:
    conf = os.path.join(path, "fsdp_config.json")
    try:
        with open(conf) as f:
            doc = json.load(f)
        return int(doc["FSDP_version"]), int(doc["world_size"])
    except FileNotFoundError:
        raise VerlCheckpointError(f"{conf}: missing: not a verl FSDP checkpoint") from None
    except (ValueError, KeyError, TypeError) as e:
        raise VerlCheckpointError(f"{conf}: not verl's fsdp_config.json: {e}") from e


def _coordinates(mesh: Any, rank: int) -> tuple[int, ...]:
    """Where global ``rank`` sits in ``mesh`` (its ``mesh`` tensor holds global ranks)."""
    where = (mesh.mesh == rank).nonzero()
    if len(where) != 1:
        raise ValueError(f"rank {rank} is not in the device mesh {mesh.mesh.tolist()}")
    return tuple(int(i) for i in where[0])


def whole(parts: list[Any], what: str) -> torch.Tensor:
    """The whole tensor from each rank's DTensor (``parts[r]`` is rank ``r``'s), for
    placements ``Shard(d)`` and ``Replicate()`` on any mesh; plain tensors (replicated
    by the job) are taken from rank 0.  Every shard's place and size is checked."""
    first = parts[0]
    if not isinstance(first, DTensor):
        return first
    shape = tuple(first.shape)
    out = torch.empty(shape, dtype=first.dtype)
    covered = torch.zeros(shape, dtype=torch.bool) if out.numel() else None
    for rank, part in enumerate(parts):
        if not isinstance(part, DTensor) or tuple(part.shape) != shape:
            raise VerlCheckpointError(f"{what}: rank {rank}'s tensor does not match rank 0's "
                                      f"(global shape {shape})")
        if rank not in part.device_mesh.mesh:
            continue  # not a member of this tensor's mesh
        # mesh axes in order, each chunking the region the axes before it left along its
        # dim as torch.chunk does (ceil sizes, the last ones shorter or empty)
        index = [slice(0, n) for n in shape]
        mesh_sizes = part.device_mesh.mesh.shape
        coords = _coordinates(part.device_mesh, rank)
        for axis, placement in enumerate(part.placements):
            if isinstance(placement, Replicate):
                continue
            if type(placement) is not Shard:
                raise VerlCheckpointError(f"{what}: placement {placement} is not supported")
            d = placement.dim
            start, n = index[d].start, index[d].stop - index[d].start
            chunk = -(-n // mesh_sizes[axis])
            lo = min(n, coords[axis] * chunk)
            index[d] = slice(start + lo, start + min(n, lo + chunk))
        local = part.to_local()
        region = tuple(index)
        if tuple(out[region].shape) != tuple(local.shape):
            raise VerlCheckpointError(f"{what}: rank {rank}'s shard has shape "
                                      f"{tuple(local.shape)}, its place {region} another")
        if covered is not None and bool(covered[region].any()):  # replicated: the same bytes
            if not (bool(covered[region].all()) and torch.equal(out[region], local)):
                raise VerlCheckpointError(f"{what}: rank {rank}'s replica differs from an "
                                          "earlier rank's")
            continue
        out[region] = local
        if covered is not None:
            covered[region] = True
    if covered is not None and not bool(covered.all()):
        raise VerlCheckpointError(f"{what}: the ranks' shards do not cover the tensor")
    return out


def _whole_tree(trees: list[Any], what: str) -> Any:
    first = trees[0]
    if isinstance(first, dict):
        return {k: _whole_tree([t[k] for t in trees], f"{what}[{k!r}]") for k in first}
    if isinstance(first, (list, tuple)) and not isinstance(first, torch.Size):
        return type(first)(_whole_tree([t[i] for t in trees], f"{what}[{i}]")
                           for i in range(len(first)))
    if isinstance(first, torch.Tensor):
        return whole(trees, what)
    return first


def read_role(path: str, *, contents: tuple[str, ...] = ("model", "optim", "extra_state")
              ) -> VerlRole:
    """Read the verl role directory ``path`` (``.../global_step_N/actor``) whole."""
    version, world = _config(path)
    if version != 2:
        raise VerlCheckpointError(
            f"{path}: written by FSDP{version}; only FSDP2 checkpoints are read (FSDP1's "
            "ShardedTensor files need code to unpickle, and its optimizer state is keyed "
            "by flat parameters whose layout the files do not record)")
    files: dict[str, list[Any]] = {}
    for kind in contents:
        names = [rank_file(path, kind, world, r) for r in range(world)]
        missing = [n for n in names if not os.path.exists(n)]
        if missing and kind != "optim":
            raise VerlCheckpointError(f"{missing[0]}: missing ({len(missing)} of {world} "
                                      f"{kind} files)")
        if not missing:
            files[kind] = [_load(n) for n in names]
    model = _whole_tree(files["model"], os.path.join(path, "model")) if "model" in files else {}
    optim = (_whole_tree(files["optim"], os.path.join(path, "optim"))
             if "optim" in files else None)
    extra = files.get("extra_state")
    return VerlRole(path=path, world_size=world, fsdp_version=version, model=model,
                    optimizer=optim, extra=extra[0] if extra else None,
                    rank_rng=[e.get("rng") for e in extra] if extra else [],
                    params=_parameters(files["model"][0]) if "model" in files else [])


def _parameters(rank0: dict[str, Any]) -> list[str]:
    """The DTensor entries of rank 0's model file in order, each storage once."""
    seen: set[int] = set()
    out = []
    for name, value in rank0.items():
        if not isinstance(value, DTensor):
            continue
        ptr = value.to_local().untyped_storage().data_ptr()
        if ptr in seen and value.to_local().numel():
            continue
        seen.add(ptr)
        out.append(name)
    return out
