"""What background verification costs training: step time beside a running verification.

    python -m bench.verify_overhead [--ranks 2] [--d-model 1024] [--layers 4] [--rounds 5]
                                    [--root DIR_OR_URI] [--batch 2]

Builds an FSDP2 worker group (TinyLM with AdamW state) and a manager with
``verify_after_save=True``.  Each round saves a full checkpoint and waits for its commit
and clean-up, so that the verifier starts; then times the training steps started while
the verification runs ("beside"), and as many steps again with nothing running
("alone").  The two are measured in the same round, one right after the other, so the
shared machine's noise falls on both.  Reported: the median step time of each, their
ratio (target: at most 1.05), how long a verification took, and what it costs a save
interval of ``--interval-steps`` steps (the extra time of the steps beside it, over the
interval).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import ray

from drivers._ray import init_ray
from raycheckpoint import CheckpointConfig, CheckpointManager
from workers import FSDPTrainWorker, create_worker_group

TIMEOUT_S = 1800.0


def _steps(group: list, seed: int, count: int | None = None,
           running: Callable[[], bool] | None = None) -> list[float]:
    """Times of ``count`` steps, or of the steps started while ``running()``."""
    times: list[float] = []
    while (count is None or len(times) < count) and (running is None or running()):
        t0 = time.perf_counter()
        ray.get([w.train_step.remote(seed + len(times)) for w in group], timeout=TIMEOUT_S)
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--interval-steps", type=int, default=10,
                   help="steps between verified saves, for the per-interval cost")
    p.add_argument("--root", default=None, help="checkpoint root (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = p.parse_args(argv)
    root = args.root or tempfile.mkdtemp(prefix="rc-bench-")
    init_ray()
    group = create_worker_group(FSDPTrainWorker, role="actor", world_size=args.ranks,
                                timeout_s=TIMEOUT_S,
                                model={"d_model": args.d_model, "n_layers": args.layers,
                                       "batch_size": args.batch, "seq_len": 64})
    ray.get([w.train_step.remote(0) for w in group], timeout=TIMEOUT_S)  # AdamW state exists
    cfg = CheckpointConfig(save_dir=root, keep_last_n=1, verify_after_save=True,
                           publish_metrics=False, commit_timeout_s=TIMEOUT_S)
    manager = CheckpointManager(cfg, {"actor": group})
    rows = []

    def verifying() -> bool:
        return not ray.get(manager.coordinator.wait_verifications.remote(0), timeout=TIMEOUT_S)

    try:
        for rnd in range(args.rounds + 1):  # round 0 warms up (the verifier's imports)
            manager.update(step=rnd + 1)
            result = manager.save_checkpoint().wait(TIMEOUT_S)
            manager.wait_for_cleanup(TIMEOUT_S)
            beside = _steps(group, 1000 * rnd, running=verifying)
            if not ray.get(manager.coordinator.wait_verifications.remote(TIMEOUT_S),
                           timeout=TIMEOUT_S + 60):
                raise RuntimeError("a verification did not finish")
            alone = _steps(group, 1000 * rnd + 500, count=len(beside))
            manager.checkpoint_stats  # noqa: B018 - takes the verification results
            v = manager.verifications[-1]
            if not v["ok"]:
                raise RuntimeError(f"verification failed: {v['error']}")
            if rnd == 0 or not beside:  # warm-up, or it finished before a step started
                continue
            rows.append({"bytes": result["bytes"], "verify_s": v["seconds"], "steps": len(beside),
                         "step_beside_s": statistics.median(beside),
                         "step_alone_s": statistics.median(alone)})
    finally:
        manager.close(600)
        ray.shutdown()
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{'round':>5} {'MB':>8} {'verify s':>9} {'steps':>6} {'step beside s':>14} "
          f"{'step alone s':>13} {'ratio':>6}")
    for i, r in enumerate(rows):
        print(f"{i + 1:>5} {r['bytes'] / 1e6:>8.1f} {r['verify_s']:>9.2f} {r['steps']:>6} "
              f"{r['step_beside_s']:>14.4f} {r['step_alone_s']:>13.4f} "
              f"{r['step_beside_s'] / r['step_alone_s']:>6.3f}")
    summary = {k: statistics.median(r[k] for r in rows)
               for k in ("bytes", "verify_s", "step_beside_s", "step_alone_s")}
    summary["slowdown"] = statistics.median(r["step_beside_s"] / r["step_alone_s"] for r in rows)
    summary["interval_cost"] = statistics.median(
        r["steps"] * (r["step_beside_s"] - r["step_alone_s"]) / (args.interval_steps * r["step_alone_s"])
        for r in rows)
    print(f"median: {summary['bytes'] / 1e6:.1f} MB verified in {summary['verify_s']:.2f} s; a "
          f"step beside it takes {summary['slowdown']:.3f}x a step alone (target <= 1.05); over "
          f"{args.interval_steps} steps between verified saves: {summary['interval_cost']:+.1%}")
    if args.json:
        print(json.dumps({"rows": rows, "median": summary}))
    return summary


if __name__ == "__main__":
    main()
