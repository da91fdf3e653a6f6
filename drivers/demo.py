"""The main job, demonstrated: GRPO training with checkpoints, a SIGKILL, an exact resume.

    python -m drivers.demo [--root ./checkpoints/demo] [--steps 40] [--crash-at 23]
                           [key=value ...]   (any drivers.main_ppo option)

1. a straight run of ``--steps`` GRPO steps (full checkpoint every 5 steps, light every 2);
2. the same job in another root, SIGKILLed after step ``--crash-at``, as an OOM or a
   preemption would;
3. the same command again: it resumes from the newest checkpoint that verifies.
A kill right after a step that starts a full save may land before that save commits (as a
real crash may): the resume then takes the full checkpoint before it, or starts afresh
when none had committed.  A kill one step later cannot: a save starts only once the one
before it has finished.
It prints the reward curve, the training time blocked per save, and whether the resumed
run's metrics and final weights are bitwise those of the straight run (exit 1 if not).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from drivers.metrics import read_metrics


def run(args: list[str]) -> subprocess.CompletedProcess:
    child = subprocess.Popen([sys.executable, "-m", "drivers.main_ppo", *args], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    out, err = child.communicate(timeout=1800)
    try:  # a SIGKILLed driver leaves its local Ray's agents behind: end its process group
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc = subprocess.CompletedProcess(child.args, child.returncode, out, err)
    if proc.returncode not in (0, -9):
        print(proc.stdout[-3000:], proc.stderr[-4000:], file=sys.stderr)
    return proc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="./checkpoints/demo")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--crash-at", type=int, default=23)
    args, extra = p.parse_known_args()
    root = Path(args.root).resolve()
    shutil.rmtree(root, ignore_errors=True)
    common = [f"trainer.total_training_steps={args.steps}", "trainer.save_freq=5",
              "checkpoint.save_interval=2", "checkpoint.keep_last_n=2",
              "checkpoint.keep_last_n_light=2", *extra]

    print(f"[1/3] straight run: {args.steps} GRPO steps -> {root / 'straight'}", flush=True)
    a = run([*common, f"trainer.default_local_dir={root / 'straight'}"])
    if a.returncode != 0:
        return 1
    ra = read_metrics(root / "straight" / "metrics.jsonl")
    for step in range(1, args.steps + 1, 5):
        window = [ra[s]["reward"] for s in range(step, min(step + 5, args.steps + 1))]
        print(f"      steps {step:3d}-{step + len(window) - 1:3d}: mean reward "
              f"{sum(window) / len(window):.3f}", flush=True)
    saves = [r["ckpt_blocked_s"] for r in ra.values() if any(e.startswith("save ") for e in r["ckpt_events"])]
    print(f"      {len(saves)} saves; training blocked per save: median "
          f"{sorted(saves)[len(saves) // 2] * 1e3:.1f} ms, max {max(saves) * 1e3:.1f} ms", flush=True)

    crash_root = root / "crashed"
    print(f"[2/3] same job in {crash_root}, SIGKILL after step {args.crash_at}", flush=True)
    b = run([*common, f"trainer.default_local_dir={crash_root}", f"trainer.crash_at_step={args.crash_at}"])
    print(f"      driver exit code {b.returncode} (-9: killed); checkpoints left: "
          f"{sorted(p.name for p in crash_root.iterdir() if p.name.startswith('step_'))}", flush=True)
    print("[3/3] the same command again: resume from the newest checkpoint that verifies", flush=True)
    c = run([*common, f"trainer.default_local_dir={crash_root}"])
    if c.returncode != 0:
        return 1
    resumed = [ln for ln in c.stdout.splitlines() if ln.startswith("resumed from")]
    print(f"      {resumed[0] if resumed else 'did not resume'}", flush=True)
    if not resumed:  # what the resumed run saw: its own output, for whoever debugs this
        print(c.stdout[-3000:], c.stderr[-4000:], file=sys.stderr)
    rb = read_metrics(crash_root / "metrics.jsonl")
    start = int(resumed[0].split("step_")[1][:8]) if resumed else 0
    same = bool(resumed) and all(
        ra[s][k] == rb[s][k] for s in range(start + 1, args.steps + 1)
        for k in ("loss", "reward", "kl", "actor_weights_sha256"))
    print(f"resumed run == straight run (metrics and weights, bitwise, steps {start + 1}-{args.steps}): "
          f"{same}", flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
