"""Large local files written with O_DIRECT (raycheckpoint.storage.direct_io); a block
written while its host copy fills it: ``test_block_write.py``."""

from __future__ import annotations

import uuid

import pytest

from raycheckpoint.integrity import digest
from raycheckpoint.storage import Storage


def direct_supported(root) -> bool:
    import errno
    import os

    from raycheckpoint.storage.direct_io import O_DIRECT

    probe = os.path.join(str(root), f".probe-{uuid.uuid4().hex}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | O_DIRECT, 0o644))
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    return bool(O_DIRECT)



def _cached_pages(path) -> int:
    """How many of ``path``'s pages are in the page cache (mincore over a mapping)."""
    import ctypes
    import mmap
    import os

    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), size)  # mapping faults nothing in
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            anchor = ctypes.c_char.from_buffer(m)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            if libc.mincore(ctypes.addressof(anchor), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            del anchor
            return sum(b & 1 for b in vec)
        finally:
            m.close()


@pytest.mark.parametrize("direct_io", [True, False])
def test_direct_writes_are_the_same_bytes_and_bypass_the_page_cache(tmp_path, direct_io):
    """A data file written with O_DIRECT: across bounce-buffer boundaries, through both
    write paths, pieces of every size and a tail not a multiple of the alignment, the file
    holds exactly the bytes written, with their checksum, and none of them is cached."""
    import os

    from raycheckpoint.storage import direct_io as dio

    if not direct_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    st = Storage(str(tmp_path), direct_io=direct_io)
    chunk = dio.DIRECT_CHUNK
    pieces = [os.urandom(n) for n in (3, 4096, chunk - 10, 70_000, 1, chunk + 12_345, 0, 999)]
    with st.open_write("s/direct.bin", direct=True) as w:
        assert w.direct is direct_io
        w.write(b"head")
        w.write_many(pieces[:4])
        w.write(pieces[4])  # a plain write lands in the same buffer, in order
        w.write_many(pieces[5:])
        w.write(memoryview(b"tail" * 19))
        length = w.tell()
    path = tmp_path / "s" / "direct.bin"
    cached = _cached_pages(path)
    assert (cached == 0) if direct_io else (cached > 0)
    expected = b"head" + b"".join(pieces) + b"tail" * 19
    assert length == len(expected) == w.entry.size == os.path.getsize(path)
    assert path.read_bytes() == expected
    assert w.entry.digest == digest.of(expected, "blake3")
    with st.open_write("s/empty.bin", direct=True) as w:
        pass
    assert path.with_name("empty.bin").read_bytes() == b"" and w.entry.size == 0


def test_direct_writes_fall_back_where_the_filesystem_refuses_them(tmp_path, monkeypatch):
    """A filesystem that opens with O_DIRECT but refuses the writes (EINVAL) gets the
    file buffered from there on, the same bytes; one that cannot open it, from the start."""
    import errno
    import os

    from raycheckpoint.storage import direct_io

    if not direct_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    real_write = os.write

    def refusing_write(fd, data):
        if direct_io.fcntl.fcntl(fd, direct_io.fcntl.F_GETFL) & direct_io.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_io.os, "write", refusing_write)
    data = os.urandom(direct_io.DIRECT_CHUNK + 5000)
    st = Storage(str(tmp_path))
    with st.open_write("s/a.bin", direct=True) as w:
        w.write_many([memoryview(data)])
    assert not w.direct and (tmp_path / "s" / "a.bin").read_bytes() == data
    monkeypatch.undo()

    real_open = os.open

    def no_direct_open(path, flags, *args):
        if flags & direct_io.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", no_direct_open)
    with st.open_write("s/b.bin", direct=True) as w:
        w.write(data)
    assert not w.direct and (tmp_path / "s" / "b.bin").read_bytes() == data
    assert w.entry.digest == digest.of(data, "blake3")


