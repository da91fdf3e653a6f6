"""Unit tests without Ray: config, format, retention, errors, RNG and sampler state."""

from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import pytest
import torch

from raycheckpoint import (
    CheckpointConfig,
    CommitTimeoutError,
    IntegrityError,
    ResumableSampler,
    capture_rng,
    restore_rng,
)
from raycheckpoint.policy.retention import DEFAULT_KEEP_LAST_N_LIGHT, RetentionPolicy
from raycheckpoint.protocol.checkpoint import check_version
from raycheckpoint.protocol.format import Manifest, Marker, RoleLayout, json_bytes
from raycheckpoint.protocol.paths import parse_step_dir, step_dir_name, validate_tag
from raycheckpoint.resume import ABSENT, config_diff
from raycheckpoint.state import decode_loader_state, encode_loader_state
from raycheckpoint.storage import FileEntry


def test_config_accepts_seed_and_verl_names():
    cfg = CheckpointConfig.from_dict({
        "save_dir": "/tmp/x", "save_interval": 200, "save_full_interval": 1000,
        "keep_last_n": 2, "keep_best_n": 3, "save_on_train_end": True})
    assert (cfg.save_interval, cfg.save_full_interval, cfg.keep_last_n, cfg.keep_best_n) == \
        (200, 1000, 2, 3)
    cfg = CheckpointConfig.from_dict({"trainer.default_local_dir": "s3://b/p",
                                      "trainer.save_freq": 20, "trainer.resume_mode": "resume_path",
                                      "trainer.resume_from_path": "/x/step_00000020"})
    assert cfg.save_dir == "s3://b/p" and cfg.save_full_interval == 20
    assert cfg.resume_mode == "path" and cfg.resume_from == "/x/step_00000020"


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="literal secret"):
        CheckpointConfig(save_dir="/x", encryption_key="your-secret-key-32-bytes")
    with pytest.raises(ValueError, match="keep_last_n"):
        CheckpointConfig(save_dir="/x", keep_last_n=0)
    with pytest.raises(ValueError, match="unknown checkpoint option"):
        CheckpointConfig.from_dict({"save_dir": "/x", "keep_last": 3})
    with pytest.raises(ValueError, match="best_mode"):
        CheckpointConfig(save_dir="/x", best_mode="up")
    with pytest.raises(ValueError, match="persist_nice"):
        CheckpointConfig(save_dir="/x", persist_nice=20)
    CheckpointConfig(save_dir="/x", encryption_key="env:CKPT_KEY")


def test_step_names_and_tags():
    assert step_dir_name(1000) == "step_00001000"
    assert parse_step_dir("step_00001000") == 1000
    assert parse_step_dir("step_00001000_full") == 1000
    assert parse_step_dir("latest") is None
    validate_tag("reward_0.85_baseline")
    for bad in ("", "latest", "a/b", "step_00000001", ".hidden"):
        with pytest.raises(ValueError):
            validate_tag(bad)


def test_manifest_and_marker_roundtrip():
    files = {"s/a": FileEntry("s/a", 3, "ab" * 32)}
    m = Manifest(name="s", step=5, kind="full", files=files,
                 roles={"actor": RoleLayout(world_size=2, dcp_dir="s/actor", ranks={0: ["s/a"]})})
    m2 = Manifest.from_bytes(m.to_bytes())
    assert m2.files == files and m2.roles["actor"].ranks == {0: ["s/a"]} and m2.total_bytes == 3
    mk = Marker(name="s", step=5, kind="full", manifest_size=10, manifest_sha256="x", bytes=13,
                metrics={"reward": 0.5}, tag="t")
    assert Marker.from_bytes(mk.to_bytes()) == mk


def test_errors_survive_pickling():
    e = CommitTimeoutError("missing ranks", missing=[("actor", 1)])
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is CommitTimeoutError and e2.missing == [("actor", 1)]
    assert isinstance(e2, TimeoutError) and str(e2) == "missing ranks"
    i = pickle.loads(pickle.dumps(IntegrityError("bad", path="p")))
    assert isinstance(i, ValueError) and i.path == "p"


