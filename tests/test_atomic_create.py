"""LEASE and COMMITTED only on roots whose exclusive create is atomic (storage/atomic.py).

A root served by the generic fsspec backend (as ``gs://``, ``az://`` or ``hdfs://`` are)
is refused for a job's lease and for every marker, naming the backend, while the tools
that only read, tag or collect keep working on it.  Such a backend is played here by
fsspec's own local filesystem under a kind raycheckpoint has no backend class for
(``rcplain://``), and by fsspec's HTTP filesystem.  An S3 store that ignores
``If-None-Match`` (moto behind a front that drops the header) is refused at job start.
"""

from __future__ import annotations

import json
import shutil
import threading
import uuid
from pathlib import Path

import pytest
from fsspec import register_implementation
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import stringify_path

from raycheckpoint import Storage
from raycheckpoint.errors import StorageCapabilityError
from raycheckpoint.protocol.lease import Lease
from raycheckpoint.protocol.paths import COMMITTED, LEASE

pytestmark = pytest.mark.timeout(120)

FIXTURE = sorted((Path(__file__).parent / "fixtures").glob("format_v*"))[-1] / "root"


class PlainLocal(LocalFileSystem):
    """This machine's disk as a kind raycheckpoint has no backend class for: the generic
    fsspec backend serves it, as it serves gs://, az:// or hdfs://."""

    protocol = ("rcplain",)

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("auto_mkdir", True)
        super().__init__(**kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        path = stringify_path(path)
        if path.startswith("rcplain://"):
            path = "/" + path[len("rcplain://"):].lstrip("/")
        return super()._strip_protocol(path)


register_implementation("rcplain", PlainLocal, clobber=True)


@pytest.fixture
def plain_root(tmp_path) -> tuple[str, Path]:
    """A committed checkpoint root on local disk, and its rcplain:// URI."""
    root = tmp_path / "root"
    shutil.copytree(FIXTURE, root)
    return f"rcplain://{root}", root


def test_a_backend_without_an_atomic_create_makes_no_marker_and_no_lease(plain_root):
    uri, root = plain_root
    storage = Storage(uri)
    assert type(storage) is Storage and not storage.caps.atomic_create
    with pytest.raises(StorageCapabilityError) as e:
        storage.create_marker(f"step_00000009/{COMMITTED}", b"marker")
    message = str(e.value)
    assert "rcplain:// (tests.PlainLocal)" in message and f"step_00000009/{COMMITTED}" in message
    assert "atomic exclusive create" in message and "s3://" in message
    assert "raycheckpoint ls, verify" in message  # what still works on it
    assert e.value.backend == "rcplain:// (tests.PlainLocal)" and isinstance(e.value, ValueError)
    assert not (root / "step_00000009").exists()

    with pytest.raises(StorageCapabilityError, match=r"a job's root .*LEASE.*COMMITTED") as e:
        Lease(storage, job_name="job", wait_s=0).acquire()
    assert str(e.value).startswith(f"{storage.url()}: ") and e.value.uri == storage.url()
    assert not (root / LEASE).exists()


def test_http_is_refused_before_any_request():
    """fsspec's HTTP filesystem, pointed at a port where nothing listens: the refusal
    comes from what the backend can do, before any request (which would fail to connect)."""
    storage = Storage("http://127.0.0.1:9/ckpt", create=False)
    with pytest.raises(StorageCapabilityError, match=r"http:// \(fsspec\.HTTPFileSystem\)"):
        storage.create_marker(COMMITTED, b"x")
    with pytest.raises(StorageCapabilityError, match="http://"):
        storage.require_atomic_create()


def test_the_operator_tools_work_on_such_a_root(plain_root, tmp_path, capsys):
    from raycheckpoint import cli

    uri, root = plain_root

    def run(*argv: str) -> dict:
        code = cli.main([*argv, "--json"])
        out = capsys.readouterr().out
        assert code == 0, out
        return json.loads(out)

    ls = run("ls", uri)
    assert [c["name"] for c in ls["checkpoints"]] == ["step_00000003"]
    verified = run("verify", uri)
    assert verified["ok"] and [c["name"] for c in verified["checkpoints"]] == ["step_00000003"]
    assert run("inspect", uri)["name"] == "step_00000003"
    assert run("tag", uri, "best")["checkpoint"] == "step_00000003"
    assert (root / "tags" / "best").exists()
    assert run("untag", uri, "best")["tag"] == "best"
    out = run("export", uri, str(tmp_path / "sd"), "--format", "state_dict", "--role", "actor")
    assert out["tensors"] > 0


def test_the_backends_that_can_create_atomically_say_so(tmp_path):
    from raycheckpoint.storage.raymem import RayMemoryStorage

    assert Storage(str(tmp_path)).caps.atomic_create
    assert Storage(f"memory://rc-{uuid.uuid4().hex[:8]}").caps.atomic_create
    assert Storage("s3://bucket/prefix", {"anon": True}, create=False).caps.atomic_create
    # the memory tier's holders and the per-node agents: one job's own, not atomic, never
    # leased (a check, then a write to every holder; the durable root's lease guards them)
    assert RayMemoryStorage.caps.job_private and not RayMemoryStorage.caps.atomic_create
    Storage(str(tmp_path)).require_atomic_create()  # nothing to refuse


def test_memory_roots_create_exclusively_under_racing_threads():
    """Eight threads create one marker at once, fifty times, with the interpreter
    switching threads as often as it can: exactly one wins each time."""
    import sys

    storage = Storage(f"memory://rc-{uuid.uuid4().hex[:8]}")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for round_ in range(50):
            rel, start, won = f"r{round_}/{COMMITTED}", threading.Barrier(8, timeout=30), []
            threads = [threading.Thread(target=_race, args=(storage, rel, i, start, won))
                       for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert len(won) == 1, (round_, won)
            assert storage.read_bytes(rel) == f"writer {won[0]}".encode()
    finally:
        sys.setswitchinterval(interval)


def _race(storage: Storage, rel: str, i: int, start: threading.Barrier, won: list[int]) -> None:
    start.wait()
    try:
        storage.create_marker(rel, f"writer {i}".encode())
        won.append(i)
    except FileExistsError:
        pass


# ---- S3: a store must honour If-None-Match ------------------------------------------------


@pytest.fixture
def careless_s3():
    """A moto S3 server behind a front that drops ``If-None-Match`` (as a store without
    conditional writes does): ``(uri, options)`` of a fresh bucket there."""
    import boto3
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)

    def ignoring_conditions(environ, start_response):
        environ.pop("HTTP_IF_NONE_MATCH", None)
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, ignoring_conditions, threaded=True,
                         request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    options = {"endpoint_url": endpoint, "key": "careless", "secret": "careless-secret"}
    bucket = f"careless-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=options["key"],
                 aws_secret_access_key=options["secret"],
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    try:
        yield f"s3://{bucket}/job", options
    finally:
        server.shutdown()
        thread.join(10)


@pytest.mark.s3
def test_an_s3_store_that_ignores_conditional_writes_is_refused_at_job_start(careless_s3):
    uri, options = careless_s3
    storage = Storage(uri, options)
    with pytest.raises(StorageCapabilityError) as e:
        Lease(storage, job_name="job", wait_s=0).acquire()
    assert "ignores conditional writes" in str(e.value) and uri in str(e.value)
    assert storage.list_files() == {}  # no LEASE, and the probe key is gone


@pytest.mark.s3
def test_an_s3_store_with_conditional_writes_passes_the_check(s3_root):
    uri, options = s3_root
    storage = Storage(uri, options)
    storage.require_atomic_create()
    assert storage.list_files() == {}  # the probe key is gone
    lease = Lease(storage, job_name="job", wait_s=0).acquire()
    assert set(storage.list_files()) == {LEASE}
    lease.release()
