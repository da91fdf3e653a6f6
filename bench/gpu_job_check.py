"""The RL job on one GPU, killed and resumed (``scripts/gpu_job_check.sh``).

    python -m bench.gpu_job_check OUT_DIR          # on a machine with one CUDA device
    python -m bench.gpu_job_check --cpu OUT_DIR    # the same runs on cpu, a small model

Three runs of ``drivers.main_ppo`` with the one-GPU settings (one rank per role, the
roles colocated on the GPU; a Llama of about 400 MB, 100M fp32 parameters, built from
config; 8 steps, a checkpoint every 2): straight; SIGKILLed after step 5 (``trainer.crash_at_step``, while
that step's save may still persist); resumed with ``trainer.resume_mode=auto``.  Prints
and writes to ``OUT_DIR/gpu_job_check.json``:

* resumed == straight: the actor's weights digest, loss and reward of every step after
  the checkpoint the resumed run loaded, and the final weights;
* the stall of every save (``ckpt_blocked_s``) against a pinned device-to-host copy of
  the bytes each rank staged (``checkpoint_stats``' ``host_bytes``), measured after the
  runs;
* the GPU memory free before the runs and after the kill (every rank's memory returned).

Each run has its own timeout; the JSON is rewritten after every run.  Exit 0 when the
resumed run equals the straight one and the memory came back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from drivers.metrics import read_metrics, resumed_at

REPO = Path(__file__).resolve().parents[1]
STEPS, SAVE_FREQ, CRASH = 8, 2, 5
GPU_MODEL = {"hidden_size": 1024, "intermediate_size": 4096, "num_layers": 6, "num_heads": 16}
CPU_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 1}


def job_args(device: str, root: Path) -> list[str]:
    model = GPU_MODEL if device == "cuda" else CPU_MODEL
    # on cpu each rank is a process of its own: colocating shares GPUs, which cpu has not
    colocate = "true" if device == "cuda" else "false"
    return ["trainer.n_gpus_per_node=1", f"trainer.colocate={colocate}", f"trainer.device={device}",
            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
            f"trainer.total_training_steps={STEPS}", f"trainer.save_freq={SAVE_FREQ}",
            f"trainer.default_local_dir={root}",
            *(f"actor_rollout_ref.model.{k}={v}" for k, v in model.items())]


def run_job(args: list[str], timeout: float, log: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "drivers.main_ppo", *args], cwd=REPO,
                              stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    text = log.read_text()
    return {"returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
            "tail": text[-2000:], "stdout": text}


def metrics(root: Path) -> dict[int, dict[str, Any]]:
    """The run's ``metrics.jsonl`` (none before its first step)."""
    path = root / "metrics.jsonl"
    return read_metrics(path) if path.exists() else {}


def gpu_free() -> int | None:
    import torch

    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


def wait_gpu_free(before: int | None, timeout: float = 60.0) -> dict[str, Any]:
    """Poll until the GPU has as much free memory as ``before`` (64 MiB slack)."""
    if before is None:
        return {}
    t0 = time.monotonic()
    free = gpu_free()
    while free is not None and free < before - (64 << 20) and time.monotonic() - t0 < timeout:
        time.sleep(0.5)
        free = gpu_free()
    return {"gpu_free_before": before, "gpu_free_after_kill": free,
            "gpu_memory_returned": free is not None and free >= before - (64 << 20),
            "returned_after_s": round(time.monotonic() - t0, 1)}


def compare(straight: dict[int, dict], resumed: dict[int, dict], start: int) -> dict[str, Any]:
    keys = ("actor_weights_sha256", "loss", "reward")
    diffs = [f"step {s} {k}" for s in range(start + 1, STEPS + 1) for k in keys
             if straight.get(s, {}).get(k) != resumed.get(s, {}).get(k)]
    return {"resumed_from_step": start, "steps_compared": STEPS - start, "differences": diffs,
            "resumed_equals_straight": not diffs and STEPS in resumed}


def saves(run: dict[int, dict]) -> list[dict[str, Any]]:
    """Every committed save of a run: its step, stall and the bytes a rank staged."""
    out = []
    for rec in run.values():
        for s in rec.get("checkpoint_stats") or []:
            out.append({"step": s.get("step"), "stall_s": s.get("stall_s"),
                        "worker_stall_s": s.get("worker_stall_s"),
                        "host_bytes": s.get("host_bytes"), "pinned_bytes": s.get("pinned_bytes")})
    return out


