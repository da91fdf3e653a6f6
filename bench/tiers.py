"""Tiered saves against a direct save to the durable store, side by side in one run.

    python -m bench.save_latency --tiers memory,local,durable --ranks 2 --bytes-per-rank 64MB \\
        --storage moto:// --local-dir /tmp/bench-nvme --out bench/results/tiers

One FSDP2 group (model + AdamW of the given size per rank) saves the same state, in
alternating rounds, to the durable store directly (``save_dir`` only) and tiered
(``checkpoint.local_dir`` first, then replicated to ``save_dir``; with ``memory`` among
the tiers, also copied to the memory tier: ``checkpoint.memory_replicas=1``).  Measured in
the same run:

* **stall**: training blocked by each save (tiered / direct: the target is <= 1.05);
* **local commit**: a tiered save until it is committed in the local tier, against a
  sequential write + fsync of the same bytes to the same local disk (target <= 1.2);
* **recovery**: the same checkpoint loaded from the memory tier (when asked), the local
  tier and the durable tier (each verified, into the same ranks; durable / memory: the
  target is >= 5);
* **step beside replication**: a training step while the previous checkpoint is being
  replicated, against a step alone (target <= 1.10), and, for scale, a step while a
  direct save persists to the durable store.

Each figure is the median over ``--repeat`` rounds after one warm-up round.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import ray

from bench._harness import TIMEOUT_S, BenchStorage, Where, _group, _kill, _max, _median, _settle
from bench._ranks import model_dims
from raycheckpoint import CheckpointConfig, CheckpointManager

TIERS = ("local", "durable")
TARGETS = {"stall_ratio": 1.05, "local_commit_ratio": 1.2, "step_beside_ratio": 1.10}
AT_LEAST = {"durable_over_memory_load": 5.0}  # targets a ratio meets from above


def _manager(durable: BenchStorage, group: list[Any], name: str,
             local_dir: str | None, memory: bool = False) -> CheckpointManager:
    cfg = CheckpointConfig(save_dir=durable.url(name), storage_options=durable.options,
                           local_dir=local_dir, memory_replicas=int(memory and local_dir is not None),
                           replicate_every=1, keep_last_n=1,
                           keep_last_n_local=1, publish_metrics=False, job_name=f"bench-{name}",
                           commit_timeout_s=TIMEOUT_S, rpc_timeout_s=TIMEOUT_S)
    return CheckpointManager(cfg, {"actor": group})


def _replicated(manager: CheckpointManager) -> None:
    assert ray.get(manager.coordinator.wait_replication.remote(TIMEOUT_S), timeout=TIMEOUT_S + 60)


def _steps(group: list[Any], n: int, batch: int, seq: int) -> list[float]:
    return [_max([w.train_step.remote(batch, seq) for w in group]) for _ in range(n)]


def run_tiers(ranks: int, bytes_per_rank: int, durable: BenchStorage, *, local_root: str,
              repeat: int = 3, step_batch: int = 4, step_seq: int = 64, memory: bool = False,
              log=print) -> dict[str, Any]:
    d = model_dims(ranks * bytes_per_rank)
    group, placement = _group(ranks, d, durable, Where())
    info = ray.get([w.ready.remote() for w in group], timeout=TIMEOUT_S)
    state_bytes = sum(i["bytes"] for i in info)
    log(f"== tiers: {ranks} ranks x {state_bytes / ranks / 1e6:.0f} MB; durable {durable.kind}, "
        f"local {local_root}")
    # a worker saves for one manager at a time (its ckpt_setup): each save gets its own
    # manager, built before it (outside the timed part) and closed after
    s: dict[str, list[float]] = {k: [] for k in (
        "stall_direct_s", "stall_tiered_s", "durable_direct_s", "local_commit_s",
        "raw_write_fsync_s", "replicated_s", "load_local_s", "load_durable_s", "step_alone_s",
        "step_beside_s", "step_beside_direct_s") + (("load_memory_s",) if memory else ())}
    raw = f"{local_root}/raw"
    local = os.path.join(local_root, "tiered")
    try:
        for rnd in range(repeat + 1):
            order = ("direct", "tiered") if rnd % 2 == 0 else ("tiered", "direct")
            got: dict[str, float] = {}
            for which in order:
                m = _manager(durable, group, which, local if which == "tiered" else None, memory)
                try:
                    m.update(step=rnd + 1)
                    _settle(group, durable)
                    t0 = time.perf_counter()
                    handle = m.save_checkpoint()
                    got[f"stall_{which}_s"] = handle.stall_s
                    if which == "direct":
                        # steps while the save persists to the durable store: the baseline
                        # of a step beside background I/O
                        got["step_beside_direct_s"] = _median(_steps(group, 3, step_batch, step_seq))
                        got["durable_direct_s"] = handle.wait(TIMEOUT_S)["total_s"]
                        m.wait_for_cleanup(TIMEOUT_S)
                        continue
                    handle.wait(TIMEOUT_S)
                    got["local_commit_s"] = time.perf_counter() - t0
                    # steps while the checkpoint is replicated, then the replication's rest
                    got["step_beside_s"] = _median(_steps(group, 3, step_batch, step_seq))
                    _replicated(m)
                    got["replicated_s"] = time.perf_counter() - t0  # the steps ran beside it
                    m.wait_for_cleanup(TIMEOUT_S)
                    # recovery of the same checkpoint: from each tier, fastest first
                    got.update(_recoveries(m, local, handle.name))
                finally:
                    m.close(TIMEOUT_S)
            got["step_alone_s"] = _median(_steps(group, 3, step_batch, step_seq))
            os.makedirs(raw, exist_ok=True)
            got["raw_write_fsync_s"] = max(ray.get(
                [w.raw_write.remote(raw) for w in group], timeout=TIMEOUT_S))
            shutil.rmtree(raw, ignore_errors=True)
            if rnd == 0:
                continue  # warm-up
            for k, v in got.items():
                s[k].append(v)
    finally:
        _kill(group, placement)
    med = {k: _median(v) for k, v in s.items()}
    ratios = {
        "stall_ratio": med["stall_tiered_s"] / med["stall_direct_s"],
        "local_commit_ratio": med["local_commit_s"] / med["raw_write_fsync_s"],
        "durable_over_local_load": med["load_durable_s"] / med["load_local_s"],
        "step_beside_ratio": med["step_beside_s"] / med["step_alone_s"],
        "step_beside_direct_ratio": med["step_beside_direct_s"] / med["step_alone_s"],
        "tiered_replicated_over_direct": med["replicated_s"] / med["durable_direct_s"],
    }
    targets = {k: {"target": t, "met": ratios[k] <= t} for k, t in TARGETS.items()}
    if memory:
        ratios["durable_over_memory_load"] = med["load_durable_s"] / med["load_memory_s"]
        targets.update({k: {"target": t, "at_least": True, "met": ratios[k] >= t}
                        for k, t in AT_LEAST.items()})
    return {"config": {"ranks": ranks, "bytes": state_bytes, "durable": durable.kind,
                       "repeat": repeat, "tiers": ["memory", *TIERS] if memory else list(TIERS)},
            "medians": med, "samples": s, "ratios": ratios, "targets": targets}


def _recoveries(manager: CheckpointManager, local: str, name: str) -> dict[str, float]:
    """Load ``name`` from its fastest tier, then with that tier's copy gone (the memory
    tier's holders ended; the local copy moved away, as when the node is lost), the next."""
    out = {}
    if manager.roots.memory is not None:
        from raycheckpoint.protocol import memory

        loaded = manager.load_checkpoint(name)
        assert loaded.tier == "memory tier", loaded.tier
        out["load_memory_s"] = loaded.load_s
        memory.release(manager.roots.memory.open().root)
    loaded = manager.load_checkpoint(name)
    assert loaded.tier == "local tier", loaded.tier
    out["load_local_s"] = loaded.load_s
    aside = tempfile.mkdtemp(dir=os.path.dirname(local), prefix="aside-")
    os.rename(os.path.join(local, name), os.path.join(aside, name))
    try:
        from_durable = manager.load_checkpoint(name)
        assert from_durable.tier == "durable tier", from_durable.tier
    finally:
        os.rename(os.path.join(aside, name), os.path.join(local, name))
        shutil.rmtree(aside, ignore_errors=True)
    out["load_durable_s"] = from_durable.load_s
    return out


