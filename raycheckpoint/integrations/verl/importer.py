"""``raycheckpoint import-verl``: a step that verl's own manager wrote, carried once into the
roots the switch reads (:mod:`.manager`), so that a running project can switch
mid-training.

For each role of ``<dir>/global_step_<N>`` (each subdirectory with verl's
``fsdp_config.json``): the role is read whole without running code
(:func:`~raycheckpoint.integrations.verl.checkpoint_files.read_role`; FSDP2 only), and
saved through the drop-in manager at world size 1, as step ``N`` of the role's root:

* the model's tensors under their names, parameters as parameters (tied ones shared),
  buffers as buffers;
* the optimizer's state under parameter names: verl keys it by position in
  ``module.parameters()``, which the files record (FSDP2 makes every parameter, and
  nothing else, a DTensor).  Adam and AdamW state only (``exp_avg``, ``exp_avg_sq``,
  ``max_exp_avg_sq``, ``step``); any other is refused;
* the LR scheduler's state as verl saved it, and verl's rank-0 RNG as the checkpoint's.

* with the actor, the data loader's state from verl's ``data.pt`` (read without running
  code), committed inside the checkpoint as the switch's own saves do.

verl's files stay where they are: the switch's resume finds step ``N`` committed, with
its data loader's position.  A job at ``W`` ranks
reshards the checkpoint; per-rank RNG beyond rank 0's is not carried (a load at another
world size skips per-rank RNG).  The command starts its own one-rank process group and
local Ray instance unless the process has them.
"""

from __future__ import annotations

import os
import random
import tempfile
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from raycheckpoint.integrations.verl import _handoff as handoff
from raycheckpoint.integrations.verl.checkpoint_files import VerlCheckpointError, VerlRole, read_role
from raycheckpoint.integrations.verl.manager import FSDPCheckpointManager, read_options
from raycheckpoint.integrations.verl.trainer import TRACKER
from raycheckpoint.state import encode_loader_state

ADAM_STATE = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}


def import_step(directory: str, step: int | None = None, roles: list[str] | None = None,
                options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Import ``directory/global_step_<step>`` (default: the step verl's tracker names);
    ``roles``: default every role there.  Returns one summary per role."""
    directory = os.path.abspath(directory)
    if step is None:
        tracker = os.path.join(directory, TRACKER)
        try:
            with open(tracker) as f:
                step = int(f.read().strip())
        except FileNotFoundError:
            raise VerlCheckpointError(f"{tracker}: missing; name the step (--step N)") from None
        except ValueError:
            raise VerlCheckpointError(f"{tracker}: not a step number; name the step "
                                      "(--step N)") from None
    folder = os.path.join(directory, f"global_step_{step}")
    found = sorted(d for d in (os.listdir(folder) if os.path.isdir(folder) else [])
                   if os.path.exists(os.path.join(folder, d, "fsdp_config.json")))
    if not found:
        raise VerlCheckpointError(f"{folder}: no role written by verl's FSDP manager there")
    wanted = found if not roles else list(roles)
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise VerlCheckpointError(f"{folder}: no role {missing} (it has {found})")
    with _one_rank():
        return [_import_role(os.path.join(folder, role), step, read_options(options))
                for role in wanted]


def _import_role(path: str, step: int, options: dict[str, Any]) -> dict[str, Any]:
    role = read_role(path)
    if role.optimizer is None:
        raise VerlCheckpointError(f"{path}: no optimizer state (optim_world_size_*): it cannot "
                                  "resume training")
    holder = holder_module(role)
    optimizer = _optimizer(role, holder, path)
    scheduler = _SavedScheduler(role.extra.get("lr_scheduler")) if role.extra else None
    if role.rank_rng and role.rank_rng[0]:
        _set_rng(role.rank_rng[0])
    manager = FSDPCheckpointManager(model=holder, optimizer=optimizer, lr_scheduler=scheduler,
                                    options=options)
    data = os.path.join(os.path.dirname(path), "data.pt")
    if os.path.basename(path) == "actor" and os.path.exists(data):
        try:
            loader = torch.load(data, weights_only=True)
        except Exception as e:  # noqa: BLE001 - a pickle asking for code, or damage
            raise VerlCheckpointError(f"{data}: not loadable without running code or damaged "
                                      f"({type(e).__name__}: {str(e)[:300]})") from None
        handoff.publish(manager.root_url(path), step, encode_loader_state(loader))
    try:
        manager.save_checkpoint(path, global_step=step)
        root = manager.root_url(path)
    finally:
        manager.close()
    return {"role": os.path.basename(path), "step": step, "root": root,
            "from_world_size": role.world_size, "tensors": len(role.model),
            "parameters": len(role.params)}


def holder_module(role: VerlRole) -> nn.Module:
    """A module whose parameters and buffers are ``role``'s tensors under their names."""
    root = nn.Module()
    params = set(role.params)
    by_storage: dict[int, nn.Parameter] = {}
    for name, tensor in role.model.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        ptr = tensor.untyped_storage().data_ptr()
        if name in params:
            param = nn.Parameter(tensor, requires_grad=tensor.is_floating_point())
            by_storage[ptr] = param
            module.register_parameter(leaf, param)
        elif ptr in by_storage and tensor.numel():  # a tied parameter's second name
            module.register_parameter(leaf, by_storage[ptr])
        else:
            module.register_buffer(leaf, tensor)
    return root


def _optimizer(role: VerlRole, holder: nn.Module, path: str) -> torch.optim.Optimizer:
    saved = role.optimizer
    groups = saved["param_groups"]
    count = sum(len(g["params"]) for g in groups)
    if count != len(role.params):
        raise VerlCheckpointError(f"{path}: the optimizer holds {count} parameters, the model "
                                  f"files {len(role.params)}: their order cannot be matched")
    unknown = sorted({k for state in saved["state"].values() for k in state} - ADAM_STATE)
    if unknown:
        raise VerlCheckpointError(f"{path}: optimizer state {unknown} is not Adam's or AdamW's; "
                                  "only those are imported")
    params = [holder.get_parameter(n) for n in role.params]
    optimizer = torch.optim.AdamW([{"params": [params[i] for i in g["params"]]} for g in groups])
    optimizer.load_state_dict(saved)  # verl's hyperparameters, Adam or AdamW, come with it
    return optimizer


class _SavedScheduler:
    """The LR scheduler's state as verl saved it (saved again as it is)."""

    def __init__(self, state: dict[str, Any] | None) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any] | None:
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = state


def _set_rng(rng: dict[str, Any]) -> None:
    """verl's ``get_rng_state()`` of rank 0, made this process's (saved with the step)."""
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "numpy" in rng:
        np.random.set_state(rng["numpy"])
    if "random" in rng:
        random.setstate(rng["random"])


@contextmanager
def _one_rank() -> Any:
    """A one-rank process group and a local Ray instance, where the process has none."""
    import ray

    own_group, own_ray = not dist.is_initialized(), not ray.is_initialized()
    with tempfile.TemporaryDirectory(prefix="rcimport-", dir="/tmp") as tmp:
        if own_group:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                    world_size=1)
        if own_ray:
            ray.init(address="local", num_cpus=1, include_dashboard=False,
                     _temp_dir=os.path.join(tmp, "ray"), logging_level="ERROR",
                     log_to_driver=False)
        try:
            yield
        finally:
            if own_ray:
                ray.shutdown()
            if own_group:
                dist.destroy_process_group()
