"""An asynchronous job's rollout state (``CheckpointManager(rollout_state=...)``): a data file
of the checkpoint, encrypted with the root's key, verified before any worker loads."""

from __future__ import annotations

import pytest

from raycheckpoint import IntegrityError, Storage
from raycheckpoint.integrity.crypto import MAGIC
from tests.helpers import flip_bit, manager

pytestmark = pytest.mark.timeout(300)


class Box:
    """Anything with ``state_dict()`` / ``load_state_dict()``."""

    def __init__(self, state=None) -> None:
        self.state, self.loaded = state, []

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.loaded.append(state)


def test_the_rollout_state_is_an_encrypted_file_checked_before_the_workers_load(group2, local_root,
                                                                              tmp_path):
    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    config = {"encryption_key": f"file:{key}"}
    states = {s: {"version": s, "inflight": [[{"tokens": [5, 6 + s], "logprobs": [-0.5, -1.25]}]],
                  "queue": ("a tuple", b"bytes")} for s in (1, 2)}
    box = Box()
    m = manager(local_root, {"actor": group2}, config=config, rollout_state=box)
    try:
        for step in (1, 2):
            box.state = states[step]
            m.update(step=step)
            m.save_checkpoint().wait(120)
    finally:
        m.close(60)
    st = Storage(local_root)
    raw = st.read_bytes("step_00000002/rollout_state.json")
    assert raw.startswith(MAGIC) and b"inflight" not in raw and b"tokens" not in raw

    back = Box()
    m = manager(local_root, {"actor": group2}, config=config, rollout_state=back)
    try:
        assert m.load_checkpoint(2).name == "step_00000002"
        assert back.loaded == [states[2]]  # tuples and bytes come back as they were
        flip_bit(f"{local_root}/step_00000002/rollout_state.json")
        with pytest.raises(IntegrityError, match=r"rollout_state\.json"):
            m.load_checkpoint(2)
        assert back.loaded == [states[2]]  # refused before anything was applied
        assert m.load_checkpoint("auto").name == "step_00000001"  # the one before
        assert back.loaded[-1] == states[1]
    finally:
        m.close(60)


def test_a_job_with_a_rollout_state_refuses_a_checkpoint_without_one(group2, local_root):
    m = manager(local_root, {"actor": group2})
    try:
        m.update(step=1)
        m.save_checkpoint().wait(120)
    finally:
        m.close(60)
    assert not Storage(local_root).exists("step_00000001/rollout_state.json")
    box = Box()
    m = manager(local_root, {"actor": group2}, rollout_state=box)
    try:
        with pytest.raises(IntegrityError, match="has no rollout state"):
            m.load_checkpoint(1)
        assert m.load_checkpoint(1, strict=False).name == "step_00000001"
        assert box.loaded == []
    finally:
        m.close(60)
