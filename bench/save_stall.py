"""How long training is blocked by a save, against how long the save takes to commit.

    python -m bench.save_stall [--ranks 2] [--d-model 1024] [--layers 4] [--repeat 3]
                               [--root DIR_OR_URI]

Builds an FSDP2 worker group holding a model of the given size with AdamW state,
then saves ``--repeat`` full checkpoints back to back (each waited for), and reports
per save: the bytes written, the stall (driver blocked in ``save_checkpoint``), the
workers' host-copy time, the persist time and the time until committed.  The ratio
stall / committed is what this machine shows; absolute times mean little off a GPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import ray

from drivers._ray import init_ray
from raycheckpoint import CheckpointConfig, CheckpointManager
from workers import FSDPTrainWorker, create_worker_group


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--root", default=None, help="checkpoint root (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = p.parse_args(argv)
    root = args.root or tempfile.mkdtemp(prefix="rc-bench-")
    init_ray()
    group = create_worker_group(FSDPTrainWorker, role="actor", world_size=args.ranks, timeout_s=600,
                                model={"d_model": args.d_model, "n_layers": args.layers,
                                       "batch_size": 2, "seq_len": 16})
    ray.get([w.train_step.remote(0) for w in group], timeout=600)  # materialize AdamW state
    cfg = CheckpointConfig(save_dir=root, keep_last_n=1, commit_timeout_s=1800)
    manager = CheckpointManager(cfg, {"actor": group})
    rows = []
    try:
        for i in range(args.repeat):
            manager.update(step=i + 1)
            t0 = time.perf_counter()
            handle = manager.save_checkpoint()
            result = handle.wait(1800)
            committed = time.perf_counter() - t0
            rows.append({"bytes": result["bytes"], "stall_s": handle.stall_s,
                         "worker_copy_s": handle.worker_stall_s,
                         "persist_s": result["persist_s"], "committed_s": committed})
    finally:
        manager.close(600)
        ray.shutdown()
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{'save':>4} {'MB':>8} {'stall s':>8} {'copy s':>8} {'persist s':>9} "
          f"{'commit s':>9} {'stall/commit':>12}")
    for i, r in enumerate(rows):
        print(f"{i + 1:>4} {r['bytes'] / 1e6:>8.1f} {r['stall_s']:>8.3f} {r['worker_copy_s']:>8.3f} "
              f"{r['persist_s']:>9.3f} {r['committed_s']:>9.3f} "
              f"{r['stall_s'] / r['committed_s']:>12.3f}")
    summary = {k: statistics.median(r[k] for r in rows)
               for k in ("bytes", "stall_s", "worker_copy_s", "persist_s", "committed_s")}
    summary["stall_over_commit"] = summary["stall_s"] / summary["committed_s"]
    print(f"median: {summary['bytes'] / 1e6:.1f} MB, stall {summary['stall_s']:.3f} s, committed "
          f"{summary['committed_s']:.3f} s, stall/commit {summary['stall_over_commit']:.3f}")
    if args.json:
        print(json.dumps({"rows": rows, "median": summary}))
    return summary


if __name__ == "__main__":
    main()
