"""Two real gloo ranks sharding a small model with FSDP2, for the DCP save tests: the
model and its state, a training step, and checks that saves load back exactly."""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed.checkpoint as dcp

# a non-tensor value whose record outgrows the 64-byte alignment torch.save pads records to
LONGER = "a much longer value " * 20


def dcp_files(root: str, d: str) -> dict[str, object]:
    """A DCP directory's data files (bytes) and its metadata (unpickled: equal metadata
    may pickle to other bytes, as pickle shares the objects it meets twice)."""
    out: dict[str, object] = {}
    for name in sorted(os.listdir(os.path.join(root, d))):
        with open(os.path.join(root, d, name), "rb") as f:
            out[name] = pickle.loads(f.read()) if name == ".metadata" else f.read()
    return out


def model_and_state(world: int, out: int = 8):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from raycheckpoint.worker import optimizer_state_dict

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, out))
    mesh = init_device_mesh("cpu", (world,))
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optim = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(4, 16)).sum().backward()
    optim.step()

    def state(note: str = "x"):
        return {"model": get_model_state_dict(net), "optim": optimizer_state_dict(net, optim),
                "note": note}

    return net, optim, state


def train_step(net, optim) -> None:
    net(torch.randn(4, 16)).sum().backward()
    optim.step()


def save_whole_model(net, rank: int, path: str) -> None:
    """The whole model (all ranks gather it), saved by rank 0 to compare loads with."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    whole = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if rank == 0:
        torch.save(whole, path)


def counting(real, calls: list[int]):
    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    return counted


def load_into_one(path: str, like: dict) -> dict:
    """A DCP directory read back with torch's own reader, into one process."""
    from torch.distributed.checkpoint import FileSystemReader

    dcp.load(like, storage_reader=FileSystemReader(path), no_dist=True)
    return like


def check_saves_load_exactly(root: str, saves: dict[str, str], differ: tuple[str, str]) -> None:
    """Each save (name -> its DCP directory under ``root``) loads into one process as
    the whole model rank 0 kept beside it; the two saves ``differ`` held other values,
    so the check cannot pass by loading stale bytes."""
    for name, d in saves.items():
        saved = torch.load(os.path.join(root, f"{name}-model.pt"), weights_only=True)
        got = load_into_one(os.path.join(root, d),
                             {"model": {k: torch.zeros_like(v) for k, v in saved.items()}})
        for k, v in saved.items():
            assert torch.equal(got["model"][k], v), (name, k)
    a, b = (torch.load(os.path.join(root, f"{name}-model.pt"), weights_only=True)
            for name in differ)
    assert not torch.equal(a["0.weight"], b["0.weight"])
