"""DCP's save protocol with plans agreed once (raycheckpoint._internal.dcp.save), on two real ranks.

Two processes form a gloo group and shard a small model with FSDP2, as two workers of a
role do.  Each scenario saves through :func:`save_state` and, beside it, through
``dcp.save`` itself with the same writer: the data files must be the same bytes and the
metadata equal, and a
checkpoint saved on two ranks must load into one process (resharding reads both ranks'
files through the global metadata).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import DefaultSavePlanner

from raycheckpoint import testing as faults
from raycheckpoint._internal.dcp.save import save_state
from raycheckpoint._internal.dcp.shard_plan import ShardPlan
from raycheckpoint._internal.dcp.writer import HashingStorageWriter
from raycheckpoint.errors import InjectedFault
from raycheckpoint.storage import Storage
from tests.dcp_ranks import (
    LONGER,
    check_saves_load_exactly,
    counting,
    dcp_files,
    model_and_state,
    save_whole_model,
    train_step,
)

pytestmark = pytest.mark.timeout(180)


def _check_staging(root: str, state) -> None:
    """A snapshot stages FSDP2's DTensors into buffers of the same placements, and a
    DTensor whose placements change (its local shard the same) gets buffers anew."""
    from torch.distributed.tensor import DTensor, Replicate

    from raycheckpoint._internal.shard_saver import ShardSaver
    from raycheckpoint.storage import StorageSpec

    saver = ShardSaver(role="actor", rank=dist.get_rank(), world_size=dist.get_world_size(),
                       storage=StorageSpec(root))
    s = state()
    for _ in range(2):  # built, then staged against what was built
        staged = saver.stager.stage("full", s)
        for k, v in s["model"].items():
            assert isinstance(staged["model"][k], DTensor)
            assert staged["model"][k].placements == v.placements
            assert torch.equal(staged["model"][k].to_local(), v.to_local())
    # from one save to the next each tensor is copied from the very same source, its
    # local memory: a parameter's to_local() is a new view at every call, not taken anew
    sources = [[src for _, src in saver.stager.plan("full", s)[1]] for _ in range(2)]
    assert all(a is b for a, b in zip(*sources, strict=True))
    local = {t._local_tensor.data_ptr() for t in s["model"].values()}
    assert local <= {src.data_ptr() for src in sources[0]}
    w = s["model"]["0.weight"]
    s["model"]["0.weight"] = DTensor.from_local(w.to_local(), w.device_mesh, [Replicate()],
                                                run_check=False)
    staged = saver.stager.stage("full", s)
    assert staged["model"]["0.weight"].placements == (Replicate(),)
    assert torch.equal(staged["model"]["0.weight"].to_local(), w.to_local())


def _rank_main(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
        storage = Storage(root)
        net, optim, state = model_and_state(world)
        plan = ShardPlan()
        full_protocol: list[int] = []  # dcp.save calls made by save_state
        torch_save = dcp.save
        dcp.save = counting(torch_save, full_protocol)

        def ours(d: str, note: str = "x") -> None:
            save_state(state(note), HashingStorageWriter(storage, d, plan), plan, group)

        def torchs(d: str, note: str = "x") -> None:  # torch's planner: one write per record
            torch_save(state(note), storage_writer=HashingStorageWriter(storage, d),
                       planner=DefaultSavePlanner(), process_group=group)

        ours("s1")                        # the full protocol, remembered
        assert len(full_protocol) == 1
        ours("s2")                        # agreed: no plan exchange, the same .metadata bytes
        assert len(full_protocol) == 1
        # the file was written from its laid-out records (checked against torch's below)
        layouts = [layout for _, layout in plan.layouts.values()]
        assert layouts and all(layout is not None for layout in layouts)
        torchs("t2")
        net(torch.randn(4, 16)).sum().backward()
        optim.step()                      # new values, same structure
        for g in optim.param_groups:
            g["lr"] = 5e-4
        ours("s3")
        torchs("t3")
        ours("s4", note=LONGER)  # a non-tensor record grows: offsets move, .metadata anew
        torchs("t4", note=LONGER)
        calls = len(full_protocol)
        ours("s5", note=LONGER)  # agreed again on the new outcome
        assert len(full_protocol) == calls
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        if rank == 0:
            torch.save(whole, os.path.join(root, "s5-model.pt"))

        # a rank that fails to write fails the save on every rank; the next one is whole
        if rank == 1:
            faults.arm("storage.write@s6/__1_", "raise")
        try:
            ours("s6")
        except InjectedFault:
            assert rank == 1
        except RuntimeError as e:  # the peer names the rank that failed, and why
            assert rank == 0, e
            assert "writing the shards failed on another rank of this role (rank 1: " \
                "InjectedFault: injected fault at storage.write (s6/__1_0.distcp))" in str(e), e
        else:
            raise AssertionError(f"rank {rank}: the failed save did not fail here")
        faults.disarm()
        calls = len(full_protocol)
        ours("s7")                        # after a failure: the full protocol again
        assert len(full_protocol) == calls + 1
        torchs("t7")

        # one rank with a new plan (its buffers changed): every rank plans anew
        if rank == 1:
            plan = ShardPlan()
        calls = len(full_protocol)
        ours("s8")
        assert len(full_protocol) == calls + 1
        _check_staging(root, state)
        dist.barrier(group)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2])
def test_agreed_plans_write_what_dcp_save_writes(tmp_path, world):
    from workers.group import free_port

    root = str(tmp_path)
    mp.spawn(_rank_main, args=(world, free_port(), root), nprocs=world, join=True)
    for ours, theirs in (("s2", "t2"), ("s3", "t3"), ("s4", "t4"), ("s5", "t4"), ("s7", "t7")):
        a, b = dcp_files(root, ours), dcp_files(root, theirs)
        assert set(a) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
        assert a == b, (ours, [n for n in a if a[n] != b.get(n)])
    assert dcp_files(root, "s1") == dcp_files(root, "s2")  # same state, same bytes
    assert dcp_files(root, "s8") == dcp_files(root, "s7")
    assert ".metadata" not in os.listdir(os.path.join(root, "s6"))  # the failed save

    # the two ranks' shards load into one process: the global metadata covers both files
    from torch.distributed.checkpoint import FileSystemReader

    full = {"model": {"0.weight": torch.zeros(32, 16), "0.bias": torch.zeros(32),
                      "2.weight": torch.zeros(8, 32), "2.bias": torch.zeros(8)}, "note": ""}
    dcp.load(full, storage_reader=FileSystemReader(os.path.join(root, "s5")), no_dist=True)
    saved = torch.load(os.path.join(root, "s5-model.pt"), weights_only=True)
    assert full["note"] == LONGER
    assert set(full["model"]) == set(saved)
    for k, v in saved.items():
        assert torch.equal(full["model"][k], v), k


def _image_rank_main(rank: int, world: int, port: int, root: str) -> None:
    from raycheckpoint._internal.dcp import record_layout as dcp_io
    from raycheckpoint._internal.shard_saver import ShardSaver
    from raycheckpoint.storage import StorageSpec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
        # this model is tiny: every tensor counts as large, so file 0 holds tensors only
        dcp_io.SPLIT_AT_BYTES = dcp_io.SMALL_ITEM_BYTES = 0
        # one output: the last layer's shards are uneven, rank 1's empty
        net, optim, state = model_and_state(world, out=1)
        saver = ShardSaver(role="actor", rank=rank, world_size=world, storage=StorageSpec(root))
        full_protocol: list[int] = []
        torch_save = dcp.save
        dcp.save = counting(torch_save, full_protocol)
        data_file = f"__{rank}_0.distcp"

        def save(d: str, kind: str = "full") -> tuple[HashingStorageWriter, ShardPlan]:
            """As a snapshot then its persist do: stage, then save with the kind's plan."""
            staged = saver.stager.stage(kind, state() if kind == "full" else {"model": state()["model"]})
            plan = saver.plans.setdefault(kind, ShardPlan())
            writer = HashingStorageWriter(saver.storage, d, plan)
            save_state(staged, writer, plan, group)
            return writer, plan

        def step() -> None:
            train_step(net, optim)

        def whole_model(d: str) -> None:
            save_whole_model(net, rank, os.path.join(root, f"{d}-model.pt"))

        writer, plan = save("i1")
        whole_model("i1")
        saver._stage_files_whole("full", plan, writer.results)
        image = plan.images[data_file]
        staged = list(saver.stager.staging["full"].tensors())
        base = torch.frombuffer(image.block, dtype=torch.uint8).data_ptr()
        assert len(image.indices) == sum(1 for r in writer.results
                                         if r.storage_data.relative_path == data_file)
        inside = [t for t in staged if t.untyped_storage().data_ptr() == base]
        moved_here = sum(at is not None for at in image.data_ptrs)  # empty shards stay
        assert len(inside) == moved_here, (len(inside), moved_here)
        assert (moved_here < len(image.indices)) == (rank == 1)
        assert all(t.data_ptr() % 64 == 0 for t in inside)

        step()
        save("i2")                  # from the block: its offsets moved, .metadata anew
        whole_model("i2")
        with open(os.path.join(root, "i2", data_file), "rb") as f:
            assert f.read() == bytes(image.view)
        calls = len(full_protocol)
        step()
        save("i3")                  # agreed on the new offsets: no full protocol
        assert len(full_protocol) == calls
        whole_model("i3")

        # a staged tensor moved elsewhere (another kind's block took it, and the saver had
        # this plan forget what it resolved): record by record, from where it is now
        moved = inside[0]
        moved.set_(moved.clone())
        plan.forget_tensors()
        step()
        save("i4")
        whole_model("i4")
        with open(os.path.join(root, "i4", data_file), "rb") as f:
            assert f.read() != bytes(image.view)

        # a light save shares the full save's model buffers: its files stay record by
        # record, and the full save's block keeps its tensors
        writer, light = save("l1", "light")
        saver._stage_files_whole("light", light, writer.results)
        assert light.tried_images and not light.images
        assert sum(t.untyped_storage().data_ptr() == base for t in staged) == len(inside) - 1
        dist.barrier(group)
    finally:
        dist.destroy_process_group()


