"""A job that lost its lease writes nothing more to its root: no ``LATEST``, tag, catalog
or verification, no delete (RootState checks the lease before each), even when the lease
is taken over in the middle of a commit, after ``COMMITTED``.  Ray-free: the commit's
own sequence (``mark_committed``) and RootState on local disk."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from raycheckpoint import LeaseLostError, Storage
from raycheckpoint.protocol.commit import mark_committed
from raycheckpoint.protocol.lease import Lease
from raycheckpoint.protocol.paths import COMMITTED, LATEST, LEASE
from raycheckpoint.protocol.root import RootState

pytestmark = pytest.mark.timeout(120)


def sealed(storage: Storage, name: str, step: int, tag: str | None = None):
    """A checkpoint's manifest written, and the marker that commits it (no data files)."""
    from raycheckpoint.protocol.format import Manifest, Marker
    from raycheckpoint.protocol.paths import CheckpointPaths

    manifest = Manifest(name=name, step=step, kind="full", files={}, roles={})
    data = manifest.to_bytes()
    entry = storage.write_bytes(CheckpointPaths(name).manifest, data)
    marker = Marker(name=name, step=step, kind="full", manifest_size=entry.size,
                    manifest_sha256=hashlib.sha256(data).hexdigest(), bytes=entry.size, tag=tag)
    return marker, manifest


def contents(storage: Storage) -> dict[str, bytes]:
    """Every file of a local root but the LEASE, with its bytes (a link: its target)."""
    out = {}
    for path in sorted(storage.list_files()):
        full = storage.full_path(path)
        if path != LEASE:
            out[path] = os.readlink(full).encode() if os.path.islink(full) else storage.read_bytes(path)
    return out


def test_a_lease_lost_after_committed_writes_no_latest_tag_or_catalog(local_root):
    """The lease is taken over while the commit stands between ``COMMITTED`` and
    ``LATEST`` (fault point ``coordinator.after_marker``): the commit fails naming the new
    holder, and neither ``LATEST``, the tag nor the catalog is written."""
    from raycheckpoint import testing

    storage = Storage(local_root)
    lease = Lease(storage, job_name="job-a").acquire()
    root = RootState(storage, lease.job_id)
    mark_committed(root, *sealed(storage, "step_00000001", 1), point="coordinator")
    second = sealed(storage, "step_00000002", 2, tag="best")
    before = contents(storage)
    outcome: dict[str, BaseException] = {}

    def commit_second() -> None:
        try:
            mark_committed(root, *second, point="coordinator")
        except BaseException as e:  # noqa: BLE001 - the outcome is what is tested
            outcome["error"] = e

    testing.arm("coordinator.after_marker", "hang:5")
    committing = threading.Thread(target=commit_second)
    committing.start()
    try:
        deadline = time.monotonic() + 4
        while not storage.exists(f"step_00000002/{COMMITTED}"):
            assert time.monotonic() < deadline, "COMMITTED never appeared"
            time.sleep(0.01)
        intruder = Lease(storage, job_name="intruder", takeover=True, wait_s=0).acquire()
        committing.join(30)
    finally:
        testing.disarm()
    assert isinstance(outcome.get("error"), LeaseLostError), outcome
    assert "intruder" in str(outcome["error"])
    after = contents(storage)
    assert after.pop(f"step_00000002/{COMMITTED}") == second[0].to_bytes()
    assert after == before  # LATEST, the catalog, tags/: as they were
    assert storage.read_bytes(LATEST).decode().strip() == "step_00000001"
    intruder.release()
    lease.release()


def test_every_write_of_a_root_state_checks_its_lease(local_root):
    """Under a lease taken over, each write to the root's shared state and each delete
    fails naming the new holder, and the root is left exactly as it was."""

    storage = Storage(local_root)
    lease = Lease(storage, job_name="job-a").acquire()
    root = RootState(storage, lease.job_id)
    for step in (1, 2):
        mark_committed(root, *sealed(storage, f"step_0000000{step}", step), point="coordinator")
    storage.write_bytes("step_00000003/actor/x", b"an aborted save's file")
    intruder = Lease(storage, job_name="intruder", takeover=True, wait_s=0).acquire()
    before = contents(storage)
    writes = {
        "LATEST": lambda: root.write_latest("step_00000001"),
        "a tag": lambda: root.write_tag("best", "step_00000001"),
        "the catalog": lambda: root.write_catalog([]),
        "a verification": lambda: root.record_verification("step_00000001", {"ok": True}),
        "a checkpoint's deletion": lambda: root.delete_step("step_00000001", set()),
        "a leftover's deletion": lambda: root.delete_step("step_00000003", set(), tombstone=True),
    }
    for what, write in writes.items():
        with pytest.raises(LeaseLostError, match="intruder"):
            write()
        assert contents(storage) == before, what
    intruder.release()
    lease.release()
