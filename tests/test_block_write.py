"""A data file staged whole, written early from its block once the host copy has filled
it (raycheckpoint._internal.overlapped_write), a chunk at a time with O_DIRECT where the
filesystem has it; on two real ranks: ``test_overlapped_write.py``."""

from __future__ import annotations

import pytest

from raycheckpoint.integrity import digest
from raycheckpoint.storage import Storage
from tests.test_direct_io import direct_supported


def test_an_early_write_starts_once_its_copy_is_over(tmp_path, monkeypatch):
    """A data file's early write (an ``OverlappedWrite`` on its lane) touches nothing
    while the snapshot's copy runs: no step directory asked for, no file opened, nothing
    written, so the copy (training's blocked time) has the host to itself.  Once the copy
    is over, the block goes to the device a chunk at a time from its own memory (the last
    partial page through a buffer), and hashing waits for its release (the persist's
    start).  Bytes and checksum are a plain write's; a failed copy leaves no file, nothing
    written and nothing hashed."""
    import mmap
    import os
    import threading
    import time

    import numpy as np
    import torch

    from raycheckpoint._internal import overlapped_write as write_ahead
    from raycheckpoint._internal.lanes import Lane
    from raycheckpoint._internal.overlapped_write import CopyFailed, CopyProgress, OverlappedWrite
    from raycheckpoint.storage import direct_io

    if not direct_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    chunk = direct_io.DIRECT_CHUNK
    n = 3 * chunk + 5000
    block = mmap.mmap(-1, 4 * chunk)
    view = memoryview(block)[:n]
    start = np.frombuffer(block, dtype=np.uint8).ctypes.data
    written: list[tuple[str, int]] = []  # (from, bytes) per device write
    real_write_out = direct_io.DirectFile._write_out

    def recording(self, buf, length):
        at = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        written.append(("caller" if start <= at < start + len(block) else "bounce", length))
        return real_write_out(self, buf, length)

    monkeypatch.setattr(direct_io.DirectFile, "_write_out", recording)
    events: list[str] = []  # what the early write did, in order
    hashed: list[int] = []

    class Watched:  # the storage the early write gets: opens and hashing recorded
        def __init__(self) -> None:
            self.real = Storage(str(tmp_path))

        def open_write(self, rel, **kw):
            events.append("open")
            w = self.real.open_write(rel, **kw)
            real_hasher = w._sink.file._hasher

            class Recording:
                def update(self, data):
                    hashed.append(memoryview(data).nbytes)
                    real_hasher.update(data)

            w._sink.file._hasher = Recording()
            return w

        def delete(self, rel):
            self.real.delete(rel)

    def dcp_dir() -> str:
        events.append("named")
        return "s"

    lane = Lane("test-early-write")
    lane.start()

    def run(fail: bool) -> tuple:
        for seen in (written, events, hashed):
            seen.clear()
        source = torch.frombuffer(bytearray(os.urandom(n)), dtype=torch.uint8)
        flat = torch.frombuffer(block, dtype=torch.uint8)
        copies = [(flat[a:b], source[a:b]) for a, b in ((0, chunk), (chunk, n))]
        go = threading.Event()

        def gated(pairs):
            pairs[0][0].copy_(pairs[0][1])  # the first chunk final, the copy still running
            assert go.wait(20)
            if fail:
                raise RuntimeError("copy failed")
            for d, src in pairs[1:]:
                d.copy_(src)

        monkeypatch.setattr(write_ahead, "copy_tensors", gated)
        progress = CopyProgress()
        early = OverlappedWrite([("f.bin", view)], progress, 30.0)
        early.start(lane, Watched(), dcp_dir)
        copy_error: list = []

        def copy() -> None:
            try:
                progress.copy(copies)
            except RuntimeError as e:
                copy_error.append(e)

        copier = threading.Thread(target=copy)
        copier.start()
        time.sleep(0.3)  # the lane has long taken the job: it waits for the copy
        assert not events and not written and not hashed
        go.set()
        copier.join(30)
        assert len(copy_error) == fail
        deadline = time.monotonic() + 20
        if not fail:
            while len(written) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            # every whole page written, none hashed: hashing waits for its release
            assert events == ["named", "open"] and len(written) == 4 and not hashed
        entry = early.take("s/f.bin", view)  # as the persist's writer asks: releases hashing
        return entry, early, source

    entry, early, source = run(fail=False)
    expected = source.numpy().tobytes()
    assert (tmp_path / "s" / "f.bin").read_bytes() == expected
    assert entry.digest == digest.of(expected, "blake3") and entry.size == n
    # whole pages from the block; the last partial page (904 bytes) through a buffer
    assert [src for src, _ in written] == ["caller"] * 4 + ["bounce"], written
    assert sum(hashed) == n

    entry, early, _ = run(fail=True)
    assert entry is None and isinstance(early.error, CopyFailed)
    assert not events and not written and not hashed
    lane.close()


def test_an_early_write_never_waits_for_its_hashing(tmp_path, monkeypatch):
    """Once a block is filled, its chunks are all queued to the device, and hashing runs
    beside the queued writes: the disk is never left idle while the writing thread
    hashes.  Here each hash waits until every chunk has been written; a writer that
    hashed between two writes would hold up the writes it has not yet handed on."""
    import mmap
    import os
    import threading

    from raycheckpoint.storage import direct_io

    if not direct_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    chunks = 4
    n = chunks * direct_io.DIRECT_CHUNK
    block = mmap.mmap(-1, n)
    data = os.urandom(1 << 20) * (n >> 20)
    block.write(data)
    done = []
    all_written = threading.Event()
    real_write_out = direct_io.DirectFile._write_out

    def counting(self, buf, length):
        real_write_out(self, buf, length)
        done.append(length)
        if len(done) == chunks:
            all_written.set()

    monkeypatch.setattr(direct_io.DirectFile, "_write_out", counting)
    w = Storage(str(tmp_path)).open_write("s/early.bin", direct=True)
    real_hasher = w._sink.file._hasher
    waited: list[bool] = []

    class AfterTheWrites:
        def update(self, piece):
            waited.append(all_written.wait(5))
            real_hasher.update(piece)

    w._sink.file._hasher = AfterTheWrites()
    assert w.write_block(memoryview(block), lambda: None) == n
    entry = w.close()
    assert waited == [True] * chunks
    assert (tmp_path / "s" / "early.bin").read_bytes() == data
    assert entry.digest == digest.of(data, "blake3") and entry.size == n
