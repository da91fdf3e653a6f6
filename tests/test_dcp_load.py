"""The load plan computed once per layout (raycheckpoint.dcp_load) is DCP's own plan.

Four real ranks (gloo, FSDP2, part of the model on a 2-D mesh) save a model and its AdamW
state with uneven shapes; then 4 ranks (the same layout: layers of one shape on either
mesh), 3 and 2 ranks plan their loads with
:class:`LayoutCachingLoadPlanner` and with DCP's ``DefaultLoadPlanner``: the plans must be
the same read items in the same order (index hints included), and loading through either,
or through this project's reader (whose copies are ``memmove``s, :func:`copy_run`), gives
the same bits.
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

from raycheckpoint._internal.dcp.load import load_verified
from raycheckpoint._internal.dcp.load_plan import (
    LayoutCachingLoadPlanner,
    contiguous_span,
    copy_run,
    local_load_plan,
)
from raycheckpoint._internal.dcp.reader import VerifyingStorageReader
from raycheckpoint._internal.dcp.writer import HashingStorageWriter
from raycheckpoint.integrity import digest
from raycheckpoint.storage import FileEntry, Storage

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


def _entries(path: str) -> dict[str, FileEntry]:
    """What a manifest would list for the DCP directory ``path`` (named ``ckpt``)."""
    out = {}
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        out[f"ckpt/{name}"] = FileEntry(f"ckpt/{name}", len(data), digest.of(data, digest.DEFAULT))
    return out


def _rank_main(rank: int, world: int, port: int, root: str, save: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        path = os.path.join(root, "ckpt")
        if save:
            # this project's writer: its records are the layout the reader copies itself
            dcp.save(_state(world, hsdp=True),
                     storage_writer=HashingStorageWriter(Storage(root), "ckpt"))
            dist.barrier()
        metadata = FileSystemReader(path).read_metadata()
        ours = _plan(LayoutCachingLoadPlanner(), _state(world, hsdp=world == 4), metadata)
        theirs = _plan(DefaultLoadPlanner(), _state(world, hsdp=world == 4), metadata)
        assert len(ours) > 20, len(ours)
        assert ours == theirs, (len(ours), len(theirs), next(
            ((a, b) for a, b in zip(ours, theirs, strict=False) if a != b), None))
        loaded = {}
        for name in ("ours", "theirs", "reader"):
            state = _state(world, hsdp=world == 4)
            for t in _flat(state).values():
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    t.zero_()
            if name == "reader":  # this project's reader, whose copies bypass torch's
                load_verified(state, VerifyingStorageReader(Storage(root), "ckpt", _entries(path)))
            else:
                planner = LayoutCachingLoadPlanner() if name == "ours" else DefaultLoadPlanner()
                dcp.load(state, checkpoint_id=path, planner=planner)
            loaded[name] = _flat(state)
        for name in ("ours", "reader"):
            assert loaded[name].keys() == loaded["theirs"].keys()
            for k, v in loaded[name].items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, loaded["theirs"][k]), (name, k)
                else:
                    assert v == loaded["theirs"][k], (name, k)
            assert loaded[name]["extra.note"] == "x"
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
    dcp.save(saved, storage_writer=HashingStorageWriter(Storage(str(tmp_path)), "ckpt"), no_dist=True)
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


def _blocks(sizes: tuple[int, ...]):
    """Every block (offsets, lengths) of a tensor of ``sizes``, and some reaching past it."""
    import itertools

    per_dim = [[(o, n) for o in range(size + 1) for n in range(size - o + 1)] + [(size, 1)]
               for size in sizes]
    for combo in itertools.product(*per_dim):
        yield tuple(o for o, _ in combo), tuple(n for _, n in combo)


@pytest.mark.parametrize("sizes", [(), (5,), (4, 3), (2, 3, 4), (3, 1, 2)])
def test_contiguous_span_is_exactly_the_blocks_that_are_one_run(sizes):
    whole = torch.arange(max(1, torch.Size(sizes).numel())).reshape(sizes)
    for offsets, lengths in _blocks(sizes):
        span = contiguous_span(sizes, offsets, lengths)
        if any(o + n > size for o, n, size in zip(offsets, lengths, sizes, strict=True)):
            assert span is None, (offsets, lengths)
            continue
        block = whole
        for dim, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
            block = block.narrow(dim, o, n)
        if block.numel() == 0:
            assert span is None or span[1] == 0
            continue
        assert (span is not None) == block.is_contiguous(), (offsets, lengths)
        if span is not None:
            start, count = span
            assert torch.equal(block.reshape(-1), whole.reshape(-1)[start:start + count])


def test_the_reader_copies_runs_itself_and_leaves_the_rest_to_dcp(tmp_path, monkeypatch):
    """Items whose source and target are one run each are ``memmove``d (and the target's
    version moves, as a ``copy_`` moves it); a transposed target, a target of another
    dtype and a tensor subclass take DCP's ``copy_``.  Every target ends as torch's own
    reader leaves it."""
    import ctypes

    from raycheckpoint._internal.dcp import load_plan as dcp_load

    g = torch.Generator().manual_seed(0)
    saved = {"w": torch.randn(6, 4, generator=g), "t": torch.randn(4, 6, generator=g),
             "h": torch.randn(6, 4, generator=g), "s": torch.tensor(3.0),
             "p": torch.nn.Parameter(torch.randn(5, generator=g)),
             "sub": torch.randn(3, generator=g), "i": torch.arange(7)}
    path = str(tmp_path / "ckpt")
    dcp.save(saved, storage_writer=HashingStorageWriter(Storage(str(tmp_path)), "ckpt"), no_dist=True)

    class Sub(torch.Tensor):
        pass

    def targets():
        return {"w": torch.zeros(6, 4), "t": torch.zeros(6, 4).t(),
                "h": torch.zeros(6, 4, dtype=torch.bfloat16), "s": torch.tensor(0.0),
                "p": torch.nn.Parameter(torch.zeros(5)), "sub": torch.zeros(3).as_subclass(Sub),
                "i": torch.zeros(7, dtype=torch.long)}

    theirs = targets()
    dcp.load(theirs, checkpoint_id=path, no_dist=True)
    moved = []
    real = ctypes.memmove
    monkeypatch.setattr(dcp_load.ctypes, "memmove",
                        lambda dst, src, n: moved.append(n) or real(dst, src, n))
    ours = targets()
    versions = {k: v._version for k, v in ours.items()}
    load_verified(ours, VerifyingStorageReader(Storage(str(tmp_path)), "ckpt", _entries(path)))
    for k, v in ours.items():
        assert torch.equal(v, theirs[k]) and v.dtype == theirs[k].dtype, k
        assert v._version > versions[k], k
    assert sorted(moved) == sorted([6 * 4 * 4, 4, 5 * 4, 7 * 8])  # w, s, p, i
    assert not copy_run(torch.zeros(4, 6).t(), torch.float32, (6, 4), None, 0)
