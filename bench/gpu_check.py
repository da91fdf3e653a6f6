"""The prepared check of the save path on a GPU machine (``scripts/gpu_check.sh``): Ray-free.

    python -m bench.gpu_check OUT_DIR           # on a machine with a CUDA device
    python -m bench.gpu_check --cpu OUT_DIR     # the same legs on cpu, small (CI)

Legs, each in processes of its own (torch.distributed over 127.0.0.1):

1. round trip: an FSDP2 model + AdamW on the device (world size 1), staged into pinned
   host buffers on the copy stream, written as DCP with checksums, loaded back onto the
   device and onto the cpu: bitwise;
2. reshard: that checkpoint loaded by 2 CPU ranks (1 -> 2), and a checkpoint those
   ranks save loaded back by one rank on the device (2 -> 1): bitwise;
3. stall: the training-blocked time of a save against the pinned device-to-host copy
   limit of the same bytes, at 1, 4 and 16 GB per rank, in default mode (the whole host
   copy) and overlap mode (the copy on its stream beside a running matmul loop);
4. memory: GPU, pinned and resident memory over 20 saves;
5. kill: a process SIGKILLed while it saves; its GPU memory is free again afterwards.

Prints a table and writes ``gpu_check.json`` to OUT_DIR; exits 1 when a correctness
check fails (the stall targets are reported as met or missed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

from bench import _gpu_legs as legs

STALL_TARGET, OVERLAP_TARGET = 1.3, 0.1  # x the pinned copy limit, at >= 4 GB per rank
GPU_SIZES, CPU_SIZES = (1, 4, 16), (1 / 64, 1 / 16)  # GB per rank


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: str, args: tuple, out: str) -> None:
    try:
        result = getattr(legs, fn)(*args)
        payload = {"ok": True, "result": result}
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the check
        payload = {"ok": False, "error": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(payload, f, default=str)


def run_leg(ctx, fn: str, *args: Any, timeout: float = 300) -> dict[str, Any]:
    """``legs.fn(*args)`` in a fresh process (its own CUDA context); its result."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    proc = ctx.Process(target=_entry, args=(fn, args, out))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(30)
        raise RuntimeError(f"leg {fn} did not finish in {timeout:.0f} s")
    with open(out) as f:
        payload = json.load(f)
    os.unlink(out)
    if not payload["ok"]:
        raise RuntimeError(f"leg {fn} failed:\n{payload['error']}")
    return payload["result"]


