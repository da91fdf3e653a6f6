"""Durable and load time of whichever raycheckpoint this interpreter imports: for comparing
two versions of the code, run alternately on one machine.

    git worktree add /tmp/rc-old <commit>
    script=$PWD/bench/release_ab.py   # older trees need not have it: run this file
    for i in 1 2 3; do
      (cd /tmp/rc-old && PYTHONPATH=$PWD python $script --ranks 2 --bytes-per-rank 64MB)
      PYTHONPATH=$PWD python $script --ranks 2 --bytes-per-rank 64MB
    done

Each run builds one benchmark group (bench._ranks) on a local Ray instance, whose workers
inherit ``PYTHONPATH`` and so import the same tree (printed), then saves and loads through
``CheckpointManager`` ``--saves`` times after one warm-up, and prints the medians: stall
(``save_checkpoint``'s blocked time, and the slowest worker's part of it), durable
(``save_checkpoint`` to committed) and load (cold page cache).  Runs of the two trees,
alternated, are what compare; one run alone says little on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray

import raycheckpoint
from bench._harness import TIMEOUT_S, BenchStorage, Where, _group, _kill, _manager, parse_bytes
from bench._ranks import model_dims
from drivers._ray import init_ray


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--bytes-per-rank", type=parse_bytes, default=parse_bytes("64MB"))
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--storage", default=None, help="a directory (default: a temporary one)")
    args = ap.parse_args(argv)
    init_ray()
    storage = BenchStorage(args.storage or tempfile.mkdtemp(prefix="rc-ab-"), {})
    group, placement = _group(args.ranks, model_dims(args.ranks * args.bytes_per_rank), storage,
                              Where())
    try:
        ray.get([w.ready.remote() for w in group], timeout=TIMEOUT_S)
        imported = ray.get(group[0].__ray_call__.remote(
            lambda self: __import__("raycheckpoint").__file__), timeout=TIMEOUT_S)
        manager = _manager(storage, group)
        durable, load, stall, worker_stall = [], [], [], []
        try:
            for i in range(args.saves + 1):  # the first is a warm-up
                manager.update(step=i + 1)
                t0 = time.perf_counter()
                handle = manager.save_checkpoint()
                handle.wait(TIMEOUT_S)
                durable.append(time.perf_counter() - t0)
                stall.append(handle.stall_s)
                worker_stall.append(handle.worker_stall_s)
                storage.drop_cache("raycheckpoint")
                t0 = time.perf_counter()
                manager.load_checkpoint(handle.name)
                load.append(time.perf_counter() - t0)
        finally:
            manager.close(TIMEOUT_S)
    finally:
        _kill(group, placement)
        storage.close()
    out = {name: statistics.median(values[1:]) for name, values in (
        ("stall_s", stall), ("worker_stall_s", worker_stall), ("durable_s", durable),
        ("load_s", load))}
    print(f"raycheckpoint {raycheckpoint.__version__} ({raycheckpoint.__file__}; workers: {imported}): "
          f"{args.ranks} ranks x {args.bytes_per_rank / 1e6:.0f} MB, stall {1e3 * out['stall_s']:.1f} ms "
          f"(workers {1e3 * out['worker_stall_s']:.1f} ms), durable {out['durable_s']:.3f} s, "
          f"load {out['load_s']:.3f} s (medians of {args.saves})")
    return out


if __name__ == "__main__":
    main()