def _entry(name, step, kind, reward=None, t=0.0):
    return {"name": name, "step": step, "kind": kind, "committed_at": t,
            "metrics": {} if reward is None else {"reward": reward}}


def test_retention_rules():
    entries = [_entry(f"f{s}", s, "full", reward=r) for s, r in
               [(10, 0.9), (20, 0.1), (30, 0.2), (40, 0.3), (50, 0.4)]]
    entries += [_entry(f"l{s}", s, "light") for s in (5, 15, 25, 35)]
    p = RetentionPolicy(keep_last_n=2, keep_last_n_light=1, keep_best_n=1)
    doomed = p.to_delete(entries, protected={"f20"})
    # f50, f40 newest; f10 best; f20 protected (tag); l35 newest light
    assert doomed == ["l5", "l15", "l25", "f30"]  # oldest first
    # no rule: every full checkpoint kept; light ones bounded by the default
    assert RetentionPolicy().to_delete(entries, protected=set()) == ["l5"]
    assert DEFAULT_KEEP_LAST_N_LIGHT == 3
    # keep_best_n alone governs full checkpoints: the best, the newest and the protected stay
    assert RetentionPolicy(keep_best_n=2).to_delete(entries[:5], protected={"f20"}) == ["f30", "f40"]
    # min mode keeps the lowest
    p = RetentionPolicy(keep_last_n=1, keep_best_n=1, best_mode="min")
    assert "f20" not in p.to_delete(entries, protected=set())


def test_retention_explains_why_each_checkpoint_is_kept():
    entries = [_entry(f"f{s}", s, "full", reward=r) for s, r in [(10, 0.9), (20, 0.1), (30, 0.2)]]
    entries.append(_entry("l25", 25, "light"))
    why = RetentionPolicy(keep_last_n=1, keep_best_n=1).explain(
        entries, protected={"f20": "tag 'ok' points here"})
    assert why["f10"] == ["one of the 1 best by reward (max; keep_best_n=1)"]
    assert why["f20"] == ["tag 'ok' points here"]
    assert why["f30"] == ["the newest full checkpoint (always kept)",
                          "one of the newest 1 full (keep_last_n=1)"]
    assert why["l25"] == ["one of the newest 3 light (keep_last_n_light default=3)"]
    assert RetentionPolicy().explain(entries[:1], protected={})["f10"] == [
        "the newest full checkpoint (always kept)"]


def test_retention_with_the_seeds_config_is_bounded():
    # seed 000: {"keep_last_n": 3, "keep_best_n": 5}, a light save every step, a full one
    # every 10th; 100 saves with a rising, noisy reward
    entries = [_entry(f"s{s}", s, "full" if s % 10 == 0 else "light",
                      reward=(s % 7) + s / 100, t=float(s)) for s in range(1, 101)]
    p = RetentionPolicy.from_config(CheckpointConfig.from_dict(
        {"save_dir": "/x", "save_interval": 1, "save_full_interval": 10, "keep_last_n": 3,
         "keep_best_n": 5}))
    kept = {e["name"] for e in entries} - set(p.to_delete(entries, protected=set()))
    assert len(kept) <= 3 + 5 + DEFAULT_KEEP_LAST_N_LIGHT, sorted(kept)
    assert {"s100", "s90", "s80"} <= kept
    # seed 000's integration example, unchanged
    cfg = CheckpointConfig.from_dict({"save_dir": "/path/to/checkpoints", "save_interval": 200,
                                      "save_full_interval": 1000, "keep_last_n": 2,
                                      "keep_best_n": 3, "save_on_train_end": True})
    assert (cfg.save_interval, cfg.save_full_interval, cfg.keep_last_n, cfg.keep_best_n) == (
        200, 1000, 2, 3)


def test_retention_always_keeps_newest_full():
    entries = [_entry("f1", 1, "full"), _entry("f2", 2, "full")]
    assert RetentionPolicy(keep_last_n=1).to_delete(entries, protected=set()) == ["f1"]


