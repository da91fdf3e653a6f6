"""The RL job's asynchronous mode end to end, killed and resumed (``ray job submit``).

Sequences are kept in flight across every save (3 decode steps per training step, responses
of up to 8 tokens), so each resume continues sequences from their saved tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from drivers.metrics import resumed_at
from tests.helpers import flip_bit
from tests.ray_head import ray_head as start_head
from tests.test_rl_job import metrics, submit

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(1200)]

ASYNC = ["async_training.enable=true", "async_training.schedule=deterministic",
         "async_training.decode_steps_per_step=3",
         "async_training.staleness_threshold=2", "trainer.save_freq=2", "data.num_prompts=64"]
# a random kill, which may land while its step's save persists; never right after step 3: the
# first save (step 2, which also writes the frozen reference and reward weights) may not
# have committed by then, and the resume would start afresh (CI met it under load)
KILL_AFTER = [4, 5, 6]
SAME = ("loss", "reward", "kl", "actor_weights_sha256", "staleness_mean", "staleness_max",
        "dropped_groups", "queue_depth", "in_flight", "policy_version", "batch_prompts")


@pytest.fixture(scope="module")
def ray_head():
    with start_head() as head:
        yield head


def run(head, root: Path, *args: str, ok: bool = True):
    out = submit(head, [*ASYNC, f"trainer.default_local_dir={root}", *args])
    if ok:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def prompts(ms: dict[int, dict], steps) -> list[tuple[int, int]]:
    return [tuple(k) for s in steps for k in ms[s]["batch_prompts"]]


@pytest.mark.parametrize("seed", [0, 1])
def test_killed_async_job_resumes_bit_for_bit(ray_head, tmp_path, seed):
    steps = 7
    common = [f"trainer.total_training_steps={steps}", f"trainer.seed={seed}", f"data.seed={seed}"]
    if seed:  # an encrypted root: the rollout state is training data, stored encrypted
        key = tmp_path / "key"
        key.write_bytes(bytes(range(32)))
        common.append(f"checkpoint.encryption_key=file:{key}")
    run(ray_head, tmp_path / "a", *common)
    a = metrics(tmp_path / "a")
    crash = random.Random().choice(KILL_AFTER)
    print(f"seed {seed}: SIGKILL after step {crash}")
    b_root = tmp_path / "b"
    killed = run(ray_head, b_root, *common, f"trainer.crash_at_step={crash}", ok=False)
    assert killed.returncode != 0 and max(metrics(b_root)) == crash
    before = metrics(b_root)
    again = run(ray_head, b_root, *common, "trainer.resume_mode=auto")
    start = resumed_at(again.stdout)
    assert 2 <= start <= crash
    b = metrics(b_root)
    assert a[start]["in_flight"] > 0  # sequences were in flight when it saved
    restored = [e for e in b[start + 1]["ckpt_events"] if e.startswith("rollout state restored")]
    assert restored and f"{a[start]['in_flight']} sequences in flight" in restored[0]
    for step in range(start + 1, steps + 1):
        for key in SAME:
            assert a[step][key] == b[step][key], (seed, step, key)
    # nothing saved was generated again: the resumed run generated exactly what the straight
    # run generated after the checkpoint
    assert (before[start]["tokens_generated"] + b[steps]["tokens_generated"]
            == a[steps]["tokens_generated"])
    trained = prompts(before, range(1, start + 1)) + prompts(b, range(start + 1, steps + 1))
    assert len(trained) == len(set(trained))  # no prompt trained twice
    state = (b_root / f"step_{start:08d}" / "rollout_state.json").read_bytes()
    assert (b"inflight" in state) == (not seed)


def test_rollout_state_drop_regenerates_what_was_in_flight(ray_head, tmp_path):
    root = tmp_path / "run"
    common = ["trainer.total_training_steps=6"]
    run(ray_head, root, *common, "trainer.crash_at_step=4", "trainer.crash_once_committed=true",
        ok=False)
    before = metrics(root)
    assert before[4]["in_flight"] > 0
    again = run(ray_head, root, *common, "trainer.resume_mode=auto", "checkpoint.rollout_state=drop")
    assert resumed_at(again.stdout) == 4
    after = metrics(root)
    dropped = [e for e in after[5]["ckpt_events"] if e.startswith("rollout state dropped")]
    assert dropped and int(dropped[0].split()[3]) > 0
    trained = prompts(before, range(1, 5)) + prompts(after, range(5, 7))
    assert len(trained) == len(set(trained))  # regenerated, never lost nor repeated


def test_rollout_ranks_reshard_two_to_one_and_back(ray_head, tmp_path):
    root = tmp_path / "run"
    reshard = "checkpoint.allow_reshard=true"
    run(ray_head, root, "trainer.total_training_steps=4", "rollout.n_gpus_per_node=2")
    one = run(ray_head, root, "trainer.total_training_steps=6", "rollout.n_gpus_per_node=1", reshard)
    assert resumed_at(one.stdout) == 4 and "resharded" in one.stdout
    ms = metrics(root)
    saved = ms[4]["in_flight"]
    assert saved > 0
    assert (f"rollout state restored: {saved} sequences in flight on 1 rank(s) (saved on 2)"
            in " ".join(ms[5]["ckpt_events"]))
    two = run(ray_head, root, "trainer.total_training_steps=8", "rollout.n_gpus_per_node=2", reshard)
    assert resumed_at(two.stdout) == 6
    ms = metrics(root)
    assert "on 2 rank(s) (saved on 1)" in " ".join(ms[7]["ckpt_events"])
    trained = prompts(ms, range(1, 9))
    assert len(trained) == len(set(trained)) == 8 * 4
    assert all(ms[s]["staleness_max"] <= 2 for s in range(1, 9))


def test_a_damaged_rollout_state_falls_back_to_the_checkpoint_before(ray_head, tmp_path):
    root = tmp_path / "run"
    run(ray_head, root, "trainer.total_training_steps=4")
    flip_bit(str(root / "step_00000004" / "rollout_state.json"))
    again = run(ray_head, root, "trainer.total_training_steps=6", "trainer.resume_mode=auto")
    assert resumed_at(again.stdout) == 2
    assert "rollout_state.json" in again.stdout + again.stderr


def test_weights_synced_every_two_steps_a_save_between_syncs_resumes_bit_for_bit(ray_head, tmp_path):
    """``trigger_parameter_sync_step=2``: a checkpoint of an odd step holds the rollout's
    weights of the step before (the last sync), which are no longer the actor's.  With
    ``require_batches=2`` each step trains on two batches, one update each."""
    common = ["trainer.total_training_steps=6", "trainer.save_freq=1",
              "async_training.trigger_parameter_sync_step=2", "async_training.staleness_threshold=1",
              "async_training.require_batches=2"]
    run(ray_head, tmp_path / "a", *common)
    a = metrics(tmp_path / "a")
    assert [a[s]["policy_version"] for s in range(1, 7)] == [0, 0, 1, 1, 2, 2]
    assert all(len(a[s]["batch_prompts"]) == 2 * 4 for s in range(1, 7))
    # the LR schedule (0.01 down to half over 6 steps) advances once per step, not per update
    assert all(abs(a[s]["lr"] - 0.01 * (1 - 0.5 * s / 6)) < 1e-6 for s in range(1, 7))
    assert all(a[s]["staleness_max"] <= 1 for s in range(1, 7))
    root = tmp_path / "b"
    # killed once step 3's save committed: an odd step's checkpoint is what this tests
    run(ray_head, root, *common, "trainer.crash_at_step=3", "trainer.crash_once_committed=true",
        ok=False)
    again = run(ray_head, root, *common)
    assert resumed_at(again.stdout) == 3
    b = metrics(root)
    synced = [e for e in b[4]["ckpt_events"] if e.startswith("rollout weights re-synced")]
    # the rollout got the weights of step 2's sync back, not the actor's of step 3
    assert synced and synced[0].split()[-1] == a[2]["actor_weights_sha256"]
    assert a[2]["actor_weights_sha256"] != a[3]["actor_weights_sha256"]
    for step in range(4, 7):
        for key in SAME:
            assert a[step][key] == b[step][key], (step, key)


def rollout_doc(root: Path, step: int) -> dict:
    return json.loads((root / f"step_{step:08d}" / "rollout_state.json").read_bytes())


def tokens_held(doc: dict) -> int:
    """Tokens a rollout state holds: in flight on every rank, and queued."""
    seqs = [s for rank in doc["inflight"] for s in rank] + doc["hub"]["queue"]["sequences"]
    return sum(len(s["tokens"]) for s in seqs)


def test_free_running_job_killed_and_resumed_loses_and_repeats_nothing(ray_head, tmp_path):
    """The free-running schedule (rollout ranks generate on their own): across a kill and a
    resume no prompt is trained twice or lost, no trained sample is staler than the bound,
    and no token the checkpoint holds is generated again (the tokens the resumed run
    generated are exactly those it trained, queued, kept in flight or dropped, less those it
    restored)."""
    root = tmp_path / "run"
    common = ["async_training.schedule=free", "rollout.n_gpus_per_node=2", "data.num_prompts=32",
              "trainer.total_training_steps=10"]
    crash = random.Random().choice(KILL_AFTER)
    print(f"SIGKILL after step {crash}")
    killed = run(ray_head, root, *common, f"trainer.crash_at_step={crash}", ok=False)
    assert killed.returncode != 0
    before = metrics(root)
    again = run(ray_head, root, *common, "trainer.resume_mode=auto")
    start = resumed_at(again.stdout)
    after = metrics(root)
    saved, final = rollout_doc(root, start), rollout_doc(root, 10)
    assert tokens_held(saved) > 0
    trained = prompts(before, range(1, start + 1)) + prompts(after, range(start + 1, 11))
    assert len(trained) == len(set(trained))
    d = final["hub"]["dispatcher"]
    pending = {tuple(k) for k in d["outstanding"] + d["requeue"]}
    epoch0 = {k for k in trained if k[0] == 0} | {k for k in pending if k[0] == 0}
    assert epoch0 == {(0, i) for i in range(32)}  # each trained once, or still on its way
    assert all(after[s]["staleness_max"] <= 2 for s in range(start + 1, 11))
    dropped = (final["hub"]["queue"]["dropped_tokens"] - saved["hub"]["queue"]["dropped_tokens"])
    trained_tokens = sum(after[s]["tokens_trained"] for s in range(start + 1, 11))
    assert sum(final["generated"]) == (trained_tokens + tokens_held(final) + dropped
                                       - tokens_held(saved))
    assert all("rollout_pause_s" in c for s in range(start + 1, 11)
               for c in after[s]["checkpoint_stats"] if c["ok"])


@pytest.mark.parametrize("schedule", ["deterministic", "free"])
def test_without_partial_rollout_each_sequence_comes_from_one_policy(ray_head, tmp_path, schedule):
    """``async_training.partial_rollout=false``: sequences in flight at a sync finish under
    the weights they began with, so every sequence, queued or in flight at a save, carries
    one policy version (with partial rollout, those of the run above carry several)."""
    root = tmp_path / "run"
    run(ray_head, root, "trainer.total_training_steps=4", "async_training.partial_rollout=false",
        f"async_training.schedule={schedule}")
    for step in (2, 4):
        doc = rollout_doc(root, step)
        seqs = [s for rank in doc["inflight"] for s in rank] + doc["hub"]["queue"]["sequences"]
        assert seqs and all(len(set(s["versions"])) == 1 for s in seqs), step
    assert all(r["staleness_max"] <= 2 for r in metrics(root).values())