def tiers_table(result: dict[str, Any]) -> str:
    m, r = result["medians"], result["ratios"]
    c = result["config"]
    lines = [f"tiers: {c['ranks']} ranks, {c['bytes'] / 1e6:.0f} MB in all; durable "
             f"{c['durable']}; medians of {c['repeat']} rounds",
             "| measure | direct to durable | tiered (local, durable) | ratio | target |",
             "|---|---|---|---|---|",
             f"| stall (s) | {m['stall_direct_s']:.3f} | {m['stall_tiered_s']:.3f} | "
             f"{r['stall_ratio']:.2f} | <= 1.05 |",
             f"| committed (s) | {m['durable_direct_s']:.3f} (durable) | {m['local_commit_s']:.3f} "
             f"(local) | {r['local_commit_ratio']:.2f} x write+fsync {m['raw_write_fsync_s']:.3f} s "
             "| <= 1.2 |",
             f"| in the durable tier, 3 steps beside (s) | {m['durable_direct_s']:.3f} | "
             f"{m['replicated_s']:.3f} | "
             f"{r['tiered_replicated_over_direct']:.2f} | - |",
             f"| recovery (s) | durable {m['load_durable_s']:.3f} | local {m['load_local_s']:.3f} | "
             f"{r['durable_over_local_load']:.2f} (durable / local) | - |",
             *([f"| recovery from memory (s) | durable {m['load_durable_s']:.3f} | memory "
                f"{m['load_memory_s']:.3f} | {r['durable_over_memory_load']:.2f} (durable / "
                "memory) | >= 5 |"] if "load_memory_s" in m else []),
             f"| step beside the save's background I/O (s; alone {m['step_alone_s']:.3f}) | "
             f"beside the persist {m['step_beside_direct_s']:.3f} "
             f"({r['step_beside_direct_ratio']:.2f}x) | beside replication "
             f"{m['step_beside_s']:.3f} | {r['step_beside_ratio']:.2f} x alone | <= 1.10 |"]
    return "\n".join(lines)


