"""The latency benchmark end to end (tiny sizes), and the save-path changes it drove.

The benchmark checks its own results as it goes: every method's load must restore
exactly the state that was saved (per-rank digests, and the gathered state after a
resharded load), and every virtual-rank checkpoint must verify.  A wrong method or a
broken commit therefore fails this test, not just a table.
"""

from __future__ import annotations

import glob
import json
import os
import time
import uuid

import pytest
import ray

from raycheckpoint import verify_checkpoint
from raycheckpoint.storage import Storage
from tests.helpers import manager, train

pytestmark = pytest.mark.timeout(600)


@pytest.mark.long
def test_save_latency_bench_runs_every_method_and_writes_results(ray_session, tmp_path):
    pytest.importorskip("matplotlib")
    from bench._ranks import RESHARDS
    from bench.save_latency import default_methods, main

    out = tmp_path / "out"
    results = main(["--ranks", "2", "--bytes-per-rank", "2MB", "--repeat", "1",
                    "--storage", str(tmp_path / "store"), "--step-batch", "1", "--step-seq", "8",
                    "--out", str(out)])
    saved = json.loads((out / "results.json").read_text())
    assert saved["config"]["ranks"] == 2 and saved["config"]["bytes_per_rank"] > 1_000_000
    methods = default_methods(local=True)  # verl's own manager where verl is, else verl_sync
    assert set(saved["methods"]) == set(methods) and len(methods) == len(RESHARDS) - 1
    for name, row in saved["methods"].items():
        for key in ("stall_s", "durable_s", "load_s"):
            assert row[key] > 0, (name, key)
        assert row["stall_s"] <= row["durable_s"] + 1e-6, name
        if not RESHARDS[name]:  # verl's per-rank torch.save files cannot be resharded
            assert row["reshard_load_s"] is None and "reshard_note" in row
        else:
            assert row["reshard_load_s"] > 0, name
            assert row["spread"]["reshard_load_s"][0] <= row["reshard_load_s"], name
    lim = saved["limits"]
    assert all(lim[k] > 0 for k in ("host_copy_s", "raw_write_fsync_s", "raw_read_s"))
    # the write limit is the faster of a buffered and an O_DIRECT write (this local disk)
    assert lim["raw_write_direct_s"] > 0 and lim["raw_write_buffered_s"] > 0
    assert lim["raw_write_fsync_s"] == min(lim["raw_write_direct_s"], lim["raw_write_buffered_s"])
    # the host copy is measured again before each of raycheckpoint's saves; stalls face that one
    assert lim["host_copy_beside_s"] > 0 and lim["spread"]["host_copy_beside_s"][0] > 0
    assert saved["targets"]["stall_over_host_copy"] == pytest.approx(
        saved["methods"]["raycheckpoint"]["stall_s"] / lim["host_copy_beside_s"])
    assert saved["step_overhead"]["steps_during_persist"] >= 1
    assert saved["step_overhead"]["overlap_stall_s"] > 0  # overlap_copy measured too
    # and saves riding on a training step, without and with overlap_copy
    assert saved["step_overhead"]["ride_stall_s"] > 0
    assert saved["step_overhead"]["ride_overlap_stall_s"] > 0
    # where their blocked time went: the snapshot's phases, riding on the step
    for key in ("ride_stall_breakdown_ms", "ride_overlap_stall_breakdown_ms"):
        phases = saved["step_overhead"][key]
        assert {"send", "copy", "finish", "total"} <= set(phases), key
        assert "to_worker" not in phases  # riding: the call's way to the worker is the step's
        assert all(isinstance(v, float) and v >= 0 for v in phases.values()), phases
    assert saved["targets"]["ride_stall_over_host_copy"] == pytest.approx(
        saved["step_overhead"]["ride_stall_s"] / lim["host_copy_beside_s"])
    assert set(saved["targets"]["met"]) >= {"stall_over_host_copy", "durable_over_raw_write",
                                            "overlap_stall_over_host_copy",
                                            "ride_stall_over_host_copy",
                                            "ride_overlap_stall_over_host_copy"}
    from bench.report import markdown

    tables = markdown([saved])
    assert all(f"| {m} |" in tables for m in methods) and "| overlap_stall_over_host_copy |" in tables
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["points"][0]["config"] == saved["config"]
    # everything it wrote is gone
    assert not list((tmp_path / "store").rglob("*.distcp"))


