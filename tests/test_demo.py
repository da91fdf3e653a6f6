"""End to end: a driver SIGKILLed mid-run resumes exactly (the README's main job)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_crash_and_resume_match_straight_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "drivers.demo", "--root", str(tmp_path / "demo"),
                           "--steps", "9", "--crash-at", "5"],
                          capture_output=True, text=True, timeout=560)
    out = proc.stdout
    assert "driver exit code -9" in out, out + proc.stderr[-3000:]
    assert "resumed from step_00000003 (step 3)" in out, out
    assert "resumed run == straight run (bitwise weights): True" in out, out + proc.stderr[-3000:]
    assert proc.returncode == 0
