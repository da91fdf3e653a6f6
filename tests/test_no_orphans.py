"""Nothing outlives a job: the RL driver with its embedded local Ray, killed at a random
moment or ending normally, leaves no process behind.

Each case starts ``python -m drivers.main_ppo`` as a child process, records every
descendant of it (PID and start time) while it runs, SIGKILLs it after a random delay
(before, during or after its saves: it saves every step), and then requires that within
30 s none of the recorded processes is alive and no process has a file, its working
directory or its command line under the session's temporary directory, which is removed.
Processes are never matched by name.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPORTS

REPO = Path(__file__).resolve().parents[1]
SETTLE_S = 30.0
JOB = ["trainer.n_gpus_per_node=1", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
       "trainer.total_training_steps=8", "trainer.save_freq=1", "trainer.step_delay_s=0.3"]
TALLY = {"runs": 0, "kills": 0, "left": 0}
# the job runs ~25 s here: Ray and the workers start, then a save every step
KILL_WINDOW_S = (2.0, 26.0)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", autouse=True)
def report():
    """After the module: how many runs and kills were made and what they left."""
    yield
    if TALLY["runs"]:
        REPORTS.append(f"no orphans: {TALLY['runs']} driver runs ({TALLY['kills']} SIGKILLed at "
                       f"random moments), {TALLY['left']} processes left after {SETTLE_S:.0f}s")


class Recorder(threading.Thread):
    """Records ``root``'s descendants (pid -> start time) until stopped."""

    def __init__(self, root: psutil.Process) -> None:
        super().__init__(daemon=True)
        self.root, self.seen, self.stopped = root, {}, threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                for child in self.root.children(recursive=True):
                    self.seen.setdefault(child.pid, child.create_time())
            except psutil.Error:
                pass
            time.sleep(0.1)


def alive(pid: int, started: float) -> bool:
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def using(base: str) -> list[str]:
    """Processes with a file, cwd or argument under ``base`` (what psutil can see)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if (any(base in a for a in p.info["cmdline"] or []) or p.cwd().startswith(base)
                    or any(f.path.startswith(base) for f in p.open_files())):
                found.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:80]}")
        except psutil.Error:
            continue
    return found


def run_driver(tmp_path: Path, kill_after: float | None) -> tuple[list[str], str]:
    """Run the job; SIGKILL it after ``kill_after`` s (None: let it end). Returns what is
    left after SETTLE_S, and how the driver ended."""
    base = tempfile.mkdtemp(prefix="rck", dir="/tmp")  # short: Ray's socket paths live here
    env = {**os.environ, "RAYCHECKPOINT_RAY_TMPDIR": base}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "driver.log", "w")  # noqa: SIM115 - closed below
    driver = subprocess.Popen([sys.executable, "-m", "drivers.main_ppo", *JOB,
                               f"trainer.default_local_dir={tmp_path / 'ck'}"],
                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    recorder = Recorder(psutil.Process(driver.pid))
    recorder.start()
    try:
        try:
            driver.wait(timeout=kill_after if kill_after is not None else 180)
            ended = f"exited {driver.returncode}"
        except subprocess.TimeoutExpired:
            if kill_after is None:
                raise
            driver.send_signal(signal.SIGKILL)
            driver.wait(timeout=30)
            ended = f"SIGKILLed after {kill_after:.1f}s"
        recorder.stopped.set()
        recorder.join(timeout=5)
        deadline = time.monotonic() + SETTLE_S
        while True:
            left = [f"{pid} (recorded)" for pid, t in recorder.seen.items() if alive(pid, t)]
            left += [u for u in using(base) if u.split()[0] not in {x.split()[0] for x in left}]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(1)
        if not left and os.listdir(base):
            left = [f"{base} still holds {os.listdir(base)}"]
        return left, ended
    finally:
        log.close()
        for pid, t in recorder.seen.items():  # the test's own clean-up, by recorded PID
            if alive(pid, t):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


def _check(tmp_path: Path, kill_after: float | None) -> None:
    left, ended = run_driver(tmp_path, kill_after)
    TALLY["runs"] += 1
    TALLY["kills"] += ended.startswith("SIGKILLed")
    TALLY["left"] += len(left)
    tail = (tmp_path / "driver.log").read_text()[-2000:]
    assert not left, f"driver {ended}; left after {SETTLE_S:.0f}s: {left}\n{tail}"


def test_a_job_that_ends_normally_leaves_nothing(tmp_path):
    _check(tmp_path, None)
    assert "final actor weights sha256" in (tmp_path / "driver.log").read_text()


# a handful here, 20 more with the long tests; the delays span the start (Ray, workers),
# the saves and the last steps (a driver that ends first counts as a run, not a kill)
@pytest.mark.parametrize("seed", [1, 5, 9])  # after 5.2, 16.9 and 9.8 s
def test_a_killed_driver_leaves_nothing(tmp_path, seed):
    _check(tmp_path, random.Random(seed).uniform(*KILL_WINDOW_S))


@pytest.mark.long
@pytest.mark.parametrize("seed", [s for s in range(23) if s not in (1, 5, 9)])
def test_a_killed_driver_leaves_nothing_20_more(tmp_path, seed):
    _check(tmp_path, random.Random(seed).uniform(*KILL_WINDOW_S))


def test_a_worker_whose_raylet_is_gone_ends_within_seconds(tmp_path):
    import json

    base = tempfile.mkdtemp(prefix="rck", dir="/tmp")
    try:
        out = subprocess.run([sys.executable, "-m", "tests.cluster.raylet_gone", base], cwd=REPO,
                             capture_output=True, text=True, timeout=180)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith('{"actor_pid"')))
    assert result["gone_after_s"] is not None and result["gone_after_s"] < 10, result
