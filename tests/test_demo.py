"""End to end: a driver SIGKILLed mid-run resumes exactly (the README's main job)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# three driver runs, each starting its own Ray: with the long tests (.ci/run runs them)
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(600)]


def test_crash_and_resume_match_straight_run(tmp_path):
    # killed after step 6: step 6's light save starts only once step 5's full one has
    # finished, so step 5 is committed whatever the timing (a kill after step 5 itself
    # could land before its save commits, and the job would rightly start afresh)
    proc = subprocess.run([sys.executable, "-m", "drivers.demo", "--root", str(tmp_path / "demo"),
                           "--steps", "8", "--crash-at", "6",
                           "trainer.n_gpus_per_node=1", "data.train_batch_size=4"],
                          capture_output=True, text=True, timeout=560)
    out = proc.stdout
    assert "driver exit code -9" in out, out + proc.stderr[-3000:]
    assert "resumed from step_00000005 at step 5" in out, out + proc.stderr[-7000:]
    assert "mean reward" in out and "training blocked per save" in out
    assert "resumed run == straight run (metrics and weights, bitwise, steps 6-8): True" in out, \
        out + proc.stderr[-3000:]
    assert proc.returncode == 0
