"""Training blocked by a save in the RL job itself, where the time goes, against the copy.

    python -m bench.job_stall [--hidden 512] [--layers 8] [--intermediate 1536]
                              [--steps 6] [--rounds 2] [--small] [--json PATH]
                              [--set KEY=VALUE ...]

Runs ``drivers.main_ppo`` (GRPO, 2 actor ranks on cpu, a full save every step) once per
configuration and round, alternating them so that the machine's noise falls on all:
the snapshot riding on the step's update (``trainer.save_with_step``, the default) or
sent between steps, each with and without ``checkpoint.overlap_copy``.  Each run is a
process of its own; after its last step it measures the **copy limit** on the same
actor ranks: a host copy of the same tensors into buffers of their own, both ranks at
once, as the save makes it (median of 5).  Reported per configuration, medians over the
saves after the first (which touches its buffers for the first time) of every round:
``blocked`` (``ckpt_blocked_s``: the save's own blocked time, see
``raycheckpoint/_internal/breakdown.py``), ``copy wait`` (with ``overlap_copy``: what the
next optimizer step waited for the copy, per save), their sum over the copy limit, and
the breakdown of the blocked time.  ``--small`` adds the default tiny model (the fixed
part: what a save costs beyond a copy of almost nothing).  Absolute times mean little
off a GPU; the ratios are what this machine shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

CONFIGS = [("between steps", {"trainer.save_with_step": False}),
           ("with the step", {"trainer.save_with_step": True}),
           ("between steps, overlap_copy", {"trainer.save_with_step": False,
                                            "checkpoint.overlap_copy": True}),
           ("with the step, overlap_copy", {"trainer.save_with_step": True,
                                            "checkpoint.overlap_copy": True})]
PHASES = ["trainer_state", "send", "to_worker", "wait_previous", "state_dict",
          "rng_extra", "plan", "copy", "begin_answer", "answer", "to_driver", "wait_answers",
          "finish", "begin_beside", "send_snapshots_beside", "driver_wait_beside"]


def _copy_limit(worker: Any, repeats: int = 5) -> dict[str, float]:
    """On an actor rank: a host copy of its full state's tensors into touched memory,
    as the bench's other limits measure it (``bench/_limits.py``)."""
    import torch

    from bench._limits import host_buffers, timed_copy
    from raycheckpoint.worker import local_tensors

    with torch.no_grad():
        src = list(local_tensors(worker.ckpt_state_dict("full")).values())
    buffers = host_buffers(src)
    return {"copy_s": statistics.median(timed_copy(buffers, src) for _ in range(repeats)),
            "bytes": sum(t.numel() * t.element_size() for t in src)}


def run_one(opts: dict[str, Any], out: str) -> None:
    """One job (in this process), then the copy limit on its actor ranks; JSON to ``out``."""
    import ray

    from drivers.config import from_mapping
    from drivers.main_ppo import RPC, Trainer

    trainer = Trainer(from_mapping(opts))
    trainer.start()
    try:
        trainer.run()
        actor = trainer.groups["actor"]
        limits = ray.get([w.__ray_call__.remote(_copy_limit) for w in actor], timeout=RPC)
        waits = ray.get([w.ckpt_status.remote() for w in actor], timeout=RPC)
        stats = trainer.manager.checkpoint_stats
    finally:
        trainer.manager.close(RPC)
    with open(out, "w") as f:
        json.dump({"saves": stats, "copy_s": max(x["copy_s"] for x in limits),
                   "bytes_per_rank": max(x["bytes"] for x in limits),
                   "copy_wait_s": max(w["copy_wait_s"] for w in waits)}, f)


def _job_opts(args: argparse.Namespace, model: dict[str, int], extra: dict[str, Any],
              root: str) -> dict[str, Any]:
    return {**{f"actor_rollout_ref.model.{k}": v for k, v in model.items()},
            "trainer.save_freq": 1, "trainer.total_training_steps": args.steps,
            "trainer.default_local_dir": root, "trainer.max_actor_ckpt_to_keep": 2,
            "trainer.resume_mode": "disable", **extra}


