"""A data file staged whole, written as soon as the snapshot's copy has filled its block
(raycheckpoint._internal.overlapped_write), on two real ranks."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from raycheckpoint._internal.dcp.save import save_state
from raycheckpoint._internal.dcp.shard_plan import ShardPlan
from raycheckpoint._internal.dcp.writer import HashingStorageWriter
from raycheckpoint.integrity import digest
from tests.dcp_ranks import check_saves_load_exactly, model_and_state, save_whole_model, train_step

pytestmark = pytest.mark.timeout(180)


def _write_ahead_rank_main(rank: int, world: int, port: int, root: str) -> None:
    from raycheckpoint._internal.dcp import record_layout as dcp_io
    from raycheckpoint._internal.overlapped_write import CopyFailed, OverlappedWrite
    from raycheckpoint._internal.persist import SaveTarget
    from raycheckpoint._internal.shard_saver import ShardSaver
    from raycheckpoint.storage import StorageSpec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
        dcp_io.SPLIT_AT_BYTES = dcp_io.SMALL_ITEM_BYTES = 0  # file 0: tensors only
        net, optim, state = model_and_state(world)
        saver = ShardSaver(role="actor", rank=rank, world_size=world, storage=StorageSpec(root))
        data_file = f"__{rank}_0.distcp"
        taken: list = []  # what the storage writers took of the early writes
        aheads: list = []  # each save's early write
        real_take = OverlappedWrite.take

        def take(self, rel, block):
            entry = real_take(self, rel, block)
            taken.append((rel, entry))
            return entry

        OverlappedWrite.take = take

        def save(d: str, *, fail_copy: bool = False, forget: bool = False):
            """As a snapshot then its persist do, with the early write between them."""
            staged, copies, ready = saver.stager.plan("full", state())
            progress = saver._start_overlapped_write("full", SaveTarget(None, "", d), 30.0)
            plan = saver.plans.setdefault("full", ShardPlan())
            ahead = saver._early.get("full")
            aheads.append(ahead)
            failed = None
            if fail_copy:  # this rank's copy fails halfway
                half = len(copies) // 2
                copies[half] = (copies[half][0], "not a tensor")
                with pytest.raises(TypeError) as failed_copy:
                    saver.stager.copy(copies, ready, progress)
                failed = RuntimeError(f"the copy failed: {failed_copy.value}")
            else:
                saver.stager.copy(copies, ready, progress)
            if forget:  # the staged tensors moved after the snapshot: no image to write
                plan.forget_tensors()
            writer = HashingStorageWriter(saver.storage, f"{d}/actor", plan, ahead)
            try:
                save_state(staged, writer, plan, group, failed=failed)
            finally:
                saver._end_overlapped_write("full")
            if not plan.tried_images:
                saver._stage_files_whole("full", plan, writer.results)
            return writer, plan, ahead

        def step() -> None:
            train_step(net, optim)

        def whole_model(d: str) -> None:
            save_whole_model(net, rank, os.path.join(root, f"{d}-model.pt"))

        def data(d: str) -> bytes:
            with open(os.path.join(root, d, "actor", data_file), "rb") as f:
                return f.read()

        _, plan, ahead = save("w1")  # the first save of a plan: nothing written early
        assert ahead is None and plan.images
        whole_model("w1")

        step()
        writer, plan, ahead = save("w2")  # written once the copy filled the block
        whole_model("w2")
        rel = f"w2/actor/{data_file}"
        assert ahead is not None and ahead.error is None and not ahead.written
        entry = [e for e in writer.written if e.path == rel]
        assert (rel, entry[0]) in taken, taken
        assert data("w2") == bytes(plan.images[data_file].view)
        assert entry[0].digest == digest.of(data("w2"), "blake3")

        step()  # rank 1's copy fails: its early write stops, rank 0's goes unused
        taken.clear()
        with pytest.raises(Exception, match="copy failed"):
            save("w3", fail_copy=rank == 1)
        assert not os.path.exists(os.path.join(root, "w3", "actor", data_file))
        assert "full" not in saver._early  # ended, the files removed
        if rank == 1:
            assert isinstance(aheads[-1].error, CopyFailed)
        else:
            assert aheads[-1].error is None and not taken  # no storage writer reached it
        taken.clear()

        writer, plan, ahead = save("w4")  # after a failure: the full protocol, written late
        assert ahead is None and not taken
        whole_model("w4")

        step()
        saver.writes_ahead = False  # checkpoint.write_ahead=false: the block written late
        writer, plan, ahead = save("w4b")
        assert ahead is None and not taken and plan.outcome is not None
        assert data("w4b") == bytes(plan.images[data_file].view)
        whole_model("w4b")
        saver.writes_ahead = True

        step()
        writer, plan, ahead = save("w5", forget=True)  # the image is gone: record by record
        assert (f"w5/actor/{data_file}", None) in taken and not plan.images
        whole_model("w5")
        dist.barrier(group)
    finally:
        dist.destroy_process_group()


def test_a_data_file_staged_whole_is_written_once_the_copy_fills_it(tmp_path):
    """From the second save of a plan, a data file staged whole is written early, from
    its block once the snapshot's copy has filled it; the persist takes that file (its
    bytes the block's, its checksum theirs) instead of writing it.  A copy failing on one
    rank fails the save on both and leaves no early file behind; with the early write
    turned off the persist writes the block; a save whose image went away between the
    snapshot and the persist writes the file record by record.  Every save loads exactly
    with torch's own reader."""
    from workers.group import free_port

    root = str(tmp_path)
    mp.spawn(_write_ahead_rank_main, args=(2, free_port(), root), nprocs=2, join=True)
    check_saves_load_exactly(root, {d: f"{d}/actor" for d in ("w1", "w2", "w4", "w4b", "w5")},
                              ("w2", "w5"))
