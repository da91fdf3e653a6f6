"""A save that fails on one rank (its write, its snapshot, its wait for ``begin``'s answer,
its report) fails alone: nothing of it is committed, ``LATEST`` stays, training goes on
and the next save is whole (FSDP2 worker groups on gloo, the coordinator actor, real
storage)."""

from __future__ import annotations

import pytest

from raycheckpoint import CheckpointSaveError, CommitTimeoutError, Storage
from raycheckpoint.protocol.paths import CLAIM, COMMITTED, LATEST
from tests.helpers import a_failed_save_then_a_whole_one, arm, disarm, manager, train

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_worker_failure_aborts_and_training_continues(backend, group2, local_root, request):
    root, options = (local_root, {}) if backend == "local" else request.getfixturevalue("s3_root")
    m = manager(root, {"actor": group2}, options)
    try:
        m.update(step=1)
        m.save_checkpoint().wait(120)
        arm(group2, "storage.write@actor/__1_", "raise", ranks=[1])
        try:
            m.update(step=2)
            h = m.save_checkpoint()
            with pytest.raises(CheckpointSaveError, match="injected fault") as err:
                h.wait(120)
            assert "actor/1" in err.value.failures or "actor/0" in err.value.failures
        finally:
            disarm(group2)
        st = Storage(root, options)
        assert not st.exists(f"step_00000002/{COMMITTED}")
        assert st.read_bytes(LATEST).decode().strip() == "step_00000001"
        train(group2, [5])  # training goes on
        m.update(step=3)
        assert m.save_checkpoint().wait(120)["name"] == "step_00000003"
        cleanup = m.wait_for_cleanup(60)  # leftovers are collected after the commit
        assert cleanup["collected"] == ["step_00000002"] and cleanup["error"] is None
        # the aborted save's leftovers were collected; its claim stays (a tombstone), so
        # no later save is handed the name a late writer of that attempt may write into
        assert sorted(st.list_files("step_00000002")) == [f"step_00000002/{CLAIM}"]
        assert [s["ok"] for s in m.checkpoint_stats] == [True, False, True]
    finally:
        m.close(60)


def test_a_snapshot_failing_on_one_rank_leaves_the_next_save_whole(group2, local_root):
    """One rank's snapshot fails (its state could not be staged): the save fails at once,
    and its peer, which staged, neither writes it nor holds up the next save."""
    m = manager(local_root, {"actor": group2})
    try:
        a_failed_save_then_a_whole_one(m, group2, local_root, "worker.snapshot",
                                       "injected fault")
        assert [s["ok"] for s in m.checkpoint_stats] == [True, True]
    finally:
        m.close(60)


def test_a_rank_that_never_reads_begins_answer_fails_the_save_at_once(group2, local_root):
    """``begin`` answers the driver, but one rank's wait for the answer fails: that rank
    staged nothing, so the save fails at once (naming the rank), and its peer, which
    staged and persists, neither waits for it in DCP's first agreement nor holds up the
    next save."""
    m = manager(local_root, {"actor": group2})
    try:
        a_failed_save_then_a_whole_one(m, group2, local_root, "worker.begin_answer",
                                       r"actor/1: begin failed: InjectedFault")
        assert [s["ok"] for s in m.checkpoint_stats] == [True, True]
    finally:
        m.close(60)


def test_barrier_timeout_names_missing_rank(group2, local_root):
    m = manager(local_root, {"actor": group2}, config={"commit_timeout_s": 4})
    try:
        m.update(step=1)
        m.save_checkpoint().wait(120)
        arm(group2, "worker.before_report", "hang:10", ranks=[1])
        try:
            m.update(step=2)
            with pytest.raises(CommitTimeoutError, match=r"\('actor', 1\)") as err:
                m.save_checkpoint().wait(120)
            assert err.value.missing == [("actor", 1)]
        finally:
            disarm(group2)
        assert Storage(local_root).read_bytes(LATEST).decode().strip() == "step_00000001"
        m.update(step=3)
        assert m.save_checkpoint().wait(120)["name"] == "step_00000003"
    finally:
        m.close(60)
