"""A rank's load through ``CheckpointableWorker.ckpt_load``, in one process: its
extra-state (RNG) file is read beside the tensors from an object store, where a read
is a round trip, and after them, in the loading thread, from local disk."""

from __future__ import annotations

import threading

import pytest
import ray
import torch

from raycheckpoint.protocol.paths import rng_file
from raycheckpoint.state import capture_rng, restore_rng
from raycheckpoint.worker import CheckpointableWorker
from tests.helpers import RPC_TIMEOUT, Reports, TinyWorker


class _Worker(TinyWorker, CheckpointableWorker):
    def ckpt_state_dict(self, kind: str) -> dict:
        return {"model": self.net.state_dict()}

    def ckpt_load_state_dict(self, state: dict, kind: str) -> None:
        self.net.load_state_dict(state["model"])


@pytest.fixture
def files_actor(ray_session):
    actor = Reports.remote()
    yield actor
    ray.kill(actor)


def test_the_rng_file_is_read_beside_the_tensors_only_from_an_object_store(
        storage_spec, files_actor, tmp_path, monkeypatch):
    w = _Worker(str(tmp_path / "unused"), coordinator=files_actor)
    w.ckpt_setup(role="actor", rank=0, world_size=1, storage=storage_spec,
                 coordinator=files_actor)
    saved = {k: v.clone() for k, v in w.net.state_dict().items()}
    w.ckpt_snapshot_begun({"save_id": "s1", "name": "step_00000001", "reused": []}, "full")
    w.ckpt_start_persist("s1")
    w._saver().pending.wait(RPC_TIMEOUT)
    files, error = ray.get(files_actor.entries.remote("s1"), timeout=RPC_TIMEOUT)
    assert error is None
    rng = f"step_00000001/{rng_file('actor', 0)}"
    entries = {f["path"]: f for f in files}
    assert rng in entries

    with torch.no_grad():
        for p in w.net.parameters():
            p.add_(1.0)
    storage = w._saver().storage
    reads: list[tuple[str, str]] = []
    real = storage.read_bytes

    def read_bytes(rel, *args, **kwargs):
        reads.append((rel, threading.current_thread().name))
        return real(rel, *args, **kwargs)

    monkeypatch.setattr(storage, "read_bytes", read_bytes)
    rng_state = capture_rng()
    try:
        out = w.ckpt_load({"dcp_dir": "step_00000001/actor", "files": entries,
                           "checksums": True, "kind": "full", "saved_world_size": 1,
                           "rng_file": rng, "wait_timeout_s": RPC_TIMEOUT})
    finally:
        restore_rng(rng_state)
    assert out["skipped"] == []
    assert all(torch.equal(saved[k], v) for k, v in w.net.state_dict().items())
    readers = [name for rel, name in reads if rel == rng]
    if storage.caps.local_paths:
        assert readers == [threading.current_thread().name]
    else:
        assert readers == ["raycheckpoint-load-extra_0"]
