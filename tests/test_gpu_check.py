"""scripts/gpu_check.sh, the prepared check for a GPU machine: its CPU leg here, the GPU
leg where a CUDA device is visible (skipped otherwise)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def run_check(out: Path, *args: str) -> dict:
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", *args, str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ok   save on device, load on cpu: bitwise" in proc.stdout
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.timeout(300)
def test_the_check_runs_its_cpu_leg(tmp_path):
    report = run_check(tmp_path, "--cpu")
    assert report["ok"] and report["mode"] == "cpu"
    assert len(report["checks"]) == 7 and all(report["checks"].values())
    assert [r["gb_per_rank"] for r in report["stall"]] == [1 / 64, 1 / 16]
    assert len(report["memory"]) == 20 and report["kill"]["killed"]
    # the projection calibrates from a GPU's result only
    from bench.projection import calibrate_from_gpu_check

    with pytest.raises(SystemExit, match="not the result of a run on a GPU"):
        calibrate_from_gpu_check({}, report)


def test_the_projection_takes_the_gpus_measured_stall_ratios():
    from bench.projection import calibrate_from_gpu_check, project

    gpu = {"mode": "cuda", "stall": [{"gb_per_rank": 1, "stall_ratio": 1.5, "overlap_ratio": 0.2},
                                     {"gb_per_rank": 16, "stall_ratio": 1.1, "overlap_ratio": 0.05}]}
    calib = calibrate_from_gpu_check({"stall_over_host_copy": 3.0, "durable_over_raw_write": 1.2,
                                      "verl_over_raw_write": 1.0, "rank0_over_raw_write": 1.0,
                                      "commit_overhead_256_s": 0.0}, gpu)
    assert calib["stall_over_host_copy"] == 1.1 and calib["overlap_stall_over_host_copy"] == 0.05
    from bench.projection import HARDWARE

    row = project(7e9, 256, HARDWARE["H100"], calib)
    assert row["raycheckpoint_overlap_stall_s"] == pytest.approx(row["limit_copy_s"] * 0.05)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_the_check_on_a_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    report = run_check(tmp_path)
    assert report["ok"] and report["checks"]["GPU memory free after the kill"]
