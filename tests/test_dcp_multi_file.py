"""The DCP layer reading a directory of several files (one process, no process group): a
rank reading several files at once, the prefetch of the files a rank will load, the small
items' own file, and the memory budget of files read whole."""

from __future__ import annotations

import os
import pickle
import re
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from raycheckpoint import IntegrityError
from raycheckpoint._internal.dcp.load import load_verified
from raycheckpoint._internal.dcp.read_ahead import overlapping_ranks
from raycheckpoint._internal.dcp.reader import VerifyingStorageReader
from raycheckpoint._internal.dcp.writer import HashingStorageWriter
from raycheckpoint.storage import Storage
from tests.test_dcp_io import _save, _state


@pytest.fixture
def storage(storage_spec):
    return storage_spec.open()


def _two_file_checkpoint(storage: Storage, d: str) -> tuple[dict, dict]:
    """A DCP directory whose items lie in two data files, as two saving ranks leave it."""
    halves = [{"model": {"w": _state()["model"]["w"]}},
              {"model": {"b": _state()["model"]["b"]}, "optim": {"step": torch.tensor(3.0)}}]
    expected, metadata = {}, None
    for i, half in enumerate(halves):
        writer = HashingStorageWriter(storage, f"part{i}")
        dcp.save(half, storage_writer=writer)
        data = storage.read_bytes(f"part{i}/__0_0.distcp")
        expected.update({e.path: e for e in [storage.write_bytes(f"{d}/__{i}_0.distcp", data)]})
        md = pickle.loads(storage.read_bytes(f"part{i}/.metadata"))
        for info in md.storage_data.values():
            info.relative_path = f"__{i}_0.distcp"
        if metadata is None:
            metadata = md
        else:
            metadata.state_dict_metadata.update(md.state_dict_metadata)
            metadata.storage_data.update(md.storage_data)
    entry = storage.write_bytes(f"{d}/.metadata", pickle.dumps(metadata))
    expected[entry.path] = entry
    source = {"model": dict(halves[0]["model"], **halves[1]["model"]), "optim": halves[1]["optim"]}
    return expected, source


class _RecordingReader(VerifyingStorageReader):
    """Notes which thread read which file (the reader's own code path, unchanged)."""

    def _read_file(self, file_name, reqs, planner):
        self.threads[file_name] = threading.current_thread().name
        return super()._read_file(file_name, reqs, planner)


@pytest.mark.parametrize("parallel_files", [1, 4])
def test_a_rank_reading_several_files_reads_them_at_once(storage, parallel_files):
    """Loading into fewer ranks than saved, a rank reads several files: each in a thread of
    its own, with the same result and the same checks as one at a time."""
    expected, source = _two_file_checkpoint(storage, "multi")
    target = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
              "optim": {"step": torch.tensor(0.0)}}
    reader = _RecordingReader(storage, "multi", expected, parallel_files=parallel_files)
    reader.threads = {}
    load_verified(target, reader)
    assert torch.equal(target["model"]["w"], source["model"]["w"])
    assert torch.equal(target["model"]["b"], source["model"]["b"])
    assert torch.equal(target["optim"]["step"], source["optim"]["step"])
    assert set(reader.threads) == {"__0_0.distcp", "__1_0.distcp"}
    pooled = [name for name in reader.threads.values() if name.startswith("raycheckpoint-load")]
    assert len(pooled) == (2 if parallel_files > 1 else 0)

    path = "multi/__1_0.distcp"  # a flipped byte in one file fails the load, naming it
    bad = bytearray(storage.read_bytes(path))
    bad[len(bad) // 2] ^= 0x01
    storage.write_bytes(path, bytes(bad))
    reader = VerifyingStorageReader(storage, "multi", expected, parallel_files=parallel_files)
    with pytest.raises(IntegrityError, match=re.escape(path)):
        load_verified({"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
                       "optim": {"step": torch.tensor(0.0)}}, reader)


@pytest.mark.parametrize(("rank", "world_size", "saved", "expected"), [
    (0, 2, 2, [0]), (1, 2, 2, [1]),                                 # same size: its own file
    (0, 1, 2, [0, 1]), (0, 3, 4, [0, 1]), (1, 3, 4, [1, 2]), (2, 3, 4, [2, 3]),
    (0, 4, 2, [0]), (3, 4, 2, [1]), (1, 2, 4, [2, 3]), (0, 2, 3, [0, 1]), (1, 2, 3, [1, 2]),
])
def test_overlapping_ranks_are_those_an_even_split_shares(rank, world_size, saved, expected):
    assert list(overlapping_ranks(rank, world_size, saved)) == expected


_SENDFILE, _FADVISE = os.sendfile, getattr(os, "posix_fadvise", None)


def _recording(real, calls: list, reader=None):
    """``real`` (os.sendfile or os.posix_fadvise), noting (file, offset, length) of each
    call; with ``reader``, the first call also stops that reader's prefetch."""
    def call(*args):
        fd, offset, length = args[1:4] if real is _SENDFILE else args[:3]
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        if reader is not None:
            reader.stop_prefetch()
        return real(*args)
    return call


def _reads_by_thread(storage: Storage, monkeypatch) -> list[tuple[str, str]]:
    """(file, thread name) of each whole-file read ``storage`` serves from now on."""
    reads: list[tuple[str, str]] = []
    real = storage.read_into

    def read_into(rel, buf):
        reads.append((rel, threading.current_thread().name))
        return real(rel, buf)

    monkeypatch.setattr(storage, "read_into", read_into)
    return reads


def test_prefetch_reads_the_named_ranks_files_only(storage, monkeypatch):
    """The prefetch reads the files of the ranks asked for ahead of the load: through the
    page cache on local disk, whole into memory from an object store, where the load then
    takes them instead of reading them again.  The load reads and checks as before."""
    calls: list = []
    monkeypatch.setattr(os, "sendfile", _recording(_SENDFILE, calls))
    reads = _reads_by_thread(storage, monkeypatch)
    expected, source = _two_file_checkpoint(storage, "multi")
    reader = VerifyingStorageReader(storage, "multi", expected)
    thread = reader.prefetch([1])
    if not storage.caps.local_paths:
        assert thread is None and not calls
        assert set(reader._fetched) == {"multi/__1_0.distcp"}
        reader._fetched["multi/__1_0.distcp"].result(10)
        assert [(rel, name.startswith("raycheckpoint-load-fetch")) for rel, name in reads] == [
            ("multi/__1_0.distcp", True)]
    else:
        thread.join(10)
        path = os.path.realpath(storage.full_path("multi/__1_0.distcp"))
        assert {c[0] for c in calls} == {path}
        assert sum(c[2] for c in calls) >= os.path.getsize(path)  # to the end of the file
        assert reader.prefetch([5]) is None  # a rank that wrote nothing here
    target = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
              "optim": {"step": torch.tensor(0.0)}}
    load_verified(target, reader)
    assert torch.equal(target["model"]["w"], source["model"]["w"])
    assert torch.equal(target["model"]["b"], source["model"]["b"])
    if not storage.caps.local_paths:  # each file read once: the prefetched one taken, the other read
        assert sorted(rel for rel, _ in reads) == ["multi/__0_0.distcp", "multi/__1_0.distcp"]
        assert not reader._fetched


