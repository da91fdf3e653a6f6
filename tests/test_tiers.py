"""Tiered checkpoints: saves commit in the local tier, every Nth reaches the durable tier
(S3 on the test server) in the background, verified there before its marker; retention
runs per tier; resume takes the newest checkpoint of either tier, bit for bit, also when
the local tier is gone (the node and its disk lost)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import ray

from raycheckpoint import Storage, admin
from raycheckpoint import testing as faults
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.paths import CheckpointPaths
from raycheckpoint.roots import JobRoots
from raycheckpoint.storage import StorageSpec
from tests.helpers import REPORTS, RPC_TIMEOUT, assert_same, full_state, manager, train
from tests.s3proxy import FaultProxy

pytestmark = [pytest.mark.s3, pytest.mark.timeout(300)]


def committed(storage: Storage) -> list[str]:
    return sorted(m.name for m in catalog.scan(storage)[0])


def tiers(local: str, **more) -> dict:
    return {"local_dir": local, "replicate_every": 2, "keep_last_n_local": 2, "keep_last_n": 3,
            **more}


def test_saves_commit_locally_every_second_reaches_s3_and_resume_survives_losing_the_disk(
        group2, tmp_path, s3_root):
    root, options = s3_root
    local = str(tmp_path / "nvme")
    m = manager(root, {"actor": group2}, options, config=tiers(local))
    states = {}
    try:
        for step in range(1, 7):
            train(group2, [step])
            m.update(step=step)
            m.save_checkpoint(tag="best" if step == 3 else None).wait(RPC_TIMEOUT)
            states[step] = full_state(group2)
        assert ray.get(m.coordinator.wait_replication.remote(60), timeout=RPC_TIMEOUT)
        m.wait_for_cleanup(RPC_TIMEOUT)
        status = m.replication()
        stats = m.checkpoint_stats
    finally:
        m.close(60)
    # each commit said how many checkpoints waited for the durable tier (the gauge
    # raycheckpoint_replication_pending): none at step 1 (not due), its own at 2 (due) and
    # 3 (tagged), never more than the backlog bound
    pending = [s["replication_pending"] for s in stats]
    assert pending[0] == 0 and pending[1] >= 1 and pending[2] >= 1, pending
    assert max(pending) <= 4, pending
    durable, disk = Storage(root, options), Storage(local)
    # every second one (2, 4, 6) and the tagged one (3); keep_last_n=3 drops step 2
    assert committed(durable) == ["step_00000003", "step_00000004", "step_00000006"], status
    # keep_last_n_local=2 (5, 6), and the tagged one
    assert committed(disk) == ["step_00000003", "step_00000005", "step_00000006"]
    assert catalog.read_latest(durable) == catalog.read_latest(disk) == "step_00000006"
    assert catalog.read_tags(durable) == {"best": "step_00000003"}
    for name in ("step_00000003", "step_00000006"):  # one manifest and marker in every tier
        paths = CheckpointPaths(name)
        for rel in (paths.manifest, paths.committed):
            assert durable.read_bytes(rel) == disk.read_bytes(rel)
        assert admin.verify(f"{root}/{name}", options)["ok"]
    assert catalog.scan(durable)[1] == []  # no step directory without its marker
    doc = admin.list_tiers(durable, disk)
    by_name = {r["name"]: r["tiers"] for r in doc["checkpoints"]}
    assert by_name["step_00000005"] == {"local": "committed"}
    assert by_name["step_00000006"] == {"local": "committed", "durable": "committed"}
    assert by_name["step_00000004"] == {"durable": "committed"}
    ls = subprocess.run([sys.executable, "-m", "raycheckpoint.cli", "ls", root, "--local", local,
                         "--json", "--storage-option", f"endpoint_url={options['endpoint_url']}",
                         "--storage-option", f"key={options['key']}",
                         "--storage-option", f"secret={options['secret']}"],
                        capture_output=True, text=True, timeout=120)
    assert ls.returncode == 0, ls.stderr
    assert {r["name"]: r["tiers"] for r in json.loads(ls.stdout)["checkpoints"]} == by_name

    # the local tier holds step 6: resume reads it there
    train(group2, [99])
    m = manager(root, {"actor": group2}, options, config=tiers(local, debug=True))
    try:
        loaded = m.load_checkpoint("auto")
        assert (loaded.name, loaded.tier) == ("step_00000006", "local tier")
        assert any("local tier" in line for line in loaded.report)
        assert_same(full_state(group2), states[6])
    finally:
        m.close(60)
    # the node and its disk are gone: the same state comes from S3, bit for bit
    shutil.rmtree(local)
    train(group2, [99])
    m = manager(root, {"actor": group2}, options, config=tiers(local))
    try:
        loaded = m.load_checkpoint("auto")
        assert (loaded.name, loaded.tier) == ("step_00000006", "durable tier")
        assert_same(full_state(group2), states[6])
        # an explicit reference the local tier lacks comes from the durable tier too
        loaded = m.load_checkpoint("best")
        assert (loaded.name, loaded.tier) == ("step_00000003", "durable tier")
        assert_same(full_state(group2), states[3])
    finally:
        m.close(60)


def test_a_corrupt_local_copy_is_passed_over_for_the_durable_one(group2, tmp_path, s3_root):
    root, options = s3_root
    local = str(tmp_path / "nvme")
    m = manager(root, {"actor": group2}, options, config=tiers(local, replicate_every=1))
    try:
        train(group2, [1])
        m.update(step=1)
        m.save_checkpoint().wait(RPC_TIMEOUT)
        state = full_state(group2)
        assert ray.get(m.coordinator.wait_replication.remote(60), timeout=RPC_TIMEOUT)
    finally:
        m.close(60)
    disk = Storage(local)
    shard = next(p for p in disk.list_files("step_00000001") if p.endswith(".distcp"))
    data = bytearray(disk.read_bytes(shard))
    data[len(data) // 2] ^= 1
    (tmp_path / "nvme" / shard).write_bytes(bytes(data))
    train(group2, [99])
    m = manager(root, {"actor": group2}, options, config=tiers(local))
    try:
        with pytest.warns(RuntimeWarning, match="trying its copy in another tier"):
            loaded = m.load_checkpoint("auto")
        assert (loaded.name, loaded.tier) == ("step_00000001", "durable tier")
        assert_same(full_state(group2), state)
    finally:
        m.close(60)


@pytest.mark.long
def test_an_s3_outage_stops_replication_not_training(group2, tmp_path, s3_server, s3_root):
    root, _ = s3_root
    local = str(tmp_path / "nvme")
    with FaultProxy(s3_server["endpoint"], seed=3) as proxy:
        options = {**s3_server["options"], "endpoint_url": proxy.endpoint}
        m = manager(root, {"actor": group2}, options,
                    config=tiers(local, replicate_every=1, storage_retries=1,
                                 replication_backlog=8, lease_ttl_s=600))
        try:
            proxy.set(drop=1.0)  # the store is unreachable
            t0 = time.monotonic()
            for step in (1, 2, 3):
                train(group2, [step])
                m.update(step=step)
                assert m.save_checkpoint().wait(RPC_TIMEOUT)["name"] == f"step_0000000{step}"
            assert time.monotonic() - t0 < 60, "local saves waited for the durable tier"
            deadline = time.monotonic() + 90
            while not (status := m.replication())["last_error"] and time.monotonic() < deadline:
                time.sleep(0.5)
            assert status["pending"][0] == "step_00000001" and status["last_error"], status
            assert committed(Storage(local)) == ["step_00000001", "step_00000002",
                                                 "step_00000003"]  # kept: not yet durable
            proxy.set(drop=0.0)  # back: replication goes on, oldest first
            assert ray.get(m.coordinator.wait_replication.remote(120), timeout=RPC_TIMEOUT)
            status = m.replication()
            assert status["replicated"] == ["step_00000001", "step_00000002", "step_00000003"]
            m.wait_for_cleanup(RPC_TIMEOUT)
        finally:
            m.close(60)
        durable = Storage(root, options)
        assert committed(durable) == ["step_00000001", "step_00000002", "step_00000003"]
        assert catalog.scan(durable)[1] == []
    # once durable, the local tier keeps only its newest two
    m = manager(root, {"actor": group2}, s3_server["options"], config=tiers(local))
    try:
        m.gc()
    finally:
        m.close(60)
    assert committed(Storage(local)) == ["step_00000002", "step_00000003"]


@pytest.mark.parametrize("point", ["replicate.file", "replicate.before_marker",
                                   "replicate.after_marker"])
def test_a_coordinator_killed_while_replicating_leaves_no_partial_durable_checkpoint(
        point, group2, tmp_path, s3_root):
    root, options = s3_root
    local = str(tmp_path / "nvme")
    config = tiers(local, replicate_every=1)
    m = manager(root, {"actor": group2}, options, config=config)
    try:
        train(group2, [1])
        m.update(step=1)
        m.save_checkpoint().wait(RPC_TIMEOUT)
        assert ray.get(m.coordinator.wait_replication.remote(60), timeout=RPC_TIMEOUT)
        ray.get(m.coordinator.__ray_call__.remote(lambda self, f=point: faults.arm(f, "kill")),
                timeout=RPC_TIMEOUT)
        train(group2, [2])
        m.update(step=2)
        m.save_checkpoint().wait(RPC_TIMEOUT)  # committed locally; its copy kills the process
        state = full_state(group2)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(m.coordinator.wait_replication.remote(60), timeout=RPC_TIMEOUT)
    finally:
        try:
            m.close(30)
        except Exception:  # noqa: BLE001 - its coordinator is dead: expected here
            m.roots.release()
    durable = Storage(root, options)
    marked = point == "replicate.after_marker"  # committed there, LATEST not yet moved
    assert committed(durable) == ["step_00000001"] + ["step_00000002"] * marked
    assert catalog.read_latest(durable) == "step_00000001"
    partial = catalog.scan(durable)[1]
    assert partial == (["step_00000002"] if point == "replicate.before_marker" else partial)
    # the restarted job collects the leftover and copies step 2 again, whole
    train(group2, [99])
    m = manager(root, {"actor": group2}, options, config=config)
    try:
        assert ray.get(m.coordinator.wait_replication.remote(60), timeout=RPC_TIMEOUT)
        assert committed(durable) == ["step_00000001", "step_00000002"]
        assert catalog.read_latest(durable) == "step_00000002"
        assert catalog.scan(durable)[1] == []
        assert admin.verify(f"{root}/step_00000002", options)["ok"]
        shutil.rmtree(local)
        loaded = m.load_checkpoint("auto")
        assert (loaded.name, loaded.tier) == ("step_00000002", "durable tier")
        assert_same(full_state(group2), state)
    finally:
        m.close(60)


def test_a_local_dir_some_rank_cannot_see_is_refused(tmp_path):
    roots = JobRoots(durable=StorageSpec(str(tmp_path / "durable")),
                     local=StorageSpec(str(tmp_path / "nvme")))
    probe = roots.write_probe()
    assert Storage(str(tmp_path / "nvme")).exists(probe)
    with pytest.raises(ValueError, match=r"actor/1 cannot see .*checkpoint\.local_dir_per_node=true"):
        roots.check_visible(probe, [("actor/0", True), ("actor/1", False)])
    assert not Storage(str(tmp_path / "nvme")).exists(probe)
    assert JobRoots(durable=StorageSpec(str(tmp_path))).write_probe() is None


def test_a_new_best_checkpoint_always_reaches_the_durable_tier(group2, tmp_path):
    root, local = str(tmp_path / "durable"), str(tmp_path / "nvme")
    m = manager(root, {"actor": group2}, config=tiers(local, replicate_every=100, keep_last_n=None,
                                                      keep_best_n=2, best_metric="reward"))
    try:
        for step, reward in enumerate([1.0, 3.0, 2.0, 0.5, 5.0, 4.0], start=1):
            train(group2, [step])
            m.update(step=step, metrics={"reward": reward})
            m.save_checkpoint().wait(RPC_TIMEOUT)
        assert ray.get(m.coordinator.wait_replication.remote(60), timeout=RPC_TIMEOUT)
        status = m.replication()
    finally:
        m.close(60)
    # each one among the 2 best so far when it committed (never by count: every 100th);
    # step 4 (0.5) never was; step 6 (4.0) is, beside 5.0
    assert status["replicated"] == ["step_00000001", "step_00000002", "step_00000003",
                                    "step_00000005", "step_00000006"], status
    # the durable tier's retention keeps the 2 best
    assert committed(Storage(root)) == ["step_00000005", "step_00000006"]


def test_a_copy_that_reads_back_wrong_is_retried_not_dropped(group2, tmp_path):
    import io
    import threading

    from raycheckpoint.policy.retention import RetentionPolicy
    from raycheckpoint.protocol.collect import Collector
    from raycheckpoint.protocol.replicate import Replicator, TargetMismatchError, replicate
    from raycheckpoint.protocol.root import RootState

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    m = manager(src, {"actor": group2})
    try:
        train(group2, [1])
        m.update(step=1)
        name = m.save_checkpoint().wait(RPC_TIMEOUT)["name"]
    finally:
        m.close(60)
    target = Storage(dst)
    flips = {"left": 1}
    read = target.open_read

    def flaky(rel):  # the target's first read-back of a shard returns one flipped bit
        f = read(rel)
        if rel.endswith(".distcp") and flips["left"]:
            flips["left"] -= 1
            with f:
                data = bytearray(f.read())
            data[0] ^= 1
            return io.BytesIO(bytes(data))
        return f

    target.open_read = flaky
    root = RootState(target)
    with pytest.raises(TargetMismatchError, match="read back"):
        replicate(Storage(src), root, name)
    assert catalog.read_marker(target, name) is None
    flips["left"] = 1
    done = []
    r = Replicator(Storage(src), root, Collector(root, RetentionPolicy()), lock=threading.Lock(),
                   on_done=lambda n, res, err: done.append((n, res is not None, err,
                                                            r.pending())),
                   retry_s=(0.05, 0.1))
    r.enqueue(name)
    assert r.wait_idle(60)
    # done: no longer pending when on_done runs the source tier's retention, which must
    # not keep it "waiting for replication" (it did, until the next commit's clean-up)
    assert done == [(name, True, None, [])] and flips["left"] == 0
    assert admin.verify(f"{dst}/{name}")["ok"]


def test_retention_per_tier_over_thirty_saves(group2, tmp_path, s3_root):
    root, options = s3_root
    local = str(tmp_path / "nvme")
    config = tiers(local, replicate_every=7, keep_last_n=2, keep_last_n_light=2,
                   save_interval=1, save_full_interval=2, save_on_train_end=True)
    m = manager(root, {"actor": group2}, options, config=config)
    disk, durable = Storage(local), Storage(root, options)
    try:
        for step in range(1, 31):
            train(group2, [step])
            m.step(step, metrics={"loss": 1.0 / step}, is_last=step == 30).wait(RPC_TIMEOUT)
            m.wait_for_cleanup(RPC_TIMEOUT)
            pending = set(m.replication()["pending"])
            kept = set(committed(disk)) - pending
            assert len(kept) <= 2 + 2, (step, kept)  # newest 2 full + newest 2 light
        assert ray.get(m.coordinator.wait_replication.remote(60), timeout=RPC_TIMEOUT)
        m.wait_for_cleanup(RPC_TIMEOUT)
        replicated = m.replication()["replicated"]
    finally:
        m.close(60)
    # every seventh commit went to S3 (odd steps are light), and the train-end save
    assert replicated == [f"step_{s:08d}" for s in (7, 14, 21, 28, 30)]
    # S3 keeps the newest 2 full and 2 light; the local disk the same of its own
    assert committed(durable) == ["step_00000007", "step_00000021", "step_00000028",
                                  "step_00000030"]
    assert [m.kind for m in catalog.scan(durable)[0]] == ["light", "light", "full", "full"]
    assert committed(disk) == ["step_00000027", "step_00000028", "step_00000029", "step_00000030"]
    assert catalog.scan(disk)[1] == [] and catalog.scan(durable)[1] == []


@pytest.mark.cluster
def test_a_lost_node_and_its_disk_resume_from_memory_then_s3_on_a_replacement(tmp_path, s3_server):
    """tests/cluster/node_loss.py: a three-node Ray cluster on this machine."""
    import os
    import tempfile

    base = tempfile.mkdtemp(prefix="rcn", dir="/tmp")  # short: Ray's sockets live there
    options = s3_server["options"]
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.cluster.node_loss", base, options["endpoint_url"],
             options["key"], options["secret"]], capture_output=True, text=True, timeout=280,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1])
    assert out["rank_nodes"] == 2, out  # one rank on each worker node
    assert out["durable_before"] == ["step_00000002", "step_00000004"], out
    assert out["local_before"] == [["step_00000004", "step_00000005"]] * 2, out
    assert out["shards_step5"] == [["__0_0.distcp"], ["__1_0.distcp"]], out
    assert out["uploaded_by_nodes"], out  # each node's agent copied its own files to S3
    assert out["memory_before"] == ["step_00000005"] and out["holders_before"] == 2, out
    # step 5 was on the lost disk and node, and in the other node's memory
    assert (out["memory"]["name"], out["memory"]["tier"]) == ("step_00000005", "memory tier"), out
    # without the replicas: the newest durable one
    assert (out["durable"]["name"], out["durable"]["tier"]) == ("step_00000004", "durable tier"), out
    assert out["replacement_used"], out
    for phase in ("memory", "durable"):
        r = out[phase]
        assert r["bitwise"] is True, out
        REPORTS.append(f"node loss (tiered, 2 ranks on 2 nodes): resumed {r['name']} from the "
                       f"{r['tier']} on a replacement node, bit for bit; "
                       + ("new job start" if phase == "memory" else "replicas gone too: start")
                       + f" to loaded {r['recovery_s']:.1f} s (the load itself {r['load_s']:.2f} s)")
