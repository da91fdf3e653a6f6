"""Background verification: a committed checkpoint re-read from storage by a process that
wrote none of it.

``checkpoint.verify_every=N`` (or ``verify_after_save``) has the coordinator hand every
Nth committed checkpoint to a :class:`CheckpointVerifier` actor (started on first use,
``num_cpus=0``, one thread at the idle scheduling class, so that it runs on CPU time
training leaves idle).  :func:`verify_committed` checks, in order:

1. the marker, the manifest and ``version.json`` (:func:`open_verified`);
2. every file of the manifest, streamed and hashed against its checksum (assets, RNG
   files and every role's DCP directory included);
3. each role's DCP metadata (through the restricted unpickler: a forged one is refused,
   nothing it names runs), every tensor it lists assembled on CPU from its chunks and
   every non-tensor item unpickled weights-only (what a load deserializes, with no
   training state touched), and each rank's extra state file unpacked.

Two outcomes, kept apart:

* **failed** (``ok: False`` with the reason): anything wrong with the checkpoint's own
  bytes: a missing or corrupt file, a pickle refused, a record, a msgpack or a struct
  that does not decode, whatever type of error that raises;
* **could not run** (:func:`verify_committed` raises; nothing is recorded): the store
  could not be read: a transient storage error that outlasted the storage's retries,
  a connection error, access denied (:func:`could_not_run`).  A verifier that dies or
  hangs is the same to the coordinator
  (:mod:`~raycheckpoint.protocol.verification`).

An encrypted checkpoint is verified with the job's key, in memory: nothing plaintext is
written anywhere.  The coordinator records a result (``verification.json`` and the
catalog: ``raycheckpoint ls`` shows "verified <age> ago"), the manager publishes it as a
metric and warns about a failure, ``auto`` resume skips a checkpoint that failed, and
retention keeps the newest one that passed.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from raycheckpoint._internal import exit as process_exit
from raycheckpoint._internal import faults
from raycheckpoint.errors import RayCheckpointError
from raycheckpoint.integrity.verify import read_verified, verify_files
from raycheckpoint.protocol.checkpoint import open_verified
from raycheckpoint.storage import Storage, StorageSpec
from raycheckpoint.storage.retry import is_transient

logger = logging.getLogger(__name__)


# packages whose errors are about talking to a store, never about a checkpoint's bytes
_STORE_CLIENTS = frozenset({"botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "s3fs",
                            "gcsfs", "adlfs", "azure"})


def could_not_run(e: BaseException) -> bool:
    """Whether ``e``, raised while verifying, says the store could not be read (the
    verification could not run) rather than that the checkpoint's bytes are bad: a
    transient storage error (after the storage's own retries: connection errors,
    timeouts, throttling, 5xx, I/O errors), any error of the store's client library,
    access denied, or memory exhausted."""
    if isinstance(e, RayCheckpointError):
        return False  # raised on purpose about the checkpoint (missing, corrupt, refused)
    return (isinstance(e, (PermissionError, MemoryError)) or is_transient(e)
            or type(e).__module__.split(".")[0] in _STORE_CLIENTS)


def verify_committed(storage: Storage, name: str) -> dict[str, Any]:
    """Verify committed checkpoint ``name`` completely.

    Returns ``{"name", "step", "ok", "verified_at", "seconds", "checks", "error"?}``: ``ok``
    False, with the error, for anything wrong with the checkpoint's own bytes, whatever
    type of error decoding them raised.  Raises (the verification could not run) only
    where :func:`could_not_run` says the store could not be read.
    """
    from raycheckpoint.export import RoleReader  # torch: only in the verifier's process
    from raycheckpoint.state import decode_rank_state

    t0 = time.perf_counter()
    checks: list[str] = []
    step = None
    where = name  # what is being read: named in an error that names no file itself
    try:
        ck = open_verified(storage, name)
        step = ck.step
        checks.append("marker, manifest and version")
        verify_files(storage, ck.manifest.files, threads=1)
        checks.append(f"{len(ck.manifest.files)} files' checksums "
                      f"({ck.manifest.total_bytes / 1e6:.1f} MB)")
        tensors = items = extras = 0
        for role, layout in sorted(ck.manifest.roles.items()):
            reader = RoleReader(ck, role)
            where = reader.dcp_dir
            if reader.has_tensors:
                for info in reader.tensors():
                    reader.read(info)
                    tensors += 1
                for fqn in reader.other_items():
                    reader.read_item(fqn)
                    items += 1
            for rank in range(layout.world_size):
                rel = where = ck.paths.rng(role, rank)
                if rel in ck.manifest.files:
                    decode_rank_state(rel, read_verified(storage, rel, ck.manifest.files[rel],
                                                         decrypt=True))
                    extras += 1
        checks.append(f"{tensors} tensors of {len(ck.manifest.roles)} role(s) deserialized")
        checks.append(f"{items} non-tensor item(s) unpickled (weights-only)")
        checks.append(f"{extras} rank state file(s) unpacked")
        error = None
    except Exception as e:  # sorted below: the checkpoint's fault, or the store's
        if could_not_run(e):
            raise
        error = f"{type(e).__name__}: {e}"
        if getattr(e, "path", None) is None:
            error = f"{where}: {error}"
    result: dict[str, Any] = {"name": name, "step": step, "ok": error is None,
                              "verified_at": time.time(),
                              "seconds": round(time.perf_counter() - t0, 3), "checks": checks}
    if error is not None:
        result["error"] = error
    return result


def _idle_priority() -> None:
    """Run this thread (and the threads it starts) only on CPU time nothing else wants."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: the lowest nice level instead
        try:
            os.nice(19 - os.nice(0))
        except OSError:
            logger.debug("cannot lower the verifier's priority", exc_info=True)


class CheckpointVerifier:
    """The Ray actor that verifies committed checkpoints of one root (see the module doc)."""

    def __init__(self, spec: StorageSpec) -> None:
        process_exit.install()  # never hang in Ray's C++ teardown (_internal/exit.py)
        self.storage = spec.open()

    def verify(self, name: str) -> dict[str, Any]:
        faults.check("verifier.verify", path=name)
        _idle_priority()
        import torch

        torch.set_num_threads(1)  # one core at most, and only when training leaves it idle
        result = verify_committed(self.storage, name)
        log = logger.info if result["ok"] else logger.warning
        log("verification of %s: %s", name, "passed" if result["ok"] else result["error"])
        return result


def start(spec: StorageSpec) -> Any:
    import ray

    return ray.remote(CheckpointVerifier).options(num_cpus=0).remote(spec)

