"""ShardedModelWorker: one rank of an FSDP2-sharded model (trainable or frozen).

The base of the actor, critic, reference and reward roles.  It picks its device
(``trainer.device``: one GPU per rank, or cpu), forms the role's process group (NCCL for
the model on cuda, gloo on cpu), builds the model from its Hugging Face directory or from
config (identical initial weights on every rank), shards each decoder layer and the root
with ``fully_shard``, and, when trainable, owns AdamW and a linear LR schedule.
Checkpoint state: the sharded model (and optimizer) state dicts, plus the scheduler and
step counter as extra state.
Frozen roles save their weights only; the coordinator stores them once and later
checkpoints reference those bytes.
"""

from __future__ import annotations

from typing import Any

import ray
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from raycheckpoint.worker import CheckpointableWorker, StateDictCache, install_clean_exit
from workers.device import backend as device_backend
from workers.device import rank_device
from workers.group import init_process_group
from workers.models import ValueModel, build_causal_lm, decoder_layers, hf_assets, state_sha256


class ShardedModelWorker(CheckpointableWorker):
    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str,
                 master_port: int, timeout_s: float = 120.0, model: dict | None = None,
                 seed: int = 0, trainable: bool = True, value_model: bool = False,
                 optim: dict | None = None, device: str = "auto") -> None:
        self.role, self.rank, self.world_size = role, rank, world_size
        install_clean_exit()  # never hang in Ray's C++ teardown
        self.device, self.gpu_ids = rank_device(device, f"{role} rank {rank}")
        init_process_group(rank=rank, world_size=world_size, master_addr=master_addr,
                           master_port=master_port, timeout_s=timeout_s,
                           backend=device_backend(self.device))
        self.model_spec = dict(model or {})
        self.net, layers = self.build_model(self.model_spec, seed, value_model)
        self.net.to(self.device)  # built on cpu from the seed: the same weights on any device
        mesh = init_device_mesh(self.device.type, (world_size,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
        self.trainable = trainable
        self.steps = 0
        self.optim = self.sched = None
        if trainable:
            optim = dict(optim or {})
            self.optim = torch.optim.AdamW(self.net.parameters(), lr=optim.get("lr", 1e-3),
                                           weight_decay=optim.get("weight_decay", 0.0))
            self.sched = torch.optim.lr_scheduler.LinearLR(
                self.optim, start_factor=1.0, end_factor=optim.get("end_factor", 0.1),
                total_iters=max(1, optim.get("total_steps", 1000)))
            self.ckpt_guard(self.optim)  # allows checkpoint.overlap_copy
        else:
            self.net.requires_grad_(False)
            self.net.eval()
        # torch builds these state dicts item by item while training is blocked; the
        # cache rebuilds them only when the tensors behind them change
        self._state_dicts = StateDictCache(self.net, self.optim)

    def build_model(self, model: dict[str, Any], seed: int,
                    value_model: bool) -> tuple[nn.Module, nn.ModuleList]:
        """The unsharded model (same weights on every rank) and the layers to shard."""
        net = ValueModel(model, seed) if value_model else build_causal_lm(model, seed)
        return net, decoder_layers(net)

    def ready(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "trainable": self.trainable,
                "device": str(self.device), "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": self.gpu_ids}

    def _optimizer_step(self, loss: torch.Tensor, step_scheduler: bool = True) -> None:
        """One optimizer step; the LR schedule advances once per training step (with
        ``step_scheduler``: the last of a step's mini-batches)."""
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        self.optim.step()
        if step_scheduler:
            self.sched.step()
            self.steps += 1

    # ---- whole-model views (collectives: every rank of the role must call) ----------------

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The unsharded weights on rank 0 (None elsewhere)."""
        sd = get_model_state_dict(self.net, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
        return sd if self.rank == 0 else None

    def weights_sha256(self) -> str:
        return state_sha256(get_model_state_dict(self.net,
                                                 options=StateDictOptions(full_state_dict=True)))

    # ---- CheckpointableWorker hooks --------------------------------------------------------

    def ckpt_state_dict(self, kind: str) -> dict[str, Any]:
        return self._state_dicts.state_dict(kind)  # "optim" only where there is an optimizer

    def ckpt_load_state_dict(self, state: dict[str, Any], kind: str) -> None:
        self._state_dicts.load_state_dict(state)  # the load filled the live tensors

    def ckpt_extra_state(self) -> dict[str, Any]:
        if not self.trainable:
            return {}
        return {"scheduler": self.sched.state_dict(), "steps": self.steps}

    def ckpt_assets(self) -> dict[str, bytes]:
        """The Hugging Face config and tokenizer files of a causal LM (none for value models)."""
        if getattr(self, "_assets", None) is None:
            self._assets = (hf_assets(self.net, self.model_spec)
                            if hasattr(self.net, "generation_config") else {})
        return self._assets

    def ckpt_load_extra_state(self, extra: dict[str, Any]) -> None:
        if self.trainable and extra:
            self.sched.load_state_dict(extra["scheduler"])
            self.steps = int(extra["steps"])
