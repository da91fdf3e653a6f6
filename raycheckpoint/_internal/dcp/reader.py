"""torch DCP StorageReader over :class:`~raycheckpoint.storage.Storage`, verifying
what it reads: the checkpoints :mod:`~raycheckpoint._internal.dcp.writer` writes.

* The reader checks every file it opens against the verified manifest (presence,
  size, checksum), and a flipped bit raises :class:`~raycheckpoint.errors.IntegrityError`
  naming the file.  Every pickle is unpickled once verified, and only through
  :mod:`~raycheckpoint._internal.dcp.safe_pickle` (a re-sealed checksum proves nothing).
  A local data file's checksum is computed in a helper thread while its tensors are
  copied out (non-tensor items wait for the check), and checked before the load returns;
* where the storage has local paths a data file is memory-mapped and each tensor is copied straight from the
  mapping into its destination: no per-item buffer, no intermediate tensor, and for a
  record of the layout the metadata names no zip parsing either
  (:mod:`~raycheckpoint._internal.dcp.torch_records`);
* elsewhere (object stores) a data file's body streams into one buffer of its listed size
  (:meth:`~raycheckpoint.storage.Storage.read_into`), which is verified before anything
  is copied out of it; :meth:`VerifyingStorageReader.prefetch` starts reading the files a
  rank's load needs while DCP plans.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import mmap
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    LoadPlan,
    LoadPlanner,
    Metadata,
    StorageReader,
)
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from raycheckpoint._internal.dcp import read_ahead
from raycheckpoint._internal.dcp.load_plan import copy_run
from raycheckpoint._internal.dcp.read_ahead import page_in, receive_buffer
from raycheckpoint._internal.dcp.safe_pickle import load_item, load_metadata
from raycheckpoint._internal.dcp.torch_records import load_record, record_data_offset, record_tensor
from raycheckpoint._internal.dcp.writer import DCP_SUFFIX
from raycheckpoint.errors import IntegrityError
from raycheckpoint.integrity import digest
from raycheckpoint.integrity.verify import check_digest, check_size, missing, read_verified
from raycheckpoint.protocol.paths import dcp_metadata
from raycheckpoint.storage import FileEntry, Storage
from raycheckpoint.storage.direct_io import address

# what a rank's parallel reads may hold in memory at once where files are not mapped
PARALLEL_READ_BYTES = 4 << 30
class VerifyingStorageReader(StorageReader):
    """Reads a DCP directory, checking each file against the manifest before use."""

    def __init__(self, storage: Storage, dcp_dir: str, expected: Mapping[str, FileEntry],
                 *, checksums: bool = True, parallel_files: int = 4,
                 hash_threads: int = digest.AUTO) -> None:
        super().__init__()
        self.storage = storage
        self.dcp_dir = dcp_dir.rstrip("/")
        self.expected = expected
        self.checksums = checksums
        # a load blocks training: a BLAKE3 file hash may use every core (sha256 uses one)
        self.hash_threads = hash_threads
        self.parallel_files = max(1, parallel_files)
        self.storage_data: dict[Any, Any] = {}
        self._metadata: Metadata | None = None
        self._prefetch_stop: threading.Event | None = None
        # object stores: files read whole ahead of the load's own reads (prefetch)
        self._fetched: dict[str, concurrent.futures.Future[memoryview]] = {}
        self._fetch_pool: ThreadPoolExecutor | None = None
        # the files read whole and checked against the manifest (checksums unless off)
        self.verified: set[str] = set()

    def _read_verified(self, rel: str) -> bytes:
        """A small file (``.metadata``) read whole, verified and decrypted."""
        return read_verified(self.storage, rel, self.expected.get(rel), checksums=self.checksums,
                             decrypt=True)

    def _record(self, rel: str, blob: memoryview, req: Any) -> memoryview:
        info: _StorageInfo = self.storage_data[req.storage_index]
        if info.transform_descriptors:
            raise IntegrityError(f"{rel}: uses DCP stream transforms {info.transform_descriptors}, "
                                 "which this reader does not support", path=rel)
        if info.offset < 0 or info.length < 0 or info.offset + info.length > len(blob):
            raise IntegrityError(f"{rel}: item {req.storage_index.fqn} lies outside the file",
                                 path=rel)
        return blob[info.offset:info.offset + info.length]

    def _chunk_layout(self, index: Any) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """The dtype and sizes of the saved chunk ``index`` names, from the metadata."""
        md = self._metadata.state_dict_metadata.get(index.fqn) if self._metadata else None
        if not isinstance(md, TensorStorageMetadata):
            return None
        chunks = md.chunks
        at = index.index
        if at is None or not 0 <= at < len(chunks) or chunks[at].offsets != index.offset:
            at = next((i for i, c in enumerate(chunks) if c.offsets == index.offset), None)
        return None if at is None else (md.properties.dtype, tuple(chunks[at].sizes))

    def _load_tensor(self, rel: str, blob: memoryview, req: Any, planner: LoadPlanner,
                     base: int | None = None) -> None:
        """Copy tensor item ``req`` out of ``blob`` (``base``: its address, where the
        planner resolves targets as DCP's default one does) into its target."""
        record = self._record(rel, blob, req)
        layout = self._chunk_layout(req.storage_index)
        if base is not None and layout is not None:
            at = record_data_offset(record, *layout)
            if at is not None and copy_run(
                    planner.lookup_tensor(req.dest_index), *layout, req,
                    base + self.storage_data[req.storage_index].offset + at):
                return  # DCP's default planner commits nothing
        stored = record_tensor(record, *layout) if layout is not None else load_record(record)
        tensor = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
        del stored
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise IntegrityError(
                f"{rel}: item {req.storage_index.fqn} has shape {tuple(tensor.size())}, "
                f"expected {tuple(target.size())}", path=rel)
        target.copy_(tensor)
        del tensor  # it views the file's mapping, which closes after the last item
        planner.commit_tensor(req, target)

    @contextlib.contextmanager
    def _open_verified(self, rel: str) -> Iterator[memoryview]:
        """A data file's bytes as a writable view, checked against the manifest.

        Presence and size are checked before anything reads it.  A plain file on local
        disk is memory-mapped (copy-on-write, so the view is writable and nothing is
        faulted in beyond the file's pages); its checksum is computed in a helper thread
        (both hashes release the GIL) while the caller copies tensors out of the mapping, and
        checked when the caller is done: a mismatch raises IntegrityError, also when the
        caller failed first on the corrupt bytes.  Elsewhere (object stores) the file streams
        into a buffer of its listed size and is verified before use; with a cipher it is
        read, verified and decrypted first (:meth:`_whole_file`, or what :meth:`prefetch`
        started of it).
        """
        if self.storage.cipher is not None or not self.storage.caps.local_paths:
            fetched = self._fetched.pop(rel, None)
            yield self._whole_file(rel) if fetched is None else fetched.result()
            return
        try:
            f = open(self.storage.full_path(rel), "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError as e:
            raise missing(rel) from e
        with f:
            size = os.fstat(f.fileno()).st_size
            expected = check_size(rel, size, self.expected.get(rel))
            if size == 0:
                if self.checksums:
                    check_digest(rel, digest.like(b"", expected.digest), expected)
                yield memoryview(bytearray())
                return
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            view = memoryview(mapped)
            got: list[str] = []
            hasher = None
            if self.checksums:
                hasher = threading.Thread(
                    target=lambda: got.append(digest.like(view, expected.digest,
                                                          threads=self.hash_threads)),
                    name="raycheckpoint-load-hash", daemon=True)
                hasher.start()
            try:
                try:
                    yield view
                finally:
                    if hasher is not None:
                        hasher.join()  # the view is in use until the hash is done
                        if got:  # a mismatch wins over what the caller raised on the bytes
                            check_digest(rel, got[0], expected)
                if hasher is not None and not got:
                    raise IntegrityError(f"{rel}: could not hash the file", path=rel)
            finally:
                try:
                    view.release()
                    mapped.close()
                except BufferError:
                    # a tensor viewing the mapping is still referenced (by a traceback);
                    # the mapping closes when that goes
                    pass

    def _whole_file(self, rel: str) -> memoryview:
        """``rel`` read whole, verified (and decrypted, with a cipher), as a writable view."""
        if self.storage.cipher is not None:
            return memoryview(bytearray(self._read_verified(rel)))
        return self._read_into_verified(rel)

    def _read_into_verified(self, rel: str) -> memoryview:
        """``rel`` read into a buffer of the manifest's size (``Storage.read_into``: an
        object's body streams into it), checked against the manifest."""
        expected = self.expected.get(rel)
        if expected is None:
            check_size(rel, 0, None)  # raises: the manifest does not list it
        buf = receive_buffer(expected.size)
        try:
            size = self.storage.read_into(rel, buf)
        except FileNotFoundError as e:
            raise missing(rel) from e
        check_size(rel, size, expected)
        if self.checksums:
            check_digest(rel, digest.like(buf, expected.digest, threads=self.hash_threads), expected)
        self.storage.decrypted(rel, buf)  # no key here: raises if the file is encrypted
        return buf

    def prefetch(self, saved_ranks: Iterable[int]) -> threading.Thread | None:
        """Start reading the data files ``saved_ranks`` wrote: on local disk into the page
        cache, from an object store whole into memory (:meth:`_fetch_whole`).

        DCP plans a load before it reads anything: verifying and unpickling ``.metadata``
        and matching every item against the saved chunks take 20-40 ms at 788 items a
        rank, with the disk idle (~60 ms from S3, where ``.metadata`` is a round trip).
        Meanwhile up to ``parallel_files`` threads stream the files, each file's first
        :data:`~.read_ahead.PREFETCH_BYTES`, into the page cache
        (:func:`~.read_ahead.page_in`), and the load's reads then find them there or
        follow right behind.  Only a head start: the load reads and verifies every byte
        as before, a file not prefetched is read when the
        plan reaches it, and one prefetched in vain costs disk time and page cache,
        nothing else.  The reads stop at :meth:`stop_prefetch` (the end of the load).
        Returns the thread that waits for the page-cache reads, or None where there are
        none.
        """
        prefixes = tuple(f"{self.dcp_dir}/__{r}_" for r in saved_ranks)
        rels = [rel for rel in sorted(self.expected)
                if rel.startswith(prefixes) and rel.endswith(DCP_SUFFIX)]
        if not rels:
            return None
        if not self.storage.caps.local_paths:
            self._fetch_whole(rels)
            return None
        if not hasattr(os, "sendfile"):
            return None
        paths = [self.storage.full_path(rel) for rel in rels]
        stop = self._prefetch_stop = threading.Event()

        def run() -> None:
            with ThreadPoolExecutor(min(self.parallel_files, len(paths)),
                                    thread_name_prefix="raycheckpoint-load-prefetch") as pool:
                for path in paths:
                    pool.submit(page_in, path, read_ahead.PREFETCH_BYTES, stop)

        thread = threading.Thread(target=run, name="raycheckpoint-load-prefetch", daemon=True)
        thread.start()
        return thread

    def stop_prefetch(self) -> None:
        """End :meth:`prefetch`'s reads after their current step: a load that is over
        needs them no more, and one that failed should not leave the disk busy."""
        if self._prefetch_stop is not None:
            self._prefetch_stop.set()
        if self._fetch_pool is not None:  # a file being read finishes, unused
            self._fetch_pool.shutdown(wait=False, cancel_futures=True)
            self._fetch_pool = None
        self._fetched.clear()

    def _fetch_whole(self, rels: list[str]) -> None:
        """Read ``rels`` whole and verified, as :meth:`_open_verified` reads an object
        store's file, in ``parallel_files`` threads, while DCP reads ``.metadata`` and
        plans; the load's reads take them from there.  Files are started in order while
        their listed sizes fit :data:`PARALLEL_READ_BYTES` together (the rest are read
        when the plan reaches them).  A failed read raises where the load takes the file,
        as its own read would; one the plan never takes is dropped at :meth:`stop_prefetch`.

        Without it a resharded load's first read began after the ``.metadata`` round trip
        and the planning (~60 ms into a load from moto's S3 server here).  Loading two
        60 MB files and ``.metadata`` in one process, every request delayed 30 ms (as a
        remote store's first byte is), took 271 against 327 ms (medians of 7,
        alternated); from moto on 2 cores, with no delay and the reads bound by the
        server's CPU, the two were within noise.
        """
        budget = PARALLEL_READ_BYTES
        pool = self._fetch_pool = ThreadPoolExecutor(
            min(self.parallel_files, len(rels)), thread_name_prefix="raycheckpoint-load-fetch")
        for rel in rels:
            size = self.expected[rel].size
            if size > budget:
                break
            budget -= size
            self._fetched[rel] = pool.submit(self._whole_file, rel)

    def reset(self, checkpoint_id=None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            rel = dcp_metadata(self.dcp_dir)
            metadata = load_metadata(self._read_verified(rel), rel)  # no code it names runs
            self.verified.add(rel)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            self._metadata = metadata
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _read_file(self, file_name: str, reqs: list, planner: LoadPlanner) -> None:
        """Copy ``file_name``'s tensors out while it is verified; then apply its other items.

        Non-tensor items (a learning rate, betas) wait until the whole file has passed its
        check, and are then unpickled by torch's weights-only unpickler (:func:`_load_bytes`).
        """
        rel = f"{self.dcp_dir}/{file_name}"
        held: list[tuple[Any, bytearray]] = []
        # grad mode is per thread, so set here too: DTensor.to_local() is then an attribute
        # read (3 against 17 us through autograd), once per item
        with torch.no_grad(), self._open_verified(rel) as blob:
            base = address(blob) if len(blob) and _default_targets(planner) else None
            for req in reqs:
                if req.type == LoadItemType.BYTE_IO:
                    held.append((req, bytearray(self._record(rel, blob, req))))
                else:
                    self._load_tensor(rel, blob, req, planner, base)
        self.verified.add(rel)
        for req, record in held:  # the file verified (or checksums are off)
            _load_bytes(planner, req, load_item(record, rel, req.storage_index.fqn))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items, up to ``parallel_files`` files at once.

        A rank loading into fewer ranks than saved reads several files (two from R to R/2);
        each is read, hashed and copied out by a thread of its own (reads, hashing and tensor
        copies release the GIL), into disjoint parts of the destination tensors.  Every file
        is finished before this returns; an IntegrityError wins over any other failure.
        Where a file is read into memory rather than mapped (object stores, encryption), the
        files in flight together stay within ``PARALLEL_READ_BYTES``.
        """
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        # the files prefetch read (or is reading) first: they hold memory until taken
        per_file = dict(sorted(per_file.items(),
                               key=lambda kv: f"{self.dcp_dir}/{kv[0]}" not in self._fetched))
        workers = min(self.parallel_files, len(per_file))
        if workers > 1 and not (self.storage.caps.local_paths and self.storage.cipher is None):
            largest = max((e.size for e in (self.expected.get(f"{self.dcp_dir}/{name}")
                                            for name in per_file) if e is not None), default=0)
            workers = min(workers, max(1, PARALLEL_READ_BYTES // max(largest, 1)))
        if workers <= 1:
            for file_name, reqs in per_file.items():
                self._read_file(file_name, reqs, planner)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="raycheckpoint-load") as pool:
                futures = [pool.submit(self._read_file, file_name, reqs, planner)
                           for file_name, reqs in per_file.items()]
                errors = [e for e in (f.exception() for f in futures) if e is not None]
            if errors:
                raise next((e for e in errors if isinstance(e, IntegrityError)), errors[0])
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def _default_targets(planner: LoadPlanner) -> bool:
    """Whether ``planner`` finds, narrows and commits targets as DCP's default planner
    does, so that an item may be copied into its target without asking it
    (:func:`~raycheckpoint._internal.dcp.load_plan.copy_run`)."""
    kind = type(planner)
    return isinstance(planner, DefaultLoadPlanner) and all(
        getattr(kind, name) is getattr(DefaultLoadPlanner, name)
        for name in ("resolve_tensor", "lookup_tensor", "transform_tensor", "commit_tensor"))


def _load_bytes(planner: LoadPlanner, req: Any, value: Any) -> None:
    """Give ``planner`` the non-tensor item ``req``, unpickled (weights-only) as ``value``.

    DCP's planners take it as bytes for torch's full unpickler: a planner doing that as
    DCP's default one does gets ``value`` put where that one would; any other gets
    ``value`` pickled anew, so that its unpickler never sees the file's bytes."""
    if type(planner).load_bytes is not DefaultLoadPlanner.load_bytes:
        buf = io.BytesIO()
        torch.save(value, buf)
        planner.load_bytes(req, io.BytesIO(buf.getvalue()))
    elif planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[req.dest_index.fqn], value)
    else:
        planner.state_dict[req.dest_index.fqn] = value
