"""scripts/gpu_job_check.sh, the RL job on one GPU killed and resumed: its CPU mode here
(the same three runs of the driver, a small model), the GPU mode where a CUDA device is."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def run_check(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(["bash", "scripts/gpu_job_check.sh", *args, str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    return proc, json.loads((out / "gpu_job_check.json").read_text())


@pytest.mark.long
@pytest.mark.timeout(660)
def test_the_job_check_kills_and_resumes_the_job_on_cpu(tmp_path):
    proc, report = run_check(tmp_path, "--cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["status"] for r in report["runs"].values()] == ["ok", "ok", "ok"]
    cmp_ = report["compare"]
    assert cmp_["resumed_equals_straight"] and 0 < cmp_["resumed_from_step"] <= 5
    assert "resumed == straight" in proc.stdout
    steps = [s["step"] for s in report["saves"]]
    assert {2, 4, 6} <= set(steps)
    assert report["runs"]["killed"]["last_step"] == 5
    for s in report["saves"]:
        assert s["host_bytes"] > 0 and s["copy_limit_s"] > 0 and s["stall_over_copy"] > 0


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_the_job_check_on_a_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    proc, report = run_check(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert report["runs"]["killed"]["gpu_memory_returned"]
