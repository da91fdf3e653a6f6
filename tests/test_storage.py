"""The storage contract, run over memory://, a local directory and the S3 server."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from raycheckpoint.integrity import digest
from raycheckpoint.storage import Storage


@pytest.fixture(params=["memory", "local", pytest.param("s3", marks=pytest.mark.s3)])
def storage(request, tmp_path):
    if request.param == "memory":
        return Storage(f"memory://rc-{uuid.uuid4().hex[:8]}")
    if request.param == "local":
        return Storage(str(tmp_path / "root"))
    s3_root, options = request.getfixturevalue("s3_root")
    return Storage(s3_root, options)


def test_write_read_hash_and_ranges(storage):
    data = bytes(range(256)) * 1000
    entry = storage.write_bytes("a/b/file.bin", data)
    assert entry.size == len(data)
    assert entry.digest == digest.of(data, "blake3")
    assert storage.read_bytes("a/b/file.bin") == data
    assert storage.read_bytes("a/b/file.bin", 10, 20) == data[10:20]
    assert storage.exists("a/b/file.bin") and storage.size("a/b/file.bin") == len(data)
    assert not storage.exists("a/b/nope")


def test_read_into_fills_the_buffer_or_says_the_size(storage, monkeypatch):
    from raycheckpoint.storage import base as storage_module

    monkeypatch.setattr(storage_module, "READ_STEP", 1000)  # several pieces
    data = bytes(range(256)) * 20
    storage.write_bytes("a/f", data)
    out = bytearray(len(data))
    assert storage.read_into("a/f", memoryview(out)) == len(data)
    assert out == data
    for wrong in (len(data) - 1, len(data) + 1, 0):  # the file's size, the buffer untouched
        out = bytearray(b"x" * wrong)
        assert storage.read_into("a/f", memoryview(out)) == len(data)
        assert out == b"x" * wrong
    with pytest.raises(FileNotFoundError):
        storage.read_into("a/nope", memoryview(bytearray(1)))


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_files_are_hashed_with_the_storages_algorithm_and_checked_by_their_own(tmp_path, algorithm):
    """BLAKE3 digests carry their name; sha256 ones are the bare hex format 1 wrote.  A
    digest is checked with the algorithm that made it, whatever the reader writes."""
    from raycheckpoint import IntegrityError
    from raycheckpoint.integrity.verify import verify_bytes, verify_file

    data = bytes(range(256)) * 999
    entry = Storage(str(tmp_path), checksum=algorithm).write_bytes("f.bin", data)
    if algorithm == "sha256":
        assert entry.digest == hashlib.sha256(data).hexdigest()
    else:
        import blake3

        assert entry.digest == "blake3:" + blake3.blake3(data).hexdigest()
    assert entry.algorithm == algorithm
    other = Storage(str(tmp_path), checksum="sha256" if algorithm == "blake3" else "blake3")
    verify_file(other, "f.bin", entry)
    verify_bytes("f.bin", data, entry, checksums=True)
    with pytest.raises(IntegrityError, match=f"f.bin: {algorithm} [0-9a-f]{{16}}... does not match"):
        verify_bytes("f.bin", data[:-1] + b"\0", entry, checksums=True)
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        Storage(str(tmp_path), checksum="md5")


def test_streaming_write_hashes_what_streams(storage):
    chunks = [b"x" * 1000, b"y" * 5000, memoryview(b"z" * 3)]
    with storage.open_write("s/stream.bin") as w:
        for c in chunks:
            w.write(c)
        assert w.tell() == 6003
    joined = b"".join(bytes(c) for c in chunks)
    assert w.entry.digest == digest.of(joined, "blake3")
    assert storage.read_bytes("s/stream.bin") == joined


def test_large_chunks_are_hashed_beside_the_write(storage):
    import os
    import threading

    from raycheckpoint.storage.writer import PARALLEL_HASH_BYTES

    big = os.urandom(PARALLEL_HASH_BYTES + 7)
    chunks = [b"head" * 10, big, memoryview(big)[5:], b"tail"]  # small, large, large, small

    def hashers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("raycheckpoint-hash")]

    before = hashers()
    with storage.open_write("s/large.bin") as w:
        w.write(chunks[0])
        assert hashers() == before  # small chunks are hashed in line
        for c in chunks[1:]:
            w.write(c)
        assert len(hashers()) == len(before) + 1
    assert hashers() == before  # the helper ends with the file
    joined = b"".join(bytes(c) for c in chunks)
    assert w.entry.size == len(joined)
    assert w.entry.digest == digest.of(joined, "blake3")
    assert storage.read_bytes("s/large.bin") == joined


@pytest.mark.parametrize("cap", [None, 4099])
def test_pieces_are_written_whole_and_hashed_in_order(storage, monkeypatch, cap):
    """write_many: one gathered write (os.writev per IOV_MAX pieces on POSIX) between plain
    writes; with the kernel writing at most ``cap`` bytes a call, every piece is still
    written whole, in order."""
    import os

    from raycheckpoint.storage import posix, writer

    if cap is not None:
        if not storage.caps.local_paths:
            pytest.skip("os.writev is the POSIX path")
        real = os.writev

        def short_writev(fd, buffers):
            head = b"".join(bytes(b) for b in buffers)[:cap]  # a partial write of the first bytes
            return real(fd, [head])

        monkeypatch.setattr(posix.os, "writev", short_writev)
    big = os.urandom(writer.PARALLEL_HASH_BYTES + 3)
    pieces = [bytes([i % 251]) * (i % 5) for i in range(2 * posix.IOV_MAX + 3)]  # empty ones too
    pieces[100] = memoryview(big)  # a large piece: hashed beside the write
    with storage.open_write("s/pieces.bin") as w:
        w.write(b"before")
        assert w.write_many(pieces) == sum(memoryview(p).nbytes for p in pieces)
        w.write(b"after")
        assert w.tell() == 11 + sum(memoryview(p).nbytes for p in pieces)
    joined = b"before" + b"".join(bytes(p) for p in pieces) + b"after"
    assert storage.read_bytes("s/pieces.bin") == joined
    assert w.entry.size == len(joined) and w.entry.digest == digest.of(joined, "blake3")


def test_list_and_delete(storage):
    for p in ("d/x/1", "d/x/2", "d/y", "e"):
        storage.write_bytes(p, p.encode())
    assert storage.list_dir("") == ["d", "e"]
    assert storage.list_dir("d") == ["x", "y"]
    assert storage.list_dir("missing") == []
    assert storage.list_files("d") == {"d/x/1": 5, "d/x/2": 5, "d/y": 3}
    storage.delete("d/y")
    storage.delete("d/y")  # deleting twice is fine
    assert storage.list_files("d") == {"d/x/1": 5, "d/x/2": 5}
    storage.delete_tree("d")
    storage.delete_tree("d")
    assert storage.list_files("d") == {}
    assert storage.list_dir("") == ["e"]


def test_pointer_is_replaced_whole(storage):
    storage.write_pointer("LATEST", b"step_00000001\n")
    storage.write_pointer("LATEST", b"step_00000002\n")
    assert storage.read_bytes("LATEST") == b"step_00000002\n"
    # no temp files left beside the pointer
    assert storage.list_dir("") == ["LATEST"]


def test_marker_is_exclusive(storage):
    storage.create_marker("step/COMMITTED", b"first")
    with pytest.raises(FileExistsError):
        storage.create_marker("step/COMMITTED", b"second")
    assert storage.read_bytes("step/COMMITTED") == b"first"
    assert storage.list_dir("step") == ["COMMITTED"]


def test_posix_latest_symlink(tmp_path):
    s = Storage(str(tmp_path))
    s.write_bytes("step_00000001/x", b"1")
    s.symlink("latest", "step_00000001")
    s.symlink("latest", "step_00000001")  # replacing is atomic and idempotent
    assert (tmp_path / "latest").resolve() == (tmp_path / "step_00000001").resolve()


def test_a_latest_that_is_no_link_is_left_alone_and_fails_nothing(tmp_path, caplog):
    """A root copied with its ``latest`` link followed has a directory there: pointing
    ``latest`` (a convenience for people) must not fail the commit that moves LATEST."""
    from raycheckpoint.protocol import catalog

    s = Storage(str(tmp_path / "root"))
    s.write_bytes("latest/COMMITTED", b"a copy of a checkpoint")
    catalog.write_latest(s, "step_00000002")
    assert catalog.read_latest(s) == "step_00000002"
    assert (tmp_path / "root" / "latest").is_dir() and "not a symbolic link" in caplog.text


def test_file_uri_and_plain_path_agree(tmp_path):
    a = Storage(f"file://{tmp_path}")
    b = Storage(str(tmp_path))
    a.write_bytes("f", b"data")
    assert b.read_bytes("f") == b"data" and a.caps.local_paths and b.caps.local_paths


def test_each_kind_of_uri_opens_its_backend(tmp_path):
    """Storage(uri) is the backend for the URI's kind, and a spec reopens the same kind;
    what a backend can do is what its capabilities say."""
    from raycheckpoint.storage.memory import MemoryStorage
    from raycheckpoint.storage.posix import LocalStorage
    from raycheckpoint.storage.s3 import S3Storage

    local = Storage(str(tmp_path / "a"))
    memory = Storage(f"memory://rc-{uuid.uuid4().hex[:8]}")
    s3 = Storage("s3://bucket/prefix", {"anon": True}, create=False)
    assert type(local) is LocalStorage and type(Storage(f"file://{tmp_path}")) is LocalStorage
    assert type(memory) is MemoryStorage and type(s3) is S3Storage
    # a kind without a backend of its own: the generic fsspec one (nothing is requested here)
    assert type(Storage("http://127.0.0.1:9/ckpt", create=False)) is Storage
    assert type(local.spec.open()) is LocalStorage and type(memory.spec.open()) is MemoryStorage
    assert type(local.spec.child("x").open()) is LocalStorage
    assert local.caps.local_paths and local.caps.atomic_create and local.writes_direct
    assert not memory.caps.shared and memory.caps.atomic_create  # one process's, under a lock
    assert not Storage("http://127.0.0.1:9/ckpt", create=False).caps.atomic_create
    assert s3.caps.atomic_create and not s3.caps.local_paths and not s3.writes_direct
    assert not Storage(str(tmp_path / "b"), direct_io=False).writes_direct


def test_a_job_refuses_a_root_only_its_own_process_sees():
    from raycheckpoint import CheckpointConfig, CheckpointManager

    with pytest.raises(ValueError, match="process-local"):
        CheckpointManager(CheckpointConfig(save_dir=f"memory://rc-{uuid.uuid4().hex[:8]}"), {})


def test_an_s3_root_without_s3fs_names_the_package_and_the_extra():
    """s3fs is the [s3] extra, not a requirement: without it an S3 root says what to install."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("from raycheckpoint import Storage, MissingDependencyError\n"
            "try:\n    Storage('s3://bucket/job')\nexcept MissingDependencyError as e:\n    print(e)\n")
    done = subprocess.run(["bash", "scripts/without.sh", "s3fs", "--", sys.executable, "-c", code],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "s3://bucket/job" in done.stdout and "raycheckpoint[s3]" in done.stdout, done.stdout
