"""Save and load latency of raycheckpoint against the alternatives, beside the machine's limits.

    python -m bench.save_latency --ranks 2 --bytes-per-rank 256MB --storage /tmp/bench
    python -m bench.save_latency --ranks 1,2,4,8 --bytes-per-rank 128MB --storage /tmp/bench \\
        --repeat 3 --out bench/results/ranks
    python -m bench.save_latency --ranks 2 --bytes-per-rank 64MB --storage moto://   # local S3
    python -m bench.save_latency --virtual-ranks 8,64,256 --storage /tmp/bench
    python -m bench.save_latency --ranks 2 --bytes-per-rank 256MB --host-buffer-bytes 64MB,256MB
    # against verl's own FSDPCheckpointManager, with the Python that has verl (scripts/verl_env.sh):
    PYTHONPATH=. .venv-verl/bin/python -m bench.save_latency --methods raycheckpoint,verl --ranks 2
    # on a Ray cluster (ray up cluster.yaml), one GPU per rank, state on the GPUs:
    ray job submit --working-dir . -- python -m bench.save_latency --ranks 256 \\
        --bytes-per-rank 1GB --device cuda --storage s3://BUCKET/bench --out /tmp/bench

Each point (ranks x bytes per rank) builds one FSDP2 group whose ranks hold model +
AdamW state of that size (a 16-layer decoder; about 580 tensors), then, interleaved in
rounds, saves that same state with every method and loads it back (cold: the files
are evicted from the page cache first), checking that each load restores exactly what
was saved.  In the same run it measures the limits of the machine: a host copy of the
same bytes into preallocated memory, a sequential write + fsync of the same bytes to
the same storage, and the read back.  With ``--ranks R >= 2`` it also loads every
method's checkpoint into R/2 ranks (resharding).  See ``bench/README.md``.

``--virtual-ranks`` measures coordination instead: many ranks per process report small
shards through the real coordinator (see :mod:`bench.virtual_ranks`).

Times are the maximum over ranks; each figure is the median over ``--repeat`` rounds
(after one warm-up round that is not counted).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from typing import Any

import fsspec
import ray

from bench._harness import (
    TIMEOUT_S,
    BenchStorage,
    Where,
    _cleaned_up,
    _group,
    _ints,
    _kill,
    _manager,
    _max,
    _median,
    _rotated,
    _settle,
    _sizes,
    _spread,
    parse_bytes,
)
from bench._ranks import METHODS, RESHARDS, model_dims
from bench._steps import _perturb, reshard_loads, step_overhead
from bench._verl import HINT, require_verl, verl_version
from bench.host_buffer import budget_stalls
from bench.report import _fmt, _pct, plot, table, targets
from drivers._ray import init_ray


def measure_limits(group: list[Any], storage: BenchStorage, repeat: int) -> dict[str, Any]:
    """The machine's limits for these bytes.  The write limit is the faster of a buffered
    write + fsync and an ``O_DIRECT`` one (local disk, where the filesystem allows it),
    each measured ``repeat`` times, alternating which goes first."""
    copies, reads = [], []
    writes: dict[bool, list[float]] = {False: [], True: []}
    _max([w.host_copy.remote() for w in group])  # allocates and touches the buffers
    fresh = _max([w.host_copy.remote(fresh=True) for w in group])
    for i in range(repeat):
        copies.append(_max([w.host_copy.remote() for w in group]))
        for direct in ((False, True) if i % 2 == 0 else (True, False)):
            _settle(group, storage)
            got = ray.get([w.raw_write.remote(storage.url(f"raw/{i}{'d' * direct}"), direct=direct)
                           for w in group], timeout=TIMEOUT_S)
            if None not in got:
                writes[direct].append(max(got))
        _settle(group, storage)
        storage.drop_cache(f"raw/{i}")
        reads.append(_max([w.raw_read.remote(storage.url(f"raw/{i}")) for w in group]))
        storage.remove(f"raw/{i}")
        storage.remove(f"raw/{i}d")
    ray.get([w.free_limit_buffers.remote(keep_copy=True) for w in group], timeout=TIMEOUT_S)
    best = min((w for w in writes.values() if w), key=_median)
    return {"host_copy_s": _median(copies), "host_copy_fresh_s": fresh,
            "raw_write_fsync_s": _median(best), "raw_read_s": _median(reads),
            "raw_write_buffered_s": _median(writes[False]),
            "raw_write_direct_s": _median(writes[True]) if writes[True] else None,
            "spread": {"host_copy_s": _spread(copies), "raw_write_fsync_s": _spread(best),
                       "raw_read_s": _spread(reads)}}


def _check(group: list[Any], expected: list[str], what: str) -> None:
    got = ray.get([w.local_digest.remote() for w in group], timeout=TIMEOUT_S)
    if got != expected:
        bad = [r for r, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
        raise RuntimeError(f"{what}: ranks {bad} did not get back the state that was saved")


def run_point(ranks: int, bytes_per_rank: int, storage: BenchStorage, *, repeat: int,
              methods: tuple[str, ...] = METHODS, reshard: bool = True, step_batch: int = 4,
              step_seq: int = 64, where: Where = Where(), log=print,
              host_buffer_bytes: list[int] | None = None) -> dict[str, Any]:
    d = model_dims(ranks * bytes_per_rank)
    group, placement = _group(ranks, d, storage, where)
    info = ray.get([w.ready.remote() for w in group], timeout=TIMEOUT_S)
    state_bytes = sum(i["bytes"] for i in info)
    nodes = len({i["node_id"] for i in info})
    if nodes > 1 and storage.local:
        log(f"   note: {nodes} nodes share {storage.root}: that must be one shared mount")
    log(f"== {ranks} ranks x {state_bytes / ranks / 1e6:.0f} MB ({info[0]['tensors']} tensors per "
        f"rank, d_model {d}) on {storage.kind}, {where.describe()}, {nodes} node(s)")
    manager = _manager(storage, group)
    samples: dict[str, dict[str, list[float]]] = {m: {"stall_s": [], "durable_s": [], "load_s": [],
                                                      "stall_worker_s": []} for m in methods}
    result: dict[str, Any] = {"config": {"ranks": ranks, "bytes_per_rank": state_bytes // ranks,
                                         "bytes": state_bytes, "d_model": d,
                                         "tensors_per_rank": info[0]["tensors"],
                                         "storage": storage.kind, "repeat": repeat,
                                         "device": where.device, "nodes": nodes,
                                         "worker_resources": where.resources,
                                         "placement_groups": len({i["placement_group"] for i in info
                                                                  if i["placement_group"]})}}
    measured = False
    try:
        limits = measure_limits(group, storage, repeat)
        log(f"   limits: host copy {limits['host_copy_s']:.3f} s (fresh memory "
            f"{limits['host_copy_fresh_s']:.3f} s), write+fsync {limits['raw_write_fsync_s']:.3f} s "
            f"(buffered {limits['raw_write_buffered_s']:.3f} s, O_DIRECT "
            f"{_fmt(limits['raw_write_direct_s'])} s), "
            f"read {limits['raw_read_s']:.3f} s")
        expected = ray.get([w.local_digest.remote() for w in group], timeout=TIMEOUT_S)
        copies_beside: list[float] = []  # the host copy, measured before each of our saves
        last_url: dict[str, str] = {}  # method -> its newest checkpoint (the reshard source)
        ray_name = None
        written: dict[str, list[str]] = {}  # method -> the files its last save wrote (verl)
        for rnd in range(repeat + 1):  # round 0 warms up and is not counted
            for method in _rotated(methods, rnd):
                url = storage.url(f"{method}/r{rnd}")
                _settle(group, storage)
                if method == "raycheckpoint":
                    # the copy limit again, on the machine as this save finds it (after the
                    # other methods' saves and loads), then settled as every save is
                    copies_beside.append(_max([w.host_copy.remote() for w in group]))
                    _settle(group, storage)
                    manager.update(step=rnd + 1)
                    t0 = time.perf_counter()
                    # the last round's checkpoint is tagged: the step-overhead saves below
                    # must not retire it before the resharded load reads it
                    handle = manager.save_checkpoint(tag="reshard-source" if rnd == repeat else None)
                    handle.wait(TIMEOUT_S)
                    saved = {"stall_s": handle.stall_s, "durable_s": time.perf_counter() - t0,
                             "stall_worker_s": handle.worker_stall_s}
                    ray_name = handle.name
                    _cleaned_up(manager)
                else:
                    per_rank = ray.get([w.save.remote(method, url, rnd + 1) for w in group],
                                       timeout=TIMEOUT_S)
                    saved = {k: max(r[k] for r in per_rank) for k, v in per_rank[0].items()
                             if isinstance(v, float)}
                    if "files" in per_rank[0]:  # verl's: what its real manager wrote
                        written[method] = sorted({f for r in per_rank for f in r["files"]})
                _perturb(group)
                _settle(group, storage)
                storage.drop_cache(method)
                if method == "raycheckpoint":
                    t0 = time.perf_counter()
                    manager.load_checkpoint(ray_name)
                    load_s = time.perf_counter() - t0
                else:
                    load_s = _max([w.load.remote(method, url) for w in group])
                _check(group, expected, f"{method} load")
                if method != "raycheckpoint":
                    if method in last_url:
                        storage.remove(last_url[method][len(storage.root) + 1:])
                    last_url[method] = url
                if rnd == 0:
                    continue
                for k, v in saved.items():
                    samples[method].setdefault(k, []).append(v)
                samples[method]["load_s"].append(load_s)
            if rnd:
                log("   round " + str(rnd) + ": " + ", ".join(
                    f"{m} {samples[m]['stall_s'][-1]:.3f}/{samples[m]['durable_s'][-1]:.3f}"
                    for m in methods) + f" (stall/durable s); host copy {copies_beside[-1]:.3f} s")
        ray.get([w.free_limit_buffers.remote() for w in group], timeout=TIMEOUT_S)
        limits["host_copy_beside_s"] = _median(copies_beside[1:])  # round 0 warms up
        limits["spread"]["host_copy_beside_s"] = _spread(copies_beside[1:])
        full_digest = None
        if reshard and ranks > 1:  # a gather: every rank joins, rank 0 answers
            full_digest = ray.get([w.full_digest.remote() for w in group], timeout=TIMEOUT_S)[0]
        steps = step_overhead(group, manager, storage, step_batch, step_seq)
        log(f"   train step {steps['step_s']:.3f} s alone, {_fmt(steps['step_during_persist_s'])} s "
            f"during a raycheckpoint persist ({_pct(steps['slowdown'])}), "
            f"{_fmt(steps['step_during_dcp_async_s'])} s during a DCP async_save "
            f"({_pct(steps['dcp_async_slowdown'])}); first step after a save "
            f"{_fmt(steps['first_step_after_save_s'])} s; overlap_copy: blocked "
            f"{steps['overlap_stall_s']:.3f} s, first step {steps['overlap_first_step_s']:.3f} s "
            f"({_pct(steps['overlap_first_step_slowdown'])}); riding on a step: blocked "
            f"{steps['ride_stall_s']:.3f} s, with overlap_copy {steps['ride_overlap_stall_s']:.3f} s")
        for key in ("ride_stall_breakdown_ms", "ride_overlap_stall_breakdown_ms"):
            log(f"   {key}: " + ", ".join(f"{p} {v:.1f}" for p, v in steps[key].items()))
        measured = True
    finally:
        manager.close(TIMEOUT_S)
        try:
            if host_buffer_bytes and measured:
                result["host_buffer"] = budget_stalls(group, storage, host_buffer_bytes, log=log)
        finally:
            ray.get([w.close_stager.remote() for w in group], timeout=TIMEOUT_S)
            _kill(group, placement)
    reshard_s: dict[str, list[float]] = {}
    if reshard and ranks > 1:
        reshard_s = reshard_loads(ranks // 2, d, storage, methods, ray_name, last_url, full_digest,
                                  repeat=repeat, where=where, log=log)
    result["limits"] = limits
    verl_info = {}
    if "verl" in methods:
        from bench._verl import MANAGER, verl_version

        verl_info = {"verl_version": verl_version(), "manager": MANAGER}
        result["config"]["verl_version"] = verl_info["verl_version"]
    result["methods"] = {}
    for m in methods:
        s = samples[m]
        s["reshard_load_s"] = reshard_s.get(m, [])
        row = {"stall_s": _median(s["stall_s"]), "durable_s": _median(s["durable_s"]),
               "load_s": _median(s["load_s"]), "reshard_load_s": _median(s["reshard_load_s"]),
               "bytes": state_bytes,
               "spread": {k: _spread(v) for k, v in s.items() if v}}
        if s["stall_worker_s"]:
            row["stall_worker_s"] = _median(s["stall_worker_s"])
        for k in ("returned_s", "fsync_s"):  # verl's: its save returned; the fsync it skips
            if s.get(k):
                row[k] = _median(s[k])
        if m == "verl":
            row.update(files=written.get(m, []), **verl_info)
        row["durable_gb_s"] = state_bytes / row["durable_s"] / 1e9
        row["load_gb_s"] = state_bytes / row["load_s"] / 1e9
        if not RESHARDS[m]:
            row["reshard_note"] = "cannot load into a different number of ranks"
        result["methods"][m] = row
    result["step_overhead"] = steps
    result["targets"] = targets(result)
    storage.remove("raycheckpoint")
    for m in methods:
        storage.remove(m)
    return result


# ---- command line --------------------------------------------------------------------------------


def _options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    env = os.environ.get("RAYCHECKPOINT_STORAGE_OPTIONS")
    if env:
        out.update(json.loads(env))
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"-o expects KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def _resources(text: str) -> dict[str, float]:
    try:
        res = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(res, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in res.items()):
        raise argparse.ArgumentTypeError(f"expected {{resource: amount}}, got {text!r}")
    return {k: float(v) for k, v in res.items()}


def _local_uri(uri: str | None) -> bool:
    """Whether ``--storage`` is a directory on this machine (no server started to tell)."""
    if uri is None:
        return True
    return fsspec.utils.infer_storage_options(uri)["protocol"] in ("file", "local")


def default_methods(local: bool) -> tuple[str, ...]:
    """Every method; against verl, its own manager where verl is importable and the
    storage local, else ``verl_sync``, the imitation (said on stdout)."""
    if local and verl_version() is not None:
        return tuple(m for m in METHODS if m != "verl_sync")
    print("note: verl's own manager cannot run here (verl not importable, or storage not "
          "local): verl_sync imitates its save; " + HINT, flush=True)
    return tuple(m for m in METHODS if m != "verl")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=_ints, default=[2], help="ranks, or a comma list to sweep")
    p.add_argument("--bytes-per-rank", type=_sizes, default=[parse_bytes("64MB")],
                   help="state bytes per rank (model + AdamW), or a comma list to sweep")
    p.add_argument("--storage", default=None,
                   help="a directory or fsspec URI (default: a temporary directory); "
                        "moto:// starts a local S3 server for the run")
    p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--repeat", type=int, default=3, help="counted rounds per point (after a warm-up)")
    p.add_argument("--methods", default=None,
                   help=f"comma list of methods, of {', '.join(METHODS)} (default: all, with "
                        "verl's own manager where verl is importable and --storage is local, "
                        "else verl_sync, its imitation)")
    p.add_argument("--no-reshard", action="store_true", help="skip the R -> R/2 loads")
    p.add_argument("--step-batch", type=int, default=4)
    p.add_argument("--step-seq", type=int, default=64)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where each rank holds its state (cuda: one GPU per rank; the host-copy "
                        "limit is then a pinned device-to-host copy)")
    p.add_argument("--worker-resources", type=_resources, default=None, metavar="JSON",
                   help="resources per rank, e.g. '{\"GPU\": 1}': the ranks get a placement "
                        "group (on a cluster, across nodes) and meet at rank 0's node; "
                        "default with --device cuda: {\"GPU\": 1}, else this node")
    p.add_argument("--placement-strategy", default="PACK",
                   choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    p.add_argument("--virtual-ranks", type=_ints, default=None,
                   help="measure commit coordination with this many virtual ranks (comma list)")
    p.add_argument("--virtual-hosts", type=int, default=4,
                   help="processes hosting the virtual ranks")
    p.add_argument("--shard-bytes", type=parse_bytes, default=parse_bytes("64KiB"),
                   help="bytes each virtual rank writes")
    p.add_argument("--tiers", default=None, metavar="[memory,]local,durable",
                   help="tiered saves (checkpoint.local_dir, replicated to --storage) against "
                        "direct saves to --storage (see bench/tiers.py)")
    p.add_argument("--local-dir", default=None, help="the local tier for --tiers (default: a "
                   "temporary directory)")
    p.add_argument("--host-buffer-bytes", type=_sizes, default=None, metavar="SIZES",
                   help="also measure the stall per save with checkpoint.host_buffer_bytes "
                        "set to each of these (comma list, e.g. 64MB,256MB), against none")
    p.add_argument("--out", default=None, help="write results.json and plot.png here")
    args = p.parse_args(argv)
    if args.tiers:
        from bench.tiers import main_tiers

        return main_tiers(args, p)
    local = _local_uri(args.storage)
    if args.methods is None:
        methods = default_methods(local)
    else:
        methods = tuple(m.strip() for m in args.methods.split(","))
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    if "verl" in methods:
        print(f"verl {require_verl(local)}: its own FSDPCheckpointManager", flush=True)
    resources = args.worker_resources
    if resources is None and args.device == "cuda":
        resources = {"GPU": 1}
    where = Where(device=args.device, resources=resources, strategy=args.placement_strategy)
    storage = BenchStorage(args.storage, _options(args.storage_option))
    started_ray = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    init_ray()
    try:
        if args.virtual_ranks:
            from bench.virtual_ranks import run_virtual, virtual_table

            results = run_virtual(args.virtual_ranks, storage, hosts=args.virtual_hosts,
                                  shard_bytes=args.shard_bytes, repeat=args.repeat)
            print(virtual_table(results))
        else:
            points = []
            for ranks in args.ranks:
                for size in args.bytes_per_rank:
                    point = run_point(ranks, size, storage, repeat=args.repeat, methods=methods,
                                      reshard=not args.no_reshard, step_batch=args.step_batch,
                                      step_seq=args.step_seq, where=where,
                                      host_buffer_bytes=args.host_buffer_bytes)
                    print(table(point), flush=True)
                    points.append(point)
            results = {**points[-1], "points": points}
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
            # .venv-verl (verl's own manager) has no matplotlib: results.json, and no plot
            drawn = not args.virtual_ranks and importlib.util.find_spec("matplotlib") is not None
            if drawn:
                plot(results["points"], os.path.join(args.out, "plot.png"))
            print(f"wrote {args.out}/results.json" + (" and plot.png" if drawn else ""))
        return results
    finally:
        storage.close()
        if started_ray:
            ray.shutdown()


if __name__ == "__main__":
    main()
