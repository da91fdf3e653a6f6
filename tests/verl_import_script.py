"""A step saved by verl 0.9's own FSDPCheckpointManager, carried over with
``raycheckpoint import-verl`` and resumed by raycheckpoint's manager: the switch made
mid-training.  Run by ``tests/test_beside_verl.py`` with the Python of the environment
holding verl (not by pytest), the project's root on ``PYTHONPATH`` and no switch in the
environment (verl's own manager writes)::

    verl_import_script.py DIR RAY_TEMP

Two gloo ranks (Ray actors), a two-layer Qwen2 with tied embeddings under verl's
``apply_fsdp2``, AdamW and a warm-up schedule.  verl's manager saves step 2 (and the
script writes the tracker and ``data.pt`` as verl's trainer does); ``raycheckpoint
import-verl DIR`` runs as a user runs it; fresh ranks built from another seed load
``DIR/global_step_2/actor`` with raycheckpoint's manager.  Prints one JSON line:
whether the model, the optimizer and the scheduler equal verl's at step 2, and whether
the two steps after it give the same weights (the inputs of each step come from a
generator of its own, so the per-rank RNG, which a world-size-1 import does not carry,
does not matter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ray
import torch

from workers.group import free_port, init_process_group

TIMEOUT_S = 180


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank: int, world_size: int, port: int, seed: int) -> None:
        from torch.distributed import init_device_mesh
        from transformers import AutoModelForCausalLM, Qwen2Config
        from verl.utils.fsdp_utils import MixedPrecisionPolicy, apply_fsdp2

        init_process_group(rank=rank, world_size=world_size, master_addr="127.0.0.1",
                           master_port=port, timeout_s=TIMEOUT_S)
        mesh = init_device_mesh("cpu", mesh_shape=(world_size,), mesh_dim_names=("dp",))
        self.config = Qwen2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                  max_position_embeddings=64, tie_word_embeddings=True)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32,
                                                      attn_implementation="sdpa")
        apply_fsdp2(self.model, {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)}, {})
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lambda s: min(1.0, (s + 1) / 3))

    def train(self, step: int) -> None:
        gen = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, self.config.vocab_size, (2, 12), generator=gen)
        self.model(input_ids=ids).logits.float().pow(2).mean().backward()
        self.optim.step()
        self.sched.step()
        self.optim.zero_grad()

    def save_with_verl(self, path: str, step: int) -> None:
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

        assert FSDPCheckpointManager.__module__.startswith("verl."), FSDPCheckpointManager
        FSDPCheckpointManager(model=self.model, optimizer=self.optim, lr_scheduler=self.sched,
                              processing_class=None).save_checkpoint(path, global_step=step)

    def load_with_raycheckpoint(self, path: str) -> None:
        from raycheckpoint.integrations.verl import FSDPCheckpointManager

        manager = FSDPCheckpointManager(model=self.model, optimizer=self.optim,
                                        lr_scheduler=self.sched)
        manager.load_checkpoint(path)
        manager.close()

    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"model": get_model_state_dict(self.model, options=full),
                "optim": get_optimizer_state_dict(self.model, self.optim, options=full),
                "sched": self.sched.state_dict()}


def group(seed: int) -> list:
    port = free_port()
    ranks = [Rank.remote(r, 2, port, seed) for r in range(2)]
    ray.get([r.state.remote() for r in ranks], timeout=TIMEOUT_S)
    return ranks


def call(ranks: list, method: str, *args: object) -> list:
    return ray.get([getattr(r, method).remote(*args) for r in ranks], timeout=TIMEOUT_S)


def same(a: object, b: object) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def committed_loader_state(directory: str, step: int) -> object:
    """The data loader's state committed inside the actor's checkpoint of ``step``."""
    from raycheckpoint.integrations.verl._root import open_step
    from raycheckpoint.state import decode_loader_state
    from raycheckpoint.storage import Storage

    root = os.path.join(directory, "raycheckpoint", "actor")
    ck = open_step(root, Storage(root), step, None)
    return decode_loader_state(ck.trainer_state.get("dataloader"), ck.name)


def main(directory: str, ray_temp: str) -> int:
    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=ray_temp,
             logging_level="ERROR")
    path = os.path.join(directory, "global_step_2", "actor")
    verl = group(seed=0)
    for step in (1, 2):
        call(verl, "train", step)
    call(verl, "save_with_verl", path, 2)
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")  # what verl's trainer writes after the managers return
    position = {"position": 2, "generator": torch.arange(5, dtype=torch.uint8)}  # a sampler's
    torch.save(position, os.path.join(directory, "global_step_2", "data.pt"))
    saved = call(verl, "state")[0]
    for step in (3, 4):
        call(verl, "train", step)
    after = call(verl, "state")[0]["model"]
    for r in verl:
        ray.kill(r)

    imported = subprocess.run([sys.executable, "-m", "raycheckpoint.cli", "import-verl",
                               directory, "--json"], capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    if imported.returncode != 0:
        print(json.dumps({"import_error": imported.stderr[-3000:]}), flush=True)
        return 1
    ours = group(seed=1)
    call(ours, "load_with_raycheckpoint", path)
    loaded = call(ours, "state")[0]
    result = {"imported": json.loads(imported.stdout),
              "model": same(loaded["model"], saved["model"]),
              "optim": same(loaded["optim"], saved["optim"]),
              "sched": same(loaded["sched"], saved["sched"]),
              "data_loader": same(committed_loader_state(directory, 2), position)}
    for step in (3, 4):
        call(ours, "train", step)
    result["steps_after"] = same(call(ours, "state")[0]["model"], after)
    print(json.dumps(result), flush=True)
    ray.shutdown()
    return 0 if all(result[k] for k in ("model", "optim", "sched", "data_loader",
                                        "steps_after")) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
