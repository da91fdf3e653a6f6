"""Background verification: a committed checkpoint re-read from storage by a process that
wrote none of it.

``checkpoint.verify_every=N`` (or ``verify_after_save``) has the coordinator hand every
Nth committed checkpoint to a :class:`CheckpointVerifier` actor (started on first use,
``num_cpus=0``, one thread at the idle scheduling class, so that it runs on CPU time
training leaves idle).  :func:`verify_committed` checks, in order:

1. the marker, the manifest and ``version.json`` (:func:`open_verified`);
2. every file of the manifest, streamed and hashed against its checksum (assets, RNG
   files and every role's DCP directory included);
3. each role's DCP metadata, and every tensor it lists assembled on CPU from its chunks
   (what a load deserializes, with no training state touched), and each rank's extra
   state file unpacked.

An encrypted checkpoint is verified with the job's key, in memory: nothing plaintext is
written anywhere.  The coordinator records the result (``verification.json`` and the
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
from raycheckpoint.protocol.format import unpack
from raycheckpoint.storage import Storage, StorageSpec

logger = logging.getLogger(__name__)


def verify_committed(storage: Storage, name: str) -> dict[str, Any]:
    """Verify committed checkpoint ``name`` completely; never raises for a bad checkpoint.

    Returns ``{"name", "step", "ok", "verified_at", "seconds", "checks", "error"?}``.
    """
    from raycheckpoint.export import RoleReader  # torch: only in the verifier's process

    t0 = time.perf_counter()
    checks: list[str] = []
    step = None
    try:
        ck = open_verified(storage, name)
        step = ck.step
        checks.append("marker, manifest and version")
        verify_files(storage, ck.manifest.files, threads=1)
        checks.append(f"{len(ck.manifest.files)} files' checksums "
                      f"({ck.manifest.total_bytes / 1e6:.1f} MB)")
        tensors = extras = 0
        for role, layout in sorted(ck.manifest.roles.items()):
            reader = RoleReader(ck, role)
            if reader.has_tensors:
                for info in reader.tensors():
                    reader.read(info)
                    tensors += 1
            for rank in range(layout.world_size):
                rel = ck.paths.rng(role, rank)
                if rel in ck.manifest.files:
                    unpack(read_verified(storage, rel, ck.manifest.files[rel], decrypt=True))
                    extras += 1
        checks.append(f"{tensors} tensors of {len(ck.manifest.roles)} role(s) deserialized")
        checks.append(f"{extras} rank state file(s) unpacked")
        error = None
    except (RayCheckpointError, OSError, ValueError, KeyError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
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

