"""The RL job end to end, submitted with ``ray job submit`` to a Ray head this module starts.

The head (:mod:`tests.ray_head`) is a child process on 127.0.0.1, ended by its PID.
Jobs run ``python -m drivers.main_ppo`` with one rank per role to keep the suite
quick; multi-rank groups are covered by the Ray integration tests.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from drivers.metrics import read_metrics, resumed_at
from raycheckpoint import ConfigMismatchError, Storage
from raycheckpoint.protocol.paths import COMMITTED, LATEST
from tests.ray_head import RAY, REPO, submit_job
from tests.ray_head import ray_head as start_head

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BASE = ["trainer.n_gpus_per_node=1", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4"]


@pytest.fixture(scope="module")
def ray_head():
    with start_head() as head:
        yield head


def submit(head, args: list[str], *, wait: bool = True, timeout: float = 600,
           module: str = "drivers.main_ppo", base: list[str] | None = None):
    return submit_job(head, [*(BASE if base is None else base), *args], wait=wait,
                      timeout=timeout, module=module)


def metrics(root: Path) -> dict[int, dict]:
    return read_metrics(root / "metrics.jsonl")


def job_id(output: str) -> str:
    for token in output.split():
        if token.strip("'\"").startswith("raysubmit_"):
            return token.strip("'\".,")
    raise AssertionError(f"no job id in: {output}")


# gae (PPO with a critic) runs with the long tests: the default suite keeps within its
# 15 minutes on a 2-core machine, and .ci/run runs both
@pytest.mark.parametrize("algo", ["grpo", pytest.param("gae", marks=pytest.mark.long)])
def test_killed_job_resumes_exactly(ray_head, tmp_path, algo):
    steps = 8
    common = [f"algorithm.adv_estimator={algo}", f"trainer.total_training_steps={steps}",
              "trainer.save_freq=2"]
    a = submit(ray_head, [*common, f"trainer.default_local_dir={tmp_path / 'a'}"])
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]

    # a random step at least two after the first save (step 2; a kill right after step 3
    # may precede its commit, which also writes the frozen weights, and leave nothing to
    # resume from): for grpo one that has just started a save (the kill lands while it
    # persists), for gae one between saves
    rng = random.Random()
    crash = rng.choice([4, 6]) if algo == "grpo" else rng.choice([5, 7])
    print(f"{algo}: SIGKILL after step {crash}")
    b_root = tmp_path / "b"
    b = submit(ray_head, [*common, f"trainer.default_local_dir={b_root}",
                          f"trainer.crash_at_step={crash}"])
    assert b.returncode != 0  # the driver was killed
    assert max(metrics(b_root)) == crash
    resumed = submit(ray_head, [*common, f"trainer.default_local_dir={b_root}",
                                "trainer.resume_mode=auto", "trainer.debug=true"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from step_" in resumed.stdout
    # trainer.debug: the resume report, before the driver's own line
    report = resumed.stdout.split("[raycheckpoint] resume report: ")[1].split("resumed from")[0]
    assert "check: config fingerprint" in report and "loaded actor: model, optimizer" in report
    assert "verified by the workers as they read them" in report

    ma, mb = metrics(tmp_path / "a"), metrics(b_root)
    start = resumed_at(resumed.stdout)
    assert start <= crash
    for step in range(start + 1, steps + 1):
        for key in ("loss", "reward", "kl", "rule_reward", "actor_weights_sha256", "epoch"):
            assert ma[step][key] == mb[step][key], (algo, step, key)
    synced = [e for e in mb[start + 1]["ckpt_events"] if e.startswith("rollout weights re-synced")]
    assert synced, mb[start + 1]
    # after the load the rollout held exactly the actor's weights at the checkpoint
    assert synced[0].split()[-1] == ma[start]["actor_weights_sha256"]
    final = [ln for ln in resumed.stdout.splitlines() if ln.startswith("final actor weights")]
    assert final and final[0].split()[-1] == ma[steps]["actor_weights_sha256"]


# ~110 s, and the default suite had reached 14:52 of its 15 minutes; .ci/run still runs it,
# the SIGTERM flag itself is unit-tested (test_triggers) and the driver's loop around it
# in-process (test_preemption)
@pytest.mark.long
def test_external_save_request_and_sigterm_emergency_save(ray_head, tmp_path):
    root = tmp_path / "run"
    out = submit(ray_head, ["trainer.total_training_steps=500", "trainer.save_freq=-1",
                            "trainer.step_delay_s=0.3", f"trainer.default_local_dir={root}"],
                 wait=False, timeout=120)
    assert out.returncode == 0, out.stderr
    jid = job_id(out.stdout + out.stderr)

    def logs() -> str:
        return subprocess.run([RAY, "job", "logs", jid, "--address", ray_head["address"]],
                              capture_output=True, text=True, timeout=60, env=ray_head["env"]).stdout[-3000:]

    def wait_for(pred, what, timeout=240):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if (root / "metrics.jsonl").exists() and pred(metrics(root)):
                return metrics(root)
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}; logs: {logs()}")

    wait_for(lambda m: len(m) >= 2, "two steps")
    req = subprocess.run([sys.executable, "-m", "raycheckpoint.request", str(root), "--tag",
                          "manual1", "--address", ray_head["gcs"]],
                         capture_output=True, text=True, timeout=120, cwd=REPO, env=ray_head["env"])
    assert req.returncode == 0, req.stdout + req.stderr
    m = wait_for(lambda m: any("tag=manual1" in e for r in m.values() for e in r["ckpt_events"]),
                 "the requested save")
    tagged_step = next(s for s, r in m.items() if any("tag=manual1" in e for e in r["ckpt_events"]))
    st = Storage(str(root))
    assert st.read_bytes("tags/manual1").decode().strip() == f"step_{tagged_step:08d}"

    stop = subprocess.run([RAY, "job", "stop", jid, "--address", ray_head["address"]],
                          capture_output=True, text=True, timeout=180, env=ray_head["env"])
    assert stop.returncode == 0, stop.stdout + stop.stderr
    m = metrics(root)
    last = max(m)
    assert any("preemption (SIGTERM)" in e for e in m[last]["ckpt_events"]), (m[last], logs())
    assert last < 500
    name = f"step_{last:08d}"
    assert st.exists(f"{name}/{COMMITTED}")
    assert st.read_bytes(LATEST).decode().strip() == name
    # nothing of the job outlives it: its driver and every actor ran in the job's working
    # directory, under the head's session directory (matched by directory, never by name)
    jobs = os.path.join(ray_head["temp"], "session_latest", "runtime_resources")
    jobs = os.path.realpath(jobs)
    deadline = time.time() + 30
    while (left := [p.pid for p in psutil.process_iter() if _cwd_under(p, jobs)]) and (
            time.time() < deadline):
        time.sleep(1)
    assert not left, f"processes of the stopped job still running: {left}"


def _cwd_under(p: psutil.Process, root: str) -> bool:
    try:
        return p.cwd().startswith(root + os.sep)
    except psutil.Error:
        return False


@pytest.mark.long  # ~100 s; config_diff is unit-tested and resharded loads run in test_save_load
def test_strict_resume_refuses_every_difference(ray_head, tmp_path):
    from drivers.config import parse_overrides
    from drivers.main_ppo import Trainer

    root = tmp_path / "run"
    base = [*BASE, "trainer.total_training_steps=2", "trainer.save_freq=2",
            f"trainer.default_local_dir={root}"]
    first = submit(ray_head, base[len(BASE):])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

    def refused(*changes: str) -> list[str]:
        with pytest.raises(ConfigMismatchError) as e:
            Trainer(parse_overrides([*base, *changes]))
        return [d[0] for d in e.value.differences]

    Trainer(parse_overrides(base))  # the same config is accepted
    assert refused("actor_rollout_ref.model.hidden_size=128") == ["actor_rollout_ref.model.hidden_size"]
    assert refused("actor_rollout_ref.rollout.n=8") == ["actor_rollout_ref.rollout.n"]
    assert refused("algorithm.adv_estimator=gae") == ["algorithm.adv_estimator"]
    assert refused("actor_rollout_ref.actor.kl_loss_coef=0.5") == ["actor_rollout_ref.actor.kl_loss_coef"]
    assert set(refused("trainer.n_gpus_per_node=2")) == {
        f"world_size.{r}" for r in ("actor", "reference", "reward", "rollout")}
    with open(root / "data" / "train.jsonl", "a") as f:  # a row added to the dataset
        f.write(json.dumps({"id": 999, "prompt": "aaa:", "target": "a"}) + "\n")
    assert set(refused()) == {"data.rows", "data.sha256"}
    # restore the data and allow resharding: resumes on 2 ranks and says so
    lines = (root / "data" / "train.jsonl").read_text().splitlines()[:-1]
    (root / "data" / "train.jsonl").write_text("\n".join(lines) + "\n")
    resharded = submit(ray_head, [*base[len(BASE):], "trainer.total_training_steps=3",
                                  "trainer.n_gpus_per_node=2", "checkpoint.allow_reshard=true"])
    assert resharded.returncode == 0, resharded.stdout[-3000:] + resharded.stderr[-3000:]
    assert "resumed from step_00000002 at step 2 (resharded" in resharded.stdout


@pytest.mark.long
def test_latency_bench_runs_as_a_ray_job(ray_head, tmp_path):
    """`ray job submit -- python -m bench.save_latency ...` joins the cluster it runs on."""
    out = tmp_path / "out"
    r = submit(ray_head, ["--ranks", "2", "--bytes-per-rank", "1MB", "--repeat", "1",
                          "--methods", "raycheckpoint,dcp_async_stager", "--no-reshard",
                          "--step-batch", "1", "--step-seq", "8",
                          "--storage", str(tmp_path / "store"), "--out", str(out)],
               module="bench.save_latency", base=[])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "raycheckpoint" in r.stdout and "limit: host copy" in r.stdout
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"raycheckpoint", "dcp_async_stager"}
    assert results["methods"]["raycheckpoint"]["durable_s"] > 0
    assert (out / "plot.png").exists()


# long: about a minute, and the default suite keeps within its 15 minutes; the RADOS Gateway
# leg (-m s3) runs it too
@pytest.mark.s3
@pytest.mark.long
def test_a_job_on_s3_reaches_it_only_through_its_storage_options(ray_head, s3_root):
    """Checkpoints, dataset and metrics on S3, the credentials only in
    ``trainer.storage_options`` (none in the job's environment): saves, verifies, resumes."""
    import fsspec

    from raycheckpoint.admin import verify

    uri, options = s3_root
    assert not any(k.startswith("AWS_ACCESS") for k in ray_head["env"])
    common = [f"trainer.default_local_dir={uri}", f"trainer.storage_options={json.dumps(options)}",
              "trainer.save_freq=2"]
    first = submit(ray_head, [*common, "trainer.total_training_steps=4"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    doc = verify(uri, options)
    assert doc["ok"] and [c["name"] for c in doc["checkpoints"]] == ["step_00000002",
                                                                      "step_00000004"]
    resumed = submit(ray_head, [*common, "trainer.total_training_steps=6",
                                "trainer.resume_mode=auto"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from step_00000004" in resumed.stdout
    fs, root = fsspec.core.url_to_fs(uri, **options)
    assert fs.exists(f"{root}/data/train.jsonl")
    steps = [json.loads(line)["step"] for line in fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


# ~120 s (two jobs); the library's side of it runs in the default suite (test_quarantine)
@pytest.mark.long
def test_a_damaged_newest_checkpoint_costs_only_its_steps(ray_head, tmp_path):
    """As a user meets it: the newest checkpoint's ``trainer_state.json`` has a flipped bit
    (the start-up check's path) and the one before a flipped shard (the workers' load).
    The same command resumes from the newest that verifies, saves the steps it trains
    again, and afterwards every committed checkpoint verifies; the damaged ones are
    quarantined (``raycheckpoint ls``) until ``raycheckpoint gc`` removes them."""
    from raycheckpoint.admin import gc, list_root, verify
    from tests.helpers import flip_bit

    root = tmp_path / "run"
    common = ["trainer.save_freq=2", f"trainer.default_local_dir={root}"]
    first = submit(ray_head, [*common, "trainer.total_training_steps=8"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    flip_bit(str(root / "step_00000008" / "trainer_state.json"))
    flip_bit(str(root / "step_00000006" / "actor" / "__0_0.distcp"))

    again = submit(ray_head, [*common, "trainer.total_training_steps=10",
                              "trainer.resume_mode=auto"])
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed from step_00000004 at step 4" in again.stdout
    assert sorted(metrics(root)) == list(range(1, 11))
    rows = {r["name"]: r for r in list_root(Storage(str(root)))["checkpoints"]}
    assert {n for n, r in rows.items() if r["state"] == "quarantined"} == {
        "step_00000006", "step_00000008"}
    committed = sorted(n for n, r in rows.items() if r["state"] == "committed")
    # steps 6 and 8 trained again and saved again, each in a directory of its own
    assert [n[:13] for n in committed] == ["step_00000002", "step_00000004", "step_00000006",
                                            "step_00000008", "step_00000010"]
    doc = verify(str(root))
    assert doc["ok"] and sorted(c["name"] for c in doc["checkpoints"]) == committed
    assert sorted(gc(str(root))["removed_quarantined"]) == ["step_00000006", "step_00000008"]
    assert verify(str(root))["ok"]
