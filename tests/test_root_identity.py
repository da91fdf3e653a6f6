"""A root's identity (``<root>/IDENTITY``): made once by the first job that leases the root,
the same for every job after, new once the root is wiped; the memory tier serves a job
only under it (tests/test_memory_lifetime.py).  Ray-free: local disk and the S3 server."""

from __future__ import annotations

import json
import shutil

import pytest

from raycheckpoint import CheckpointConfig
from raycheckpoint.protocol.identity import read_identity, root_identity
from raycheckpoint.protocol.paths import IDENTITY
from raycheckpoint.roots import open_roots


def test_a_root_keeps_its_identity_until_it_is_wiped(storage_spec):
    storage = storage_spec.open()
    assert read_identity(storage) is None
    first = root_identity(storage)
    assert json.loads(storage.read_bytes(IDENTITY))["id"] == first
    assert root_identity(storage_spec.open()) == first == read_identity(storage)
    storage.delete_tree("")  # wiped
    fresh = storage_spec.open()
    assert read_identity(fresh) is None
    assert root_identity(fresh) not in (None, first)


def test_the_identity_written_first_wins_and_an_unreadable_one_still_names_the_root(tmp_path):
    from raycheckpoint.storage import Storage

    storage = Storage(str(tmp_path / "root"))
    storage.create_marker(IDENTITY, json.dumps({"id": "theirs"}).encode())  # another job, first
    assert root_identity(storage) == "theirs"
    storage.write_pointer(IDENTITY, b"\x00 not json")
    damaged = root_identity(storage)
    assert damaged.startswith("sha256:") and root_identity(storage) == damaged


def test_a_job_creates_its_roots_identities_when_it_leases_them(tmp_path):
    durable, local = tmp_path / "durable", tmp_path / "nvme"
    config = CheckpointConfig(save_dir=str(durable), local_dir=str(local), memory_replicas=1)
    roots = open_roots(config, None)
    try:
        ids = dict(roots.identities)
        assert set(ids) == {"durable", "local"} and ids["durable"] != ids["local"]
        # the memory tier's spec carries what its holders must serve, and their lifetime
        assert roots.memory.options == {"identity": f"{ids['durable']}+{ids['local']}",
                                        "idle_ttl_s": 3600.0}
    finally:
        roots.release()
    again = open_roots(config, None)
    try:
        assert again.identities == ids and again.memory.options == roots.memory.options
    finally:
        again.release()
    shutil.rmtree(durable)
    shutil.rmtree(local)
    wiped = open_roots(config, None)
    try:
        assert wiped.identities["durable"] != ids["durable"]
        assert wiped.identities["local"] != ids["local"]
        assert wiped.memory.options["identity"] != roots.memory.options["identity"]
    finally:
        wiped.release()


def test_memory_idle_ttl_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="memory_idle_ttl_s must be positive"):
        CheckpointConfig(save_dir=str(tmp_path), memory_idle_ttl_s=0)
    assert CheckpointConfig(save_dir=str(tmp_path)).memory_idle_ttl_s == 3600.0
