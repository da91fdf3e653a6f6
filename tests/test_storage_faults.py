"""Storage faults: transient S3 errors are retried and saves still commit; a persistent
failure or a full disk aborts the save cleanly, once, with its cause; earlier
checkpoints stay intact and training goes on.

Transient faults come from :class:`tests.s3proxy.FaultProxy`, a proxy between s3fs and
the S3 server on 127.0.0.1 that answers 503 SlowDown, drops connections or answers late
for a set fraction of requests.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest

from raycheckpoint import CheckpointSaveError, Storage
from raycheckpoint.admin import verify
from raycheckpoint.storage.retry import http_answer, is_precondition_failed, is_transient
from tests.helpers import REPORTS, manager, train
from tests.s3proxy import FaultProxy

pytestmark = pytest.mark.timeout(300)


def test_what_counts_as_transient():
    from botocore.exceptions import ClientError, EndpointConnectionError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert is_transient(client_error("SlowDown", 503))
    assert is_transient(client_error("InternalError", 500))
    assert not is_transient(client_error("AccessDenied", 403))
    assert not is_transient(client_error("NoSuchBucket", 404))
    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(OSError(errno.EIO, "I/O error"))
    assert is_transient(ConnectionResetError())
    assert not is_transient(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_transient(FileNotFoundError("x"))
    assert not is_transient(PermissionError("x"))
    assert not is_transient(OSError(errno.EINVAL, "Invalid argument"))


def test_a_refused_conditional_put_is_known_by_its_code_not_its_text():
    """What s3fs raises for a 412 without ``<Condition>`` and with an empty message (Ceph's
    RADOS Gateway): ``OSError(EINVAL, None)``, the answer only on its cause."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    def s3fs_error(error: dict, status: int) -> OSError:
        return translate_boto_error(ClientError(
            {"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"))

    gateway = s3fs_error({"Code": "PreconditionFailed", "Message": None}, 412)
    assert type(gateway) is OSError and gateway.errno == errno.EINVAL and "412" not in repr(gateway)
    assert is_precondition_failed(gateway) and not is_transient(gateway)
    assert str(http_answer(gateway)) == "HTTP 412 PreconditionFailed"
    bare = s3fs_error({"Code": "412", "Message": "Precondition Failed"}, 412)  # no body at all
    assert is_precondition_failed(bare) and not is_transient(bare)
    moto = s3fs_error({"Code": "PreconditionFailed", "Message": "At least one of the "
                       "pre-conditions you specified did not hold", "Condition": "If-None-Match"}, 412)
    assert isinstance(moto, FileExistsError) and is_precondition_failed(moto)
    throttled = s3fs_error({"Code": "SlowDown", "Message": None}, 503)
    assert is_transient(throttled) and not is_precondition_failed(throttled)
    denied = s3fs_error({"Code": "AccessDenied", "Message": None}, 403)
    assert isinstance(denied, PermissionError) and not is_transient(denied)
    assert http_answer(OSError(errno.EIO, "x")) is None


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server["endpoint"], seed=1) as p:
        yield p


def _options(s3_server, endpoint: str, **extra) -> dict:
    return {**s3_server["options"], "endpoint_url": endpoint, **extra}


@pytest.mark.s3
def test_storage_operations_survive_a_lossy_s3(proxy, s3_server, s3_root):
    uri, _ = s3_root
    st = Storage(uri, _options(s3_server, proxy.endpoint), retries=8)
    proxy.set(fail=0.3, drop=0.1, slow=0.05)
    for i in range(10):
        entry = st.write_bytes(f"d/f{i}", os.urandom(1000 + i))
        assert st.read_bytes(f"d/f{i}") and st.size(f"d/f{i}") == entry.size
    st.create_marker("d/MARKER", b"once")
    with pytest.raises(FileExistsError):
        st.create_marker("d/MARKER", b"twice")
    st.write_pointer("d/PTR", b"x")
    assert len(st.list_files("d")) == 12
    st.delete_tree("d")
    assert st.list_files("d") == {}
    assert proxy.counts["fail"] > 0 and proxy.counts["drop"] > 0


