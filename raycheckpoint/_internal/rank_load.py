"""A rank's load: the ``ckpt_load`` remote method of
:class:`~raycheckpoint.worker.CheckpointableWorker`, as a mixin of its own.

The rank reads its part of a verified checkpoint through
:class:`~raycheckpoint._internal.dcp.reader.VerifyingStorageReader` (every byte checked
against the manifest, resharding when the world size changed), applies it through the
worker's ``ckpt_load_state_dict`` hook, then its extra state and RNG.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from raycheckpoint._internal.dcp.load import load_verified
from raycheckpoint._internal.dcp.read_ahead import overlapping_ranks
from raycheckpoint._internal.dcp.reader import VerifyingStorageReader
from raycheckpoint.errors import IntegrityError
from raycheckpoint.integrity.verify import read_verified
from raycheckpoint.protocol.paths import dcp_metadata
from raycheckpoint.state import decode_rank_state, restore_rng
from raycheckpoint.storage import FileEntry


class RankLoading:
    """``ckpt_load`` for a worker that has ``ckpt_role``, ``ckpt_rank``,
    ``ckpt_world_size``, a saver (``_saver()``) and the load hooks."""

    def ckpt_load(self, request: dict[str, Any]) -> dict[str, Any]:
        """Load this rank's part of a verified checkpoint (resharding if world size changed).

        ``request`` keys: ``dcp_dir``, ``files`` (path -> entry dict, this role's files from
        the manifest), ``checksums``, ``kind`` (what to load: ``full`` or ``light``),
        ``saved_world_size``, ``rng_file`` (path of this rank's extra state, or None),
        ``partial`` (keys the checkpoint lacks keep their values, and are listed, instead of
        failing the load), ``storage`` (a tiered job's other tier to read from; default:
        where this rank saves).  Returns what was skipped and the files read and checked.
        """
        saver = self._saver()
        saver.wait_previous(request.get("wait_timeout_s", 1800.0))
        storage = saver.storage if request.get("storage") is None else request["storage"].open()
        expected = {p: FileEntry.from_dict(e) for p, e in request["files"].items()}
        kind = request["kind"]
        rel = request.get("rng_file") if kind == "full" else None
        # from an object store the rank's small extra-state file is read beside the
        # tensors, not after them (a round trip: ~20 ms of a resharded load from moto);
        # from local disk it is read after them, in this thread
        beside = None if rel is None or storage.caps.local_paths else ThreadPoolExecutor(
            1, thread_name_prefix="raycheckpoint-load-extra")

        def read_extra() -> bytes:
            return read_verified(storage, rel, expected.get(rel),
                                 checksums=request["checksums"], decrypt=True)

        skipped: list[str] = []
        verified: set[str] = set()
        try:
            extra = read_extra if beside is None else beside.submit(read_extra)
            with torch.no_grad():  # as at a snapshot: the template's DTensors resolve cheaply
                template = self.ckpt_state_dict(kind)
            if dcp_metadata(request["dcp_dir"]) in expected:
                reader = VerifyingStorageReader(storage, request["dcp_dir"], expected,
                                                checksums=request["checksums"])
                reader.prefetch(overlapping_ranks(self.ckpt_rank, self.ckpt_world_size,
                                                  request["saved_world_size"]))
                absent = load_verified(template, reader, partial=request.get("partial", False))
                verified |= reader.verified
                if absent:
                    skipped.append(f"{self.ckpt_role}/{self.ckpt_rank}: {len(absent)} key(s) not "
                                   f"in the checkpoint, left as they were: {', '.join(absent[:8])}"
                                   + (f" and {len(absent) - 8} more" if len(absent) > 8 else ""))
                self.ckpt_load_state_dict(template, kind)
            elif template:
                raise IntegrityError(f"{request['dcp_dir']}: the checkpoint holds no tensors "
                                     f"for {self.ckpt_role}, which has state to load",
                                     path=request["dcp_dir"])
            if kind == "full":
                skipped += self._load_extra(request, rel, extra)
                if rel is not None:
                    verified.add(rel)
        finally:
            if beside is not None:
                beside.shutdown(wait=False, cancel_futures=True)
        return {"role": self.ckpt_role, "rank": self.ckpt_rank, "skipped": skipped,
                "verified": sorted(verified)}

    def _load_extra(self, request: dict[str, Any], rel: str | None,
                    read: Future[bytes] | Callable[[], bytes]) -> list[str]:
        """Apply this rank's extra state and RNG from file ``rel``, read (verified and
        decrypted) by ``read``: a future where its read was started beside the tensors."""
        if rel is None:
            return [f"{self.ckpt_role}/{self.ckpt_rank}: no saved rank state"]
        data = (read.result(timeout=request.get("wait_timeout_s", 1800.0))
                if isinstance(read, Future) else read())
        extra = decode_rank_state(rel, data)
        self.ckpt_load_extra_state(extra.get("state") or {})
        skipped = []
        if request["saved_world_size"] == self.ckpt_world_size:
            skipped += [f"{self.ckpt_role}/{self.ckpt_rank}: rng {s}"
                        for s in restore_rng(extra["rng"], rel)]
        else:
            skipped.append(f"{self.ckpt_role}/{self.ckpt_rank}: per-rank RNG (world size changed "
                           f"{request['saved_world_size']} -> {self.ckpt_world_size})")
        return skipped
