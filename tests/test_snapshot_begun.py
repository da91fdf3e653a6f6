"""A trainable role's snapshot runs while the coordinator's ``begin`` does.

The driver sends each trainable worker ``ckpt_snapshot_begun`` with the reference to
``begin``'s answer, unresolved: the worker copies first and reads the answer after.  Here,
in one process on the session's Ray instance: the copy is made before a slow answer
arrives and the persist then writes where the answer says; an answer that names no save
for this rank (already saved, reused, ``begin`` failed) drops the copy, persists nothing,
and leaves the next save unharmed.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from raycheckpoint import testing as faults
from raycheckpoint.storage import Storage
from raycheckpoint.worker import CheckpointableWorker
from tests.helpers import RPC_TIMEOUT, Reports, TinyWorker

SLOW_S = 1.0


@ray.remote(num_cpus=0)
def _begin(answer: dict, delay_s: float) -> dict:
    time.sleep(delay_s)
    if "error" in answer:
        raise OSError(answer["error"])
    return answer


class _Worker(TinyWorker, CheckpointableWorker):
    pass


def _named(save_id: str, step: int) -> dict:
    return {"save_id": save_id, "name": f"step_{step:08d}", "reused": []}


def _persisted(w: _Worker, save_id: str) -> None:
    """The rank started save ``save_id``'s persist by itself as it answered (nothing here
    starts it: ``wait_done`` does not); wait for it to end."""
    pending = w._saver().pending
    assert pending.save_id == save_id and pending.started
    assert pending.wait_done(RPC_TIMEOUT)


@pytest.fixture(scope="module")
def reports(ray_session):
    actor = Reports.remote()
    yield actor
    ray.kill(actor)


@pytest.fixture
def worker(reports, tmp_path):
    ray.get(reports.take.remote(), timeout=RPC_TIMEOUT)
    return _Worker(str(tmp_path), coordinator=reports), reports, Storage(str(tmp_path))


def test_the_copy_is_made_while_begin_runs_and_persists_where_it_answers(worker):
    w, reports, storage = worker
    at_save = {k: v.clone() for k, v in w.net.state_dict().items()}
    t0 = time.perf_counter()
    out = w.ckpt_snapshot_begun([_begin.remote(_named("s7", 7), SLOW_S)], "full",
                                begin_timeout_s=RPC_TIMEOUT)
    assert "dropped" not in out
    assert out["copy_s"] >= SLOW_S * 0.8 and time.perf_counter() - t0 >= SLOW_S * 0.8
    assert all(torch.equal(at_save[k], w.staged()["model"][k]) for k in at_save)
    _persisted(w, "s7")
    got = ray.get(reports.take.remote(), timeout=RPC_TIMEOUT)
    assert [(r[0], r[1], r[2], r[4]) for r in got] == [("s7", "actor", 0, None)]
    assert got[0][3] and all(p.startswith("step_00000007/") for p in got[0][3])
    assert all(storage.exists(p) for p in got[0][3])


@pytest.mark.parametrize("answer, reason", [
    ({"existing": {"name": "step_00000003", "step": 3, "kind": "full"}}, "saved already"),
    ({"save_id": "s3", "name": "step_00000003", "reused": ["actor"]}, "reused"),
    ({"error": "storage gone"}, "begin failed: OSError"),
])
def test_an_answer_naming_no_save_for_this_rank_drops_the_copy(worker, answer, reason):
    w, reports, storage = worker
    out = w.ckpt_snapshot_begun([_begin.remote(answer, 0.0)], "full",
                                begin_timeout_s=RPC_TIMEOUT)
    assert out["dropped"] == reason
    assert w._saver().pending is None
    with pytest.raises(RuntimeError, match="no staged save"):
        w.ckpt_start_persist("s3")
    assert not storage.list_files("step_00000003")
    w.step()  # the next save is whole, through the same buffers
    out = w.ckpt_snapshot_begun(_named("s4", 4), "full")  # an answer already resolved
    assert "dropped" not in out
    _persisted(w, "s4")
    assert [r[0] for r in ray.get(reports.take.remote(), timeout=RPC_TIMEOUT)] == ["s4"]
    assert all(torch.equal(v, w.staged()["model"][k]) for k, v in w.net.state_dict().items())


def test_a_dropped_overlapped_copy_is_over_before_the_answer(reports, tmp_path):
    """With ``overlap_copy`` the copy runs in a thread; a dropped save still waits for it,
    so no later snapshot restages the buffers under a copy still running."""
    w = _Worker(str(tmp_path), guard=True, coordinator=reports)
    faults.arm("worker.copy", f"hang:{SLOW_S}")
    try:
        out = w.ckpt_snapshot_begun([_begin.remote({"error": "storage gone"}, 0.0)], "full",
                                    overlap=True, begin_timeout_s=RPC_TIMEOUT)
    finally:
        faults.disarm()
    assert out["overlap"] and out["dropped"] == "begin failed: OSError"
    assert out["stall_s"] >= SLOW_S * 0.8