def test_direct_writes_copy_the_next_chunk_while_one_is_written(tmp_path, monkeypatch):
    """The caller copies the next chunk into the second bounce buffer while the device
    write of the first is still running; the file still holds the bytes in order."""
    import os
    import threading

    from raycheckpoint.storage import direct_io

    if not direct_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    real_write = os.write
    first_started, release = threading.Event(), threading.Event()
    calls = []

    def slow_first_write(fd, data):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            first_started.set()
            assert release.wait(30), "the test never released the first write"
        return real_write(fd, data)

    monkeypatch.setattr(direct_io.os, "write", slow_first_write)
    chunk = direct_io.DIRECT_CHUNK
    data = os.urandom(2 * chunk + 777)
    f = direct_io.DirectFile(str(tmp_path / "overlap.bin"))
    try:
        # the first chunk goes to the writer thread; the second is copied meanwhile
        f.write([memoryview(data)[:chunk + chunk // 2]])
        assert first_started.wait(30)
        assert not release.is_set() and f._in_flight is not None and f._fill == chunk // 2
        release.set()
        f.write([memoryview(data)[chunk + chunk // 2:]])
        f.close()
    finally:
        release.set()
    assert (tmp_path / "overlap.bin").read_bytes() == data
    assert calls[0].startswith("raycheckpoint-direct")  # the chunks were written by its thread


def test_a_page_aligned_piece_is_written_from_its_own_memory(tmp_path, monkeypatch):
    """A piece that starts on a page while the file so far is whole pages goes to the
    device from the caller's memory, its whole pages in chunk-sized writes with no copy;
    its last partial page, and what follows, through a bounce buffer.  ``write`` returns
    once the writes from the caller's memory are over; bytes and checksum are exact."""
    import mmap
    import os

    import numpy as np

    from raycheckpoint.storage import direct_io

    if not direct_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    chunk = direct_io.DIRECT_CHUNK
    block = mmap.mmap(-1, 3 * chunk)
    block[:] = os.urandom(len(block))
    start = np.frombuffer(block, dtype=np.uint8).ctypes.data
    sources: list[str] = []
    real_write_out = direct_io.DirectFile._write_out

    def recording(self, buf, length):
        at = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        sources.append("caller" if start <= at < start + len(block) else "bounce")
        return real_write_out(self, buf, length)

    monkeypatch.setattr(direct_io.DirectFile, "_write_out", recording)
    view = memoryview(block)
    pieces = [view[:2 * chunk + 5000], view[7:4103], view[4096:3 * chunk]]
    st = Storage(str(tmp_path))
    with st.open_write("s/aligned.bin", direct=True) as w:
        w.write_many(pieces[:1])
        assert w._sink.file._in_flight is None and w._sink.file._fill == 5000 - 4096
        w.write_many(pieces[1:])  # the file is no longer whole pages: through buffers
    expected = b"".join(bytes(p) for p in pieces)
    assert (tmp_path / "s" / "aligned.bin").read_bytes() == expected
    assert w.entry.digest == digest.of(expected, "blake3") and w.entry.size == len(expected)
    assert sources[:3] == ["caller"] * 3 and set(sources[3:]) == {"bounce"}, sources


def test_a_failed_background_direct_write_is_raised_with_its_cause(tmp_path, monkeypatch):
    """A device write that fails in the writer thread (a full disk) fails the file's next
    write or its close with that error; the bounce buffers go back and the file is closed."""
    import errno
    import os

    from raycheckpoint.storage import direct_io

    if not direct_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    real_write, writes = os.write, []

    def full_disk_on_second_write(fd, data):
        writes.append(fd)
        if len(writes) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    for buf in [direct_io._take_bounce(), direct_io._take_bounce()]:
        direct_io._give_bounce(buf)  # the pool holds the two a file uses
    pool = len(direct_io._bounce_free)
    monkeypatch.setattr(direct_io.os, "write", full_disk_on_second_write)
    st = Storage(str(tmp_path))
    data = os.urandom(3 * direct_io.DIRECT_CHUNK + 10)
    with pytest.raises(OSError) as raised, st.open_write("s/full.bin", direct=True) as w:
        w.write_many([memoryview(data)])
    assert raised.value.errno == errno.ENOSPC and w.error is raised.value
    assert len(direct_io._bounce_free) == pool
    path = str(tmp_path / "s" / "full.bin")
    assert path not in {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}
