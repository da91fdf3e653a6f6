"""raycheckpoint installs beside verl and works there.

verl 0.9.1 pins ``transformers<5.11`` (and through it ``tokenizers<0.23``); the RL job
here needs newer ones, the library none.  ``scripts/verl_env.sh`` installs verl and this
package with one ``pip install`` into a fresh environment (``.venv-verl``) and runs
``pip check``: the package's own requirements are what the library imports.  The tests
run without network, so that environment is built before them (.ci/run does); here the
library saves and loads a real checkpoint in it, from this tree's source.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.long, pytest.mark.verl, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
ENV = ROOT / ".venv-verl"
VERL = os.environ.get("VERL_VERSION", "0.9.1")


def run(cmd: list, timeout: float, **kwargs) -> str:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          **kwargs)
    assert done.returncode == 0, (f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done.stdout


@pytest.fixture(scope="module")
def verl_python() -> Path:
    py = ENV / "bin" / "python"
    if not py.exists():
        pytest.skip(f"no {ENV.name}: build it with `bash scripts/verl_env.sh` (needs the package index)")
    return py


def test_the_environment_beside_verl_keeps_verls_pins(verl_python):
    run([verl_python, "-m", "pip", "check"], timeout=120)
    versions = json.loads(run([verl_python, "-c", (
        "import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in "
        "('verl', 'raycheckpoint', 'transformers', 'tokenizers')}))")], timeout=60))
    assert versions["verl"] == VERL
    major, minor = (int(x) for x in versions["transformers"].split(".")[:2])
    assert (major, minor) < (5, 11), f"verl's own transformers bound was overridden: {versions}"


def test_the_library_saves_and_loads_beside_verl(verl_python, tmp_path):
    ray_temp = tempfile.mkdtemp(prefix="rcverl-", dir="/tmp")  # short: Ray's sockets live there
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree's source, over the installed copy
    try:
        out = run([verl_python, ROOT / "tests" / "beside_verl_script.py", tmp_path / "ckpt", ray_temp],
                  timeout=300, env=env)
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["verl"] == VERL and report["raycheckpoint"].startswith(str(ROOT)), report
    assert report["loaded_step"] == 1 and report["bitwise"], report


def test_verls_own_checkpoint_test_passes_with_raycheckpoint_switched_in(verl_python, tmp_path):
    """verl's ``test_fsdp_ckpt.py`` (ported to CPU and gloo: tests/verl_fsdp_ckpt_port.py)
    under FSDP2 and FSDP1, with verl's ``FSDPCheckpointManager`` replaced by the one
    environment variable the README documents: state and logits equal after a resume."""
    ray_temp = tempfile.mkdtemp(prefix="rcverl-", dir="/tmp")
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "VERL_USE_EXTERNAL_MODULES": "raycheckpoint.integrations.verl.patch"}
    try:
        done = subprocess.run([str(verl_python), str(ROOT / "tests" / "verl_fsdp_ckpt_port.py"),
                               str(tmp_path), ray_temp], capture_output=True, text=True,
                              timeout=400, env=env)
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)
    lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert [d["strategy"] for d in lines] == ["fsdp2", "fsdp"], done.stdout[-3000:] + done.stderr[-6000:]
    for doc in lines:
        assert doc["passed"], doc
        assert doc["manager"] == "raycheckpoint.integrations.verl.manager", doc
    assert done.returncode == 0
