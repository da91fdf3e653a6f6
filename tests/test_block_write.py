"""A block written while its host copy fills it, a chunk at a time as each becomes final
(raycheckpoint._internal.overlapped_write), with O_DIRECT where the filesystem has it;
on two real ranks: ``test_overlapped_write.py``."""

from __future__ import annotations

import pytest

from raycheckpoint.integrity import digest
from raycheckpoint.storage import Storage
from tests.test_direct_io import direct_supported


def test_a_block_is_written_while_its_copy_fills_it(tmp_path, monkeypatch):
    """A block that a host copy fills front to back (copies given in any order) goes to
    the device a chunk at a time, from its own memory, as each chunk becomes final: the
    first chunk is on the device before the copy has filled the rest.  Hashing waits for
    the copy's end and its release (the persist's start).  Bytes and checksum are a plain
    write's; a failed copy fails the write with none of its writes left running, and
    nothing of the file hashed."""
    import mmap
    import os
    import threading
    import time

    import numpy as np
    import torch

    from raycheckpoint._internal import overlapped_write as write_ahead
    from raycheckpoint._internal.overlapped_write import CopyFailed, CopyOrder
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
    st = Storage(str(tmp_path))

    def run(name: str, fail: bool) -> tuple:
        written.clear()
        source = torch.frombuffer(bytearray(os.urandom(n)), dtype=torch.uint8)
        flat = torch.frombuffer(block, dtype=torch.uint8)
        spans = [(0, chunk), (chunk, 2 * chunk + 100), (2 * chunk + 100, n)]
        copies = [(flat[a:b], source[a:b]) for a, b in reversed(spans)]
        order = CopyOrder(copies, [view])
        ordered, progress = order.apply(copies)
        assert [d.data_ptr() for d, _ in ordered] == [flat[a:b].data_ptr() for a, b in spans]
        assert order.apply(copies[:1]) is None and order.apply(copies[::-1]) is None
        # each copy waits for the test's go before the progress's own loop makes it
        go = [threading.Event() for _ in ordered]
        index = {id(d): i for i, (d, _) in enumerate(ordered)}

        def gated(pairs):
            for d, src in pairs:
                i = index[id(d)]
                assert go[i].wait(20)
                if fail and i == 1:
                    raise RuntimeError("copy failed")
                d.copy_(src)

        monkeypatch.setattr(write_ahead, "copy_tensors", gated)
        copy_error: list = []

        def copy() -> None:
            try:
                progress.copy(ordered)
            except RuntimeError as e:
                copy_error.append(e)

        copier = threading.Thread(target=copy)
        copier.start()
        hashed: list[int] = []
        w = st.open_write(name, direct=True)
        real_hasher = w._sink.file._hasher

        class Recording:
            def update(self, data):
                hashed.append(memoryview(data).nbytes)
                real_hasher.update(data)

        w._sink.file._hasher = Recording()
        outcome: list = []

        def write() -> None:
            try:
                outcome.append(w.write_as_filled(view, lambda k: progress.wait(0, k, 30),
                                                 lambda: progress.wait_hashing(30)))
                w.close()
            except BaseException as e:  # noqa: BLE001 - the test reads it
                outcome.append(e)
                w.abort()

        writer = threading.Thread(target=write)
        writer.start()
        go[0].set()
        deadline = time.monotonic() + 20
        while not written and time.monotonic() < deadline:
            time.sleep(0.01)
        # the first chunk went out before the copy filled the rest; nothing hashed yet
        assert written[:1] == [("caller", chunk)] and not hashed
        for event in go[1:]:
            event.set()
        copier.join(30)
        assert len(copy_error) == fail
        if not fail:
            while len(written) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            # every whole page written, none hashed: hashing waits for its release
            assert len(written) == 4 and not hashed and writer.is_alive()
            progress.release()
        writer.join(30)
        return outcome, source, hashed, w

    outcome, source, hashed, w = run("s/filled.bin", fail=False)
    assert outcome == [n]
    expected = source.numpy().tobytes()
    assert (tmp_path / "s" / "filled.bin").read_bytes() == expected
    assert w.entry.digest == digest.of(expected, "blake3") and w.entry.size == n
    # whole pages from the block; the last partial page (904 bytes) through a buffer
    assert [src for src, _ in written] == ["caller"] * 4 + ["bounce"], written
    assert sum(hashed) == n

    outcome, _, hashed, w = run("s/failed.bin", fail=True)
    assert isinstance(outcome[0], CopyFailed) and w.error is outcome[0]
    assert w._sink.file._in_flight is None and not hashed


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
    assert w.write_as_filled(memoryview(block), lambda k: None, lambda: None) == n
    entry = w.close()
    assert waited == [True] * chunks
    assert (tmp_path / "s" / "early.bin").read_bytes() == data
    assert entry.digest == digest.of(data, "blake3") and entry.size == n
