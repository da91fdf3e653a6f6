"""The coordinator in one process (no Ray): what ``begin`` reads from storage.

``begin`` runs in training's blocked time, and on an object store a directory listing is
a request of its own.  It must still clear what an aborted attempt left in the step
directory it hands out, so the coordinator keeps the step directories that may hold
files without a marker and lists only those.
"""

from __future__ import annotations

import pytest

from raycheckpoint import CheckpointConfig
from raycheckpoint.protocol.coordinator import CheckpointCoordinator
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


def test_begin_lists_storage_only_where_an_aborted_save_may_have_left_files(spec):
    coordinator, listed = _coordinator(spec)
    st: Storage = coordinator.storage
    begun = _begin(coordinator, 1)
    assert listed == []  # nothing unmarked since the coordinator's own listing
    _write_and_report(coordinator, begun, b"one")
    coordinator.wait(begun["save_id"], 30)

    # an attempt at step 2 writes part of its files, then aborts
    begun = _begin(coordinator, 2)
    st.write_bytes("step_00000002/actor/__1_0.distcp", b"half-written")
    coordinator.abort(begun["save_id"], "a rank failed")
    with pytest.raises(Exception, match="a rank failed"):
        coordinator.wait(begun["save_id"], 30)

    listed.clear()
    begun = _begin(coordinator, 2)  # the same step again: its leftover is cleared first
    assert listed == ["step_00000002"]
    assert not st.exists("step_00000002/actor/__1_0.distcp")
    _write_and_report(coordinator, begun, b"two")
    assert coordinator.wait(begun["save_id"], 30)["name"] == "step_00000002"
    coordinator.wait_cleanup(30)

    listed.clear()
    _begin(coordinator, 3)  # committed and cleaned: nothing to list
    assert listed == []


def test_a_leftover_kept_by_the_grace_period_is_cleared_when_its_step_is_saved(spec):
    coordinator, listed = _coordinator(spec)
    st: Storage = coordinator.storage
    # written within the grace period: kept by gc (a job it does not know may be writing)
    st.write_bytes("step_00000006/actor/__1_0.distcp", b"recent")
    assert coordinator.gc(leftover_grace_s=3600)["kept_recent"] == ["step_00000006"]
    listed.clear()
    begun = _begin(coordinator, 6)
    assert listed == ["step_00000006"]
    assert not st.exists("step_00000006/actor/__1_0.distcp")
    _write_and_report(coordinator, begun, b"six")
    assert coordinator.wait(begun["save_id"], 30)["name"] == "step_00000006"
