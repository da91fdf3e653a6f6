"""Background verification records what it finds: a checkpoint whose own bytes are bad is
a failed verification, with its reason, whatever type of error decoding them raised (so
``auto`` resume and retention learn of it); only a store that cannot be read makes the
verification one that could not run, recorded nowhere.

The checkpoints are the checked-in fixture's, forged and re-sealed (tests/forgery.py) as
anyone who can write an unencrypted root can do.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import threading
import uuid
from pathlib import Path

import pytest

from raycheckpoint import verifier
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.root import RootState
from raycheckpoint.protocol.verification import VerificationQueue
from raycheckpoint.storage import Storage, StorageSpec
from raycheckpoint.verifier import verify_committed
from tests.conftest import BUCKET, RPC_TIMEOUT
from tests.forgery import METADATA, NAME, forge_item, forge_metadata, forged_root, reseal, touch
from tests.s3proxy import FaultProxy

pytestmark = pytest.mark.timeout(300)

RANK_STATE = f"{NAME}/rng/actor/rank_00000.msgpack"


def _failed(root: str, path: str, *words: str) -> dict:
    result = verify_committed(Storage(root), NAME)
    assert result["ok"] is False and result["step"] == 3, result
    assert path in result["error"] and all(w in result["error"] for w in words), result["error"]
    return result


def test_a_truncated_metadata_is_a_failed_verification(tmp_path):
    root = forged_root(tmp_path)
    data = Storage(root).read_bytes(METADATA)
    reseal(root, {METADATA: data[:len(data) // 2]})  # pickle's own error: UnpicklingError
    _failed(root, METADATA, "IntegrityError")


def test_a_forged_metadata_is_a_failed_verification_and_never_runs(tmp_path):
    flag = tmp_path / "payload-ran"
    root = forged_root(tmp_path)
    forge_metadata(root, flag)
    _failed(root, METADATA, "refused to unpickle", "posix.system")
    assert not flag.exists()


def test_a_forged_non_tensor_item_is_a_failed_verification(tmp_path):
    """What a load unpickles besides the tensors (the optimizer's hyperparameters) is
    checked too, as the load would: weights-only."""
    flag = tmp_path / "payload-ran"
    root = forged_root(tmp_path)
    assert verify_committed(Storage(root), NAME)["ok"]
    rel = forge_item(root, "optim.param_groups.0.betas", touch(flag))
    _failed(root, rel, "optim.param_groups.0.betas", "weights-only")
    assert not flag.exists()


@pytest.mark.parametrize("garbage", [
    b"\x81\x80\x01",  # a map keyed by a map: msgpack raises TypeError
    b"\x93\x01\x02\x03",  # decodes, but is no rank state
], ids=["type-error", "not-a-rank-state"])
def test_a_rank_state_file_of_garbage_is_a_failed_verification(tmp_path, garbage):
    root = forged_root(tmp_path)
    reseal(root, {RANK_STATE: garbage})
    _failed(root, RANK_STATE)


def _upload(root: str, storage: Storage) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            full = os.path.join(dirpath, f)
            storage.write_bytes(os.path.relpath(full, root), Path(full).read_bytes())


@pytest.fixture
def unreachable(s3_server, tmp_path):
    """``(direct, proxied)``: a committed checkpoint on S3, and a spec reaching it through a
    proxy that drops every connection without an answer."""
    uri = f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}"
    direct = Storage(uri, s3_server["options"])
    _upload(forged_root(tmp_path / "upload"), direct)
    with FaultProxy(s3_server["endpoint"], seed=3) as proxy:
        proxy.set(drop=1.0)
        options = {**s3_server["options"], "endpoint_url": proxy.endpoint,
                   "config_kwargs": {"retries": {"max_attempts": 1}}}
        yield direct, StorageSpec(uri, options, retries=1)


@pytest.mark.s3
def test_an_unreachable_store_is_not_a_failed_verification(unreachable):
    direct, proxied = unreachable
    assert verify_committed(direct, NAME)["ok"]
    from botocore.exceptions import ConnectionClosedError, HTTPClientError

    with pytest.raises(ConnectionClosedError) as raised:
        verify_committed(proxied.open(), NAME)  # after the storage's retries
    assert verifier.could_not_run(raised.value)

    for e in (ConnectionError("refused"), PermissionError("access denied"), TimeoutError(),
              HTTPClientError(error="bad status line")):
        assert verifier.could_not_run(e), e
    for e in (TypeError("unhashable type: 'dict'"), FileNotFoundError("gone"), EOFError(),
              pickle.UnpicklingError("truncated"), struct.error("unpack"), RuntimeError("zip")):
        assert not verifier.could_not_run(e), e


def _queue(spec: StorageSpec, storage: Storage) -> tuple[VerificationQueue, RootState]:
    state = RootState(storage)
    state.sync()
    return VerificationQueue(spec, state, threading.Lock(), timeout_s=RPC_TIMEOUT,
                             start=verifier.start), state


# ~15 s (a verifier actor, a dropped store): the default suite keeps within its 15 minutes
# on a 2-core machine; .ci/run runs the long tests too; verify_committed's side of it runs
# in the default suite above
@pytest.mark.long
@pytest.mark.s3
def test_the_coordinator_records_a_failure_and_nothing_for_a_verification_that_could_not_run(
        ray_session, unreachable, tmp_path, caplog):
    import ray

    root = forged_root(tmp_path)
    reseal(root, {RANK_STATE: b"\x81\x80\x01"})
    queue, state = _queue(StorageSpec(root), Storage(root))
    queue.due(NAME)
    assert queue.wait_idle(RPC_TIMEOUT)
    [result] = queue.take()
    assert result["ok"] is False and RANK_STATE in result["error"]
    recorded = catalog.read_verification(Storage(root))[NAME]
    assert recorded["ok"] is False and RANK_STATE in recorded["error"]
    assert state.verified[NAME]["ok"] is False
    ray.kill(queue._actor)

    direct, proxied = unreachable
    queue, state = _queue(proxied, direct)
    with caplog.at_level(logging.WARNING, logger="raycheckpoint.protocol.verification"):
        queue.due(NAME)
        assert queue.wait_idle(RPC_TIMEOUT)
    assert queue.take() == [] and catalog.read_verification(direct) == {}
    assert any(f"verification of {NAME} could not run" in r.getMessage()
               and "raised ConnectionClosedError" in r.getMessage() for r in caplog.records), caplog.text
    assert queue._actor is not None  # it raised, it did not die: kept for the next one
    ray.kill(queue._actor)
