"""Shared test fixtures: one local S3 server, one Ray instance and warm worker groups.

Everything here is real: an S3 server on 127.0.0.1 reached through s3fs, a local Ray
instance (never joining another cluster), and FSDP2 worker groups on gloo.  They are
session-scoped and reused, and every wait has a timeout.

Every Ray instance the tests start keeps its files in a temporary directory of its own,
never in Ray's default one (``/tmp/ray``), which tests/ray_temp_guard.py checks.

The S3 server is the one named by ``RAYCHECKPOINT_TEST_S3_ENDPOINT`` (with ``_KEY`` and
``_SECRET``; ``python -m tests.rgw -- pytest ...`` starts Ceph's RADOS Gateway and sets
them), else moto's, started here with credentials made up for the session.  Credentials
reach the code only through storage options: none are in the environment, so code that
drops the options fails here as it would against a real store.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import pytest

for _var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
    os.environ.pop(_var, None)  # Ray workers inherit this environment too
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.environ["AWS_CONFIG_FILE"] = os.devnull
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

RPC_TIMEOUT = 120
BUCKET = "ckpt"


def pytest_configure(config):
    """No test may write Ray's default temporary directory: every Ray instance a test
    starts has one of its own (the check: tests/ray_temp_guard.py)."""
    config.pluginmanager.import_plugin("tests.ray_temp_guard")


@pytest.fixture(scope="session")
def s3_server():
    """``{"endpoint", "options", "kind"}`` of the session's S3 server, bucket ``ckpt`` in it."""
    import boto3

    endpoint = os.environ.get("RAYCHECKPOINT_TEST_S3_ENDPOINT")
    server = None
    if endpoint:
        key = os.environ["RAYCHECKPOINT_TEST_S3_KEY"]
        secret = os.environ["RAYCHECKPOINT_TEST_S3_SECRET"]
        kind = os.environ.get("RAYCHECKPOINT_TEST_S3_KIND", "external")
    else:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint, key, secret, kind = f"http://{host}:{port}", uuid.uuid4().hex[:20], uuid.uuid4().hex, "moto"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key,
                          aws_secret_access_key=secret)
    if BUCKET not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket=BUCKET)
    from tests.helpers import REPORTS

    REPORTS.append(f"S3 server: {kind} at {endpoint}")
    options = {"endpoint_url": endpoint, "key": key, "secret": secret}
    yield {"endpoint": endpoint, "options": options, "kind": kind}
    if server is not None:
        server.stop()


@pytest.fixture
def s3_root(s3_server):
    """A fresh prefix in the test bucket, with the s3fs options to reach it."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}", s3_server["options"]


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def storage_spec(request, tmp_path):
    """A fresh checkpoint root, once on local disk and once on the S3 server."""
    from raycheckpoint.storage import StorageSpec

    if request.param == "local":
        return StorageSpec(str(tmp_path / "root"))
    root, options = request.getfixturevalue("s3_root")
    return StorageSpec(root, options)


METRICS_PORT: list[int] = []


@pytest.fixture(scope="session")
def ray_session(s3_server):
    import ray

    from workers.group import free_port

    temp = tempfile.mkdtemp(prefix="rcray-", dir="/tmp")  # short: Ray's sockets live here
    METRICS_PORT.append(free_port())  # Ray's Prometheus endpoint, on 127.0.0.1
    ray.init(address="local", _temp_dir=temp, include_dashboard=False,
             object_store_memory=256 * 1024 * 1024, num_cpus=8, log_to_driver=False,
             configure_logging=False, _metrics_export_port=METRICS_PORT[0])
    yield ray
    ray.shutdown()
    _report_crashed_workers(temp)
    shutil.rmtree(temp, ignore_errors=True)


# a segfault or an abort, and raycheckpoint/_internal/exit.py's watchdog ending a worker
CRASH_WORDS = ("Fatal Python error", "Segmentation fault", "Aborted", "terminate called",
               "is gone; exiting")


def _report_crashed_workers(temp: str) -> None:
    """Put the end of every worker log that tells of a crash or an exit of its own into
    the run's report: the logs go with the session's directory, and a test that meets
    the dead worker says only that it died (its PID ends the log's name)."""
    from pathlib import Path

    from tests.helpers import REPORTS

    sessions = [d for d in Path(temp).glob("session_*") if not d.is_symlink()]  # not _latest
    for log in sorted(p for d in sessions for p in d.glob("logs/worker-*.err")):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        if any(word in text for word in CRASH_WORDS):
            REPORTS.append(f"a Ray worker ended on its own ({log.name}):\n{text[-3000:]}")


@pytest.fixture(scope="session")
def metrics_url(ray_session):
    return f"http://127.0.0.1:{METRICS_PORT[0]}/metrics"


def _group(ray_session, world_size: int, **kwargs):
    from workers import FSDPTrainWorker, create_worker_group

    return create_worker_group(FSDPTrainWorker, role="actor", world_size=world_size,
                               timeout_s=RPC_TIMEOUT, **kwargs)


@pytest.fixture(scope="session")
def group2(ray_session):
    return _group(ray_session, 2)


@pytest.fixture(scope="session")
def group4(ray_session):
    return _group(ray_session, 4)


@pytest.fixture(scope="session")
def group3(ray_session):
    return _group(ray_session, 3)


@pytest.fixture
def local_root(tmp_path):
    return str(tmp_path / "ckpts")


@pytest.fixture(scope="session")
def verl_python():
    """The Python of ``.venv-verl`` (verl 0.9.1 beside this package), built by
    ``scripts/verl_env.sh``; the tests that need it skip without it."""
    from pathlib import Path

    py = Path(__file__).resolve().parent.parent / ".venv-verl" / "bin" / "python"
    if not py.exists():
        pytest.skip("no .venv-verl: build it with `bash scripts/verl_env.sh` (needs the package index)")
    return py


def pytest_terminal_summary(terminalreporter):
    """Print what the tests measured (crash matrix, soak figures) into the log."""
    from tests.helpers import REPORTS

    for block in REPORTS:
        terminalreporter.write_line("")
        for line in block.splitlines():
            terminalreporter.write_line(line)


LONG = ("cluster", "soak", "crash", "faults")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every cluster, soak, crash-matrix or heavy-fault test is also ``long`` (selected by
    ``-m long``, left out of the default run) -- before ``-m`` selects."""
    for item in items:
        if any(item.get_closest_marker(m) for m in LONG):
            item.add_marker(pytest.mark.long)