def test_config_diff_lists_every_difference():
    diffs = config_diff({"algo": "grpo", "rollout": {"n": 4}, "kl": 0.1},
                        {"algo": "gae", "rollout": {"n": 4}, "seed": 1})
    assert diffs == [("algo", "grpo", "gae"), ("kl", 0.1, None), ("seed", None, 1)]


def test_a_key_added_later_compares_as_its_stated_default_when_absent():
    old = {"algo": "grpo"}  # written before "async.enable" existed
    now = {"algo": "grpo", "async.enable": False, ABSENT: {"async.enable": False}}
    assert config_diff(old, now) == [] and config_diff(now, old) == []
    on = {**now, "async.enable": True}
    assert config_diff(old, on) == [("async.enable", None, True)]
    # without the entry an absent key is a difference, as before
    assert config_diff(old, {"algo": "grpo", "async.enable": False}) == [("async.enable", None, False)]


def test_version_check():
    assert check_version({"format_version": 1, "compatible_since": 1}, "x") == []
    with pytest.raises(ValueError, match="Upgrade raycheckpoint"):
        check_version({"format_version": 9, "compatible_since": 9, "library_version": "9.0"}, "x")


def test_rng_roundtrip():
    state = capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(()).item())
    random.random(), np.random.rand(), torch.rand(3)
    assert restore_rng(state) == []
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == a


def test_sampler_resumes_mid_epoch():
    s = ResumableSampler(10, seed=3)
    first = s.next_batch(7)
    state = s.state_dict()
    rest = s.next_batch(8)  # crosses into epoch 1
    s2 = ResumableSampler(10, seed=3)
    s2.load_state_dict(state)
    assert s2.next_batch(8) == rest
    assert sorted(first + rest[:3]) == list(range(10))
    with pytest.raises(ValueError, match="seed"):
        ResumableSampler(10, seed=4).load_state_dict(state)


def test_a_data_loaders_state_survives_json_with_its_tensors():
    """A shuffling StatefulDataLoader's state holds its generator's state (a tensor):
    trainer_state.json keeps it, and anything needing code to load is refused."""
    gen = torch.Generator().manual_seed(7)
    state = {"_sampler_iter_state": {"generator": gen.get_state(), "yielded": 8},
             3: (1, b"x", None), "arr": np.arange(4, dtype=np.float32),
             "bf": torch.ones(2, 3, dtype=torch.bfloat16), "__rc.tuple__": [1.5, True]}
    back = decode_loader_state(json.loads(json_bytes(encode_loader_state(state))), "ts.json")
    assert back.keys() == state.keys() and back[3] == (1, b"x", None)
    assert back["__rc.tuple__"] == [1.5, True]
    assert torch.equal(back["_sampler_iter_state"]["generator"], gen.get_state())
    assert torch.equal(back["bf"], state["bf"]) and back["bf"].dtype == torch.bfloat16
    assert np.array_equal(back["arr"], state["arr"]) and back["arr"].dtype == np.float32
    with pytest.raises(TypeError, match=r"\['fn'\]: a function"):
        encode_loader_state({"fn": lambda: 0})
    forged = {"__rc.tensor__": {"dtype": "uint8", "shape": [9], "data": "AAA="}}
    with pytest.raises(IntegrityError, match=r"ts\.json: malformed"):
        decode_loader_state(forged, "ts.json")
    with pytest.raises(IntegrityError, match="unknown tag"):
        decode_loader_state({"__rc.object__": "os.system"}, "ts.json")


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread nice values here")
@pytest.mark.parametrize(("start", "lower", "expected"), [(0, 10, 10), (15, 10, 19), (5, 3, 8),
                                                          (15, 0, 15)])