def test_virtual_ranks_commit_through_the_real_coordinator(ray_session, tmp_path, capsys):
    from bench._harness import BenchStorage
    from bench.virtual_ranks import run_virtual, virtual_table

    storage = BenchStorage(str(tmp_path), {})
    try:
        results = run_virtual([4, 16], storage, hosts=2, shard_bytes=1024, repeat=1, log=lambda s: None)
    finally:
        storage.close()
    rows = results["virtual_ranks"]
    assert set(rows) == {"4", "16"}
    for n, row in rows.items():
        assert row["files"] == int(n) + 2  # one shard per rank + trainer_state + version
        assert 0 < row["commit_s"] <= row["save_s"]
    assert results["growth"]["ranks_ratio"] == 4
    assert "16" in virtual_table(results)
    from bench.report import main as report

    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    report([str(path)])  # bench.report prints a virtual run's table too
    assert "| 16 |" in capsys.readouterr().out


def test_a_deferred_persist_never_started_by_the_driver_still_commits(group2, local_root):
    """The manager starts persists after every rank answered; if that start never arrives
    (a driver dying in between), the worker's next wait starts it: nothing hangs."""
    m = manager(local_root, {"actor": group2})
    try:
        train(group2, [0])
        m.update(step=1)
        coord = m.coordinator
        begun = ray.get(coord.begin.remote(
            step=1, kind="full", tag=None, metrics={}, trainer_state={"rng": None},
            expected=[("actor", 0), ("actor", 1)], world_sizes={"actor": 2}), timeout=60)
        snaps = ray.get([w.ckpt_snapshot.remote(begun["save_id"], begun["name"], "full", coord,
                                                60, True) for w in group2], timeout=60)
        assert all(s["stall_s"] >= s["copy_s"] > 0 for s in snaps)
        time.sleep(1.0)
        step_dir = os.path.join(local_root, begun["name"])
        assert not glob.glob(f"{step_dir}/**/*.distcp", recursive=True), "persist started early"
        ray.get([w.ckpt_wait.remote(60) for w in group2], timeout=120)  # starts, then waits
        result = ray.get(coord.wait.remote(begun["save_id"], 60), timeout=120)
        assert result["name"] == "step_00000001" and result["commit_s"] > 0
        assert verify_checkpoint(Storage(local_root), "step_00000001")["files"] >= 4
    finally:
        m.close(60)


@pytest.mark.long
def test_bench_places_ranks_by_resources_and_gives_the_placement_back(ray_session, tmp_path):
    """--worker-resources: every rank (and the resharded group's) runs in a placement group
    whose master is rank 0's node, the way the same command spreads ranks on a cluster."""
    from bench.save_latency import main

    before = set(ray.util.placement_group_table())
    results = main(["--ranks", "2", "--bytes-per-rank", "1MB", "--repeat", "1",
                    "--methods", "raycheckpoint,dcp_sync", "--storage", str(tmp_path / "store"),
                    "--step-batch", "1", "--step-seq", "8",
                    "--worker-resources", '{"CPU": 0.25}', "--placement-strategy", "SPREAD"])
    config = results["config"]
    assert config["worker_resources"] == {"CPU": 0.25} and config["device"] == "cpu"
    assert config["placement_groups"] == 1 and config["nodes"] == 1
    assert results["methods"]["raycheckpoint"]["reshard_load_s"] > 0  # checked against the state
    table = ray.util.placement_group_table()
    made = {pg: info for pg, info in table.items() if pg not in before}
    assert len(made) == 2  # the point's group and the resharded group's
    assert all(info["state"] == "REMOVED" for info in made.values()), made
    assert all(info["strategy"] == "SPREAD" for info in made.values())


