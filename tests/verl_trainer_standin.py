"""verl 0.9's own trainer methods saving and resuming through raycheckpoint, on a stand-in
trainer.  Run by ``tests/test_beside_verl.py`` with the Python of the environment holding
verl, the project's root on ``PYTHONPATH`` and
``VERL_USE_EXTERNAL_MODULES=raycheckpoint.integrations.verl.patch`` set, in a session of its
own (a run that kills itself ends its process group)::

    verl_trainer_standin.py ROOT RAY_TEMP STEPS [--kill-in-save-of N] [--legacy] [--async]

The stand-in holds what verl's v1 ``PPOTrainer._save_checkpoint`` and ``_load_checkpoint``
read (``config``, ``global_steps``, ``actor_rollout_wg``, ``use_critic``, ``critic_wg``,
``train_dataloader``, ``checkpoint_callback``, ``trainer_mode``); the methods are verl's
own (``_load_checkpoint`` as the patch replaced it).  The actor and the critic are two
gloo ranks each (Ray actors, their own seeds) with raycheckpoint's verl manager; their
worker groups make verl's blocking ONE_TO_ALL calls.  Each step takes the next batch of
a ``StatefulDataLoader`` and one optimizer step per rank; a save every 2 steps
(``trainer.save_freq``), keeping ``max_actor_ckpt_to_keep=max_critic_ckpt_to_keep=1``.
Appends ``{"step", "batch", "weights", "critic"}`` per step to ``ROOT/steps.jsonl``, and
prints ``resumed <N>`` after the load.
``--kill-in-save-of N``: the ranks' persist hangs in step N's save, and the process
group is SIGKILLed 3 s into it (the job dies while that save persists).  ``--legacy``:
the methods of verl's legacy ``RayPPOTrainer`` instead of v1's.  ``--async``: verl's
``async_save`` (the saves return after the host copy; verl's trainer writes no tracker).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import ray
import torch
from omegaconf import OmegaConf
from torchdata.stateful_dataloader import StatefulDataLoader

from workers.group import create_worker_group

TIMEOUT_S = 180


class WorkerGroup:
    """verl's RayWorkerGroup as the trainer uses it: each call on every rank, blocking."""

    def __init__(self, ranks: list) -> None:
        self.ranks = ranks

    def _all(self, method: str, *args: object) -> list:
        return ray.get([getattr(r, method).remote(*args) for r in self.ranks], timeout=TIMEOUT_S)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        self._all("save", local_path, global_step, max_ckpt_to_keep)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        self._all("load", local_path)


class StandIn:
    """The attributes verl's trainer methods read."""

    def __init__(self, root: str, ranks: list, critics: list, steps: int, async_save: bool) -> None:
        from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback

        self.config = OmegaConf.create({
            "trainer": {"default_local_dir": root, "resume_mode": "auto", "resume_from_path": None,
                        "del_local_ckpt_after_load": False, "default_hdfs_dir": None,
                        "max_actor_ckpt_to_keep": 1, "max_critic_ckpt_to_keep": 1,
                        "checkpoint_callback_class": None},
            "actor_rollout_ref": {"actor": {"checkpoint": {"async_save": async_save}}}})
        self.global_steps = 0
        self.total_training_steps = steps
        self.use_critic = True
        self.trainer_mode = "sync"
        self.actor_rollout_wg = WorkerGroup(ranks)
        self.critic_wg = WorkerGroup(critics)
        gen = torch.Generator().manual_seed(7)
        self.train_dataloader = StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True,
                                                   generator=gen)
        self.checkpoint_callback = build_checkpoint_callback(self.config)


def kill_group_after(seconds: float) -> None:
    def run() -> None:
        time.sleep(seconds)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=run, daemon=True).start()


def main(root: str, ray_temp: str, steps: int, kill_in: int | None, legacy: bool,
         async_save: bool) -> None:
    if legacy:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer as PPOTrainer
    else:
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=ray_temp,
             logging_level="ERROR")
    from tests.verl_dropin_ranks import DropinRank

    ranks = create_worker_group(DropinRank, role="actor", world_size=2, timeout_s=TIMEOUT_S,
                                async_save=async_save)
    critics = create_worker_group(DropinRank, role="critic", world_size=2, timeout_s=TIMEOUT_S,
                                  async_save=async_save, seed=100)
    trainer = StandIn(root, ranks, critics, steps, async_save)
    PPOTrainer._load_checkpoint(trainer)
    print(f"resumed {trainer.global_steps}", flush=True)
    batches = iter(trainer.train_dataloader)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "steps.jsonl"), "a") as log:
        for step in range(trainer.global_steps + 1, steps + 1):
            trainer.global_steps = step
            batch = [int(x) for x in next(batches)]
            ray.get([r.train.remote(1) for r in ranks + critics], timeout=TIMEOUT_S)
            weights = ray.get([r.state.remote() for r in ranks], timeout=TIMEOUT_S)[0]["weights"]
            critic = ray.get([r.state.remote() for r in critics], timeout=TIMEOUT_S)[0]["weights"]
            log.write(json.dumps({"step": step, "batch": batch, "weights": weights,
                                  "critic": critic}) + "\n")
            log.flush()
            if step % 2 == 0:
                if step == kill_in:
                    ray.get([r.arm.remote("worker.persist", "hang:600") for r in ranks + critics],
                            timeout=TIMEOUT_S)
                    kill_group_after(3.0)
                PPOTrainer._save_checkpoint(trainer)
    ray.get([r.close.remote() for r in ranks + critics], timeout=TIMEOUT_S)
    ray.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    kill = int(args[args.index("--kill-in-save-of") + 1]) if "--kill-in-save-of" in args else None
    main(args[0], args[1], int(args[2]), kill, "--legacy" in args, "--async" in args)