def test_a_data_file_staged_whole_is_written_from_its_block_and_loads(tmp_path):
    """After a first save, a saver moves a data file's staged tensors into one page-aligned
    block laid out as the file (records' tensor data 64-byte aligned); the next saves write
    that block as the file, and torch's own reader loads each save's state exactly.  A
    tensor moved out of the block sends the file back to being written record by record."""
    from workers.group import free_port

    root = str(tmp_path)
    mp.spawn(_image_rank_main, args=(2, free_port(), root), nprocs=2, join=True)
    check_saves_load_exactly(root, {d: d for d in ("i1", "i2", "i3", "i4")}, ("i2", "i3"))


def test_the_planner_flattens_once_and_reads_the_values_afresh():
    """The flattened state dict is built once: later saves reuse its tensors (the staged
    buffers, the same objects at the same paths) and read every non-tensor value from the
    state they are given; a state whose values no longer lie where they did is flattened
    anew.  What each save would write is what DCP's own planner resolves."""
    from torch.distributed.checkpoint import _nested_dict

    def state(lr: float, note: str = "x") -> dict:
        return {"model": {"w": w, "b": b}, "optim": {"param_groups": [{"lr": lr, "betas": (0.9, 0.99),
                                                                     "params": ["w", "b"]}]},
                "note": note}

    w, b = torch.arange(6.0).reshape(2, 3), torch.ones(3)
    planner = ShardPlan().planner
    flattened: list[int] = []
    real = _nested_dict.flatten_state_dict
    _nested_dict.flatten_state_dict = counting(real, flattened)
    try:
        import torch.distributed.checkpoint.default_planner as default_planner

        default_planner.flatten_state_dict = _nested_dict.flatten_state_dict
        for i, (lr, note) in enumerate([(1e-3, "x"), (5e-4, "x"), (2e-4, LONGER)]):
            planner.set_up_planner(state(lr, note), is_coordinator=True)
            assert len(flattened) == 1, i  # flattened once, on the first save
            reference = DefaultSavePlanner()
            reference.set_up_planner(state(lr, note), is_coordinator=True)
            flattened.pop()  # the reference's own
            assert list(planner.state_dict) == list(reference.state_dict)
            for fqn, value in reference.state_dict.items():
                got = planner.state_dict[fqn]
                assert got is value if isinstance(value, torch.Tensor) else got == value, fqn
        # the structure changed under the planner: its values moved, so it flattens anew
        planner.set_up_planner({"model": {"w": w, "b": b}, "note": {"nested": 1}},
                               is_coordinator=True)
        assert len(flattened) == 2 and planner.state_dict["note.nested"] == 1
        planner.forget_tensors()  # the staged tensors moved: the next save flattens anew
        planner.set_up_planner(state(1e-4), is_coordinator=True)
        assert len(flattened) == 3 and planner.state_dict["optim.param_groups.0.lr"] == 1e-4
    finally:
        _nested_dict.flatten_state_dict = real
        default_planner.flatten_state_dict = real


