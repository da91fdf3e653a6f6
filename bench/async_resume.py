"""What an asynchronous RL job loses to a crash: with the rollout state, and without.

    python -m bench.async_resume [--steps 8] [--kills 3,5,7] [--engine hf|vllm] [--json PATH]

Runs ``drivers.main_ppo`` in its asynchronous mode (deterministic schedule: the same run
every time; 2 rollout ranks, 3 decode steps per training step, so sequences are in flight at
every save, a full save every step) straight through, then for each kill point: the job
SIGKILLed after that step, and resumed from the same checkpoint twice, with
``checkpoint.rollout_state=full`` and ``drop`` (what other frameworks keep: the data
position only).  Reported per kill point: the tokens the checkpoint held (in flight and
queued), the tokens thrown away at the resume (generated again), and the tokens the run
generated in all to reach the last step beyond the straight run's; then, over every save
of the runs, the rollout's pause per save (copying its state at a token boundary) against
the trainer's blocked time, for the deterministic and the free-running schedules.
``--engine vllm``: the rollout is a vLLM engine per rank (a saved sequence continues by
prefilling its prompt and tokens).
Absolute times mean little off a GPU; the token counts are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from drivers.metrics import read_metrics, resumed_at

COMMON = ["async_training.enable=true", "async_training.schedule=deterministic",
          "async_training.decode_steps_per_step=3", "async_training.staleness_threshold=2",
          "rollout.n_gpus_per_node=2", "trainer.n_gpus_per_node=1", "data.train_batch_size=4",
          "actor_rollout_ref.rollout.n=4", "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=3"]


ENGINE: list[str] = []  # the rollout engine's key, when not the default


def job(root: str, steps: int, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "drivers.main_ppo", *COMMON, *ENGINE,
                           f"trainer.total_training_steps={steps}",
                           f"trainer.default_local_dir={root}", *extra],
                          capture_output=True, text=True, timeout=1800)
    if check and proc.returncode != 0:
        raise SystemExit(f"the job failed (rc {proc.returncode}): {' '.join(extra)}\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def held_tokens(root: str, step: int) -> int:
    with open(os.path.join(root, f"step_{step:08d}", "rollout_state.json"), "rb") as f:
        doc = json.load(f)
    seqs = [s for rank in doc["inflight"] for s in rank] + doc["hub"]["queue"]["sequences"]
    return sum(len(s["tokens"]) for s in seqs)


def generated(ms: dict[int, dict], upto: int) -> int:
    return ms[upto]["tokens_generated"]


def pauses(ms: dict[int, dict]) -> list[tuple[float, float]]:
    return [(r["ckpt_rollout_pause_s"], r["ckpt_blocked_s"]) for r in ms.values()
            if "ckpt_rollout_pause_s" in r]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kills", default="3,5,7")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    ENGINE[:] = [f"actor_rollout_ref.rollout.name={args.engine}"]
    kills = [int(k) for k in args.kills.split(",")]
    rows, timing = [], {"deterministic": [], "free": []}
    with tempfile.TemporaryDirectory(prefix="rc-async-resume-") as tmp:
        straight = os.path.join(tmp, "straight")
        job(straight, args.steps)
        base = read_metrics(os.path.join(straight, "metrics.jsonl"))
        timing["deterministic"] += pauses(base)
        free = os.path.join(tmp, "free")
        job(free, args.steps, "async_training.schedule=free")
        timing["free"] += pauses(read_metrics(os.path.join(free, "metrics.jsonl")))
        for k in kills:
            killed = os.path.join(tmp, f"kill{k}")
            job(killed, args.steps, f"trainer.crash_at_step={k}", check=False)
            row: dict[str, Any] = {"kill_after": k}
            for mode in ("full", "drop"):
                root = os.path.join(tmp, f"kill{k}-{mode}")
                shutil.copytree(killed, root)
                before = read_metrics(os.path.join(root, "metrics.jsonl"))
                out = job(root, args.steps, "trainer.resume_mode=auto",
                          f"checkpoint.rollout_state={mode}").stdout
                start = resumed_at(out)
                ms = read_metrics(os.path.join(root, "metrics.jsonl"))
                events = " ".join(ms[start + 1]["ckpt_events"])
                thrown = (int(events.split("rollout state dropped: ")[1].split()[0])
                          if mode == "drop" else 0)
                extra = generated(before, start) + generated(ms, args.steps) - generated(
                    base, args.steps)
                row.update({"resumed_at": start, "held_tokens": held_tokens(killed, start),
                            f"{mode}_thrown_away": thrown, f"{mode}_extra_generated": extra})
                if mode == "full":
                    timing["deterministic"] += pauses({s: r for s, r in ms.items() if s > start})
                    row["full_matches_straight"] = all(
                        ms[s]["actor_weights_sha256"] == base[s]["actor_weights_sha256"]
                        for s in range(start + 1, args.steps + 1))
            rows.append(row)
            print(f"kill after step {k}: done", file=sys.stderr, flush=True)
    summary = {sched: {"saves": len(v),
                       "rollout_pause_ms": statistics.median(x for x, _ in v) * 1e3,
                       "trainer_blocked_ms": statistics.median(y for _, y in v) * 1e3}
               for sched, v in timing.items() if v}
    print("| kill after step | resumed at | tokens held | full: thrown away | full: extra "
          "generated | drop: thrown away | drop: extra generated | full run = straight run |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['kill_after']} | {r['resumed_at']} | {r['held_tokens']} | "
              f"{r['full_thrown_away']} | {r['full_extra_generated']} | {r['drop_thrown_away']} | "
              f"{r['drop_extra_generated']} | {'bit for bit' if r['full_matches_straight'] else 'no'} |")
    print("\n| schedule | saves | rollout pause per save | trainer blocked per save |")
    print("|---|---:|---:|---:|")
    for sched, s in summary.items():
        print(f"| {sched} | {s['saves']} | {s['rollout_pause_ms']:.2f} ms | "
              f"{s['trainer_blocked_ms']:.1f} ms |")
    result = {"engine": args.engine, "kills": rows, "pause": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
