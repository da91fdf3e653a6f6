"""The RL job on a one-GPU machine, checked on this machine's CPUs: a job the cluster can
never hold is refused at once (not after the placement group's 600 s), each rank computes
on the GPU Ray assigned it, vLLM gets the policy's dtype, the rollout sampler's RNG state
is stored device-free, and the driver's own Ray sizes its object store from the model."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch

from drivers._ray import MIB, OBJECT_STORE_FLOOR, object_store_bytes
from drivers.capacity import Ask, Capacity, job_asks, shortfall, starts_nodes
from drivers.config import parse_overrides
from drivers.groups import rank_resources
from drivers.main_ppo import roles_of
from workers.device import cuda_index
from workers.engines import generator_state, restore_generator, vllm_engine_args

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def asks_of(args: list[str], device: str = "cuda") -> tuple[list[Ask], dict]:
    opts = parse_overrides(args)
    world = opts["trainer.n_gpus_per_node"] * opts["trainer.nnodes"]
    return job_asks(opts, roles_of(opts), world, rank_resources(opts, device)), opts


# ---- 7: refusing what the cluster can never hold --------------------------------------------

ONE_GPU = Capacity(({"CPU": 16.0, "GPU": 1.0, "memory": 1e11},))


def test_the_defaults_on_one_gpu_are_refused_naming_both_sides():
    asks, opts = asks_of([])
    why = shortfall(asks, ONE_GPU, opts)
    assert why.startswith("the job asks for 8 GPUs (actor 2 + reference 2 + reward 2 + rollout 2, "
                          "1 GPU per rank; trainer.n_gpus_per_node=2 x trainer.nnodes=1")
    assert "but the cluster has 1 GPU;" in why
    assert why.endswith("on one GPU run with trainer.n_gpus_per_node=1 trainer.nnodes=1 "
                        "trainer.colocate=true")
    asks, opts = asks_of(["algorithm.adv_estimator=gae", "trainer.n_gpus_per_node=1"])
    assert shortfall(asks, ONE_GPU, opts).startswith("the job asks for 5 GPUs (actor 1 + reference 1 "
                                                     "+ reward 1 + rollout 1 + critic 1")
    asks, opts = asks_of(["trainer.colocate=true"])  # colocated, but two ranks per role
    assert "asks for 2 GPUs (actor, reference, reward, rollout colocated: 2 ranks" in shortfall(
        asks, ONE_GPU, opts)


@pytest.mark.parametrize("extra", [[], ["algorithm.adv_estimator=gae"], ["trainer.cpus_per_worker=2"]])
def test_one_rank_per_role_colocated_fits_one_gpu(extra):
    asks, opts = asks_of(["trainer.n_gpus_per_node=1", "trainer.colocate=true", *extra])
    assert shortfall(asks, ONE_GPU, opts) is None


def test_cpus_custom_resources_and_strategies_are_checked():
    asks, opts = asks_of(["trainer.cpus_per_worker=4"], device="cpu")  # plain actors
    why = shortfall(asks, Capacity(({"CPU": 8.0},)), opts)
    assert why.startswith("the job asks for 32 CPUs") and "trainer.cpus_per_worker=4" in why
    assert "but the cluster has 8 CPUs" in why
    # a bundle never spans nodes: two nodes of one GPU do not hold a rank asking for two
    asks, opts = asks_of(['trainer.worker_resources={"GPU": 2}', "trainer.n_gpus_per_node=1",
                          "trainer.colocate=true"], device="cpu")
    two = Capacity(({"GPU": 1.0}, {"GPU": 1.0}))
    assert "asks for {\"GPU\": 2} on one node but no node of the cluster has that much" in shortfall(
        asks, two, opts)
    asks, opts = asks_of(["trainer.placement_strategy=STRICT_SPREAD", "trainer.colocate=true"])
    assert "STRICT_SPREAD puts each of the 2" in shortfall(asks, Capacity(({"GPU": 4.0},)), opts)
    assert shortfall(asks, two, opts) is None
    asks, opts = asks_of(["trainer.placement_strategy=STRICT_PACK", "trainer.colocate=true"])
    assert "STRICT_PACK puts all 2" in shortfall(asks, two, opts)
    asks, opts = asks_of(['trainer.worker_resources={"trainer_slot": 1}'], device="cpu")
    assert "trainer.worker_resources=" in shortfall(asks, Capacity(({"CPU": 8.0},)), opts)


def test_an_autoscaler_that_can_grow_keeps_the_wait():
    asks, opts = asks_of([])
    # v2: node types published, the most it can reach compared
    grows = Capacity(({"CPU": 2.0},), autoscaling=True, node_types=({"CPU": 8.0, "GPU": 4.0},),
                     max_total={"CPU": 32.0, "GPU": 16.0})
    assert shortfall(asks, grows, opts) is None
    small = Capacity(({"CPU": 2.0},), autoscaling=True, node_types=({"CPU": 8.0, "GPU": 4.0},),
                     max_total={"CPU": 8.0, "GPU": 4.0})
    assert "the cluster has 4 GPUs (its autoscaler included)" in shortfall(asks, small, opts)
    # v1 (ray up): it does not say how far it grows
    assert shortfall(asks, Capacity(({"CPU": 2.0},), autoscaling=True), opts) is None
    # its status names nodes by their configured type; a cluster without one by node id
    assert starts_nodes({"autoscaler_report": {"node_type_mapping": {"ab12": "ray.worker.trainer"}}})
    assert not starts_nodes({"autoscaler_report": {"node_type_mapping": {"ab12": "node_ab12"}}})
    assert not starts_nodes({})


PROBE = r"""
import json, shutil, sys, tempfile, time
import ray
spec = json.loads(sys.argv[1])
temp = tempfile.mkdtemp(prefix="rccap-", dir="/tmp")
try:
    if spec.get("model_bytes") is not None:  # the driver's own Ray, as main_ppo starts it
        from drivers._ray import init_ray
        init_ray(num_cpus=spec["num_cpus"], model_bytes=lambda: spec["model_bytes"])
    else:
        ray.init(address="local", num_cpus=spec["num_cpus"], num_gpus=spec["num_gpus"],
                 _temp_dir=temp, include_dashboard=False, object_store_memory=256 << 20,
                 log_to_driver=False, configure_logging=False)
    from drivers.capacity import autoscaler_status, cluster_capacity
    from drivers.config import parse_overrides
    from drivers.groups import check_capacity, job_device
    from drivers.main_ppo import roles_of
    out = {"object_store": ray.cluster_resources()["object_store_memory"], "jobs": {}}
    for args in spec["jobs"]:
        opts = parse_overrides(args)
        world = opts["trainer.n_gpus_per_node"] * opts["trainer.nnodes"]
        t0 = time.monotonic()
        try:
            check_capacity(opts, roles_of(opts), world, job_device(opts))
            why = None
        except SystemExit as e:
            why = str(e)
        out["jobs"][" ".join(args)] = [why, time.monotonic() - t0]
    deadline = time.monotonic() + spec.get("status_wait_s", 0)
    while autoscaler_status() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    out["status_seen"] = autoscaler_status() is not None
    out["autoscaling"] = cluster_capacity().autoscaling
    print("RESULT " + json.dumps(out), flush=True)
