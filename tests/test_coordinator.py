"""The coordinator in one process (no Ray): what ``begin`` reads from storage and which
step directory it hands out.

``begin`` runs in training's blocked time, and on an object store a directory listing is
a request of its own.  It never hands out a name an earlier attempt had (a writer of
that attempt may still be inside its write), so it needs no listing: the coordinator
keeps the step directories that may hold files without a marker, and a claim decides
the rest.
"""

from __future__ import annotations

import pytest

from raycheckpoint import CheckpointConfig
from raycheckpoint.protocol.checkpoint import verify_checkpoint
from raycheckpoint.protocol.coordinator import CheckpointCoordinator
from raycheckpoint.protocol.paths import CLAIM
from raycheckpoint.storage import Storage, StorageSpec


@pytest.fixture
def spec(storage_spec):
    return storage_spec


def _coordinator(spec: StorageSpec) -> tuple[CheckpointCoordinator, list[str]]:
    coordinator = CheckpointCoordinator(spec, CheckpointConfig(
        save_dir=spec.uri, storage_options=spec.options, commit_timeout_s=30))
    listed: list[str] = []
    real = coordinator.storage.list_dir

    def counted(path: str):
        listed.append(path)
        return real(path)

    coordinator.storage.list_dir = counted
    return coordinator, listed


def _begin(coordinator: CheckpointCoordinator, step: int) -> dict:
    return coordinator.begin(step=step, kind="full", tag=None, metrics={}, trainer_state={},
                             expected=[("actor", 0)], world_sizes={"actor": 1})


def _write_and_report(coordinator: CheckpointCoordinator, begun: dict, data: bytes) -> None:
    entry = coordinator.storage.write_bytes(f"{begun['name']}/actor/__0_0.distcp", data)
    coordinator.report(begun["save_id"], "actor", 0, [entry.to_dict()], None, 0.0)


def test_begin_never_hands_out_a_name_an_aborted_attempt_had_and_lists_nothing(spec):
    coordinator, listed = _coordinator(spec)
    st: Storage = coordinator.storage
    begun = _begin(coordinator, 1)
    assert listed == [] and begun["name"] == "step_00000001"
    assert st.exists(f"step_00000001/{CLAIM}")
    _write_and_report(coordinator, begun, b"one")
    coordinator.wait(begun["save_id"], 30)

    # an attempt at step 2 writes part of its files, then aborts
    aborted = _begin(coordinator, 2)
    st.write_bytes("step_00000002/actor/__0_0.distcp", b"half-written")
    coordinator.abort(aborted["save_id"], "a rank failed")
    with pytest.raises(Exception, match="a rank failed"):
        coordinator.wait(aborted["save_id"], 30)

    listed.clear()
    begun = _begin(coordinator, 2)  # the same step again: a directory of its own
    assert listed == []  # nothing listed in training's blocked time
    assert begun["name"] == f"step_00000002.{begun['save_id']}"
    _write_and_report(coordinator, begun, b"two")
    assert coordinator.wait(begun["save_id"], 30)["name"] == begun["name"]
    assert coordinator.wait_cleanup(30)["collected"] == ["step_00000002"]
    # the aborted attempt's files are gone; its claim stays, so that name is never reused
    assert sorted(st.list_files("step_00000002")) == [f"step_00000002/{CLAIM}"]
    # a writer of the aborted attempt that was still inside its write lands there, not in
    # the committed checkpoint, which verifies
    st.write_bytes("step_00000002/actor/__0_0.distcp", b"late zombie bytes")
    assert verify_checkpoint(st, begun["name"])["files"] >= 1

    listed.clear()
    assert _begin(coordinator, 3)["name"] == "step_00000003"
    assert listed == []


def test_a_leftover_of_a_job_it_does_not_know_is_neither_reused_nor_touched_by_begin(spec):
    coordinator, listed = _coordinator(spec)
    st: Storage = coordinator.storage
    # written within the grace period: kept by gc (a job it does not know may be writing)
    st.write_bytes("step_00000006/actor/__0_0.distcp", b"recent")
    assert coordinator.gc(leftover_grace_s=3600)["kept_recent"] == ["step_00000006"]
    listed.clear()
    begun = _begin(coordinator, 6)
    assert listed == [] and begun["name"] == f"step_00000006.{begun['save_id']}"
    assert st.read_bytes("step_00000006/actor/__0_0.distcp") == b"recent"
    _write_and_report(coordinator, begun, b"six")
    assert coordinator.wait(begun["save_id"], 30)["name"] == begun["name"]
    # this job holds the lease: after its commit the leftover is collected (it had no claim)
    assert coordinator.wait_cleanup(30)["collected"] == ["step_00000006"]
    assert not st.list_files("step_00000006")
