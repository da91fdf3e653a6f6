"""What a load reads ahead of DCP, and where its bytes land.

* :func:`page_in`: a local data file read into the page cache ahead of the load's own
  reads (:meth:`~raycheckpoint._internal.dcp.reader.VerifyingStorageReader.prefetch`);
* :func:`overlapping_ranks`: which saved ranks' files a rank's load reads most of;
* :func:`receive_buffer`: the memory a file read whole (from an object store) lands in.
"""

from __future__ import annotations

import os
import threading

import torch

# how much of each data file a load reads into the page cache ahead of its own reads
# (VerifyingStorageReader.prefetch), in steps of PREFETCH_STEP: DCP's planning lasts
# 20-40 ms, and the load's reads follow right behind; a bound keeps a huge shard from
# crowding the page cache.  Where the kernel has to be asked with POSIX_FADV_WILLNEED, it
# reads at most the device's readahead window per call (8 MB on the test machines, often
# less elsewhere), so a step is no larger.
PREFETCH_BYTES = 1 << 30
PREFETCH_STEP = 8 << 20


def page_in(path: str, limit: int, stop: threading.Event) -> None:
    """Read ``path``'s first ``limit`` bytes into the page cache, :data:`PREFETCH_STEP`
    at a time, until ``stop`` is set.

    ``sendfile`` to ``/dev/null`` reads the file through the page cache and copies it
    nowhere: 250 MB took ~10 ms of CPU here, against ~90 ms read into a buffer.
    ``POSIX_FADV_WILLNEED`` alone is no substitute: the kernel caps each call at the
    device's readahead window (one call for a whole 250 MB file cached 8 MB of it).  It
    serves where ``sendfile`` is refused, one step per call.  Errors are left to the
    load, which reads every file itself.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # the load itself names a missing file
    offset = 0
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            while offset < limit and not stop.is_set():
                n = os.sendfile(null, fd, offset, min(PREFETCH_STEP, limit - offset))
                if n <= 0:
                    return  # the end of the file
                offset += n
        finally:
            os.close(null)
    except OSError:
        if hasattr(os, "posix_fadvise"):
            size = min(limit, os.fstat(fd).st_size)
            while offset < size and not stop.is_set():
                try:
                    os.posix_fadvise(fd, offset, PREFETCH_STEP, os.POSIX_FADV_WILLNEED)
                except OSError:
                    return
                offset += PREFETCH_STEP
    finally:
        os.close(fd)


def overlapping_ranks(rank: int, world_size: int, saved_world_size: int) -> range:
    """The saved ranks whose share of an evenly split dimension overlaps ``rank``'s.

    That is FSDP's layout (each parameter split on dim 0): the saved ranks whose files a
    load into ``world_size`` ranks reads most of; their own rank alone when the world
    size is unchanged.
    """
    if world_size <= 0 or saved_world_size <= 0:
        return range(0)
    lo = rank * saved_world_size // world_size
    hi = -(-(rank + 1) * saved_world_size // world_size)
    return range(lo, min(hi, saved_world_size))


def receive_buffer(size: int) -> memoryview:
    """Writable memory of ``size`` bytes for a file read whole (an object's body streams
    into it), its pages already in place.

    ``bytearray(size)`` zero-fills its memory with the GIL held, page-faulting every page
    in: 45-100 ms for 60 MB on a 2-core test machine, during which the load's other reader
    threads could not start and the S3 client's event loop could not receive (a resharded
    load's four files began over ~100 ms, one after another; ``mmap`` with
    ``MAP_POPULATE`` holds the GIL too).  torch fills its tensor with the GIL released and
    on all intra-op threads: ~20 ms.  The memory lives as long as a view of it does.
    """
    return memoryview(torch.zeros(size, dtype=torch.uint8).numpy())
