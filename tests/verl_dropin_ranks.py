"""Ranks that use raycheckpoint's verl manager as verl's FSDP engine uses its own: each a
Ray actor in one gloo group, a small FSDP2 model with AdamW and a warm-up LR schedule
(verl's defaults), the manager built with ``FSDPCheckpointManager``'s arguments and
called on every rank at once.  For tests/test_verl_dropin.py.
"""

from __future__ import annotations

import hashlib
from typing import Any

import ray
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from workers.group import init_process_group


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(13, 8), torch.nn.Linear(8, 9),
                               torch.nn.LayerNorm(9), torch.nn.Linear(9, 5))


@ray.remote
class DropinRank:
    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str,
                 master_port: int, timeout_s: float, contents: list[str] | None = None,
                 options: dict[str, Any] | None = None, async_save: bool = False,
                 seed: int = 0) -> None:
        from raycheckpoint.integrations.verl import FSDPCheckpointManager

        init_process_group(rank=rank, world_size=world_size, master_addr=master_addr,
                           master_port=master_port, timeout_s=timeout_s)
        self.rank = rank
        self.model = build_model()
        for layer in self.model:
            if isinstance(layer, (torch.nn.Linear, torch.nn.Embedding)):
                fully_shard(layer)
        fully_shard(self.model)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lambda s: min(1.0, (s + 1) / 4))
        config = {} if contents is None else {"save_contents": contents, "load_contents": contents}
        if async_save:
            import verl  # noqa: F401 - as in verl's workers: the switch comes with it

            config["async_save"] = True
        self.manager = FSDPCheckpointManager(model=self.model, optimizer=self.optim,
                                             lr_scheduler=self.sched, processing_class=None,
                                             checkpoint_config=config or None, options=options)
        torch.manual_seed(1000 + seed + rank)  # each rank's own stream, as verl's ranks have

    def ready(self) -> bool:
        return True

    def train(self, steps: int) -> float:
        loss = 0.0
        for _ in range(steps):
            x = torch.randint(0, 13, (4, 6))
            out = self.model(x).pow(2).mean()
            out.backward()
            self.optim.step()
            self.sched.step()
            self.optim.zero_grad()
            loss = float(out)
        return loss

    def save(self, local_path: str, step: int, keep: int | None = None) -> None:
        self.manager.save_checkpoint(local_path=local_path, hdfs_path=None, global_step=step,
                                     max_ckpt_to_keep=keep)

    def load(self, local_path: str) -> None:
        self.manager.load_checkpoint(local_path=local_path, hdfs_path=None,
                                     del_local_after_load=False)

    def state(self) -> dict[str, Any]:
        """The whole state (a collective: every rank calls it) and this rank's RNG."""
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(self.model, options=full)
        optim = get_optimizer_state_dict(self.model, self.optim, options=full)
        h = hashlib.sha256()
        for k in sorted(model):
            h.update(k.encode() + model[k].numpy().tobytes())
        return {"model": model, "optim": optim, "sched": self.sched.state_dict(),
                "rng": torch.get_rng_state(), "weights": h.hexdigest()}

    def arm(self, point: str, action: str) -> None:
        """Arm a fault point in this rank's process."""
        from raycheckpoint.testing import arm

        arm(point, action)

    def close(self) -> None:
        self.manager.close()
