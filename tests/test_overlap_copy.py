"""checkpoint.overlap_copy: the host copy runs beside training; the optimizer step waits.

In one process (no Ray): a worker's snapshot returns before its copy, a slowed copy
makes the next optimizer step wait, and the staged state is the state at the save step.
Without the guard the same sequence stages the next step's state, which is what the
guard prevents.  The Ray test saves, trains on, commits and resumes through the manager.
"""

from __future__ import annotations

import copy
import time

import pytest
import ray
import torch

from raycheckpoint import testing as faults
from raycheckpoint.worker import CheckpointableWorker
from tests.helpers import (
    RPC_TIMEOUT,
    TinyWorker,
    a_failed_save_then_a_whole_one,
    arm,
    assert_same,
    disarm,
    full_state,
    manager,
    train,
)

HANG_S = 1.0


class _Worker(TinyWorker, CheckpointableWorker):
    def snapshot_and_step(self) -> tuple[dict, dict, float]:
        """Save with overlap (its persist never started), then one training step."""
        at_save = copy.deepcopy(self.ckpt_state_dict("full"))
        out = self.ckpt_snapshot("s", "step_00000001", "full", coordinator=None,
                                 defer_persist=True, overlap=True)
        t0 = time.perf_counter()
        self.step()
        return out, at_save, time.perf_counter() - t0


def _tensors_equal(a, b) -> bool:
    if isinstance(a, dict):
        return all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return all(_tensors_equal(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else True


@pytest.fixture
def slow_copy():
    faults.arm("worker.copy", f"hang:{HANG_S}")
    yield
    faults.disarm()


def test_optimizer_step_waits_for_the_copy_and_the_saved_state_is_the_save_steps(
        tmp_path, slow_copy):
    w = _Worker(str(tmp_path), guard=True)
    out, at_save, step_s = w.snapshot_and_step()
    assert out["overlap"] and out["stall_s"] < HANG_S / 2  # answered before the copy
    assert step_s >= HANG_S * 0.9                           # the step waited for it
    assert w._saver().copy_wait_s >= HANG_S * 0.8
    assert w._saver().pending.copy_error is None
    staged = w.staged()
    assert _tensors_equal(at_save["model"], staged["model"])
    assert _tensors_equal(at_save["optim"]["state"], staged["optim"]["state"])
    assert not _tensors_equal(at_save["model"], w.ckpt_state_dict("full")["model"])  # moved on


def test_without_the_guard_the_next_step_would_leak_into_the_save(tmp_path, slow_copy):
    """What the guard prevents: the hook removed, the step runs during the copy."""
    w = _Worker(str(tmp_path), guard=True)
    for handle in w._ckpt_guards:
        handle.remove()
    out, at_save, step_s = w.snapshot_and_step()
    assert out["overlap"] and step_s < HANG_S / 2
    w._saver().wait_copied(30)
    assert not _tensors_equal(at_save["model"], w.staged()["model"])
    assert _tensors_equal(w.ckpt_state_dict("full")["model"], w.staged()["model"])


def test_a_worker_without_a_guarded_optimizer_copies_before_answering(tmp_path):
    w = _Worker(str(tmp_path), guard=False)
    out, at_save, _ = w.snapshot_and_step()
    assert not out["overlap"] and w._saver().pending.copied.is_set()
    assert _tensors_equal(at_save["model"], w.staged()["model"])


def test_overlapped_save_resumes_exactly(group2, local_root):
    """Save with a slowed overlapped copy, train on at once, commit, resume: the state
    loaded is the state at the save step, and training from it repeats bit for bit."""
    m = manager(local_root, {"actor": group2}, config={"overlap_copy": True})
    try:
        train(group2, [0, 1])
        m.update(step=2)
        m.save_checkpoint().wait(120)  # buffers prepared; the next save overlaps as usual
        train(group2, [2])
        m.update(step=3)
        at_save = full_state(group2)
        arm(group2, "worker.copy", f"hang:{HANG_S}")
        handle = m.save_checkpoint()
        t0 = time.perf_counter()
        train(group2, [3])  # forward/backward beside the copy; the optimizer step waits
        step_s = time.perf_counter() - t0
        result = handle.wait(120)
        disarm(group2)
        assert result["name"] == "step_00000003"
        assert handle.worker_stall_s < HANG_S / 2  # the snapshot did not wait for the copy
        assert step_s >= HANG_S * 0.9               # the optimizer step did
        status = ray.get([w.ckpt_status.remote() for w in group2], timeout=RPC_TIMEOUT)
        assert all(s["copy_wait_s"] >= HANG_S * 0.5 for s in status), status
        train(group2, [4])
        straight = full_state(group2)
        m.load_checkpoint("step_00000003")
        assert_same(at_save, full_state(group2))
        train(group2, [3, 4])
        assert_same(straight, full_state(group2))
    finally:
        disarm(group2)
        m.close(60)


def test_an_overlapped_copy_failing_on_one_rank_fails_the_save_at_once(group2, local_root):
    """One rank's host copy fails beside training: the save fails on every rank of the
    role in their first agreement, without waiting out a timeout, and the next save
    commits at once."""
    m = manager(local_root, {"actor": group2}, config={"overlap_copy": True})
    try:
        a_failed_save_then_a_whole_one(m, group2, local_root, "worker.copy",
                                       r"injected fault at worker\.copy",
                                       beside=lambda: train(group2, [2]))
    finally:
        m.close(60)
