"""raycheckpoint's drop-in for verl's FSDPCheckpointManager, called as verl's FSDP engine
calls its own (every rank of a role at once, ``<dir>/global_step_<N>/<role>``): saves
commit with retention across saves, a new job resumes bit for bit, another world size
reshards, and damage or a missing step is refused naming what is wrong."""

from __future__ import annotations

import json
import os

import pytest
import ray
import torch

from tests.helpers import RPC_TIMEOUT, assert_same, flip_bit

# about a minute together: with the long tests (the default suite keeps within its 15
# minutes on a 2-core machine; .ci/run runs both)
pytestmark = pytest.mark.long


def group(world_size: int, **kwargs):
    from tests.verl_dropin_ranks import DropinRank
    from workers.group import create_worker_group

    return create_worker_group(DropinRank, role="actor", world_size=world_size,
                               timeout_s=RPC_TIMEOUT, **kwargs)


def call(ranks, method: str, *args):
    return ray.get([getattr(r, method).remote(*args) for r in ranks], timeout=RPC_TIMEOUT)


def end(ranks) -> None:
    call(ranks, "close")
    for r in ranks:
        ray.kill(r)


def path(base, step: int) -> str:
    return f"{base}/global_step_{step}/actor"


def test_saves_commit_and_a_new_job_resumes_bit_for_bit(ray_session, tmp_path):
    from raycheckpoint.admin import list_root, verify
    from raycheckpoint.storage import Storage

    base = tmp_path / "ckpts"
    a = group(2)
    try:
        for step in (2, 3, 4):
            call(a, "train", 1 if step > 2 else 2)
            call(a, "save", path(base, step), step, 1)
        saved = call(a, "state")
        call(a, "train", 2)
        after = call(a, "state")
    finally:
        end(a)
    root = str(base / "raycheckpoint" / "actor")
    # max_ckpt_to_keep=1 keeps one more: the trainer's tracker names step 3 until step 4's
    # data.pt and tracker are written
    assert [c["name"] for c in list_root(Storage(root))["checkpoints"]] == ["step_00000003", "step_00000004"]
    assert verify(root)["ok"]
    pointer = json.loads((base / "global_step_4" / "actor" / "raycheckpoint.json").read_text())
    assert pointer["checkpoint"] == "step_00000004" and pointer["root"] == root
    assert os.listdir(base / "global_step_4" / "actor") == ["raycheckpoint.json"]

    b = group(2)  # a new job at the same world size: everything back, RNG included
    try:
        call(b, "load", path(base, 4))
        loaded = call(b, "state")
        for r in range(2):
            assert_same(loaded[r]["model"], saved[r]["model"])
            assert_same(loaded[r]["optim"], saved[r]["optim"])
            assert loaded[r]["sched"] == saved[r]["sched"]
            assert torch.equal(loaded[r]["rng"], saved[r]["rng"])
        call(b, "train", 2)  # and training goes on exactly as it did
        assert call(b, "state")[0]["weights"] == after[0]["weights"]
    finally:
        end(b)

    c = group(1)  # another world size: resharded
    try:
        call(c, "load", path(base, 4))
        one = call(c, "state")[0]
        assert_same(one["model"], saved[0]["model"])
        assert_same(one["optim"], saved[0]["optim"])
        assert one["sched"] == saved[0]["sched"]
    finally:
        end(c)


def test_damage_and_missing_steps_are_refused_naming_them(ray_session, tmp_path):
    from raycheckpoint.errors import CheckpointNotFoundError, IntegrityError

    base = tmp_path / "ckpts"
    a = group(2)
    try:
        call(a, "train", 1)
        call(a, "save", path(base, 1), 1)
        call(a, "train", 1)
        call(a, "save", path(base, 2), 2)
        missing = r"global_step_5/actor: .* no committed checkpoint of step 5"
        with pytest.raises(CheckpointNotFoundError, match=missing):
            call(a, "load", path(base, 5))
        shard = base / "raycheckpoint" / "actor" / "step_00000002" / "actor" / "__1_0.distcp"
        flip_bit(str(shard))
        with pytest.raises(IntegrityError, match=r"__1_0\.distcp"):
            call(a, "load", path(base, 2))
        call(a, "load", path(base, 1))  # the step before still loads
        with pytest.raises(ValueError, match="names step 3, global_step is 4"):
            call(a, "save", path(base, 3), 4)
    finally:
        end(a)


