"""The DCP layer on its own (one process, no process group): format and verification."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from raycheckpoint import IntegrityError
from raycheckpoint.dcp_io import HashingStorageWriter, VerifyingStorageReader, load_verified
from raycheckpoint.storage import Storage


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "optim": {"step": torch.tensor(3.0), "lr": 0.01, "betas": [0.9, 0.99]}}


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def storage(request, tmp_path):
    if request.param == "local":
        return Storage(str(tmp_path / "root"))
    root, options = request.getfixturevalue("s3_root")
    return Storage(root, options)


def _save(storage):
    writer = HashingStorageWriter(storage, "step_00000001/actor")
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    return {e.path: e for e in writer.written}


def test_written_files_are_hashed_and_load_back(storage):
    expected = _save(storage)
    assert set(expected) == {"step_00000001/actor/__0_0.distcp", "step_00000001/actor/.metadata"}
    for path, entry in expected.items():
        assert storage.size(path) == entry.size
    target = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
              "optim": {"step": torch.tensor(0.0), "lr": 0.0, "betas": [0.0, 0.0]}}
    dcp.load(target, storage_reader=VerifyingStorageReader(storage, "step_00000001/actor", expected),
             no_dist=True)
    src = _state()
    assert torch.equal(target["model"]["w"], src["model"]["w"])
    assert torch.equal(target["optim"]["step"], src["optim"]["step"])
    assert target["optim"]["lr"] == 0.01 and target["optim"]["betas"] == [0.9, 0.99]


def test_torch_reads_our_directories(tmp_path):
    storage = Storage(str(tmp_path))
    _save(storage)
    target = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}}
    dcp.load(target, storage_reader=FileSystemReader(str(tmp_path / "step_00000001/actor")),
             no_dist=True)
    assert torch.equal(target["model"]["w"], _state()["model"]["w"])


def test_tampered_metadata_is_never_unpickled(tmp_path):
    storage = Storage(str(tmp_path))
    expected = _save(storage)
    path = "step_00000001/actor/.metadata"
    data = bytearray(storage.read_bytes(path))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(path, bytes(data))
    reader = VerifyingStorageReader(storage, "step_00000001/actor", expected)
    with pytest.raises(IntegrityError, match=re.escape(path)):
        load_verified({"model": {"w": torch.zeros(64, 32)}}, reader, no_dist=True)


def test_file_not_in_manifest_is_refused(tmp_path):
    storage = Storage(str(tmp_path))
    _save(storage)
    reader = VerifyingStorageReader(storage, "step_00000001/actor", {})
    with pytest.raises(IntegrityError, match="not listed in the checkpoint's manifest"):
        load_verified({"model": {"w": torch.zeros(64, 32)}}, reader, no_dist=True)


def test_prepared_buffers_are_reused_and_restaged_fresh(tmp_path):
    from raycheckpoint.snapshot import ShardSaver
    from raycheckpoint.storage import StorageSpec

    saver = ShardSaver(role="actor", rank=0, world_size=1, storage=StorageSpec(str(tmp_path)))
    state = _state()
    assert saver.prepare("full", state) == (64 * 32 + 32 + 1) * 4
    prepared = saver._buffers["full"][1]
    state["model"]["w"].add_(1.0)
    state["optim"]["lr"] = 0.5  # non-tensor leaves change between saves too
    staged = saver._stage("full", state)
    assert staged["model"]["w"].data_ptr() == prepared["model"]["w"].data_ptr()  # no new memory
    assert torch.equal(staged["model"]["w"], state["model"]["w"])
    assert staged["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()  # a copy
    assert staged["optim"]["lr"] == 0.5
    light = saver._stage("light", {"model": state["model"]})  # shares the full buffers
    assert light["model"]["w"].data_ptr() == prepared["model"]["w"].data_ptr()