@pytest.mark.s3
def test_a_marker_whose_answer_was_lost_is_recognised_as_our_own(proxy, s3_server, s3_root):
    """The conditional PUT reaches the server, its answer does not: the retry meets 412
    and finds its own bytes there, which is success; anyone else's bytes are not."""
    uri, _ = s3_root
    st = Storage(uri, _options(s3_server, proxy.endpoint), retries=4)
    proxy.script("lose")
    st.create_marker("d/MARKER", b"ours")
    assert proxy.counts["lose"] == 1 and st.read_bytes("d/MARKER") == b"ours"
    t0 = time.monotonic()
    with pytest.raises(FileExistsError):
        st.create_marker("d/MARKER", b"theirs")
    assert time.monotonic() - t0 < 2 and st.read_bytes("d/MARKER") == b"ours"  # 412 is final


@pytest.mark.s3
def test_an_s3_error_names_the_operation_the_object_and_the_status(proxy, s3_server, s3_root):
    uri, _ = s3_root
    st = Storage(uri, _options(s3_server, proxy.endpoint,
                               config_kwargs={"retries": {"max_attempts": 1}}), retries=1)
    with pytest.raises(FileNotFoundError) as missing:
        st.read_bytes("d/absent")
    assert f"S3 read {uri}/d/absent failed: " in str(missing.value) and "404" in str(missing.value)
    proxy.set(fail=1.0)
    with pytest.raises(OSError) as throttled:
        st.write_bytes("d/x", b"payload")
    assert f"S3 write {uri}/d/x failed: HTTP 503 SlowDown" in str(throttled.value)
    assert "failed after 2 attempts" in "".join(getattr(throttled.value, "__notes__", []))



@pytest.mark.s3
@pytest.mark.long  # 20 s of waiting out retries; the RADOS Gateway leg (-m s3) runs it too
def test_a_store_that_is_down_fails_an_operation_in_seconds_not_minutes(proxy, s3_server,
                                                                       s3_root):
    """botocore's own retries, multiplied by s3fs's and ours, made one read of a store that
    drops every connection take 90 s (100 requests) with ``retries=1``; bounded, it takes
    15 to 20 s.  Options that name botocore's retries keep them."""
    uri, _ = s3_root
    st = Storage(uri, _options(s3_server, proxy.endpoint), retries=1)
    proxy.set(drop=1.0)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="Connection was closed"):  # botocore's own type
        st.read_bytes("d/any")
    took = time.monotonic() - t0
    assert took < 45 and proxy.counts["drop"] <= 60, (took, proxy.counts)
    own = {"retries": {"mode": "legacy", "max_attempts": 1}}
    assert Storage(uri, _options(s3_server, proxy.endpoint, config_kwargs=own),
                   create=False).fs.config_kwargs["retries"] == own["retries"]
@pytest.mark.s3
@pytest.mark.parametrize("ignore_range", [False, True])
def test_a_streamed_read_goes_on_when_a_response_is_cut_short(proxy, s3_server, s3_root,
                                                               ignore_range):
    uri, _ = s3_root
    proxy.ignore_range = ignore_range  # then a retry gets the whole object and starts over
    data = os.urandom(9 << 20)  # more than two of read_into's pieces
    Storage(uri, s3_server["options"]).write_bytes("d/big", data)
    st = Storage(uri, _options(s3_server, proxy.endpoint, config_kwargs={"retries": {"max_attempts": 1}}),
                 retries=8)
    proxy.set(cut=0.5, fail=0.2)
    for _ in range(4):
        out = bytearray(len(data))
        assert st.read_into("d/big", memoryview(out)) == len(data)
        assert out == data
    # a retry asks for the bytes not yet received, not the whole object again
    assert proxy.counts["cut"] > 0 and st.retried > 0 and proxy.ranged > 0


