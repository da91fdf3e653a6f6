"""The check that no test writes Ray's default temporary directory (tests/ray_temp_guard.py).

Each case runs pytest on a small test file in a subprocess with the plugin loaded and
``TMPDIR`` pointing at a fresh directory, so Ray's default temporary directory is
``TMPDIR/ray`` (the machine's ``/tmp/ray`` is neither read nor written), and looks at how
that session ended.  No Ray instance is started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TESTS = '''
import os

def test_minds_its_own_business(tmp_path):
    (tmp_path / "x").write_text("x")

def test_starts_a_ray_without_a_temp_dir():
    os.makedirs(os.path.join(os.environ["TMPDIR"], "ray", "session_latest"))

def test_after_it():
    pass
'''


def inner_pytest(tmp_path: Path, source: str, ray_dir_exists: bool = False) -> subprocess.CompletedProcess:
    temp = tmp_path / "t"
    temp.mkdir()
    if ray_dir_exists:
        (temp / "ray").mkdir()
    (tmp_path / "test_inner.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "RAY_TMPDIR"}
    env["TMPDIR"] = str(temp)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.ray_temp_guard", "-p", "no:cacheprovider",
         "-c", os.devnull, "--rootdir", str(tmp_path), "-q", str(tmp_path / "test_inner.py")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_test_that_creates_rays_default_temp_dir_fails_and_so_does_the_run(tmp_path):
    proc = inner_pytest(tmp_path, TESTS)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "ERROR at teardown of test_starts_a_ray_without_a_temp_dir" in out, out
    assert f"Ray's default temporary directory {tmp_path / 't' / 'ray'} did not exist" in out, out
    assert "it holds: session_latest" in out, out
    assert "3 passed, 1 error" in out, out  # the tests after it are not blamed


def test_a_run_that_leaves_it_alone_passes(tmp_path):
    proc = inner_pytest(tmp_path, TESTS.split("def test_starts")[0])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "t" / "ray").exists()


def test_when_it_exists_already_the_check_is_off_and_says_so(tmp_path):
    proc = inner_pytest(tmp_path, TESTS, ray_dir_exists=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"note: Ray's default temporary directory {tmp_path / 't' / 'ray'} existed" in proc.stdout