def run_reshard(ctx, root: str, width: int) -> bool:
    port, manager = _port(), ctx.Manager()
    out = manager.dict()
    ranks = [ctx.Process(target=legs.reshard_rank, args=(r, 2, port, root, width, out)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(300)
    ok = all(p.exitcode == 0 for p in ranks) and bool(out.get("reshard_bitwise"))
    manager.shutdown()
    return ok


def flat(samples: list[dict[str, int]], key: str, slack: int) -> bool:
    """Whether ``key`` stayed within ``slack`` bytes after the first two saves."""
    values = [s[key] for s in samples[2:] if key in s]
    return bool(values) and max(values) - min(values) <= slack


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory for gpu_check.json")
    p.add_argument("--cpu", action="store_true", help="run the legs on cpu, small (no GPU needed)")
    p.add_argument("--sizes", default=None, help="GB per rank for the stall leg, comma-separated")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device visible; run with --cpu for the CPU leg", file=sys.stderr)
        return 2
    sizes = [float(s) for s in args.sizes.split(",")] if args.sizes else (
        CPU_SIZES if args.cpu else GPU_SIZES)
    os.makedirs(args.out, exist_ok=True)
    ctx = mp.get_context("spawn")
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
        "mode": device, "torch": torch.__version__, "python": platform.python_version(),
        "checksum": legs.checksum(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    checks: dict[str, bool] = {}
    width = 4096 if device == "cuda" else 256
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        rt = run_leg(ctx, "roundtrip", device, _port(), work, width)
        report["roundtrip"] = rt
        checks["save on device, load on device: bitwise"] = rt["device_bitwise"]
        checks["save on device, load on cpu: bitwise"] = rt["cpu_bitwise"]
        checks["staging buffers pinned on cuda, plain on cpu"] = rt["pinned"] == (device == "cuda")
        checks["reshard 1 -> 2 cpu ranks: bitwise"] = run_reshard(ctx, work, width)
        back = run_leg(ctx, "load_on_device", device, _port(), work, width)
        checks["saved by 2 cpu ranks, loaded on device (2 -> 1): bitwise"] = back["cpu_to_device_bitwise"]

        report["stall"] = []
        for gb in sizes:
            nbytes = int(gb * legs.GB)
            limit = run_leg(ctx, "copy_limit_s", device, nbytes)
            s = run_leg(ctx, "stall", device, nbytes, 8192 if device == "cuda" else 256, timeout=480)
            report["stall"].append({"gb_per_rank": gb, "limit_s": limit, **s,
                                    "stall_ratio": s["default_s"] / limit,
                                    "overlap_ratio": s["overlap_s"] / limit,
                                    "d2h_gb_s": nbytes / limit / 1e9})
        mem_bytes = legs.GB if device == "cuda" else 8 << 20
        mem_dir = os.path.join(work, "memory")
        os.makedirs(mem_dir)
        samples = run_leg(ctx, "memory_over_saves", device, mem_bytes, 20, mem_dir)["samples"]
        report["memory"] = samples
        checks["resident memory flat over 20 saves"] = flat(samples, "rss", mem_bytes // 20 + (32 << 20))
        if device == "cuda":
            checks["GPU memory flat over 20 saves"] = flat(samples, "gpu_reserved", 0)
            if any("pinned_reserved" in x for x in samples):  # torch's caching host allocator
                checks["pinned (cached host) memory flat over 20 saves"] = flat(samples, "pinned_reserved", 0)
        kill_dir = os.path.join(work, "kill")
        os.makedirs(kill_dir)
        killed = legs.kill_while_saving(ctx, device, mem_bytes, kill_dir)
        report["kill"] = killed
        checks["saving process SIGKILLed"] = killed["killed"]
        if device == "cuda":
            checks["GPU memory free after the kill"] = killed["gpu_memory_returned"]
    report["checks"] = checks
    report["seconds"] = round(time.perf_counter() - t0, 1)
    big = [r for r in report["stall"] if r["gb_per_rank"] >= 4]
    report["targets"] = {
        f"stall <= {STALL_TARGET}x copy limit at >= 4 GB": (
            all(r["stall_ratio"] <= STALL_TARGET for r in big) if big and device == "cuda" else None),
        f"overlap stall <= {OVERLAP_TARGET}x copy limit at >= 4 GB": (
            all(r["overlap_ratio"] <= OVERLAP_TARGET for r in big) if big and device == "cuda" else None)}
    report["ok"] = all(checks.values())
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(table(report))
    return 0 if report["ok"] else 1


def table(report: dict[str, Any]) -> str:
    lines = [f"gpu_check on {report['device']} ({report['mode']}), torch {report['torch']}, "
             f"checksum {report['checksum']}, {report['seconds']} s", "",
             f"{'GB/rank':>8} {'D2H GB/s':>9} {'limit s':>8} {'stall s':>8} {'x limit':>8} "
             f"{'overlap s':>10} {'x limit':>8} {'matmul alone/beside ms':>23}"]
    for r in report["stall"]:
        lines.append(f"{r['gb_per_rank']:>8.3g} {r['d2h_gb_s']:>9.1f} {r['limit_s']:>8.4f} "
                     f"{r['default_s']:>8.4f} {r['stall_ratio']:>8.2f} {r['overlap_s']:>10.4f} "
                     f"{r['overlap_ratio']:>8.3f} {r['matmul_alone_s'] * 1e3:>11.2f}/"
                     f"{r['matmul_beside_copy_s'] * 1e3:.2f}")
    lines.append("")
    lines += [f"{'ok  ' if ok else 'FAIL'} {name}" for name, ok in report["checks"].items()]
    lines += [f"{'n/a ' if met is None else 'met ' if met else 'MISS'} target: {name}"
              for name, met in report["targets"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