def test_save_contents_model_only_is_a_light_checkpoint(ray_session, tmp_path):
    from raycheckpoint.admin import list_root
    from raycheckpoint.storage import Storage

    base = tmp_path / "ckpts"
    a = group(2, contents=["model"])
    try:
        call(a, "train", 1)
        call(a, "save", path(base, 1), 1)
        saved = call(a, "state")[0]
        call(a, "train", 1)
        call(a, "load", path(base, 1))
        assert_same(call(a, "state")[0]["model"], saved["model"])
    finally:
        end(a)
    [ck] = list_root(Storage(str(base / "raycheckpoint" / "actor")))["checkpoints"]
    assert ck["kind"] == "light"


@pytest.mark.s3
def test_a_role_saved_to_s3_through_the_options_resumes_bit_for_bit(ray_session, tmp_path, s3_root):
    """``save_dir`` and ``storage_options`` (RAYCHECKPOINT_VERL_OPTIONS' names): the role's
    root is ``<save_dir>/actor`` on the S3 server; verl's local_path gets only the pointer."""
    from raycheckpoint.admin import verify

    uri, storage_options = s3_root
    options = {"save_dir": uri, "storage_options": storage_options}
    base = tmp_path / "ckpts"
    a = group(2, options=options)
    try:
        call(a, "train", 2)
        call(a, "save", path(base, 2), 2)
        saved = call(a, "state")
    finally:
        end(a)
    assert verify(f"{uri}/actor", storage_options)["ok"]
    assert os.listdir(base / "global_step_2" / "actor") == ["raycheckpoint.json"]
    b = group(2, options=options)
    try:
        call(b, "load", path(base, 2))
        loaded = call(b, "state")
    finally:
        end(b)
    for r in range(2):
        assert_same(loaded[r]["model"], saved[r]["model"])
        assert_same(loaded[r]["optim"], saved[r]["optim"])


def test_the_data_loaders_state_is_committed_encrypted_and_data_pt_is_not_trusted(
        ray_session, tmp_path):
    """The trainer's data-loader state handed to the actor's rank 0 is committed (and
    read back) inside an encrypted checkpoint; a step without it is refused rather than
    resumed from verl's ``data.pt``, which no key authenticates."""
    from raycheckpoint.errors import IntegrityError
    from raycheckpoint.integrations.verl import _handoff as handoff
    from raycheckpoint.integrations.verl.manager import role_root
    from raycheckpoint.integrations.verl.trainer import _loader_state
    from raycheckpoint.state import encode_loader_state

    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    options = {"encryption_key": f"file:{key}"}
    base = tmp_path / "ckpts"
    position = {"samples_yielded": 8, "generator": torch.Generator().manual_seed(3).get_state()}
    handoff.publish(role_root(str(base), "actor", options), 2, encode_loader_state(position))
    a = group(2, options=options)
    try:
        call(a, "save", path(base, 2), 2)
        call(a, "save", path(base, 4), 4)  # nothing published for step 4
    finally:
        end(a)
    for step in (2, 4):
        torch.save({"samples_yielded": 99}, base / f"global_step_{step}" / "data.pt")
    loaded = _loader_state(str(base), 2, options, strict=True)
    assert loaded["samples_yielded"] == 8 and torch.equal(loaded["generator"], position["generator"])
    with pytest.raises(IntegrityError, match=r"data\.pt is not authenticated"):
        _loader_state(str(base), 4, options, strict=True)