def test_persist_priority_is_lowered_for_the_persist_thread_only(start, lower, expected):
    """Relative to the thread's own nice value: a Ray worker's threads start at 15."""
    import threading

    from raycheckpoint._internal.priority import lower_priority as _lower_priority

    seen = {}

    def persist_like():
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(start, os.getpriority(os.PRIO_PROCESS, tid)))
        begun = os.getpriority(os.PRIO_PROCESS, tid)
        _lower_priority(lower)
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, tid) - begun

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=persist_like)
    t.start()
    t.join(10)
    assert seen["thread"] == min(19, max(start, before) + lower) - max(start, before)
    if before <= start:
        assert seen["thread"] == expected - start
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


@pytest.mark.parametrize("fails", [False, True])
def test_a_once_call_lets_go_of_its_function(fails):
    """The snapshot's ``named`` holds the reference to ``begin``'s answer it was lent;
    once answered, nothing the early write's thread keeps may still hold it.  An error
    is kept with its traceback (which holds the function's frame): the save fails then."""
    import gc
    import weakref

    from raycheckpoint._internal.persist import _Once

    class Answer:
        calls = 0

        def __call__(self):
            Answer.calls += 1
            if fails:
                raise OSError("begin failed")
            return ("s1", "step_00000001")

    fn = Answer()
    alive = weakref.ref(fn)
    once = _Once(fn)
    del fn
    for _ in range(2):  # the answer (or error) kept, the function called once
        if fails:
            with pytest.raises(OSError, match="begin failed"):
                once()
        else:
            assert once() == ("s1", "step_00000001")
    gc.collect()
    assert Answer.calls == 1
    assert (alive() is None) is not fails


def _worker_marks(received: float) -> dict[str, float]:
    names = ["received", "previous", "state_dict", "extra", "planned", "copied", "named", "answered"]
    return {n: received + i * 0.001 for i, n in enumerate(names)}  # 1 ms a phase


def test_a_saves_breakdown_lays_its_phases_end_to_end_along_the_slowest_rank():
    from raycheckpoint._internal.breakdown import save_breakdown

    driver = {"start": 100.0, "trainer_state": 100.002, "begun": 100.010, "snapped": 100.020,
              "end": 100.021}
    fast, slow = {"marks": _worker_marks(100.004)}, {"marks": _worker_marks(100.0105)}
    out = save_breakdown(driver, [("actor/0", fast), ("actor/1", slow), ("rollout/0", {})])
    assert out["rank"] == "actor/1" and not out["queued"]
    assert out["trainer_state"] == 2.0 and out["to_worker"] == 8.5  # 100.002 -> 100.0105
    assert all(out[p] == 1.0 for p in ("wait_previous", "copy", "begin_answer", "answer"))
    assert out["to_driver"] == 2.5 and out["finish"] == 1.0
    assert out["total"] == 21.0 and out["begin_beside"] == 8.0
    # riding on a step: the step between the request and the snapshot is not the save's
    driver.update(begin_sent=100.003, send_start=100.5, sent=100.502, finish=101.0,
                  snapped=101.001, end=101.002)
    out = save_breakdown(driver, [("actor/0", {"marks": _worker_marks(100.9)})], queued=True)
    assert out["queued"] and "to_worker" not in out and "to_driver" not in out
    assert out["send"] == 1.0 and out["send_snapshots_beside"] == 2.0 and out["finish"] == 1.0
    assert out["wait_answers"] == 0.0 and out["driver_wait_beside"] == 1.0
    assert out["total"] == 2.0 + 1.0 + 7 * 1.0 + 1.0
    # the driver finishes right after the step: its wait for the answers runs beside the
    # snapshot (7 ms), counted once; a wait beyond it (a frozen role's snapshot) counts
    for snapped, beyond in ((100.908, 0.0), (100.912, 3.0)):
        driver.update(finish=100.902, snapped=snapped, end=snapped + 0.001)
        out = save_breakdown(driver, [("actor/0", {"marks": _worker_marks(100.9)})], queued=True)
        assert out["wait_answers"] == beyond and out["finish"] == 1.0
        assert out["total"] == 2.0 + 1.0 + 7 * 1.0 + beyond + 1.0
    assert save_breakdown(driver, [("actor/0", {"stall_s": 0.1})]) == {}  # no marks: none
