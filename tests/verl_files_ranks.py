"""Ranks that write a role as verl 0.9's FSDPCheckpointManager does under FSDP2 (its
save_checkpoint's torch.save calls, file names and fsdp_config.json), and the whole
state they had, for tests/test_verl_files.py.

    python -m tests.verl_files_ranks OUT_DIR WORLD_SIZE PORT [MESH]   (MESH: "2x2" = HSDP)
"""

from __future__ import annotations

import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 7),
                               torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))


def run(rank: int, world: int, out: str, port: int, mesh_shape: tuple[int, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        m = model()
        names = ("ddp", "fsdp") if len(mesh_shape) == 2 else ("fsdp",)
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        fully_shard(m, mesh=mesh)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        torch.manual_seed(1)
        for _ in range(2):
            m(torch.randint(0, 11, (4, 5))).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        torch.manual_seed(100 + rank)
        rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(),
               "random": random.getstate()}
        torch.save(m.state_dict(), f"{out}/model_world_size_{world}_rank_{rank}.pt")
        torch.save(opt.state_dict(), f"{out}/optim_world_size_{world}_rank_{rank}.pt")
        torch.save({"lr_scheduler": sched.state_dict(), "rng": rng},
                   f"{out}/extra_state_world_size_{world}_rank_{rank}.pt")
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        whole_model = get_model_state_dict(m, options=full)
        whole_optim = get_optimizer_state_dict(m, opt, options=full)
        if rank == 0:
            with open(f"{out}/fsdp_config.json", "w") as f:
                json.dump({"FSDP_version": 2, "world_size": world}, f)
            torch.save({"model": whole_model, "optim": whole_optim,
                        "names": [n for n, _ in m.named_parameters()]}, f"{out}/expected.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # end here, not in the interpreter's teardown: a gloo thread still being torn down
    # there now and then aborts the process ("terminate called without an active
    # exception"), and the files are written and closed already
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    out, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    shape = tuple(int(x) for x in sys.argv[4].split("x")) if len(sys.argv) > 4 else (world,)
    torch.multiprocessing.spawn(run, args=(world, out, port, shape), nprocs=world)
