"""FSDPTrainWorker: a Ray actor training one FSDP2-sharded rank of a tiny causal LM.

It is the trainable-role worker of the core tests, demo and benchmarks: a small
decoder-style language model (embeddings, MLP blocks, LM head) built from a config
(nothing downloaded), sharded with ``fully_shard`` on a CPU device mesh over gloo,
trained with AdamW and a linear LR schedule.  Its checkpoint state is the FSDP2
sharded (DTensor) model and optimizer state dicts plus the scheduler state.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import ray
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from raycheckpoint.worker import CheckpointableWorker
from workers.group import init_process_group


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    seq_len: int = 32
    batch_size: int = 8
    lr: float = 1e-3
    total_steps: int = 1000


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg.d_model) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@ray.remote
class FSDPTrainWorker(CheckpointableWorker):
    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str,
                 master_port: int, timeout_s: float = 120.0, model: dict | None = None,
                 seed: int = 0) -> None:
        self.role, self.rank, self.world_size = role, rank, world_size
        init_process_group(rank=rank, world_size=world_size, master_addr=master_addr,
                           master_port=master_port, timeout_s=timeout_s)
        self.cfg = TinyLMConfig(**(model or {}))
        torch.manual_seed(seed)  # identical initial weights on every rank
        self.model = TinyLM(self.cfg)
        mesh = init_device_mesh("cpu", (world_size,))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr)
        self.sched = torch.optim.lr_scheduler.LinearLR(
            self.optim, start_factor=1.0, end_factor=0.1, total_iters=self.cfg.total_steps)
        self.steps = 0
        torch.manual_seed(seed * 1000 + rank + 1)  # per-rank stream from here on

    def ready(self) -> dict[str, Any]:
        n = sum(p.to_local().numel() for p in self.model.parameters())
        return {"rank": self.rank, "local_params": n, "config": asdict(self.cfg)}

    def train_step(self, batch_seed: int) -> float:
        """One step on a batch derived from ``batch_seed`` (the data) and the rank RNG (noise)."""
        g = torch.Generator().manual_seed(batch_seed * 7919 + self.rank)
        tokens = torch.randint(0, self.cfg.vocab_size, (self.cfg.batch_size, self.cfg.seq_len + 1),
                               generator=g)
        # a learnable pattern: every token predicts (previous + 1) mod vocab
        tokens[:, 1:] = (tokens[:, :-1] + 1) % self.cfg.vocab_size
        noise = torch.rand(tokens.shape) < 0.05  # drawn from the per-rank RNG (saved, restored)
        tokens = torch.where(noise, torch.randint_like(tokens, self.cfg.vocab_size), tokens)
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, self.cfg.vocab_size),
                                           tokens[:, 1:].reshape(-1))
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        self.optim.step()
        self.sched.step()
        self.steps += 1
        return float(loss.detach())

    def full_state(self) -> dict[str, Any]:
        """Full (unsharded) model and optimizer state, gathered on every rank (tests)."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
        return {"model": get_model_state_dict(self.model, options=opts),
                "optim": get_optimizer_state_dict(self.model, self.optim, options=opts),
                "sched": self.sched.state_dict(), "steps": self.steps}

    def weights_sha256(self) -> str:
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        h = hashlib.sha256()
        for k in sorted(sd):
            h.update(k.encode())
            h.update(sd[k].detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    def rng_probe(self) -> float:
        """A draw from this rank's torch RNG (tests compare it across resume)."""
        return float(torch.rand(()))

    def arm_fault(self, point: str, action: str = "raise") -> None:
        from raycheckpoint._internal import faults

        faults.arm(point, action)

    def disarm_faults(self) -> None:
        from raycheckpoint._internal import faults

        faults.disarm()

    # ---- CheckpointableWorker hooks ---------------------------------------------------------

    def ckpt_state_dict(self, kind: str) -> dict[str, Any]:
        state = {"model": get_model_state_dict(self.model)}
        if kind == "full":
            state["optim"] = get_optimizer_state_dict(self.model, self.optim)
        return state

    def ckpt_load_state_dict(self, state: dict[str, Any], kind: str) -> None:
        set_model_state_dict(self.model, state["model"])
        if "optim" in state:
            set_optimizer_state_dict(self.model, self.optim, state["optim"])

    def ckpt_extra_state(self) -> dict[str, Any]:
        return {"scheduler": self.sched.state_dict(), "steps": self.steps}

    def ckpt_load_extra_state(self, extra: dict[str, Any]) -> None:
        self.sched.load_state_dict(extra["scheduler"])
        self.steps = int(extra["steps"])
