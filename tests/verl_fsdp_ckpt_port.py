"""verl's own ``tests/special_distributed/test_fsdp_ckpt.py`` (verl 0.9), ported to CPU and
gloo, run with raycheckpoint's manager switched in the way a user switches it.

Run by ``tests/test_beside_verl.py`` with the Python of the environment holding verl
(not by pytest): ``verl_fsdp_ckpt_port.py OUT_DIR RAY_TEMP_DIR``, with the project's root
on ``PYTHONPATH`` and ``VERL_USE_EXTERNAL_MODULES=raycheckpoint.integrations.verl.patch``
in the environment (verl imports that module on ``import verl``, in this process and in
every Ray worker).

What verl's test does, per strategy (``fsdp``: FSDP1, ``fsdp2``: verl's ``apply_fsdp2``),
on two ranks: a one-layer Qwen2 from its config; AdamW and StepLR; the manager built as
verl's test builds it (``FSDPCheckpointManager(model=, optimizer=, lr_scheduler=,
tokenizer=)``, imported from verl's module); a step, ``save_checkpoint(local_path,
hdfs_path=None, global_step=0)``, a second step and its logits, ``load_checkpoint``, the
state dict equal to the saved one, the second step again and its logits equal.  What
changed: ranks are Ray actors on gloo (verl's workers are Ray actors), the device is the
CPU, a small tokenizer is built here instead of read from ``~/models``, attention is
``sdpa`` without flash-attn's unpadding, and the saved state is cloned (verl's test keeps
references to the live tensors, which the second step changes in place).  Also checked:
the manager is raycheckpoint's, and the saved checkpoint verifies.
Prints one JSON line per strategy; exits 1 unless every one passed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import ray
import torch

from workers.group import free_port, init_process_group

TIMEOUT_S = 180


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank: int, world_size: int, port: int) -> None:
        init_process_group(rank=rank, world_size=world_size, master_addr="127.0.0.1",
                           master_port=port, timeout_s=TIMEOUT_S)
        self.rank = rank

    def run(self, strategy: str, out: str) -> dict:
        from torch.distributed import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from transformers import AutoModelForCausalLM, Qwen2Config
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
        from verl.utils.fsdp_utils import MixedPrecisionPolicy, apply_fsdp2

        from tests.hf_models import train_tokenizer

        world_size = torch.distributed.get_world_size()
        mesh = init_device_mesh("cpu", mesh_shape=(world_size,), mesh_dim_names=("dp",))
        tokenizer = train_tokenizer("qwen2")
        config = Qwen2Config(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                             num_attention_heads=4, num_key_value_heads=2,
                             vocab_size=len(tokenizer), max_position_embeddings=128)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config=config, dtype=torch.float32,
                                                 attn_implementation="sdpa")
        if strategy == "fsdp":
            model = FSDP(model, use_orig_params=False, device_id=torch.device("cpu"),
                         sharding_strategy=ShardingStrategy.FULL_SHARD, device_mesh=mesh)
        else:
            apply_fsdp2(model, {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)}, {})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        manager = FSDPCheckpointManager(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                        tokenizer=tokenizer)
        result = {"strategy": strategy, "manager": type(manager).__module__}

        torch.manual_seed(1 + self.rank)
        ids1 = torch.randint(0, config.vocab_size, (2, 24))
        ids2 = torch.randint(0, config.vocab_size, (2, 24))
        pos = torch.arange(24).unsqueeze(0).expand(2, -1)

        def update(ids: torch.Tensor) -> None:
            model(input_ids=ids, position_ids=pos).logits.mean().backward()
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()

        def state() -> dict:
            with FSDP.state_dict_type(model, torch.distributed.fsdp.StateDictType.SHARDED_STATE_DICT) \
                    if strategy == "fsdp" else _nothing():
                sd = model.state_dict()
            return {k: _local(v).detach().clone() for k, v in sd.items()}

        update(ids1)
        path = os.path.join(out, strategy, "checkpoint")
        manager.save_checkpoint(local_path=path, hdfs_path=None, global_step=0)
        saved = state()
        update(ids2)
        with torch.no_grad():
            before = model(input_ids=ids2, position_ids=pos).logits
        manager.load_checkpoint(path)
        loaded = state()
        result["state_equal"] = saved.keys() == loaded.keys() and all(
            torch.equal(saved[k], loaded[k]) for k in saved)
        update(ids2)
        with torch.no_grad():
            after = model(input_ids=ids2, position_ids=pos).logits
        result["logits_equal"] = torch.equal(before, after)
        manager.close()
        return result


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local()
    if isinstance(t, ShardedTensor):
        return torch.cat([s.tensor.flatten() for s in t.local_shards()]) if t.local_shards() \
            else torch.empty(0)
    return t


def main(out: str, ray_temp: str) -> int:
    from raycheckpoint.admin import verify

    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=ray_temp,
             logging_level="ERROR")
    ok = True
    for strategy in ("fsdp2", "fsdp"):
        port = free_port()
        ranks = [Rank.remote(r, 2, port) for r in range(2)]
        try:
            results = ray.get([r.run.remote(strategy, out) for r in ranks], timeout=TIMEOUT_S)
            root = os.path.join(out, strategy, "raycheckpoint", "checkpoint")
            doc = {**results[0], "ranks_agree": results[0] == results[1], "verify": verify(root)["ok"]}
        except Exception as e:  # noqa: BLE001 - reported, and the next strategy still runs
            doc = {"strategy": strategy, "error": f"{type(e).__name__}: {e}",
                   "trace": traceback.format_exc()[-4000:]}
        finally:
            for r in ranks:
                ray.kill(r)
        passed = (doc.get("manager", "").startswith("raycheckpoint.") and doc.get("state_equal")
                  and doc.get("logits_equal") and doc.get("ranks_agree") and doc.get("verify"))
        doc["passed"] = bool(passed)
        ok = ok and doc["passed"]
        print(json.dumps(doc), flush=True)
    ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