def test_bench_refuses_a_cuda_rank_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from bench._ranks import _BenchRank

    with pytest.raises(RuntimeError, match="sees no GPU"):
        _BenchRank(role="actor", rank=0, world_size=1, master_addr="127.0.0.1", master_port=1,
                   d=16, device="cuda")
    with pytest.raises(SystemExit):
        from bench.save_latency import main

        main(["--worker-resources", "[1, 2]"])


def test_a_ranks_sweep_is_plotted_as_one_line_per_method(tmp_path):
    """A ranks sweep holds slightly different per-rank sizes (the model width is chosen
    for the total): they are one group, so each method's points form one line."""
    pytest.importorskip("matplotlib")
    from bench.report import _size_groups, plot

    sizes = [121_000_000, 134_000_000, 127_000_000, 126_000_000]
    assert set(_size_groups(sizes).values()) == {(121_000_000, 134_000_000)}
    assert _size_groups([60_000_000, 254_000_000, 1_004_000_000]) == {
        60_000_000: (60_000_000, 60_000_000), 254_000_000: (254_000_000, 254_000_000),
        1_004_000_000: (1_004_000_000, 1_004_000_000)}

    import matplotlib.axes

    drawn: list[int] = []
    real_plot = matplotlib.axes.Axes.plot

    def counting_plot(self, xs, *args, **kwargs):
        drawn.append(len(xs))
        return real_plot(self, xs, *args, **kwargs)

    points = [{"config": {"ranks": r, "bytes_per_rank": b, "storage": "local"},
               "methods": {"m": {"stall_s": 0.1 * r, "durable_s": 0.2 * r}},
               "limits": {"host_copy_s": 0.05 * r, "raw_write_fsync_s": 0.1 * r}}
              for r, b in zip((1, 2, 4, 8), sizes, strict=True)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.axes.Axes, "plot", counting_plot)
        plot(points, str(tmp_path / "plot.png"))
    assert drawn == [4, 4, 4, 4]  # stall and durable: the method and the limit, all 4 points
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.long
def test_release_ab_times_the_tree_it_imports(ray_session, tmp_path):
    from bench.release_ab import main

    out = main(["--ranks", "2", "--bytes-per-rank", "1MB", "--saves", "1",
                "--storage", str(tmp_path / "store")])
    assert out["durable_s"] > 0 and out["load_s"] > 0
    assert 0 < out["worker_stall_s"] <= out["stall_s"] < out["durable_s"]


def test_stalls_are_compared_with_the_host_copy_measured_beside_them():
    """A run that measured the copy before each of raycheckpoint's saves is judged by that;
    results without it (earlier runs) by the copy measured before the rounds."""
    from bench.report import markdown, targets

    point = {"config": {"ranks": 2, "bytes_per_rank": 10**6, "bytes": 2 * 10**6,
                        "tensors_per_rank": 788, "storage": "local", "repeat": 2},
             "limits": {"host_copy_s": 0.10, "host_copy_beside_s": 0.20, "host_copy_fresh_s": 1.0,
                        "raw_write_fsync_s": 1.0, "raw_read_s": 1.0},
             "methods": {"raycheckpoint": {"stall_s": 0.25, "durable_s": 1.1, "load_s": 1.0,
                                           "reshard_load_s": None, "durable_gb_s": 1.0},
                         "verl_sync": {"stall_s": 2.0, "durable_s": 2.0, "load_s": 1.0,
                                       "reshard_load_s": None, "durable_gb_s": 1.0}}}
    got = targets(point)
    assert got["stall_over_host_copy"] == pytest.approx(1.25) and got["met"]["stall_over_host_copy"]
    assert got["verl_ratio_fraction_of_best"] == pytest.approx(0.8)
    assert "| *limit: host copy* | 0.200 |" in markdown([point])
    del point["limits"]["host_copy_beside_s"]
    assert targets(point)["stall_over_host_copy"] == pytest.approx(2.5)


