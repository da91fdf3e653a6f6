"""The ``raycheckpoint`` command on checkpoints written by the real RL driver.

One short GRPO job (2 ranks per role, HF Llama actor) runs once on the session's Ray
instance; each test works on a copy of its checkpoint root (local, or uploaded to the S3
server).  Commands run in-process through ``cli.main`` (exit codes, stdout JSON), and as
the installed console script where the output a person sees matters (one line, no
traceback).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from raycheckpoint import cli
from raycheckpoint.protocol.format import FORMAT_VERSION
from tests.helpers import flip_bit

pytestmark = pytest.mark.timeout(300)

RAYCHECKPOINT = os.path.join(os.path.dirname(sys.executable), "raycheckpoint")


@pytest.fixture(scope="module")
def job_root(ray_session, tmp_path_factory):
    """A root with full checkpoints at steps 2 and 4 and a light one at step 3."""
    from drivers.config import parse_overrides
    from tests.helpers import run_job_in_process

    root = str(tmp_path_factory.mktemp("cli") / "job")
    opts = parse_overrides([f"trainer.default_local_dir={root}", "trainer.total_training_steps=4",
                            "trainer.save_freq=2", "checkpoint.save_interval=3",
                            "checkpoint.keep_last_n=3", "trainer.n_gpus_per_node=2"])
    metrics = run_job_in_process(opts)
    return {"root": root, "sha_step4": metrics[-1]["actor_weights_sha256"], "opts": opts}


@pytest.fixture
def root(job_root, tmp_path):
    copy = str(tmp_path / "root")
    shutil.copytree(job_root["root"], copy, symlinks=True)
    return copy


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)


def script(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([RAYCHECKPOINT, *argv], capture_output=True, text=True, timeout=120,
                          **kwargs)


def test_ls_inspect_and_verify(root, capsys):
    code, doc = run_json(capsys, "ls", root)
    assert code == 0
    rows = {r["name"]: r for r in doc["checkpoints"]}
    assert list(rows) == ["step_00000002", "step_00000003", "step_00000004"]
    assert [rows[n]["kind"] for n in rows] == ["full", "light", "full"]
    assert doc["latest"] == "step_00000004" and rows["step_00000004"]["latest"]
    assert all(r["state"] == "committed" and r["bytes"] > 0 for r in rows.values())
    assert set(rows["step_00000004"]["metrics"]) == {"loss", "reward"}

    code, out, _ = run(capsys, "ls", root)
    assert code == 0 and "step_00000004" in out and "LATEST" in out

    code, doc = run_json(capsys, "inspect", root)  # a bare root means its LATEST
    assert code == 0 and doc["name"] == "step_00000004" and doc["version"]["format_version"] == FORMAT_VERSION
    actor = doc["roles"]["actor"]
    assert actor["world_size"] == 2 and "config.json" in actor["assets"]
    names = {t["name"]: t for t in actor["tensors"]}
    assert names["model.model.embed_tokens.weight"]["chunks"] == 2  # one shard per rank
    assert any(n.startswith("optim.") for n in names)
    assert doc["roles"]["reference"]["stored_in"] == "step_00000002"  # frozen: written once
    assert doc["trainer_state"]["global_step"] == 4

    code, doc = run_json(capsys, "inspect", root, "--step", "3")
    assert doc["kind"] == "light" and not any(t["name"].startswith("optim.")
                                              for t in doc["roles"]["actor"]["tensors"])

    code, doc = run_json(capsys, "verify", root)
    assert code == 0 and doc["ok"] and len(doc["checkpoints"]) == 3 and not doc["problems"]
    code, out, _ = run(capsys, "verify", f"{root}/step_00000002")
    assert code == 0 and "1 verified, 0 failed" in out


def test_export_hf_loads_in_transformers_and_generates(root, job_root, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.models import state_sha256

    out = str(tmp_path / "hf")
    code, doc = run_json(capsys, "export", root, out, "--format", "hf", "--role", "actor")
    assert code == 0 and doc["checkpoint"] == "step_00000004" and doc["tensors"] > 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    # the exported weights are exactly the actor's after step 4
    assert state_sha256(model.state_dict()) == job_root["sha_step4"]
    ids = tok("aaa:", return_tensors="pt", add_special_tokens=False).input_ids
    generated = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 6)
    assert len(tok.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)) > 0

    # a second export to the same place is refused unless forced
    code, _, err = run(capsys, "export", root, out)
    assert code == 2 and "exists" in err and "--force" in err

    # plain state dicts: safetensors streamed, or torch.save; any checkpoint, any role
    st = str(tmp_path / "actor.safetensors")
    assert run(capsys, "export", root, st, "--format", "state_dict", "--step", "3")[0] == 0
    pt = str(tmp_path / "ref.pt")
    assert run(capsys, "export", f"{root}/step_00000004", pt, "--format", "state_dict",
               "--role", "reference")[0] == 0
    from safetensors.torch import load_file

    light = load_file(st)
    assert set(light) == set(model.state_dict())
    reference = torch.load(pt, weights_only=True)
    assert set(reference) == set(light)
    # the critic is no causal LM: asking for an HF export of a role without a config says so
    code, _, err = run(capsys, "export", root, str(tmp_path / "x"), "--role", "reward")
    assert code == 2 and "config.json" in err and "state_dict" in err


def test_export_needs_one_cpu_and_no_ray(root, tmp_path):
    """The export path never imports Ray and runs pinned to a single core."""
    out = str(tmp_path / "hf")
    code = ("import sys; from raycheckpoint import cli; "
            f"rc = cli.main(['export', {root!r}, {out!r}, '--json']); "
            "assert 'ray' not in sys.modules, 'ray was imported'; sys.exit(rc)")
    cmd = [sys.executable, "-c", code]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tensors"] > 0 and os.path.exists(f"{out}/model.safetensors")


def test_verify_names_the_corrupted_file(root, capsys):
    flip_bit(f"{root}/step_00000004/actor/__1_0.distcp")
    code, doc = run_json(capsys, "verify", root)
    assert code == 1 and not doc["ok"]
    bad = [c for c in doc["checkpoints"] if not c["ok"]]
    assert [c["name"] for c in bad] == ["step_00000004"]
    assert bad[0]["path"] == "step_00000004/actor/__1_0.distcp"
    assert "does not match the manifest's" in bad[0]["error"]
    # the person at the terminal: a table line naming the file, exit code 1, no traceback
    proc = script("verify", root)
    assert proc.returncode == 1 and "FAILED" in proc.stdout and "__1_0.distcp" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr

    os.truncate(f"{root}/step_00000002/trainer_state.json", 10)
    code, doc = run_json(capsys, "verify", f"{root}/step_00000002")
    assert code == 1 and doc["checkpoints"][0]["path"] == "step_00000002/trainer_state.json"
    # export refuses a corrupted checkpoint before writing anything
    code, _, err = run(capsys, "export", root, f"{root}-hf")
    assert code == 2 and "__1_0.distcp" in err and not os.path.exists(f"{root}-hf")


def test_gc_applies_the_jobs_rules_and_collects_old_leftovers(root, capsys):
    old, recent = f"{root}/step_00000001", f"{root}/step_00000005"
    for d in (old, recent):
        os.makedirs(f"{d}/actor")
        with open(f"{d}/actor/__0_0.distcp", "wb") as f:
            f.write(b"partial")
    past = time.time() - 7200
    os.utime(f"{old}/actor/__0_0.distcp", (past, past))

    code, doc = run_json(capsys, "gc", root, "--dry-run", "--keep-last-n", "1")
    assert code == 0 and doc["dry_run"] and doc["rules"]["keep_last_n"] == 1
    assert doc["deleted"] == ["step_00000002"] and doc["collected"] == ["step_00000001"]
    assert doc["kept_recent"] == ["step_00000005"]
    assert doc["kept"]["step_00000004"] == ["LATEST points here",
                                            "the newest full checkpoint (always kept)",
                                            "one of the newest 1 full (keep_last_n=1)"]
    assert doc["kept"]["step_00000003"] == [
        "one of the newest 3 light (keep_last_n_light default=3)"]
    assert os.path.exists(f"{root}/step_00000002/COMMITTED") and os.path.exists(old)
    code, out, _ = run(capsys, "gc", root, "--dry-run", "--keep-last-n", "1")
    assert code == 0 and "would delete by retention: step_00000002" in out
    assert "kept step_00000003: one of the newest 3 light" in out

    code, doc = run_json(capsys, "gc", root)  # the job's own rules (keep_last_n=3): nothing
    assert code == 0 and doc["rules_source"] == "recorded by the job" and doc["deleted"] == []
    assert doc["collected"] == ["step_00000001"] and not os.path.exists(old)

    code, out, _ = run(capsys, "gc", root, "--keep-last-n", "1", "--grace-s", "0")
    assert code == 0 and "step_00000002" in out and "step_00000005" in out
    assert not os.path.exists(f"{root}/step_00000002/COMMITTED") and not os.path.exists(recent)
    # step 4 still verifies: the frozen roles' bytes it references under step 2 were kept
    code, doc = run_json(capsys, "verify", root)
    assert code == 0 and [c["name"] for c in doc["checkpoints"]] == ["step_00000003",
                                                                      "step_00000004"]


def test_tag_protects_from_gc_and_untag(root, capsys):
    code, doc = run_json(capsys, "tag", root, "--step", "2", "before-lr-change")
    assert code == 0 and doc["checkpoint"] == "step_00000002"
    code, doc = run_json(capsys, "ls", root)
    assert doc["tags"] == {"before-lr-change": "step_00000002"}
    with open(f"{root}/catalog.json") as f:
        assert json.load(f)["tags"] == {"before-lr-change": "step_00000002"}
    code, doc = run_json(capsys, "gc", root, "--keep-last-n", "1")
    assert doc["deleted"] == []  # tagged
    code, doc = run_json(capsys, "inspect", root, "--tag", "before-lr-change")
    assert doc["name"] == "step_00000002"

    code, _, err = run(capsys, "tag", root, "before-lr-change")  # points elsewhere: refused
    assert code == 2 and "--force" in err
    code, _, err = run(capsys, "tag", root, "latest")
    assert code == 2 and "invalid tag" in err

    code, doc = run_json(capsys, "untag", root, "before-lr-change")
    assert code == 0 and doc["checkpoint"] == "step_00000002"
    code, doc = run_json(capsys, "gc", root, "--keep-last-n", "1")
    assert doc["deleted"] == ["step_00000002"]
    code, _, err = run(capsys, "untag", root, "before-lr-change")
    assert code == 2 and "no tag" in err


def test_diff_lists_what_blocks_a_strict_resume(root, job_root, tmp_path, capsys):
    import yaml

    config = {k: v for k, v in job_root["opts"].items() if v is not None}
    config["trainer.default_local_dir"] = root
    same = tmp_path / "same.yaml"
    same.write_text(yaml.safe_dump(config))
    fn = "drivers.main_ppo:job_description"
    code, doc = run_json(capsys, "diff", root, str(same), "--fingerprint", fn)
    assert code == 0 and doc["resumable"] and doc["blocking"] == []

    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump({**config, "actor_rollout_ref.rollout.n": 8,
                                       "trainer.n_gpus_per_node": 4}))
    code, doc = run_json(capsys, "diff", root, str(changed), "--fingerprint", fn)
    keys = {d["key"] for d in doc["blocking"]}
    assert code == 1 and "actor_rollout_ref.rollout.n" in keys and "world_size.actor" in keys
    code, doc = run_json(capsys, "diff", root, str(changed), "--fingerprint", fn, "--allow-reshard")
    assert {d["key"] for d in doc["blocking"]} == {"actor_rollout_ref.rollout.n"}

    # another checkpoint's trainer_state.json is a job description too
    code, doc = run_json(capsys, "diff", f"{root}/step_00000002",
                         f"{root}/step_00000004/trainer_state.json")
    assert code == 0 and doc["resumable"]
    code, doc = run_json(capsys, "diff", root, f"{root}/step_00000003/trainer_state.json",
                         "--step", "3")
    assert code == 1 and doc["blocking"][0]["key"] == "kind"  # a light checkpoint


@pytest.mark.parametrize("argv, message", [
    (["ls", "/nonexistent/ckpts"], "no such directory"),
    (["ls", "nosuchproto://bucket/x"], "nosuchproto"),
    (["verify", "{root}/step_00000042"], "not a committed checkpoint"),
    (["inspect", "{root}", "--tag", "nope"], "unknown checkpoint reference 'nope'"),
    (["export", "{root}", "{root}/out", "--format", "onnx"], "invalid choice"),
    (["diff", "{root}", "/nonexistent.yaml"], "No such file"),
    (["ls", "{root}", "-o", "novalue"], "KEY=VALUE"),
])
def test_user_mistakes_are_one_line_errors(root, argv, message):
    proc = script(*[a.format(root=root) for a in argv])
    assert proc.returncode == 2, proc
    assert message in proc.stderr and "Traceback" not in proc.stderr
    if "invalid choice" not in message:  # argparse prints its usage; ours is one line
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_no_permission_is_a_clear_error(root):
    os.chmod(root, 0o700)  # owned by this user; another one may not enter it
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to run the command as another user")
    proc = subprocess.run([*drop, RAYCHECKPOINT, "ls", root], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HOME": "/tmp"})
    if "No such file" in proc.stderr and RAYCHECKPOINT in proc.stderr:
        pytest.skip("the virtual environment is not readable by another user here")
    assert proc.returncode == 2 and "permission denied" in proc.stderr.lower(), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.s3
def test_commands_on_s3(job_root, s3_root, tmp_path, capsys):
    import s3fs

    uri, options = s3_root
    fs = s3fs.S3FileSystem(**options)
    src = job_root["root"]
    for dirpath, _, files in os.walk(src):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            fs.put_file(path, f"{uri[5:]}/{os.path.relpath(path, src)}")
    opts = [a for k, v in options.items() for a in ("-o", f"{k}={v}")]
    code, doc = run_json(capsys, "ls", uri, *opts)
    assert code == 0 and [r["name"] for r in doc["checkpoints"]] == [
        "step_00000002", "step_00000003", "step_00000004"]
    code, doc = run_json(capsys, "verify", uri, *opts)
    assert code == 0 and doc["ok"]
    out = str(tmp_path / "hf")
    code, doc = run_json(capsys, "export", f"{uri}/step_00000004", out, *opts)
    assert code == 0 and os.path.exists(f"{out}/model.safetensors")
    code, doc = run_json(capsys, "tag", uri, "--step", "2", "keep", *opts)
    assert code == 0
    code, doc = run_json(capsys, "gc", uri, "--keep-last-n", "1", "--grace-s", "0", *opts)
    assert code == 0 and doc["deleted"] == []
    fs.rm_file(f"{uri[5:]}/step_00000002/reference/__0_0.distcp")  # steps 3, 4 reference it
    code, doc = run_json(capsys, "verify", uri, *opts)
    assert code == 1 and {c["name"] for c in doc["checkpoints"] if not c["ok"]} == {
        "step_00000002", "step_00000003", "step_00000004"}
    code, _, err = run(capsys, "ls", "s3://no-such-bucket/x", *opts)
    assert code == 2 and "nothing stored there" in err


def test_ls_shows_the_lease_and_gc_waits_for_the_job(root, capsys):
    from raycheckpoint import Storage
    from raycheckpoint.protocol.lease import Lease

    lease = Lease(Storage(root), job_name="live-job").acquire()
    try:
        code, doc = run_json(capsys, "ls", root)
        assert doc["lease"]["job_name"] == "live-job" and doc["lease"]["fresh"]
        code, out, _ = run(capsys, "ls", root)
        assert "LEASE: held by job 'live-job'" in out
        code, _, err = run(capsys, "gc", root, "--keep-last-n", "1")
        assert code == 2 and "live-job" in err and "--force" in err
        assert os.path.exists(f"{root}/step_00000002/COMMITTED")
        code, doc = run_json(capsys, "gc", root, "--keep-last-n", "1", "--dry-run")
        assert code == 0 and doc["deleted"] == ["step_00000002"]
        code, doc = run_json(capsys, "gc", root, "--keep-last-n", "1", "--force")
        assert code == 0 and doc["deleted"] == ["step_00000002"]
    finally:
        lease.release()
    code, doc = run_json(capsys, "ls", root)
    assert doc["lease"] is None
