"""scripts/gpu_check.sh, the prepared check for a GPU machine: its CPU leg here, the GPU
leg where a CUDA device is visible (skipped otherwise)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# what the GPU machine lacks: the check must return its whole table without them
ABSENT = "blake3,ray,cryptography,s3fs,vllm,boto3,botocore"


def run_check(out: Path, *args: str) -> dict:
    proc = subprocess.run(["bash", "scripts/without.sh", ABSENT, "--", "bash",
                           "scripts/gpu_check.sh", *args, str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ok   save on device, load on cpu: bitwise" in proc.stdout
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.long
@pytest.mark.timeout(300)
def test_the_check_runs_its_cpu_leg_without_what_the_gpu_machine_lacks(tmp_path):
    report = run_check(tmp_path, "--cpu")
    assert report["ok"] and report["mode"] == "cpu" and report["checksum"] == "sha256"
    assert set(report["legs"]) == {"roundtrip", "reshard", "load_on_device", "stall_16MB",
                                   "stall_64MB", "host_buffer", "memory", "kill"}
    assert all(leg["status"] == "ok" for leg in report["legs"].values())
    assert len(report["checks"]) == 10 and all(report["checks"].values())
    assert [r["gb_per_rank"] for r in report["stall"]] == [1 / 64, 1 / 16]
    for row in report["stall"]:  # the overlap stall counts the optimizer step's wait
        assert row["overlap_s"] == pytest.approx(row["overlap_plan_s"] + row["overlap_wait_s"],
                                                 rel=0.5, abs=1e-3)
    hb = report["host_buffer"]  # a save through a 4 MiB buffer: 16 MB in chunks
    assert hb["bitwise"] and 0 < hb["host_bytes"] <= hb["budget_bytes"] and hb["chunks"] >= 4
    assert len(report["memory"]) == 12
    assert report["kill"]["killed"] and report["kill"]["finished_saves"] >= 2
    # the projection calibrates from a GPU's result only
    from bench.projection import calibrate_from_gpu_check

    with pytest.raises(SystemExit, match="not the result of a run on a GPU"):
        calibrate_from_gpu_check({}, report)


@pytest.mark.timeout(180)
def test_a_failed_a_hung_and_an_interrupted_leg_keep_the_other_legs_results(tmp_path):
    """roundtrip fails (the legs that need its checkpoint are skipped, not failed), the
    first stall leg hangs past its timeout, the second passes, and the run is stopped
    with SIGTERM inside the memory leg: the report holds each outcome, and the rows the
    run reached."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.gpu_check", "--cpu", "--leg-timeout-s", "8",
         "--fail", "roundtrip", "--fail", "stall_16MB:hang", "--fail", "memory:hang",
         str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    path = tmp_path / "gpu_check.json"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, "memory leg never ran"
            legs = json.loads(path.read_text())["legs"] if path.exists() else {}
            if legs.get("memory", {}).get("status") == "running":
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 124, out
    report = json.loads(path.read_text())
    legs = report["legs"]
    assert legs["roundtrip"]["status"] == "failed"
    assert "failed on purpose" in legs["roundtrip"]["error"]
    assert legs["reshard"] == {"status": "skipped", "reason": "needs roundtrip failed"}
    assert legs["load_on_device"] == {"status": "skipped", "reason": "needs reshard skipped"}
    assert legs["stall_16MB"]["status"] == "timed out"
    assert legs["stall_64MB"]["status"] == "ok"
    assert legs["memory"]["status"] == "interrupted" and "kill" not in legs
    assert [r["gb_per_rank"] for r in report["stall"]] == [1 / 16]
    assert report["interrupted"] and not report["ok"]
    assert "leg stall_16MB      timed out" in out and "INTERRUPTED" in out


def test_the_checksum_without_blake3_is_sha256_and_blake3_is_refused_by_name(monkeypatch):
    from raycheckpoint.errors import MissingDependencyError
    from raycheckpoint.integrity import digest

    monkeypatch.setitem(sys.modules, "blake3", None)  # as on a machine without the package
    assert not digest.available("blake3") and digest.available("sha256")
    assert digest.like(b"abc", digest.of(b"abc", "sha256")) == digest.of(b"abc", "sha256")
    with pytest.raises(MissingDependencyError, match=r"pip install blake3.*checksum_algorithm=sha256"):
        digest.of(b"abc", "blake3")


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
