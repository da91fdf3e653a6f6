"""The library at work in an environment that holds verl and verl's own pins.

Run by ``tests/test_beside_verl.py`` with that environment's Python (not by pytest):
``beside_verl_script.py CHECKPOINT_ROOT RAY_TEMP_DIR``, with the project's root on
``PYTHONPATH``.  Imports verl and raycheckpoint
side by side, then saves a real checkpoint of two replicated gloo ranks of a small model
through a local Ray instance, loads it into fresh ranks, and checks the weights bit for bit.
Prints one JSON line with the versions it ran with.
"""

from __future__ import annotations

import json
import os
import sys

import ray
import torch
import transformers
import verl

import raycheckpoint
from raycheckpoint import CheckpointableWorker, CheckpointConfig, CheckpointManager
from raycheckpoint.worker import StateDictCache
from workers.group import free_port, init_process_group

TIMEOUT_S = 120


@ray.remote(num_cpus=0)
class Rank(CheckpointableWorker):
    def __init__(self, rank: int, world_size: int, port: int, seed: int) -> None:
        init_process_group(rank=rank, world_size=world_size, master_addr="127.0.0.1",
                           master_port=port, timeout_s=TIMEOUT_S)
        torch.manual_seed(seed)  # replicated (as under DDP): DCP stores one copy of each tensor
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.optim = torch.optim.AdamW(self.net.parameters(), lr=1e-2)
        self.cache = StateDictCache(self.net, self.optim)

    def train(self) -> None:
        loss = self.net(torch.randn(8, 16)).square().mean()
        loss.backward()
        self.optim.step()
        self.optim.zero_grad()

    def ckpt_state_dict(self, kind: str) -> dict:
        return self.cache.state_dict(kind)

    def ckpt_load_state_dict(self, state: dict, kind: str) -> None:
        self.cache.load_state_dict(state)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.net.state_dict().items()}


def group(seed: int) -> list:
    port = free_port()
    ranks = [Rank.remote(r, 2, port, seed) for r in range(2)]
    ray.get([r.weights.remote() for r in ranks], timeout=TIMEOUT_S)
    return ranks


def main(root: str, ray_temp: str) -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=ray_temp,
             logging_level="ERROR")
    trained = group(seed=0)
    ray.get([r.train.remote() for r in trained], timeout=TIMEOUT_S)
    manager = CheckpointManager(CheckpointConfig(save_dir=root), {"actor": trained})
    manager.save_checkpoint(step=1).wait(TIMEOUT_S)
    expected = ray.get([r.weights.remote() for r in trained], timeout=TIMEOUT_S)
    manager.close(TIMEOUT_S)

    fresh = group(seed=1)
    loader = CheckpointManager(CheckpointConfig(save_dir=root), {"actor": fresh})
    loaded = loader.load_checkpoint("auto")
    got = ray.get([r.weights.remote() for r in fresh], timeout=TIMEOUT_S)
    loader.close(TIMEOUT_S)
    same = all(torch.equal(e[k], g[k]) for e, g in zip(expected, got, strict=True) for k in e)
    print(json.dumps({"verl": verl.__version__, "raycheckpoint": os.path.dirname(raycheckpoint.__file__),
                      "transformers": transformers.__version__,
                      "torch": torch.__version__, "ray": ray.__version__,
                      "loaded_step": loaded.step if loaded else None, "bitwise": same}))
    ray.shutdown()
    if not (same and loaded and loaded.step == 1):
        sys.exit("the checkpoint did not load back bit for bit")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