@pytest.mark.s3
def test_a_corrupt_file_prefetched_from_an_object_store_fails_the_load(s3_root, monkeypatch):
    """A file prefetched whole is verified as the load's own read would verify it: the
    load fails naming it.  The budget stops the prefetch before a file that would pass it,
    and stop_prefetch drops a file the load never took."""
    from raycheckpoint._internal.dcp import reader as dcp_read
    from raycheckpoint.storage import StorageSpec

    storage = StorageSpec(*s3_root).open()
    expected, _ = _two_file_checkpoint(storage, "multi")
    path = "multi/__1_0.distcp"
    bad = bytearray(storage.read_bytes(path))
    bad[len(bad) // 2] ^= 0xFF
    storage.write_bytes(path, bytes(bad))
    target = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
              "optim": {"step": torch.tensor(0.0)}}
    reader = VerifyingStorageReader(storage, "multi", expected)
    reader.prefetch([0, 1])
    assert set(reader._fetched) == {"multi/__0_0.distcp", path}
    with pytest.raises(IntegrityError, match=re.escape(path)):
        load_verified(target, reader)
    assert not reader._fetched and reader._fetch_pool is None

    sizes = [expected[f"multi/__{r}_0.distcp"].size for r in (0, 1)]
    monkeypatch.setattr(dcp_read, "PARALLEL_READ_BYTES", sizes[0] + sizes[1] - 1)
    reader = VerifyingStorageReader(storage, "multi", expected)
    reader.prefetch([0, 1])
    assert set(reader._fetched) == {"multi/__0_0.distcp"}
    reader.stop_prefetch()
    assert not reader._fetched and reader._fetch_pool is None


