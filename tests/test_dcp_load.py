"""The load plan computed once per layout (raycheckpoint.dcp_load) is DCP's own plan.

Four real ranks (gloo, FSDP2, part of the model on a 2-D mesh) save a model and its AdamW
state with uneven shapes; then 4 ranks (the same layout: layers of one shape on either
mesh), 3 and 2 ranks plan their loads with
:class:`LayoutCachingLoadPlanner` and with DCP's ``DefaultLoadPlanner``: the plans must be
the same read items in the same order (index hints included), and loading through either
gives the same bits.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from raycheckpoint.dcp_load import LayoutCachingLoadPlanner, local_load_plan

pytestmark = pytest.mark.timeout(240)


def _state(world: int, hsdp: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from raycheckpoint.worker import optimizer_state_dict

    torch.manual_seed(0)
    # repeated layers (the cache's hits) and shapes no world size here divides evenly
    net = torch.nn.Sequential(torch.nn.Embedding(11, 6), *[torch.nn.Linear(6, 6) for _ in range(3)],
                              torch.nn.Linear(6, 13), torch.nn.Linear(13, 5))
    mesh = init_device_mesh("cpu", (world,))
    for i, layer in enumerate(net):
        if hsdp and i in (1, 4):  # replicated across 2 groups of 2, sharded within each
            fully_shard(layer, mesh=init_device_mesh("cpu", (2, world // 2),
                                                     mesh_dim_names=("rep", "shard")))
        else:
            fully_shard(layer, mesh=mesh)
    optim = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.arange(8).remainder(11)).sum().backward()
    optim.step()
    return {"model": get_model_state_dict(net), "optim": optimizer_state_dict(net, optim),
            "extra": {"note": "x", "table": torch.arange(7.0)}}


def _items(plan) -> list[tuple]:
    return [(r.type, r.dest_index, r.dest_index.index, r.dest_offsets, r.storage_index,
             r.storage_index.index, r.storage_offsets, r.lengths) for r in plan.items]


def _plan(planner, state: dict, metadata) -> list[tuple]:
    planner.set_up_planner(state, metadata, is_coordinator=dist.get_rank() == 0)
    return _items(planner.create_local_plan())


def _flat(state: dict) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, _ = flatten_state_dict(state)
    return {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in flat.items()}


def _rank_main(rank: int, world: int, port: int, root: str, save: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        path = os.path.join(root, "ckpt")
        if save:
            dcp.save(_state(world, hsdp=True), checkpoint_id=path)
            dist.barrier()
        metadata = FileSystemReader(path).read_metadata()
        ours = _plan(LayoutCachingLoadPlanner(), _state(world, hsdp=world == 4), metadata)
        theirs = _plan(DefaultLoadPlanner(), _state(world, hsdp=world == 4), metadata)
        assert len(ours) > 20, len(ours)
        assert ours == theirs, (len(ours), len(theirs), next(
            ((a, b) for a, b in zip(ours, theirs, strict=False) if a != b), None))
        loaded = {}
        for name, planner in (("ours", LayoutCachingLoadPlanner()), ("theirs", DefaultLoadPlanner())):
            state = _state(world, hsdp=world == 4)
            for t in _flat(state).values():
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    t.zero_()
            dcp.load(state, checkpoint_id=path, planner=planner)
            loaded[name] = _flat(state)
        assert loaded["ours"].keys() == loaded["theirs"].keys()
        for k, v in loaded["ours"].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, loaded["theirs"][k]), k
            else:
                assert v == loaded["theirs"][k], k
        assert loaded["ours"]["extra.note"] == "x"
    finally:
        dist.destroy_process_group()


def test_plans_match_dcps_when_resharding(tmp_path):
    from workers.group import free_port

    root = str(tmp_path)
    mp.spawn(_rank_main, args=(4, free_port(), root, True), nprocs=4, join=True)
    for world in (3, 2):
        mp.spawn(_rank_main, args=(world, free_port(), root, False), nprocs=world, join=True)


def test_plain_tensors_and_missing_keys_as_dcp_does(tmp_path):
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    path = str(tmp_path / "ckpt")
    saved = {"a": torch.ones(3, 4), "b": torch.zeros(3, 4), "c": torch.arange(5), "n": 7}
    dcp.save(saved, checkpoint_id=path, no_dist=True)
    metadata = FileSystemReader(path).read_metadata()
    state = {"a": torch.empty(3, 4), "b": torch.empty(3, 4), "c": torch.empty(5, dtype=torch.long),
             "n": 0}
    assert _items(local_load_plan(state, metadata)) == _items(
        create_default_local_load_plan(state, metadata))
    extra = {**state, "new": torch.empty(2)}  # a key the checkpoint lacks
    with pytest.raises(RuntimeError, match="Missing key in checkpoint state_dict: new"):
        local_load_plan(extra, metadata)
    assert _items(local_load_plan(extra, metadata, strict=False)) == _items(
        create_default_local_load_plan(state, metadata))
    with pytest.raises(ValueError, match="Size mismatch"):
        local_load_plan({**state, "a": torch.empty(4, 3)}, metadata)
    # keys only the checkpoint has: DCP's own planner decides (older key formats)
    fewer = {"a": torch.empty(3, 4)}
    planner = LayoutCachingLoadPlanner(allow_partial_load=True)
    planner.set_up_planner(fewer, metadata)
    assert [r.dest_index.fqn for r in planner.create_local_plan().items] == ["a"]