@pytest.mark.s3
@pytest.mark.parametrize("rates", [
    {"fail": 0.2, "drop": 0.05, "slow": 0.05},
    # about 45 s here: with the long tests (.ci/run's second run)
    pytest.param({"fail": 0.4, "drop": 0.1, "slow": 0.0}, marks=[pytest.mark.faults, pytest.mark.slow]),
])
def test_saves_commit_through_transient_s3_faults(rates, proxy, s3_server, s3_root, group2):
    uri, direct = s3_root
    m = manager(uri, {"actor": group2}, _options(s3_server, proxy.endpoint),
                config={"storage_retries": 8, "lease": False})
    try:
        proxy.set(**rates)
        t0 = time.perf_counter()
        for step in (1, 2, 3):
            train(group2, [step])
            m.update(step=step)
            m.save_checkpoint().wait(240)
        elapsed = time.perf_counter() - t0
        counts = dict(proxy.counts)
        proxy.set()
    finally:
        m.close(120)
    doc = verify(uri, direct)  # read back straight from the server
    assert doc["ok"] and [c["name"] for c in doc["checkpoints"]] == [
        "step_00000001", "step_00000002", "step_00000003"]
    injected = counts.get("fail", 0) + counts.get("drop", 0)
    assert injected > 0
    REPORTS.append(f"S3 faults survived ({rates}): 3 saves committed in {elapsed:.1f}s through "
                   f"{sum(counts.values())} requests, {counts.get('fail', 0)} answered 503 SlowDown, "
                   f"{counts.get('drop', 0)} dropped, {counts.get('slow', 0)} delayed")


@pytest.mark.s3
def test_a_persistent_s3_failure_aborts_the_save_once_with_its_cause(proxy, s3_server, s3_root,
                                                                    group2):
    uri, direct = s3_root
    fast_fail = {"config_kwargs": {"retries": {"max_attempts": 1}}}
    m = manager(uri, {"actor": group2}, _options(s3_server, proxy.endpoint, **fast_fail),
                config={"storage_retries": 2, "lease": False})
    try:
        train(group2, [1])
        m.update(step=1)
        m.save_checkpoint().wait(120)
        proxy.set(fail=1.0)
        train(group2, [2])
        m.update(step=2)
        with pytest.raises(CheckpointSaveError) as e:
            m.save_checkpoint().wait(240)
        assert "SlowDown" in str(e.value) or "503" in str(e.value) or "reduce your request rate" in str(
            e.value), str(e.value)
        proxy.set()
        train(group2, [3])  # training goes on
        m.update(step=3)
        m.save_checkpoint().wait(120)
        stats = m.checkpoint_stats
    finally:
        m.close(120)
    assert [s["ok"] for s in stats] == [True, False, True]  # the failure reported once
    doc = verify(uri, direct)
    assert doc["ok"] and [c["name"] for c in doc["checkpoints"]] == ["step_00000001",
                                                                      "step_00000003"]


def test_a_full_disk_aborts_the_save_at_once_and_keeps_the_earlier_one(group2, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        root = str(disk / "ckpts")
        m = manager(root, {"actor": group2})
        try:
            train(group2, [1])
            m.update(step=1)
            m.save_checkpoint().wait(120)
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            with open(disk / "filler", "wb") as f:  # leave less room than a checkpoint needs
                f.write(b"\0" * max(0, free - 200_000))
            train(group2, [2])
            m.update(step=2)
            t0 = time.perf_counter()
            with pytest.raises(CheckpointSaveError, match="No space left on device"):
                m.save_checkpoint().wait(120)
            assert time.perf_counter() - t0 < 20  # not retried: a full disk is not transient
            os.unlink(disk / "filler")
            train(group2, [3])
            m.update(step=3)
            m.save_checkpoint().wait(120)  # room again: saving works again
        finally:
            m.close(60)
        doc = verify(root)
        assert doc["ok"] and [c["name"] for c in doc["checkpoints"]] == ["step_00000001",
                                                                          "step_00000003"]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
