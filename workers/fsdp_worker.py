"""FSDPTrainWorker: a Ray actor training one FSDP2-sharded rank of a tiny causal LM.

It is the trainable-role worker of the core tests, demo and benchmarks: a small
decoder-style language model (embeddings, MLP blocks, LM head) built from a config
(nothing downloaded), sharded with ``fully_shard`` on a CPU device mesh over gloo,
trained with AdamW and a linear LR schedule.  Its checkpoint state is the FSDP2
sharded (DTensor) model and optimizer state dicts plus the scheduler state (all from
:class:`~workers.sharded.ShardedModelWorker`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import ray
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from raycheckpoint import testing
from raycheckpoint.worker import optimizer_state_dict
from workers.sharded import ShardedModelWorker


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
class FSDPTrainWorker(ShardedModelWorker):
    """A rank of a data-parallel TinyLM training group (the core tests' trainable role)."""

    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str,
                 master_port: int, timeout_s: float = 120.0, model: dict | None = None,
                 seed: int = 0, assets: dict[str, bytes] | None = None) -> None:
        self.cfg = TinyLMConfig(**(model or {}))
        self._assets = dict(assets or {})  # files saved beside the weights (ckpt_assets)
        super().__init__(role=role, rank=rank, world_size=world_size, master_addr=master_addr,
                         master_port=master_port, timeout_s=timeout_s, seed=seed,
                         optim={"lr": self.cfg.lr, "end_factor": 0.1,
                                "total_steps": self.cfg.total_steps})
        torch.manual_seed(seed * 1000 + rank + 1)  # per-rank stream from here on

    def build_model(self, model: dict, seed: int, value_model: bool) -> tuple[nn.Module, nn.ModuleList]:
        torch.manual_seed(seed)  # identical initial weights on every rank
        net = TinyLM(self.cfg)
        return net, net.blocks

    def ready(self) -> dict[str, Any]:
        n = sum(p.to_local().numel() for p in self.net.parameters())
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
        logits = self.net(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, self.cfg.vocab_size),
                                           tokens[:, 1:].reshape(-1))
        self._optimizer_step(loss)
        return float(loss.detach())

    def full_state(self) -> dict[str, Any]:
        """Full (unsharded) model and optimizer state, gathered on every rank (tests)."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
        return {"model": get_model_state_dict(self.net, options=opts),
                "optim": optimizer_state_dict(self.net, self.optim, options=opts),
                "sched": self.sched.state_dict(), "steps": self.steps}

    def rng_probe(self) -> float:
        """A draw from this rank's torch RNG (tests compare it across resume)."""
        return float(torch.rand(()))

    def arm_fault(self, point: str, action: str = "raise") -> None:
        testing.arm(point, action)

    def disarm_faults(self) -> None:
        testing.disarm()