finally:
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
"""


def probe(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(spec)], cwd=REPO,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.timeout(300)
def test_a_real_one_gpu_ray_refuses_the_defaults_and_runs_the_one_gpu_settings():
    """Ray declares one GPU here (the ranks are never started): the check is the real one
    the driver makes, against a real cluster's resources."""
    one_gpu = ["trainer.n_gpus_per_node=1", "trainer.colocate=true"]
    out = probe({"num_cpus": 2, "num_gpus": 1, "status_wait_s": 20,
                 "jobs": [[], one_gpu, ["trainer.device=cpu", "trainer.cpus_per_worker=1"],
                          ["trainer.device=cpu"]]})
    why, took = out["jobs"][""]
    assert why.startswith("error: the job asks for 8 GPUs") and "but the cluster has 1 GPU;" in why
    assert "trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.colocate=true" in why
    assert took < 10, took
    assert out["jobs"][" ".join(one_gpu)][0] is None
    why, _ = out["jobs"]["trainer.device=cpu trainer.cpus_per_worker=1"]
    assert "asks for 8 CPUs" in why and "but the cluster has 2 CPUs" in why
    assert out["jobs"]["trainer.device=cpu"][0] is None  # no resources per rank: nothing to hold
    # a local instance's autoscaler cannot start nodes: it reported, and is read as such
    assert out["status_seen"] and out["autoscaling"] is False