def test_laid_out_records_write_what_torch_writes(tmp_path, monkeypatch):
    """A data file written from its cached layout (runs of small records copied into one
    piece, large records' pieces as they are, non-tensor records made anew) holds the
    bytes torch's own writer gives, in one process, over saves whose values change and
    whose non-tensor record grows; torch's reader loads each save back."""
    from torch.distributed.checkpoint import FileSystemReader

    from raycheckpoint._internal.dcp import record_layout as dcp_io

    monkeypatch.setattr(dcp_io, "JOIN_RUN_BYTES", 3000)  # several runs of small records
    big, small = torch.randn(64, 512), [torch.randn(8, 8) for _ in range(12)]

    def state(note: str) -> dict:
        return {"big": big, "small": {str(i): t for i, t in enumerate(small)}, "note": note,
                "lr": 1e-3}

    storage = Storage(str(tmp_path))
    plan = ShardPlan()
    for i, note in enumerate(["x", "y", LONGER, LONGER + "!"]):
        with torch.no_grad():
            big.add_(1.0)
            for t in small:
                t.mul_(2.0)
        save_state(state(note), HashingStorageWriter(storage, f"s{i}", plan), plan)
        dcp.save(state(note), storage_writer=HashingStorageWriter(storage, f"t{i}"),
                   planner=DefaultSavePlanner(), no_dist=True)
        ours, theirs = dcp_files(str(tmp_path), f"s{i}"), dcp_files(str(tmp_path), f"t{i}")
        assert ours == theirs, (i, [n for n in ours if ours[n] != theirs.get(n)])
        got = {"big": torch.zeros_like(big), "small": {str(k): torch.zeros(8, 8) for k in range(12)},
               "note": "", "lr": 0.0}
        dcp.load(got, storage_reader=FileSystemReader(str(tmp_path / f"s{i}")), no_dist=True)
        assert torch.equal(got["big"], big) and got["note"] == note
        assert all(torch.equal(got["small"][str(k)], t) for k, t in enumerate(small))
    (layout,) = [layout for _, layout in plan.layouts.values()]
    hows = [how for how, _ in layout.segments]
    assert hows.count(dcp_io._AS_IS) == 1 and hows.count(dcp_io._FRESH) == 2
    assert hows.count(dcp_io._JOINED) >= 2
