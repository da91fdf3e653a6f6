"""A small data-parallel FSDP2 training run with checkpointing and exact resume.

    python -m drivers.train_tiny --root ./checkpoints/tiny --steps 12 --save-every 3

Each step draws a batch position from a resumable sampler, trains every rank of an
FSDP2 worker group, and every ``--save-every`` steps saves a full checkpoint in the
background (light ones every ``--light-every``).  On start it resumes from the newest
checkpoint that verifies (``--resume auto``).  ``--crash-at K`` SIGKILLs the driver
right after step K, as a preemption or OOM would.  The last line printed is the sha256
of the final weights, so two runs can be compared.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import ray

from drivers._ray import init_ray
from raycheckpoint import CheckpointConfig, CheckpointManager, ResumableSampler
from workers import FSDPTrainWorker, create_worker_group


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="./checkpoints/tiny", help="checkpoint root (path or URI)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--save-every", type=int, default=3, help="full checkpoint interval")
    p.add_argument("--light-every", type=int, default=0, help="light checkpoint interval (0: off)")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--resume", default="auto", help="auto | disable | a step, tag or path")
    p.add_argument("--crash-at", type=int, default=0, help="SIGKILL the driver after this step")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dataset-size", type=int, default=64)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    init_ray()
    model = {"d_model": args.d_model, "n_layers": args.layers}
    group = create_worker_group(FSDPTrainWorker, role="actor", world_size=args.ranks, model=model)
    sampler = ResumableSampler(args.dataset_size, seed=0)
    config = CheckpointConfig(save_dir=args.root, keep_last_n=args.keep_last,
                              keep_last_n_light=args.keep_last, commit_timeout_s=300)
    fingerprint = {"model": model, "dataset_size": args.dataset_size, "lr": 1e-3}
    manager = CheckpointManager(config, {"actor": group}, dataloader=sampler,
                                fingerprint=fingerprint)
    start = 0
    if args.resume != "disable":
        loaded = manager.load_checkpoint(args.resume)
        if loaded is not None:
            start = loaded.step
            print(f"resumed from {loaded.name} (step {loaded.step})", flush=True)
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        batch_seed = sum(i * 31 ** k for k, i in enumerate(sampler.next_batch(4)))
        losses = ray.get([w.train_step.remote(batch_seed) for w in group], timeout=300)
        manager.update(step=step, metrics={"loss": losses[0]})
        event = ""
        if step % args.save_every == 0:
            h = manager.save_checkpoint(kind="full")
            event = f" save={h.name} stall={h.stall_s * 1e3:.0f}ms"
        elif args.light_every and step % args.light_every == 0:
            h = manager.save_checkpoint(kind="light")
            event = f" light={h.name} stall={h.stall_s * 1e3:.0f}ms"
        print(json.dumps({"step": step, "loss": round(losses[0], 5),
                          "step_time_s": round(time.perf_counter() - t0, 3)}) + event, flush=True)
        if step == args.crash_at:
            print(f"crashing (SIGKILL) after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    manager.wait_for_saves(600)
    for s in manager.checkpoint_stats:
        print(f"checkpoint {s['name']}: {s.get('bytes', 0) / 1e6:.2f} MB, stall "
              f"{s['stall_s'] * 1e3:.0f} ms, committed after {s.get('total_s', 0):.2f} s", flush=True)
    sha = ray.get([w.weights_sha256.remote() for w in group], timeout=300)[0]
    manager.close(60)
    ray.shutdown()
    print(f"final weights sha256 {sha}", flush=True)
    return sha


if __name__ == "__main__":
    main()
