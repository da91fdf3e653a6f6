"""Cluster configs: Ray's own schema check, a real `ray up` over ssh to 127.0.0.1, and
autoscaling with checkpointing on Ray's fake multi-node cluster.

The two end-to-end tests run their shell scripts (tests/cluster/) in fresh network, PID
and mount namespaces: only loopback exists, `ray stop` (run by `ray down`) sees only the
processes of that namespace, and everything ends with it.  They need root, `unshare`,
openssh-server and rsync (scripts/test.sh installs the last two with apt when missing).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ["cluster.yaml", "deploy/cluster-local.yaml", "deploy/cluster-fake.yaml"]


def check(config: dict) -> None:
    """Ray's offline validation, as `ray up` runs it (fake_multinode ships no defaults file,
    so its config is complete as written and only validated)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = copy.deepcopy(config)
    if config["provider"]["type"] != "fake_multinode":
        config = prepare_config(config)
    validate_config(config)


@pytest.mark.parametrize("path", CONFIGS)
def test_cluster_configs_pass_rays_schema_check(path):
    with open(REPO / path) as f:
        config = yaml.safe_load(f)
    check(config)
    # a misspelled key anywhere must fail the same check
    import jsonschema

    mutations = [lambda c: c.update(setup_comands=c.pop("setup_commands", [])),
                 lambda c: c.update(idle_timeout_minute=c.pop("idle_timeout_minutes", 5))]
    if "available_node_types" in config:
        mutations.append(lambda c: next(iter(c["available_node_types"].values())).update(
            node_confg=c["available_node_types"][c["head_node_type"]].pop("node_config", {})))
    for mutate in mutations:
        bad = copy.deepcopy(config)
        mutate(bad)
        with pytest.raises((jsonschema.ValidationError, ValueError)):
            check(bad)


def _namespaces_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    missing = [t for t in ("unshare", "ip") if shutil.which(t) is None]
    if missing:
        return f"missing {missing}"
    probe = subprocess.run(["unshare", "--net", "--pid", "--mount", "--fork", "--mount-proc", "true"],
                           capture_output=True)
    return None if probe.returncode == 0 else "cannot create namespaces here"


def _run_isolated(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    # a ray.init() earlier in this pytest process (the session's Ray instance) sets
    # RAY_AUTH_MODE=token with its token under this process's HOME; the scripts bring up
    # clusters of their own under another HOME, so nothing of that instance may leak in
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("RAY_AUTH") or k == "RAY_ADDRESS")}
    env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    return subprocess.run(["unshare", "--net", "--pid", "--mount", "--fork", "--mount-proc", "bash",
                           str(REPO / "tests/cluster" / script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _committed(root: Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob("step_*/COMMITTED"))


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_up_over_ssh_to_loopback_runs_and_resumes_the_job(tmp_path):
    reason = _namespaces_available()
    if reason is None and (not os.path.exists("/usr/sbin/sshd") or shutil.which("rsync") is None):
        reason = "needs openssh-server and rsync (scripts/test.sh installs them)"
    if reason:
        pytest.skip(reason)
    with open(REPO / "deploy/cluster-local.yaml") as f:
        config = yaml.safe_load(f)
    # this machine is the "remote": the project and its environment are already here, so
    # the checkout sync and the setup commands (a fresh .venv) are left out
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(tmp_path / "home/.ssh/id_ed25519")}
    config["file_mounts"] = {}
    config["setup_commands"] = []
    config["head_start_ray_commands"][-1] += " --num-cpus=8"
    # ray's ssh control socket lives in /tmp (the script's own), named after the cluster:
    # a name of its own keeps two runs from sharing a connection also where /tmp is shared
    config["cluster_name"] += "-" + uuid.uuid4().hex[:8]
    check(config)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(config))

    proc = _run_isolated("ray_up_loopback.sh", str(tmp_path), str(cluster), timeout=560)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "== done" in proc.stdout
    first = json.loads((tmp_path / "ls1.json").read_text())
    assert [r["name"] for r in first["checkpoints"]] == ["step_00000002", "step_00000004"]
    job2 = (tmp_path / "job2.log").read_text()
    assert "resumed from step_00000004 at step 4" in job2
    verify = json.loads((tmp_path / "verify.json").read_text())
    assert verify["ok"] and [c["name"] for c in verify["checkpoints"]] == [
        "step_00000002", "step_00000004", "step_00000006"]


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fake_multinode_autoscaling_with_checkpointing_across_nodes(tmp_path):
    reason = _namespaces_available()
    if reason:
        pytest.skip(reason)
    proc = _run_isolated("fake_multinode.sh", str(tmp_path), timeout=560)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    # the head has no GPU: every rank asked for one (trainer.device=auto on a cluster whose
    # worker nodes declare GPUs), ran on a node the autoscaler added, and STRICT_SPREAD put
    # each role's two ranks on two different nodes
    placed = [ln for ln in proc.stdout.splitlines() if ln.startswith("worker groups placed")]
    devices = [ln for ln in proc.stdout.splitlines() if ln.startswith("ranks compute on")]
    assert devices == ["ranks compute on cpu (trainer.device=auto, one GPU per rank)"] * 2, proc.stdout
    assert len([ln for ln in proc.stdout.splitlines() if ln.startswith("GPUs per rank")]) == 2
    # the ranks found no real GPU behind the resource, and said so in the job's log
    job4 = (tmp_path / "job4.log").read_text()
    assert job4.count("was given a GPU but sees no CUDA device") >= 8, job4[-3000:]
    assert len(placed) == 2 and all("on 2 node(s)" in ln for ln in placed), proc.stdout
    for line in placed:
        for role in ("actor", "reference", "reward", "rollout"):
            ranks = line.split(f"{role}: ")[1].split(";")[0].split(",")
            assert len(set(ranks)) == 2, line
    status = (tmp_path / "status4.log").read_text()
    assert "ray.worker.trainer" in status, status
    job6 = (tmp_path / "job6.log").read_text()
    assert "resumed from step_00000004 at step 4" in job6
    # the benchmark's ranks, placed by --worker-resources, ran on two nodes and checked
    # every load (a wrong restore stops it)
    bench = [ln for ln in proc.stdout.splitlines() if ln.startswith("== 2 ranks")]
    assert len(bench) == 1 and "2 node(s)" in bench[0] and "STRICT_SPREAD" in bench[0], proc.stdout
    root = tmp_path / "checkpoints"
    assert _committed(root) == ["step_00000002", "step_00000004", "step_00000006"]
    # the shards of each role came from ranks on two nodes and verify as one checkpoint
    from raycheckpoint import admin

    doc = admin.verify(str(root))
    assert doc["ok"], doc
    manifest = admin.inspect_checkpoint(admin.open_ref(str(root)), tensors=False)
    assert manifest["roles"]["actor"]["world_size"] == 2