# ~15 s: the check's refusal on a real Ray is in the default suite above; the driver's
# own exit path runs with the long tests
@pytest.mark.long
@pytest.mark.timeout(300)
def test_the_driver_exits_at_once_with_one_line_not_a_traceback(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "drivers.main_ppo", "trainer.cpus_per_worker=4",
                           f"trainer.default_local_dir={tmp_path / 'job'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "RAY_ADDRESS": ""})
    took = time.monotonic() - t0
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("error: the job asks for 32 CPUs (actor 2 + reference 2 + reward 2 + rollout 2, 4 CPU per "
            "rank; trainer.n_gpus_per_node=2 x trainer.nnodes=1 ranks per role, "
            "trainer.cpus_per_worker=4) but the cluster has 8 CPUs") in proc.stderr
    assert took < 120, took  # not the placement group's 600 s


# ---- 8a: vLLM serves in the policy's dtype --------------------------------------------------


@pytest.mark.parametrize("dtype, name", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16"),
                                         (torch.float16, "float16")])
def test_vllm_gets_the_policys_dtype_on_every_device(dtype, name):
    cuda = vllm_engine_args("/m", {}, 3, dtype, torch.device("cuda", 0),
                            {"gpu_memory_utilization": 0.3, "tensor_model_parallel_size": 1})
    assert cuda["dtype"] == name and cuda["gpu_memory_utilization"] == 0.3
    assert cuda["model"] == "/m" and cuda["seed"] == 3 and "kv_cache_memory_bytes" not in cuda
    cpu = vllm_engine_args("/m", {"max_positions": 32}, 3, dtype, torch.device("cpu"), {})
    assert cpu["dtype"] == name and cpu["kv_cache_memory_bytes"] == 64 * MIB
    assert cpu["max_model_len"] == 32