def test_prefetch_stops_at_its_bound_when_told_and_without_sendfile(tmp_path, monkeypatch):
    """Each file is read in steps up to PREFETCH_BYTES; stop_prefetch ends it after the
    current step; where sendfile is refused, the kernel is asked step by step instead (one
    POSIX_FADV_WILLNEED call reads no more than the readahead window)."""
    import raycheckpoint._internal.dcp.read_ahead as read_ahead

    storage = Storage(str(tmp_path))
    expected, _ = _two_file_checkpoint(storage, "multi")
    size = os.path.getsize(storage.full_path("multi/__0_0.distcp"))
    monkeypatch.setattr(read_ahead, "PREFETCH_STEP", 1024)
    monkeypatch.setattr(read_ahead, "PREFETCH_BYTES", 3 * 1024)
    assert size > 4 * 1024

    sent: list = []
    monkeypatch.setattr(os, "sendfile", _recording(_SENDFILE, sent))
    reader = VerifyingStorageReader(storage, "multi", expected)
    reader.prefetch([0]).join(10)
    assert [c[1:] for c in sent] == [(0, 1024), (1024, 1024), (2048, 1024)]

    sent.clear()
    reader = VerifyingStorageReader(storage, "multi", expected)
    monkeypatch.setattr(os, "sendfile", _recording(_SENDFILE, sent, reader))
    reader.prefetch([0]).join(10)
    assert [c[1:] for c in sent] == [(0, 1024)]  # stopped during the first step

    def refused(*args):
        raise OSError(22, "Invalid argument")

    advised: list = []
    monkeypatch.setattr(os, "sendfile", refused)
    monkeypatch.setattr(os, "posix_fadvise", _recording(_FADVISE, advised))
    reader = VerifyingStorageReader(storage, "multi", expected)
    reader.prefetch([0]).join(10)
    assert [c[1:] for c in advised] == [(0, 1024), (1024, 1024), (2048, 1024)]


def test_a_large_rank_keeps_its_small_items_in_a_file_of_their_own(storage, monkeypatch):
    """A rank of SPLIT_AT_BYTES or more writes its small items (here the bias, the step,
    the lr and betas) beside its large ones, in ``__<rank>_1.distcp``: a reader needing only
    those (a rank loading another's replicated items) opens and hashes that file alone.
    torch's own reader reads the pair, and a flip in the small file fails a load of it."""
    import raycheckpoint._internal.dcp.record_layout as dcp_io

    monkeypatch.setattr(dcp_io, "SPLIT_AT_BYTES", 4096)
    monkeypatch.setattr(dcp_io, "SMALL_ITEM_BYTES", 4096)  # w: 8 KB; b: 128 B
    expected = _save(storage)
    d = "step_00000001/actor"
    assert set(expected) == {f"{d}/__0_0.distcp", f"{d}/__0_1.distcp", f"{d}/.metadata"}
    assert expected[f"{d}/__0_1.distcp"].size < expected[f"{d}/__0_0.distcp"].size
    src = _state()

    def target():
        return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
                "optim": {"step": torch.tensor(0.0), "lr": 0.0, "betas": [0.0, 0.0]}}

    full = target()
    load_verified(full, VerifyingStorageReader(storage, d, expected))
    assert torch.equal(full["model"]["w"], src["model"]["w"])
    assert torch.equal(full["model"]["b"], src["model"]["b"])
    assert full["optim"]["lr"] == 0.01 and torch.equal(full["optim"]["step"], src["optim"]["step"])
    if storage.caps.local_paths:
        theirs = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}}
        dcp.load(theirs, storage_reader=FileSystemReader(storage.full_path(d)), no_dist=True)
        assert torch.equal(theirs["model"]["w"], src["model"]["w"])
        assert torch.equal(theirs["model"]["b"], src["model"]["b"])

    small = {k: v for k, v in target().items() if k == "optim"}
    small["model"] = {"b": torch.zeros(32)}
    reader = _RecordingReader(storage, d, expected)
    reader.threads = {}
    load_verified(small, reader)
    assert set(reader.threads) == {"__0_1.distcp"}
    assert torch.equal(small["model"]["b"], src["model"]["b"]) and small["optim"]["lr"] == 0.01

    path = f"{d}/__0_1.distcp"
    bad = bytearray(storage.read_bytes(path))
    bad[len(bad) // 2] ^= 0x01
    storage.write_bytes(path, bytes(bad))
    small = {k: v for k, v in target().items() if k == "optim"}
    with pytest.raises(IntegrityError, match=re.escape(path)):
        load_verified(small, VerifyingStorageReader(storage, d, expected))


def test_files_read_into_memory_in_parallel_stay_within_the_budget(storage, monkeypatch):
    """Mapped files cost no memory to read at once; files read into memory (object stores,
    encryption) do, and are read one at a time once two would pass PARALLEL_READ_BYTES."""
    from raycheckpoint._internal.dcp import reader as dcp_read

    expected, source = _two_file_checkpoint(storage, "multi")
    largest = max(e.size for e in expected.values())
    monkeypatch.setattr(dcp_read, "PARALLEL_READ_BYTES", 2 * largest - 1)
    reader = _RecordingReader(storage, "multi", expected, parallel_files=4)
    reader.threads = {}
    target = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
              "optim": {"step": torch.tensor(0.0)}}
    load_verified(target, reader)
    assert torch.equal(target["model"]["w"], source["model"]["w"])
    pooled = [name for name in reader.threads.values() if name.startswith("raycheckpoint-load")]
    assert len(pooled) == (2 if storage.caps.local_paths else 0)
