"""The DCP layer on its own (one process, no process group): the writer, the verifying
reader, format and verification (a directory of several files, the prefetch:
``test_dcp_multi_file.py``)."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from raycheckpoint import IntegrityError
from raycheckpoint._internal.dcp.load import load_verified
from raycheckpoint._internal.dcp.read_ahead import receive_buffer
from raycheckpoint._internal.dcp.reader import VerifyingStorageReader
from raycheckpoint._internal.dcp.writer import HashingStorageWriter
from raycheckpoint.storage import Storage


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "optim": {"step": torch.tensor(3.0), "lr": 0.01, "betas": [0.9, 0.99]}}


@pytest.fixture
def storage(storage_spec):
    return storage_spec.open()


def _save(storage):
    writer = HashingStorageWriter(storage, "step_00000001/actor")
    dcp.save(_state(), storage_writer=writer)
    return {e.path: e for e in writer.written}


def test_a_file_read_whole_lands_in_zeroed_writable_memory_of_its_size():
    """The memory an object's body streams into (``receive_buffer``) is as long as the
    file, writable, zeroed, and lives as long as a view of it does."""
    import gc

    buf = receive_buffer(3 << 20)
    assert len(buf) == 3 << 20 and buf.format == "B" and not buf.readonly
    assert bytes(buf[::4096]) == bytes(len(buf[::4096]))
    buf[-1] = 7
    gc.collect()
    assert buf[-1] == 7 and bytes(buf[:2]) == b"\0\0"
    assert len(receive_buffer(0)) == 0


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
        load_verified({"model": {"w": torch.zeros(64, 32)}}, reader)


def test_file_not_in_manifest_is_refused(storage):
    _save(storage)
    reader = VerifyingStorageReader(storage, "step_00000001/actor", {})
    with pytest.raises(IntegrityError, match="not listed in the checkpoint's manifest"):
        load_verified({"model": {"w": torch.zeros(64, 32)}}, reader)


def test_prepared_buffers_are_reused_and_restaged_fresh(tmp_path):
    from raycheckpoint._internal.shard_saver import ShardSaver
    from raycheckpoint.storage import StorageSpec

    saver = ShardSaver(role="actor", rank=0, world_size=1, storage=StorageSpec(str(tmp_path)))
    state = _state()
    assert saver.prepare("full", state) == (64 * 32 + 32 + 1) * 4
    prepared = saver.stager._buffers["full"][1]
    state["model"]["w"].add_(1.0)
    state["optim"]["lr"] = 0.5  # non-tensor leaves change between saves too
    staged = saver.stager.stage("full", state)
    assert staged["model"]["w"].data_ptr() == prepared["model"]["w"].data_ptr()  # no new memory
    assert torch.equal(staged["model"]["w"], state["model"]["w"])
    assert staged["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()  # a copy
    assert staged["optim"]["lr"] == 0.5
    light = saver.stager.stage("light", {"model": state["model"]})  # shares the full buffers
    assert light["model"]["w"].data_ptr() == prepared["model"]["w"].data_ptr()


@pytest.mark.parametrize("checksums", [True, False])
def test_every_byte_of_a_data_file_is_checked_while_tensors_load(storage, checksums):
    """A data file is hashed beside the tensor copies (local disk) or before them (object
    stores): a flip anywhere in it (zip headers, pickles, tensor bytes) fails the load
    naming the file, even where parsing fails first."""
    expected = _save(storage)
    path = "step_00000001/actor/__0_0.distcp"
    clean = storage.read_bytes(path)
    target = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}}
    reader = VerifyingStorageReader(storage, "step_00000001/actor", expected, checksums=checksums)
    load_verified(target, reader)
    assert torch.equal(target["model"]["w"], _state()["model"]["w"])
    if not checksums:
        return
    header_at = clean.index(b"PK\x03\x04")
    for at in (header_at + 8, clean.index(b"data.pkl") + 20, len(clean) // 2, len(clean) - 5):
        bad = bytearray(clean)
        bad[at] ^= 0xFF
        storage.write_bytes(path, bytes(bad))
        reader = VerifyingStorageReader(storage, "step_00000001/actor", expected)
        with pytest.raises(IntegrityError, match=re.escape(path)) as err:
            load_verified({"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}}, reader)
        assert err.value.path == path, at
    storage.write_bytes(path, clean)


def test_a_missing_or_truncated_data_file_is_refused(storage):
    expected = _save(storage)
    path = "step_00000001/actor/__0_0.distcp"
    clean = storage.read_bytes(path)

    def load() -> None:
        reader = VerifyingStorageReader(storage, "step_00000001/actor", expected)
        load_verified({"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}}, reader)

    storage.write_bytes(path, clean[:-1])
    with pytest.raises(IntegrityError, match="truncated or overwritten"):
        load()
    storage.write_bytes(path, clean + b"\0")
    with pytest.raises(IntegrityError, match="truncated or overwritten"):
        load()
    storage.delete(path)
    with pytest.raises(IntegrityError, match="missing from storage"):
        load()
    storage.write_bytes(path, clean)
    load()


_UNPICKLED: list[str] = []


def _ran_on_unpickle(what: str) -> None:
    _UNPICKLED.append(what)


class _Payload:
    def __reduce__(self):
        return (_ran_on_unpickle, ("a non-tensor record of a tampered file",))


def test_a_tampered_non_tensor_record_is_never_unpickled(tmp_path):
    """Non-tensor items (a learning rate, betas) are records torch unpickles with its full
    unpickler.  In a data file read from a mapping, whose checksum is checked beside the
    tensor copies, they are applied only once that check has passed: a tampered file
    fails with IntegrityError and its pickle never runs."""
    storage = Storage(str(tmp_path))
    expected = _save(storage)
    path = "step_00000001/actor/__0_0.distcp"
    metadata = pickle.loads(storage.read_bytes("step_00000001/actor/.metadata"))
    lr = next(info for index, info in metadata.storage_data.items() if index.fqn == "optim.lr")
    payload = pickle.dumps(_Payload())
    assert len(payload) <= lr.length
    data = bytearray(storage.read_bytes(path))
    data[lr.offset:lr.offset + lr.length] = payload + b"\0" * (lr.length - len(payload))
    storage.write_bytes(path, bytes(data))  # same size: only the checksum tells
    target = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
              "optim": {"step": torch.tensor(0.0), "lr": 0.0, "betas": [0.0, 0.0]}}
    _UNPICKLED.clear()
    with pytest.raises(IntegrityError, match=re.escape(path)):
        load_verified(target, VerifyingStorageReader(storage, "step_00000001/actor", expected))
    assert _UNPICKLED == []
