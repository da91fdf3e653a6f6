"""The verl manager's small decisions, without ranks: where verl's paths lead, which root
a role gets, the options it reads, and the retention it asks for."""

from __future__ import annotations

import json

import pytest

from raycheckpoint.integrations.verl._root import keep_last_n
from raycheckpoint.integrations.verl.manager import OPTIONS_ENV, read_options, role_root, where


def test_verls_paths():
    assert where("/ck/run/global_step_12/actor") == ("/ck/run", "actor", 12)
    assert where("/ck/run/global_step_12/critic/") == ("/ck/run", "critic", 12)
    assert where("/tmp/x/checkpoint") == ("/tmp/x", "checkpoint", None)  # verl's own tests
    with pytest.raises(ValueError, match="global_step_<N>"):
        where("actor")


def test_each_role_gets_a_root_of_its_own():
    assert role_root("/ck/run", "actor", {}) == "/ck/run/raycheckpoint/actor"
    assert role_root("/ck/run", "critic", {"save_dir": "s3://b/run/"}) == "s3://b/run/critic"


def test_options_come_from_the_environment_and_the_argument_wins(monkeypatch):
    monkeypatch.setenv(OPTIONS_ENV, json.dumps({"save_dir": "s3://b/a", "keep_last_n": 3}))
    assert read_options({"save_dir": "/d"}) == {"save_dir": "/d", "keep_last_n": 3}
    monkeypatch.setenv(OPTIONS_ENV, "{not json")
    with pytest.raises(ValueError, match=OPTIONS_ENV):
        read_options()
    monkeypatch.delenv(OPTIONS_ENV)
    with pytest.raises(ValueError, match="tiers"):
        read_options({"checkpoint.local_dir": "/nvme"})


def test_retention_keeps_one_more_than_verl_asks():
    assert keep_last_n(1, {}) == 2
    assert keep_last_n(None, {}) is None and keep_last_n(0, {}) is None  # verl: keep all
    assert keep_last_n(None, {"keep_last_n": 3}) == 3  # unless the options say otherwise
    assert keep_last_n(2, {"keep_last_n": 3}) == 3
