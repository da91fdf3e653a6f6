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
VERL = os.environ.get("VERL_VERSION", "0.9.1")


def run(cmd: list, timeout: float, **kwargs) -> str:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          **kwargs)
    assert done.returncode == 0, (f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done.stdout


SWITCH = {"VERL_USE_EXTERNAL_MODULES": "raycheckpoint.integrations.verl.patch"}


def beside_verl(verl_python: Path, script: str, target: Path, *rest: str, switch: bool,
                timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``tests/<script> TARGET RAY_TEMP REST...`` with verl's Python: this tree's source
    first on its path (over the installed copy), a Ray temporary directory of its own
    (short: Ray's sockets live there), and the switch made by the environment variable
    or, without ``switch``, not made."""
    ray_temp = tempfile.mkdtemp(prefix="rcverl-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k not in SWITCH}
    env["PYTHONPATH"] = str(ROOT)
    if switch:
        env.update(SWITCH)
    try:
        return subprocess.run([str(verl_python), str(ROOT / "tests" / script), str(target),
                               ray_temp, *rest], capture_output=True, text=True,
                              timeout=timeout, env=env, **kwargs)
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)


def test_the_environment_beside_verl_keeps_verls_pins(verl_python):
    run([verl_python, "-m", "pip", "check"], timeout=120)
    versions = json.loads(run([verl_python, "-c", (
        "import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in "
        "('verl', 'raycheckpoint', 'transformers', 'tokenizers')}))")], timeout=60))
    assert versions["verl"] == VERL
    major, minor = (int(x) for x in versions["transformers"].split(".")[:2])
    assert (major, minor) < (5, 11), f"verl's own transformers bound was overridden: {versions}"


def test_the_library_saves_and_loads_beside_verl(verl_python, tmp_path):
    done = beside_verl(verl_python, "beside_verl_script.py", tmp_path / "ckpt", switch=False,
                       timeout=300)
    assert done.returncode == 0, (f"beside_verl_script.py failed ({done.returncode}):\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["verl"] == VERL and report["raycheckpoint"].startswith(str(ROOT)), report
    assert report["loaded_step"] == 1 and report["bitwise"], report


def test_verls_own_checkpoint_test_passes_with_raycheckpoint_switched_in(verl_python, tmp_path):
    """verl's ``test_fsdp_ckpt.py`` (ported to CPU and gloo: tests/verl_fsdp_ckpt_port.py)
    under FSDP2 and FSDP1, with verl's ``FSDPCheckpointManager`` replaced by the one
    environment variable the README documents: state and logits equal after a resume."""
    done = beside_verl(verl_python, "verl_fsdp_ckpt_port.py", tmp_path, switch=True, timeout=400)
    lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert [d["strategy"] for d in lines] == ["fsdp2", "fsdp"], done.stdout[-3000:] + done.stderr[-6000:]
    for doc in lines:
        assert doc["passed"], doc
        assert doc["manager"] == "raycheckpoint.integrations.verl.manager", doc
    assert done.returncode == 0


def _standin(verl_python, root, steps: int, *extra: str) -> subprocess.CompletedProcess:
    # a session of its own: the killed run ends its whole process group
    return beside_verl(verl_python, "verl_trainer_standin.py", root, str(steps), *extra,
                       switch=True, timeout=300, start_new_session=True)


def test_verls_trainer_resumes_from_the_newest_step_that_loads(verl_python, tmp_path):
    """verl's own ``_save_checkpoint`` and its ``_load_checkpoint`` as the switch replaces
    it, on a stand-in trainer (tests/verl_trainer_standin.py).  With verl's ``async_save``
    (saves return after the host copy; verl writes no tracker) a job with an actor and a
    critic is killed while step 6's save persists, and the critic's shard of step 4 is
    then damaged; the same command resumes both roles from step 2 and trains steps 3-8
    exactly as a straight (synchronous) run did, its last
    step's save committed before it ends; the legacy ``RayPPOTrainer`` then resumes that
    from step 8 and trains steps 9-10 exactly too.  verl's ``data.pt`` files are deleted
    before the resume: the data loader's position is committed inside the actor's
    checkpoint."""
    from tests.helpers import flip_bit

    straight = _standin(verl_python, tmp_path / "a", 10)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-6000:]
    killed = _standin(verl_python, tmp_path / "b", 8, "--async", "--kill-in-save-of", "6")
    assert killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-6000:]
    assert not (tmp_path / "b" / "latest_checkpointed_iteration.txt").exists()  # async_save
    assert (tmp_path / "b" / "global_step_6" / "data.pt").exists()  # its save never committed
    flip_bit(str(tmp_path / "b" / "raycheckpoint" / "critic" / "step_00000004" / "critic" / "__0_0.distcp"))
    for data in (tmp_path / "b").glob("global_step_*/data.pt"):  # the position is committed
        data.unlink()  # inside the actor's checkpoint: verl's file is not needed

    again = _standin(verl_python, tmp_path / "b", 8, "--async")
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-6000:]
    assert "passed over global_step_4" in log and "__0_0.distcp" in log, log[-6000:]
    assert "resumed 2" in again.stdout, log[-6000:]
    legacy = _standin(verl_python, tmp_path / "b", 10, "--legacy")
    assert legacy.returncode == 0, legacy.stdout[-3000:] + legacy.stderr[-6000:]
    assert "resumed 8" in legacy.stdout, legacy.stdout[-3000:]

    def steps(run: str) -> list[dict]:
        return [json.loads(ln) for ln in (tmp_path / run / "steps.jsonl").read_text().splitlines()]

    a = {r["step"]: r for r in steps("a")}
    b = steps("b")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 9, 10]
    assert a[1]["critic"] != a[1]["weights"]  # two roles, two states
    for r in b:  # the same batch and, bit for bit, the same weights at every step
        assert r == a[r["step"]], (r, a[r["step"]])
    # retention (max_actor_ckpt_to_keep=1, kept +1) across the four runs
    from raycheckpoint.admin import list_root
    from raycheckpoint.storage import Storage

    for role in ("actor", "critic"):
        rows = list_root(Storage(str(tmp_path / "b" / "raycheckpoint" / role)))["checkpoints"]
        assert [r["step"] for r in rows if r["state"] == "committed"] == [8, 10], (role, rows)


def test_a_step_verls_own_manager_saved_is_imported_and_resumed(verl_python, tmp_path):
    """The switch made mid-training (tests/verl_import_script.py): verl's own manager saves
    step 2 of a two-rank FSDP2 Qwen2 with tied embeddings, ``raycheckpoint import-verl``
    carries it over, and raycheckpoint's manager loads it into fresh ranks: model,
    optimizer and scheduler equal verl's, the data loader's position (verl's ``data.pt``)
    is committed inside the checkpoint, and the next two steps give the same weights."""
    done = beside_verl(verl_python, "verl_import_script.py", tmp_path, switch=False, timeout=400)
    lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert lines, done.stdout[-3000:] + done.stderr[-6000:]
    result = lines[-1]
    assert done.returncode == 0, result
    [imported] = result["imported"]
    assert imported["role"] == "actor" and imported["from_world_size"] == 2
    assert imported["parameters"] == imported["tensors"] - 1  # the tied lm_head, once
    assert (tmp_path / "raycheckpoint" / "actor" / "step_00000002" / "COMMITTED").exists()