def copy_limits(device: str, sizes: list[int]) -> dict[int, float]:
    from bench._gpu_perf import copy_limit_s

    return {n: copy_limit_s(device, n) for n in sorted(set(sizes)) if n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory for gpu_job_check.json, the runs' roots and logs")
    p.add_argument("--cpu", action="store_true", help="run on cpu with a small model")
    p.add_argument("--run-timeout-s", type=float, default=240.0, help="each run's timeout")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": device, "runs": {}}
    path = out / "gpu_job_check.json"

    def write() -> None:
        path.write_text(json.dumps(report, indent=1, default=str))

    free_before = gpu_free()
    ok = True
    runs = {"straight": [], "killed": [f"trainer.crash_at_step={CRASH}"],
            "resumed": ["trainer.resume_mode=auto"]}
    for name, extra in runs.items():
        root = out / ("straight" if name == "straight" else "killed")
        try:
            r = run_job([*job_args(device, root), *extra], args.run_timeout_s, out / f"{name}.log")
        except subprocess.TimeoutExpired:
            report["runs"][name] = {"status": "timed out", "timeout_s": args.run_timeout_s}
            write()
            ok = False
            break
        stdout = r.pop("stdout")
        if name == "killed":  # SIGKILLed by itself after step CRASH, not failed before it
            r["last_step"] = max(metrics(root), default=None)
            expected = r["returncode"] == -9 or (r["returncode"] != 0 and r["last_step"] == CRASH)
        else:
            expected = r["returncode"] == 0
        report["runs"][name] = {"status": "ok" if expected else "failed", **r}
        if name == "killed":
            report["runs"][name].update(wait_gpu_free(free_before))
        if name == "resumed" and "resumed from step_" in stdout:
            start = resumed_at(stdout)
            report["compare"] = compare(metrics(out / "straight"), metrics(root), start)
        write()
        if not expected:
            ok = False
            break
    straight = saves(metrics(out / "straight"))
    limits = copy_limits(device, [s["host_bytes"] or 0 for s in straight]) if straight else {}
    report["saves"] = [{**s, "copy_limit_s": limits.get(s["host_bytes"] or 0),
                        "stall_over_copy": (s["worker_stall_s"] / limits[s["host_bytes"]])
                        if s["host_bytes"] in limits and s["worker_stall_s"] else None}
                       for s in straight]
    killed = report["runs"].get("killed", {})
    report["ok"] = ok and report.get("compare", {}).get("resumed_equals_straight", False) and (
        device == "cpu" or killed.get("gpu_memory_returned", False))
    write()
    print(table(report))
    return 0 if report["ok"] else 1


def table(report: dict[str, Any]) -> str:
    where = "colocated on the GPU" if report["device"] == "cuda" else "a process each"
    lines = [f"gpu_job_check ({report['device']}): the RL job, one rank per role, {where}", ""]
    for name, r in report["runs"].items():
        lines.append(f"run {name:<9} {r['status']:<10} {r.get('seconds', '-')} s")
        if r["status"] != "ok":
            lines += ["  " + ln for ln in r.get("tail", "").strip().splitlines()[-15:]]
    cmp_ = report.get("compare")
    if cmp_:
        lines.append(f"resumed from step {cmp_['resumed_from_step']}: "
                     f"{'resumed == straight' if cmp_['resumed_equals_straight'] else 'DIFFERS'} "
                     f"over {cmp_['steps_compared']} steps {cmp_['differences'][:5] or ''}")
    killed = report["runs"].get("killed", {})
    if "gpu_memory_returned" in killed:
        lines.append(f"GPU memory after the kill: {killed['gpu_free_after_kill'] / 2**30:.2f} GiB "
                     f"free of {killed['gpu_free_before'] / 2**30:.2f} before "
                     f"({'returned' if killed['gpu_memory_returned'] else 'NOT returned'}, "
                     f"{killed['returned_after_s']} s)")
    lines += ["", f"{'step':>5} {'stall s':>8} {'rank stall s':>13} {'MB/rank':>8} "
                  f"{'copy s':>8} {'x copy':>7}"]
    for s in report.get("saves", []):
        mb = (s["host_bytes"] or 0) / 1e6
        ratio = "-" if s["stall_over_copy"] is None else f"{s['stall_over_copy']:.2f}"
        lines.append(f"{s['step']!s:>5} {s['stall_s'] or 0:>8.4f} {s['worker_stall_s'] or 0:>13.4f} "
                     f"{mb:>8.1f} {s['copy_limit_s'] or 0:>8.4f} {ratio:>7}")
    lines.append("")
    lines.append("OK" if report["ok"] else "FAILED")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
