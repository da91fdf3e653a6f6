"""The asynchronous job's parts without Ray: token-by-token sequences, dispatcher, queue."""

from __future__ import annotations

import json

import pytest
import torch

from drivers.async_hub import Dispatcher, SampleQueue, oldest_version
from workers.models import BOS, EOS, PAD, build_causal_lm, encode
from workers.streaming import Sequence, Streams

MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 1}


def streams(max_new_tokens: int = 6) -> Streams:
    return Streams(seed=7, temperature=1.0, max_new_tokens=max_new_tokens, pad=PAD, eos=EOS,
                   device=torch.device("cpu"))


def items(pids: list[int], n: int = 2) -> list[dict]:
    return [{"epoch": 0, "pid": p, "sample": j, "prompt": [BOS, *encode("aaa:")], "tokens": [],
             "versions": [], "logprobs": []} for p in pids for j in range(n)]


def run_out(s: Streams, net, version: int = 0) -> list[dict]:
    done = []
    while s.live:
        done += s.step(net, version)
    return done


def test_a_sequence_continues_from_its_saved_tokens_on_another_rank_exactly():
    net = build_causal_lm(MODEL, seed=3).eval()
    straight = streams()
    straight.admit(items([0, 1, 2]))
    expected = {(d["pid"], d["sample"]): d for d in run_out(straight, net)}

    first = streams()
    first.admit(items([0, 1, 2]))
    early = first.step(net, 0) + first.step(net, 1)  # a later version for the second token
    saved = json.loads(json.dumps(first.state()))  # what a checkpoint stores: plain JSON
    assert saved and all(len(d["tokens"]) == 2 for d in saved)
    assert len(saved) + len(early) == 6
    # two ranks take half each (a resharded resume); tokens so far are never drawn again
    halves = [streams(), streams()]
    halves[0].load(saved[: len(saved) // 2])
    halves[1].load(saved[len(saved) // 2:])
    before = sum(h.tokens_generated for h in halves)
    got = {(d["pid"], d["sample"]): d for h in halves for d in run_out(h, net)}
    assert set(got) | {(d["pid"], d["sample"]) for d in early} == set(expected)
    for key, d in got.items():
        assert d["tokens"] == expected[key]["tokens"], key
        assert d["versions"][:2] == [0, 1]
        assert d["logprobs"][2:] == expected[key]["logprobs"][2:]
    # only the tokens after the saved ones were generated after the load
    generated = sum(h.tokens_generated for h in halves) - before
    assert generated == sum(len(d["tokens"]) - 2 for d in got.values())


def test_a_malformed_in_flight_sequence_is_refused():
    bad = {**items([0])[0], "tokens": [5], "versions": [], "logprobs": []}
    with pytest.raises(ValueError, match="1 tokens, 0 versions"):
        Sequence.from_dict(bad)
    with pytest.raises(ValueError, match="without"):
        Sequence.from_dict({"epoch": 0})


def test_the_dispatcher_throttles_to_the_staleness_bound_and_gives_back_first():
    d = Dispatcher(10, seed=0, batch=2, staleness=1)
    first = d.dispatch(8, version=0)
    assert len(first) == 4  # (0 + 1 + 1) batches under version 0
    assert d.dispatch(1, version=0) == []
    d.consume(first[:2])  # the trainer takes a batch; the version is still 0
    assert d.dispatch(5, version=0) == []
    more = d.dispatch(5, version=1)
    assert len(more) == 2
    d.give_back([first[2]])  # its group dropped: dispatched again before any new prompt
    assert d.dispatch(1, version=1) == [first[2]]
    state = json.loads(json.dumps(d.state()))
    again = Dispatcher(10, seed=0, batch=2, staleness=1)
    again.load(state)
    assert again.state() == d.state()
    assert again.dispatch(1, version=5) == d.dispatch(1, version=5)


def test_a_sync_every_k_steps_lets_k_batches_per_version_out():
    # trigger_parameter_sync_step=3: the trainer takes 3 batches under each version
    d = Dispatcher(100, seed=0, batch=2, staleness=1, sync_every=3)
    first = d.dispatch(100, version=0)
    assert len(first) == (0 + 1 + 1) * 3 * 2
    d.consume(first[:6])  # three steps under version 0, then the sync
    assert d.dispatch(100, version=0) == []
    assert len(d.dispatch(100, version=1)) == 6


def test_a_fractional_staleness_lets_that_share_of_a_version_out_ahead():
    # verl's staleness_threshold=0.5: half a version's batches generated ahead
    d = Dispatcher(100, seed=0, batch=4, staleness=0.5, sync_every=2)
    assert len(d.dispatch(100, version=0)) == 12  # (1 + 0.5) * 2 batches of 4
    assert len(d.dispatch(100, version=1)) == 8


def test_an_epoch_is_dispatched_once_whatever_is_given_back():
    d = Dispatcher(6, seed=3, batch=2, staleness=0)
    taken: list[tuple[int, int]] = []
    version = 0
    while len(taken) < 6:
        keys = d.dispatch(2, version)
        if version == 1:
            d.give_back(keys[:1])  # lost work: the prompt comes back, not a new one
            keys = keys[1:] + d.dispatch(1, version)
        d.consume(keys)
        taken += keys
        version += 1
    assert sorted(taken) == [(0, i) for i in range(6)]


def test_the_queue_hands_out_complete_groups_only():
    q = SampleQueue(n=2)
    seqs = [{"epoch": 0, "pid": p, "sample": j, "tokens": [3], "versions": [v], "logprobs": [0.0]}
            for p, v in ((1, 0), (2, 1)) for j in range(2)]
    q.push(seqs[:3])
    assert q.complete() == [(0, 1)] and q.depth() == 3
    q.push(seqs[3:])
    assert q.complete() == [(0, 1), (0, 2)]
    assert oldest_version(q.groups[(0, 2)]) == 1
    state = json.loads(json.dumps(q.state()))
    again = SampleQueue(n=2)
    again.load(state)
    assert again.complete() == q.complete() and again.depth() == 4


@pytest.mark.parametrize("change, message", [
    ({"algorithm.adv_estimator": "gae"}, "set algorithm.adv_estimator=grpo"),
    ({"async_training.require_batches": 0}, "require_batches must be >= 1"),
    ({"async_training.trigger_parameter_sync_step": 0}, "trigger_parameter_sync_step must be >= 1"),
    ({"async_training.staleness_threshold": -1}, "staleness_threshold must be >= 0"),
    ({"async_training.schedule": "eager"}, "schedule must be one of"),
    ({"checkpoint.rollout_state": "some"}, "rollout_state must be one of"),
])
def test_the_async_options_it_does_not_implement_are_refused_in_one_line(change, message):
    from drivers.async_ppo import check_async_options
    from drivers.config import DEFAULTS

    opts = {**DEFAULTS, "algorithm.adv_estimator": "grpo", "checkpoint.rollout_state": "full",
            "async_training.enable": True}
    check_async_options({**opts, "actor_rollout_ref.rollout.name": "vllm",
                         "async_training.trigger_parameter_sync_step": 4,
                         "async_training.staleness_threshold": 0.1,
                         "async_training.require_batches": 2})  # all accepted
    with pytest.raises(SystemExit, match=message):
        check_async_options({**opts, **change})


def test_a_synchronous_jobs_checkpoint_from_before_the_async_keys_still_resumes():
    from drivers.config import DEFAULTS
    from drivers.job_spec import fingerprint
    from raycheckpoint.resume import ABSENT, config_diff

    now = fingerprint(dict(DEFAULTS), data_sha=7, rows=64)
    before = {k: v for k, v in now.items() if not k.startswith("async_training.") and k != ABSENT}
    assert config_diff(before, now) == []
    on = fingerprint({**DEFAULTS, "async_training.enable": True}, data_sha=7, rows=64)
    assert [d[0] for d in config_diff(before, on)] == ["async_training.enable"]


# the resume fingerprint's keys of the checkpoints written before any key was added to it
# (the job's fingerprint up to the asynchronous mode): frozen, never edited
FIRST_FINGERPRINT = {
    "actor_rollout_ref.actor.clip_ratio", "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.optim.end_factor", "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.model.arch",
    "actor_rollout_ref.model.hidden_size", "actor_rollout_ref.model.intermediate_size",
    "actor_rollout_ref.model.num_heads", "actor_rollout_ref.model.num_layers",
    "actor_rollout_ref.model.path", "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.response_length", "actor_rollout_ref.rollout.temperature",
    "algorithm.adv_estimator", "algorithm.gamma", "algorithm.lam", "critic.model.path",
    "critic.optim.lr", "data.rows", "data.sha256", "data.train_batch_size",
    "reward_model.model.path", "reward_model.rm_coef", "trainer.seed"}


def test_every_key_added_to_the_fingerprint_says_what_its_absence_means():
    """A key added to the fingerprint is missing from every checkpoint written before it: it
    must be in ``LATER_KEYS`` (absent means its default), or a strict resume of those
    checkpoints is refused for a difference the user never made."""
    from drivers.config import DEFAULTS
    from drivers.job_spec import LATER_KEYS, fingerprint
    from raycheckpoint.resume import ABSENT, config_diff

    now = fingerprint(dict(DEFAULTS), data_sha=7, rows=64)
    added = set(now) - FIRST_FINGERPRINT - {ABSENT}
    assert added <= set(LATER_KEYS), f"add to drivers/job_spec.LATER_KEYS: {sorted(added - set(LATER_KEYS))}"
    assert not FIRST_FINGERPRINT - set(now), "a key left the fingerprint: old checkpoints hold it"
    first = {k: (7 if k == "data.sha256" else 64 if k == "data.rows" else DEFAULTS[k])
             for k in FIRST_FINGERPRINT}
    assert config_diff(first, now) == []  # an old default job's checkpoint resumes strictly
