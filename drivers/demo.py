"""Save -> crash -> resume, proven exact.

    python -m drivers.demo [--root ./checkpoints/demo] [--steps 12] [--crash-at 7]

1. a run that checkpoints every 3 steps is SIGKILLed after step ``--crash-at``;
2. the same command resumes from the newest checkpoint that verifies and finishes;
3. a straight run without a crash trains the same steps in a separate root.
The demo prints the checkpoints on storage and whether the final weights of 2 and 3
are bitwise identical (exit code 1 if not).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path


def run(args: list[str]) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "drivers.train_tiny", *args],
                          capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        print("   ", line)
    if proc.returncode not in (0, -9):
        print(proc.stderr[-4000:], file=sys.stderr)
    shas = [ln.split()[-1] for ln in proc.stdout.splitlines() if ln.startswith("final weights")]
    return proc.returncode, shas[-1] if shas else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="./checkpoints/demo")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--crash-at", type=int, default=7)
    args = p.parse_args()
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    common = ["--steps", str(args.steps), "--save-every", "3", "--light-every", "2"]

    print(f"[1/3] training to step {args.steps}, SIGKILL after step {args.crash_at}")
    rc, _ = run(["--root", str(root / "run"), *common, "--crash-at", str(args.crash_at)])
    print(f"      driver exit code {rc} (-9 = killed)")
    print("[2/3] same command again: resume from the newest verified checkpoint")
    rc2, resumed = run(["--root", str(root / "run"), *common])
    print("[3/3] a straight run without crash, for comparison")
    rc3, straight = run(["--root", str(root / "straight"), *common])
    print("checkpoints on storage:",
          sorted(p.name for p in (root / "run").iterdir() if p.name.startswith("step_")))
    same = rc2 == 0 and rc3 == 0 and resumed != "" and resumed == straight
    print(f"resumed run == straight run (bitwise weights): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