def test_vllm_refuses_a_gpu_it_would_not_serve_on():
    with pytest.raises(RuntimeError, match="RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
        vllm_engine_args("/m", {}, 0, torch.float32, torch.device("cuda", 2), {})


# ---- 8b: the sampler's RNG state, device-free -----------------------------------------------

CUDA_STATE = {"generator": base64.b64encode((1234).to_bytes(8, "little") + (96).to_bytes(8, "little"))
              .decode(), "device": "cuda"}  # what a CUDA rank writes: Philox seed + offset


def test_the_sampler_state_is_plain_bytes_with_its_device_kind_and_restores_exactly():
    gen = torch.Generator().manual_seed(7)
    torch.rand(5, generator=gen)
    state = generator_state(gen)
    assert state["device"] == "cpu" and isinstance(state["generator"], str)
    assert msgpack.unpackb(msgpack.packb(state)) == state  # what the checkpoint's extra holds
    expected = torch.rand(5, generator=gen)
    other = torch.Generator().manual_seed(99)
    assert restore_generator(other, state) is None
    assert torch.equal(torch.rand(5, generator=other), expected)
    # a state of an earlier release (no device kind) still restores exactly
    legacy = torch.Generator()
    assert restore_generator(legacy, {"generator": state["generator"]}) is None
    assert torch.equal(torch.rand(5, generator=legacy), expected)


def test_a_cuda_sampler_state_resumes_on_cpu_reproducibly():
    draws = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(0)
        note = restore_generator(gen, CUDA_STATE)
        assert "cuda generator's and this rank samples on cpu" in note
        draws.append(torch.rand(4, generator=gen))
    assert torch.equal(draws[0], draws[1])
    legacy = torch.Generator()  # an earlier release's 16-byte state: told from its size
    assert restore_generator(legacy, {"generator": CUDA_STATE["generator"]}) is not None
    assert torch.equal(torch.rand(4, generator=legacy), draws[0])
    moved = dict(CUDA_STATE, generator=base64.b64encode(bytes(16)).decode())
    gen = torch.Generator()
    restore_generator(gen, moved)
    assert not torch.equal(torch.rand(4, generator=gen), draws[0])


def test_the_hf_sampler_resumes_exactly_and_takes_a_gpu_checkpoint(capsys):
    from workers.engines import HFEngine

    def engine():
        return HFEngine({}, 0, 1, 1.0, 4, torch.device("cpu"), {})

    a = engine()
    a.generate([[1, 3]], 2)
    saved = a.state()
    expected = a.generate([[1, 3]], 2)
    b = engine()
    b.load_state(saved)
    assert b.generate([[1, 3]], 2) == expected
    b.load_state(CUDA_STATE)
    assert "seeded from it instead" in capsys.readouterr().out
    b.generate([[1, 3]], 2)


# ---- 8c: the GPU Ray assigned ---------------------------------------------------------------


@pytest.mark.parametrize("assigned, visible, index", [
    ([], None, 0), ([], "3", 0),
    (["3"], "3", 0),                    # Ray set CUDA_VISIBLE_DEVICES to the assigned GPU
    (["1"], "0,1,2,3", 1),              # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    (["3"], "2,3", 1),                  # ... on a node started with some GPUs visible
    (["2"], None, 2), (["2"], "", 2),   # ... with every GPU visible
    (["GPU-5d2a"], "GPU-9f1b,GPU-5d2a", 1),
])
def test_the_cuda_index_is_the_assigned_gpus_position_among_the_visible_ones(assigned, visible, index):
    assert cuda_index(assigned, visible) == index


def test_an_assigned_gpu_that_is_not_visible_is_named():
    with pytest.raises(RuntimeError, match=r"Ray assigned GPU '5', which CUDA_VISIBLE_DEVICES='0,1'"):
        cuda_index(["5"], "0,1")
    with pytest.raises(RuntimeError, match="no device index"):
        cuda_index(["GPU-5d2a"], None)


# ---- 8d: the driver's own Ray sizes its object store from the model -------------------------


def test_the_object_store_holds_the_weights_within_the_machine():
    assert object_store_bytes(350_976, 64 * GIB) == OBJECT_STORE_FLOOR  # the built-in model
    assert object_store_bytes(GIB, 64 * GIB) == 4 * GIB                 # 0.5B params in bf16
    assert object_store_bytes(30 * GIB, 64 * GIB) == int(64 * GIB * 0.3)  # capped: memory
    assert object_store_bytes(GIB, 64 * GIB, shm_bytes=2 * GIB) == 2 * GIB  # ... and /dev/shm
    assert object_store_bytes(GIB, 512 * MIB) == OBJECT_STORE_FLOOR     # never below the floor


def test_parameter_bytes_counts_the_policy_without_loading_it(tmp_path):
    from tests.hf_models import make_model_dir
    from workers.models import build_causal_lm, parameter_bytes

    built = build_causal_lm({"hidden_size": 32, "intermediate_size": 64}, 0)
    exact = sum(p.numel() * p.element_size() for p in built.parameters())
    assert parameter_bytes({"hidden_size": 32, "intermediate_size": 64}) == exact
    model_dir = make_model_dir(tmp_path / "llama", "llama")
    on_disk = parameter_bytes({"path": str(model_dir)})
    assert on_disk == (model_dir / "model.safetensors").stat().st_size > 0


@pytest.mark.long  # ~12 s; the sizing itself is unit-tested above
@pytest.mark.timeout(300)
def test_the_drivers_ray_starts_with_the_sized_object_store():
    out = probe({"num_cpus": 2, "model_bytes": 100 * MIB, "jobs": []})
    assert out["object_store"] == object_store_bytes(100 * MIB, *_machine())


def _machine() -> tuple[int, int | None]:
    import shutil

    import psutil

    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
    return psutil.virtual_memory().total, shm