def _override(kv: str) -> tuple[str, Any]:
    """A ``--set KEY=VALUE``, its value read as the job's own command line reads it."""
    from drivers.config import parse_value

    key, sep, value = kv.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set {kv!r}: expected KEY=VALUE")
    return key, parse_value(value)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    saves = [s for r in runs for s in r["saves"][1:] if s.get("ok")]
    copy_s = _median([r["copy_s"] for r in runs])
    per_save_wait = _median([r["copy_wait_s"] / max(1, len(r["saves"])) for r in runs])
    blocked = _median([s["stall_s"] for s in saves])
    row = {"config": label, "saves": len(saves), "bytes_per_rank": runs[0]["bytes_per_rank"],
           "blocked_ms": blocked * 1e3, "copy_wait_ms": per_save_wait * 1e3,
           "copy_limit_ms": copy_s * 1e3, "ratio": (blocked + per_save_wait) / copy_s,
           "breakdown_ms": {p: _median([s["breakdown_ms"][p] for s in saves
                                        if p in s.get("breakdown_ms", {})]) for p in PHASES}}
    row["breakdown_ms"] = {p: v for p, v in row["breakdown_ms"].items() if v == v}
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | config | blocked | copy wait | copy limit | (blocked + wait) / copy |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['bytes_per_rank'] / 1e6:.1f} MB/rank) | {r['config']} "
                     f"| {r['blocked_ms']:.1f} ms | {r['copy_wait_ms']:.1f} ms "
                     f"| {r['copy_limit_ms']:.1f} ms | {r['ratio']:.2f}x |")
    phases = [p for p in PHASES if any(p in r["breakdown_ms"] for r in rows)]
    lines += ["", "| model | config | " + " | ".join(phases) + " |",
              "|---|---|" + "---|" * len(phases)]
    for r in rows:
        cells = [f"{r['breakdown_ms'][p]:.1f}" if p in r["breakdown_ms"] else "-" for p in phases]
        lines.append(f"| {r['model']} | {r['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--small", action="store_true", help="also the default tiny model")
    p.add_argument("--only", default=None, help="run the configurations whose label has this")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run, read as drivers.main_ppo reads "
                        "its own, e.g. checkpoint.write_ahead=false")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one run
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:
        run_one(json.loads(args.one), args.out)
        return []
    models = [(f"hidden {args.hidden} x {args.layers} layers",
               {"hidden_size": args.hidden, "num_layers": args.layers,
                "intermediate_size": args.intermediate, "num_heads": args.heads})]
    if args.small:
        models.append(("default tiny", {}))
    configs = [c for c in CONFIGS if args.only is None or args.only in c[0]]
    overrides = dict(_override(kv) for kv in args.set)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rc-job-stall-") as tmp:
        for rnd in range(args.rounds):
            for model_label, model in models:
                for label, extra in configs:
                    n = sum(len(r) for r in runs.values())
                    root, out = os.path.join(tmp, f"run{n}"), os.path.join(tmp, f"run{n}.json")
                    opts = _job_opts(args, model, {**extra, **overrides}, root)
                    proc = subprocess.run([sys.executable, "-m", "bench.job_stall", "--one",
                                           json.dumps(opts), "--out", out],
                                          capture_output=True, text=True, timeout=1800)
                    if proc.returncode != 0:
                        raise SystemExit(f"{model_label}, {label}: the job failed "
                                         f"(rc {proc.returncode}):\n{proc.stderr[-4000:]}")
                    with open(out) as f:
                        runs.setdefault((model_label, label), []).append(json.load(f))
                    print(f"round {rnd + 1}/{args.rounds}: {model_label}, {label}: done",
                          file=sys.stderr, flush=True)
    rows = [{"model": m, **summarize(c, r)} for (m, c), r in runs.items()]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