def plot_tiers(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["medians"]
    bars = [("stall\ndirect", m["stall_direct_s"]), ("stall\ntiered", m["stall_tiered_s"]),
            ("write+fsync\nlocal", m["raw_write_fsync_s"]),
            ("committed\nlocal tier", m["local_commit_s"]),
            ("committed\ndirect (S3)", m["durable_direct_s"]),
            ("in S3\ntiered", m["replicated_s"]),
            *([("recovery\nmemory tier", m["load_memory_s"])] if "load_memory_s" in m else []),
            ("recovery\nlocal tier", m["load_local_s"]), ("recovery\ndurable tier", m["load_durable_s"])]
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.bar([b[0] for b in bars], [b[1] for b in bars],
           color=["#888", "#2a7", "#888", "#2a7", "#888", "#2a7"] + ["#2a7"] * (len(bars) - 7)
           + ["#27a"])
    ax.set_ylabel("seconds (median)")
    c = result["config"]
    ax.set_title(f"tiered vs direct: {c['ranks']} ranks, {c['bytes'] / 1e6:.0f} MB, durable "
                 f"{c['durable']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main_tiers(args: Any, parser: Any) -> dict[str, Any]:
    """``bench.save_latency --tiers``: one point (the first of ``--ranks`` and
    ``--bytes-per-rank``), tiered against direct."""
    import json

    from bench.save_latency import _options
    from drivers._ray import init_ray

    asked = [t.strip() for t in args.tiers.split(",")]
    memory = "memory" in asked
    if sorted(t for t in asked if t != "memory") != sorted(TIERS):
        parser.error(f"--tiers takes local,durable or memory,local,durable, got {args.tiers!r}")
    storage = BenchStorage(args.storage, _options(args.storage_option))
    local_root = args.local_dir or tempfile.mkdtemp(prefix="rc-bench-local-")
    os.makedirs(local_root, exist_ok=True)
    started_ray = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    init_ray()
    try:
        result = run_tiers(args.ranks[0], args.bytes_per_rank[0], storage, local_root=local_root,
                           repeat=args.repeat, step_batch=args.step_batch, step_seq=args.step_seq,
                           memory=memory)
        print(tiers_table(result), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(result, f, indent=1)
            plot_tiers(result, os.path.join(args.out, "plot.png"))
            print(f"wrote {args.out}/results.json and plot.png")
        return result
    finally:
        storage.close()
        if args.local_dir is None:
            shutil.rmtree(local_root, ignore_errors=True)
        if started_ray:
            ray.shutdown()
