"""The prepared check of the save path on a GPU machine (``scripts/gpu_check.sh``): Ray-free.

    python -m bench.gpu_check OUT_DIR           # on a machine with a CUDA device
    python -m bench.gpu_check --full OUT_DIR    # adds the 16 GB stall leg
    python -m bench.gpu_check --cpu OUT_DIR     # the same legs on cpu, small (CI)

Each leg runs in processes of its own (torch.distributed over 127.0.0.1), under its own
timeout, and its outcome (ok, failed, timed out, skipped because a leg it needs did not
pass) goes into ``OUT_DIR/gpu_check.json``, which is rewritten after every leg: a run
cut short keeps every result it reached.  See :data:`LEGS` for what each leg measures and
how long it is expected to take.  Prints a table at the end; exits 1 when a correctness
check fails or a leg does not pass (the stall targets are reported as met or missed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

from bench import _gpu_legs as legs
from bench import _gpu_perf as perf

STALL_TARGET, OVERLAP_TARGET = 1.3, 0.1  # x the pinned copy limit, at >= 4 GB per rank
GPU_SIZES, FULL_SIZES, CPU_SIZES = (1, 4), (1, 4, 16), (1 / 64, 1 / 16)  # GB per rank
LEG_TIMEOUT_S = 120.0
DEADLINE_S = {"quick": 270.0, "full": 540.0}

# name: (what it measures, expected seconds on one H100 (quick set), on a 2-core CPU)
LEGS = {
    "roundtrip": ("an FSDP2 model + AdamW on the device staged into pinned host buffers, "
                  "written as DCP with checksums, loaded back onto the device and onto the "
                  "cpu: bitwise; the buffers are pinned (is_pinned) and what the pinned "
                  "allocator holds against the staged bytes", 20, 5),
    "reshard": ("that checkpoint loaded by 2 CPU ranks (1 -> 2): bitwise; they save one", 25, 8),
    "load_on_device": ("the 2 CPU ranks' checkpoint loaded on the device (2 -> 1): bitwise", 10, 4),
    "stall_<N>GB": ("training-blocked time of a save against the pinned device-to-host copy "
                    "limit of the same bytes: default mode (plan + copy), and overlap mode "
                    "(plan, then the wait at the next optimizer step after a step of "
                    "matmuls lasting about twice the copy)", 20, 4),
    "host_buffer": ("a 1 GB save through a 256 MB host buffer (checkpoint.host_buffer_bytes): "
                    "training's stall against a staged save's, host memory held, bitwise", 20, 4),
    "memory": ("GPU, pinned and resident memory over 12 saves (512 MB per save on a GPU)", 30, 4),
    "kill": ("a process SIGKILLed while it saves: every save it finished loads bitwise, "
             "its GPU memory is free again", 30, 6),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LegFailed(Exception):
    """A leg ended without a result (its error is the message)."""


class LegTimedOut(LegFailed):
    pass


class Interrupted(BaseException):
    """The run was told to stop (SIGTERM, SIGINT); the report is still written."""


def _entry(leg: str, module: str, fn: str, args: tuple, out: str) -> None:
    try:
        legs.maybe_fail(leg)
        target = legs if module == "legs" else perf
        payload = {"ok": True, "result": getattr(target, fn)(*args)}
    except BaseException:  # noqa: BLE001 - reported to the parent, which records the leg
        payload = {"ok": False, "error": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(payload, f, default=str)


def run_process(ctx, leg: str, module: str, fn: str, *args: Any, timeout: float) -> Any:
    """Leg ``leg``: ``module.fn(*args)`` in a fresh process (its own CUDA context); its result."""
    fd, out = tempfile.mkstemp(suffix=".json", prefix="gpu-leg-")
    os.close(fd)
    proc = ctx.Process(target=_entry, args=(leg, module, fn, args, out))
    try:
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            raise LegTimedOut(f"{fn} did not finish in {timeout:.0f} s")
        with open(out) as f:
            text = f.read()
        if not text:
            raise LegFailed(f"{fn}'s process ended with exit code {proc.exitcode} and no result")
        payload = json.loads(text)
        if not payload["ok"]:
            raise LegFailed(payload["error"])
        return payload["result"]
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(30)
        os.unlink(out)


class Run:
    """The report, its legs and the file it is kept in (rewritten after every leg)."""

    def __init__(self, path: str, report: dict[str, Any], deadline: float,
                 leg_timeout_s: float = LEG_TIMEOUT_S) -> None:
        self.path, self.report, self.deadline = path, report, deadline
        self.leg_timeout_s = leg_timeout_s
        report.setdefault("legs", {})
        report.setdefault("checks", {})
        self.write()

    @property
    def legs(self) -> dict[str, dict[str, Any]]:
        return self.report["legs"]

    def passed(self, name: str) -> bool:
        return self.legs.get(name, {}).get("status") == "ok"

    def check(self, name: str, ok: Any) -> None:
        self.report["checks"][name] = bool(ok)

    def leg(self, name: str, body, *, needs: tuple[str, ...] = (), scale: float = 1.0):
        """Run ``body(timeout)`` as leg ``name`` (``scale`` times the run's leg timeout);
        its result, or None where it did not pass."""
        timeout = self.leg_timeout_s * scale
        missing = [n for n in needs if not self.passed(n)]
        left = self.deadline - time.monotonic()
        if missing:
            why = ", ".join(f"{n} {self.legs.get(n, {}).get('status', 'not run')}" for n in missing)
            self.legs[name] = {"status": "skipped", "reason": f"needs {why}"}
        elif left < 5:
            self.legs[name] = {"status": "skipped", "reason": "the run's deadline has passed"}
        if name in self.legs:
            self.write()
            return None
        self.legs[name] = entry = {"status": "running", "timeout_s": round(min(timeout, left), 1)}
        self.write()
        t0 = time.perf_counter()
        try:
            result = body(min(timeout, left))
            entry["status"] = "ok"
            return result
        except LegTimedOut as e:
            entry.update(status="timed out", error=str(e))
        except Interrupted:
            entry.update(status="interrupted", error="the run was stopped (SIGTERM or SIGINT)")
            raise
        except Exception as e:  # noqa: BLE001 - the leg's error goes into the report
            entry.update(status="failed", error=str(e) if isinstance(e, LegFailed)
                         else traceback.format_exc())
        finally:
            entry["seconds"] = round(time.perf_counter() - t0, 1)
            self.write()
        return None

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.report, f, indent=1, default=str)
        os.replace(tmp, self.path)


def run_reshard(ctx, root: str, width: int, timeout: float) -> bool:
    port, manager, ranks = _port(), ctx.Manager(), []
    try:
        out = manager.dict()
        ranks = [ctx.Process(target=legs.reshard_rank, args=(r, 2, port, root, width, out))
                 for r in range(2)]
        for p in ranks:
            p.start()
        end = time.monotonic() + timeout
        for p in ranks:
            p.join(max(0.0, end - time.monotonic()))
        if any(p.is_alive() for p in ranks):
            raise LegTimedOut(f"the 2 reshard ranks did not finish in {timeout:.0f} s")
        codes = [p.exitcode for p in ranks]
        if codes != [0, 0]:
            raise LegFailed(f"reshard ranks exited with {codes}: {out.get('error', '')}")
        return bool(out.get("reshard_bitwise"))
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
                p.join(30)
        manager.shutdown()


def flat(samples: list[dict[str, int]], key: str, slack: int) -> bool:
    """Whether ``key`` stayed within ``slack`` bytes after the first two saves."""
    values = [s[key] for s in samples[2:] if key in s]
    return bool(values) and max(values) - min(values) <= slack


def _size_name(gb: float) -> str:
    return f"stall_{gb:g}GB" if gb >= 1 else f"stall_{gb * 1024:g}MB"


def run_all(run: Run, device: str, sizes: list[float], work: str) -> None:
    ctx = mp.get_context("spawn")
    cuda = device == "cuda"
    width = 4096 if cuda else 256
    rt = run.leg("roundtrip", lambda t: run_process(ctx, "roundtrip", "legs", "roundtrip", device, _port(),
                                                    work, width, timeout=t))
    if rt is not None:
        run.report["roundtrip"] = rt
        run.check("save on device, load on device: bitwise", rt["device_bitwise"])
        run.check("save on device, load on cpu: bitwise", rt["cpu_bitwise"])
        run.check("staging buffers pinned (is_pinned) on cuda, plain on cpu",
                  rt["pinned"] == cuda)
    ok = run.leg("reshard", lambda t: run_reshard(ctx, work, width, t), needs=("roundtrip",))
    if ok is not None:
        run.check("reshard 1 -> 2 cpu ranks: bitwise", ok)
    back = run.leg("load_on_device", lambda t: run_process(
        ctx, "load_on_device", "legs", "load_on_device", device, _port(), work, width, timeout=t),
        needs=("reshard",))
    if back is not None:
        run.check("saved by 2 cpu ranks, loaded on device (2 -> 1): bitwise",
                  back["cpu_to_device_bitwise"])

    run.report["stall"] = []
    for gb in sizes:
        nbytes = int(gb * legs.GB)
        name = _size_name(gb)
        row = run.leg(name, lambda t, n=nbytes, leg=name: run_process(
            ctx, leg, "perf", "stall", device, n, timeout=t), scale=1 + gb / 8)
        if row is not None:
            limit = row["limit_s"]
            run.report["stall"].append({
                "gb_per_rank": gb, **row, "stall_ratio": row["default_s"] / limit,
                "overlap_ratio": row["overlap_s"] / limit, "d2h_gb_s": nbytes / limit / 1e9})
            run.write()

    budget_bytes, budget = (legs.GB, 256 << 20) if cuda else (16 << 20, 4 << 20)
    budget_dir = os.path.join(work, "budget")
    os.makedirs(budget_dir)
    hb = run.leg("host_buffer", lambda t: run_process(ctx, "host_buffer", "perf", "budget_stall",
                                                      device, budget_bytes, budget, budget_dir,
                                                      timeout=t))
    if hb is not None:
        run.report["host_buffer"] = hb
        run.check("a save through a bounded host buffer loads bitwise", hb["bitwise"])
        run.check("a bounded save holds no more host memory than its budget",
                  0 < hb["host_bytes"] <= hb["budget_bytes"])
        shutil.rmtree(budget_dir, ignore_errors=True)

    mem_bytes, saves = (512 << 20, 12) if cuda else (8 << 20, 12)
    mem_dir = os.path.join(work, "memory")
    os.makedirs(mem_dir)
    mem = run.leg("memory", lambda t: run_process(ctx, "memory", "perf", "memory_over_saves", device,
                                                  mem_bytes, saves, mem_dir, timeout=t))
    if mem is not None:
        samples = mem["samples"]
        run.report["memory"] = samples
        run.check(f"resident memory flat over {saves} saves",
                  flat(samples, "rss", mem_bytes // 20 + (32 << 20)))
        if cuda:
            run.check(f"GPU memory flat over {saves} saves", flat(samples, "gpu_reserved", 0))
            run.check(f"pinned allocator memory flat over {saves} saves",
                      flat(samples, "pinned_allocated", 0))
    kill_dir = os.path.join(work, "kill")
    os.makedirs(kill_dir)
    killed = run.leg("kill", lambda t: run_process(ctx, "kill", "legs", "kill_while_saving", device,
                                                   mem_bytes, kill_dir, timeout=t))
    if killed is not None:
        run.report["kill"] = killed
        run.check("saving process SIGKILLed", killed["killed"])
        run.check("every save finished before the kill loads bitwise",
                  killed["finished_saves"] > 0 and killed["finished_saves_bitwise"])
        if cuda:
            run.check("GPU memory free after the kill", killed["gpu_memory_returned"])


def main(argv: list[str] | None = None) -> int:
    legs_help = "\n".join(f"  {n:<15} ~{gpu:>3} s on an H100, ~{cpu} s on cpu: {what}"
                          for n, (what, gpu, cpu) in LEGS.items())
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="legs (times estimated from the bytes each moves until a GPU run measures them;"
               " the quick set is about 4 minutes on an H100, --full about 7):\n" + legs_help)
    p.add_argument("out", help="directory for gpu_check.json")
    p.add_argument("--cpu", action="store_true", help="run the legs on cpu, small (no GPU needed)")
    p.add_argument("--full", action="store_true", help="add the 16 GB per rank stall leg")
    p.add_argument("--sizes", default=None, help="GB per rank for the stall legs, comma-separated")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no leg after this many seconds (default 270, --full 540)")
    p.add_argument("--leg-timeout-s", type=float, default=None,
                   help="every leg's timeout (default 120 s, more for the large stall legs)")
    p.add_argument("--fail", action="append", default=[], metavar="LEG[:hang]",
                   help="make a leg fail (or hang) on purpose, to check the report")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device visible; run with --cpu for the CPU leg", file=sys.stderr)
        return 2
    sizes = [float(s) for s in args.sizes.split(",")] if args.sizes else list(
        CPU_SIZES if args.cpu else FULL_SIZES if args.full else GPU_SIZES)
    os.environ[legs.FAIL_ENV] = ",".join(args.fail)  # read by the legs' processes
    os.makedirs(args.out, exist_ok=True)
    deadline = args.deadline_s or DEADLINE_S["full" if args.full else "quick"]
    checksum = legs.checksum()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
        "mode": device, "torch": torch.__version__, "python": platform.python_version(),
        "checksum": checksum, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"gpu_check: checksums with {checksum}"
          + ("" if checksum == "blake3" else " (the blake3 package is not importable here)"),
          file=sys.stderr)
    run = Run(os.path.join(args.out, "gpu_check.json"), report, time.monotonic() + deadline,
              args.leg_timeout_s or LEG_TIMEOUT_S)

    def stop(signum: int, _frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t0 = time.perf_counter()
    interrupted = False
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
            run_all(run, device, sizes, work)
    except Interrupted:
        interrupted = True
    finish(run.report, time.perf_counter() - t0, device, interrupted)
    run.write()
    print(table(run.report))
    return 124 if interrupted else 0 if run.report["ok"] else 1


def finish(report: dict[str, Any], seconds: float, device: str, interrupted: bool) -> None:
    report["seconds"] = round(seconds, 1)
    report["interrupted"] = interrupted
    big = [r for r in report["stall"] if r["gb_per_rank"] >= 4] if "stall" in report else []
    report["targets"] = {
        f"stall <= {STALL_TARGET}x copy limit at >= 4 GB": (
            all(r["stall_ratio"] <= STALL_TARGET for r in big) if big and device == "cuda" else None),
        f"overlap stall <= {OVERLAP_TARGET}x copy limit at >= 4 GB": (
            all(r["overlap_ratio"] <= OVERLAP_TARGET for r in big) if big and device == "cuda" else None)}
    report["ok"] = (not interrupted and all(report["checks"].values())
                    and all(leg["status"] == "ok" for leg in report["legs"].values()))


def table(report: dict[str, Any]) -> str:
    lines = [f"gpu_check on {report['device']} ({report['mode']}), torch {report['torch']}, "
             f"checksum {report['checksum']}, {report['seconds']} s", "",
             f"{'GB/rank':>8} {'D2H GB/s':>9} {'limit s':>8} {'stall s':>8} {'x limit':>8} "
             f"{'overlap s':>10} {'x limit':>8} {'wait s':>7} {'matmul alone/beside ms':>23}"]
    for r in report.get("stall", []):
        lines.append(f"{r['gb_per_rank']:>8.3g} {r['d2h_gb_s']:>9.1f} {r['limit_s']:>8.4f} "
                     f"{r['default_s']:>8.4f} {r['stall_ratio']:>8.2f} {r['overlap_s']:>10.4f} "
                     f"{r['overlap_ratio']:>8.3f} {r['overlap_wait_s']:>7.4f} "
                     f"{r['matmul_alone_s'] * 1e3:>11.2f}/{r['matmul_beside_copy_s'] * 1e3:.2f}")
    hb = report.get("host_buffer")
    if hb:
        lines.append(f"host_buffer_bytes {hb['budget_bytes'] / 2**20:g} MiB: stall "
                     f"{hb['stall_s']:.4f} s against {hb['staged_stall_s']:.4f} s staged, "
                     f"host memory {hb['host_bytes'] / 2**20:g} MiB, {hb['chunks']} chunks")
    lines.append("")
    for name, leg in report["legs"].items():
        extra = f" ({leg.get('reason') or leg.get('error', '').strip().splitlines()[-1:][0]})" \
            if leg["status"] != "ok" and (leg.get("reason") or leg.get("error")) else ""
        lines.append(f"leg {name:<15} {leg['status']:<11} {leg.get('seconds', 0):>6.1f} s{extra}")
    lines.append("")
    lines += [f"{'ok  ' if ok else 'FAIL'} {name}" for name, ok in report["checks"].items()]
    lines += [f"{'n/a ' if met is None else 'met ' if met else 'MISS'} target: {name}"
              for name, met in report["targets"].items()]
    if report.get("interrupted"):
        lines.append("INTERRUPTED: the run was stopped; the legs above are what it reached")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
