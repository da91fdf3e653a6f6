"""A Ray head for job tests: a child process (``ray start --head --block``) on 127.0.0.1,
ended by its PID, and ``ray job submit`` against it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from workers.group import free_port

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


@contextmanager
def ray_head(*extra: str) -> Iterator[dict[str, Any]]:
    """Start a head (``extra``: more ``ray start`` options, e.g. ``--num-gpus=2``) and yield
    its ``address``, ``gcs``, ``env`` and ``temp``; end it and remove its files after."""
    temp = tempfile.mkdtemp(prefix="rchead-", dir="/tmp")
    gcs, dash = free_port(), free_port()
    # every port explicit: agents of a SIGKILLed local driver elsewhere may hold the defaults
    ports = [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
             f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
             f"--ray-client-server-port={free_port()}"]
    # token authentication on, explicitly: the head and every client (job CLI, drivers,
    # request tool) use the token in ~/.ray, made here if this machine has none yet
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_JOB_STOP_WAIT_TIME_S": "60"}
    if not (Path.home() / ".ray" / "auth_token").exists():
        subprocess.run([RAY, "get-auth-token", "--generate"], env=env, check=True,
                       capture_output=True, timeout=60)
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         "--num-cpus=8", f"--temp-dir={temp}", "--disable-usage-stats", *ports, *extra],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    while True:
        # ready when a job can be submitted: the job agent comes up after the job server
        probe = subprocess.run([RAY, "job", "submit", "--address", address, "--",
                                sys.executable, "-c", "pass"], capture_output=True,
                               text=True, timeout=120, env=env)
        if probe.returncode == 0:
            break
        if time.time() > deadline or head.poll() is not None:
            head.kill()
            logs = Path(temp, "session_latest", "logs")
            agent = "".join(p.read_text()[-1500:] for p in sorted(logs.glob("dashboard_agent*")))
            raise RuntimeError(f"Ray head did not come up: {probe.stderr[-1000:]}\n{agent}")
        time.sleep(1)
    try:
        yield {"address": address, "gcs": f"127.0.0.1:{gcs}", "env": env, "temp": temp}
    finally:
        head.send_signal(signal.SIGTERM)  # --block: ends every process it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


def submit_job(head: dict[str, Any], args: list[str], *, wait: bool = True, timeout: float = 600,
           module: str = "drivers.main_ppo") -> subprocess.CompletedProcess:
    """``ray job submit`` of ``python -m module args`` with this checkout as working dir."""
    cmd = [RAY, "job", "submit", "--address", head["address"], "--working-dir", str(REPO)]
    if not wait:
        cmd.append("--no-wait")
    cmd += ["--", sys.executable, "-m", module, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=head["env"])