def test_verls_own_manager_is_judged_first_and_shown_with_and_without_the_fsync():
    """Where verl's real manager ran (``verl``), the targets compare with it, not with the
    imitation, and the tables give its save as is and followed by the fsync it skips."""
    from bench.report import markdown, targets

    row = {"load_s": 1.0, "reshard_load_s": None, "bytes": 2 * 10**9, "durable_gb_s": 1.0}
    point = {"config": {"ranks": 2, "bytes_per_rank": 10**9, "bytes": 2 * 10**9,
                        "tensors_per_rank": 788, "storage": "local", "repeat": 2,
                        "verl_version": "0.9.1"},
             "limits": {"host_copy_s": 0.1, "host_copy_fresh_s": 1.0, "raw_write_fsync_s": 1.0,
                        "raw_read_s": 1.0},
             "methods": {"raycheckpoint": {**row, "stall_s": 0.2, "durable_s": 1.2},
                         "verl": {**row, "stall_s": 2.0, "returned_s": 2.0, "durable_s": 3.0},
                         "verl_sync": {**row, "stall_s": 9.0, "durable_s": 9.0}}}
    got = targets(point)
    assert got["verl_method"] == "verl" and got["verl_stall_ratio"] == pytest.approx(10)
    assert got["durable_over_verl"] == pytest.approx(0.6)
    assert got["durable_over_verl_fsync"] == pytest.approx(0.4)
    tables = markdown([point])
    assert "verl 0.9.1 (its own FSDPCheckpointManager)" in tables
    assert "| verl | 2.000 | 2.000 | 1.000 |" in tables  # durable as verl has it: returned
    assert "| verl + fsync | 3.000 | 3.000 | 1.000 |" in tables  # synchronous: blocks too


def test_the_real_verl_method_without_verl_fails_at_once_naming_its_environment():
    """``--methods verl`` in a Python without verl exits before anything starts."""
    from bench._verl import verl_version
    from bench.save_latency import main

    if verl_version() is not None:
        pytest.skip("verl is importable here")
    with pytest.raises(SystemExit, match=r"\.venv-verl.*scripts/verl_env\.sh"):
        main(["--methods", "raycheckpoint,verl", "--ranks", "2"])


def test_the_projection_never_calibrates_a_method_below_the_machines_limit():
    """A ratio under 1 (a limit measured slow that time) counts as 1; others stay measured."""
    from bench.projection import calibration

    results = {"config": {"ranks": 2},
               "limits": {"host_copy_s": 0.2, "raw_write_fsync_s": 3.0},
               "methods": {"raycheckpoint": {"stall_s": 0.16, "durable_s": 3.6},
                           "verl_sync": {"durable_s": 2.4}, "rank0_gather": {"durable_s": 9.0}}}
    got = calibration(results, {"virtual_ranks": {"256": {"commit_overhead_s": 0.02}}})
    assert got == {"stall_over_host_copy": 1.0, "durable_over_raw_write": pytest.approx(1.2),
                   "verl_over_raw_write": 1.0, "rank0_over_raw_write": pytest.approx(1.5),
                   "commit_overhead_256_s": 0.02}


def test_the_bench_s3_server_runs_below_the_ranks_and_serves():
    """moto's server shares the ranks' cores here, where a cluster's object store would
    not: it runs at the lowest priority, and still answers."""
    pytest.importorskip("moto")
    import fsspec

    from bench._harness import MotoProcess

    server = MotoProcess()
    try:
        assert os.getpriority(os.PRIO_PROCESS, server._proc.pid) == 19
        fs = fsspec.filesystem("s3", endpoint_url=server.endpoint, key=uuid.uuid4().hex,
                               secret=uuid.uuid4().hex, skip_instance_cache=True)
        fs.mkdir("bench")
        fs.pipe("bench/x", b"payload")
        assert fs.cat("bench/x") == b"payload"
    finally:
        server.stop()
    assert server._proc.poll() is not None
