"""The generated prompt dataset: one JSON object per line, fingerprinted by sha256.

Task: each prompt is a target character repeated, then a colon (``"kkk:"``); the
reward is the fraction of response characters equal to the target.  A policy built
from scratch learns it within a few dozen steps on a CPU, so reward visibly rises.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import fsspec

TARGETS = "abcdefghijklmnopqrstuvwxyz"


def generate(path: str, *, num_prompts: int, num_targets: int, seed: int) -> None:
    rng = random.Random(seed)
    targets = TARGETS[:num_targets]
    with fsspec.open(path, "w", auto_mkdir=True) as f:
        for i in range(num_prompts):
            t = rng.choice(targets)
            f.write(json.dumps({"id": i, "prompt": f"{t}{t}{t}:", "target": t}) + "\n")


def load(path: str) -> tuple[list[dict[str, Any]], str]:
    """The rows and the sha256 of the file's bytes (the dataset fingerprint)."""
    with fsspec.open(path, "rb") as f:
        data = f.read()
    rows = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"error: dataset {path} is empty")
    return rows, hashlib.sha256(data).hexdigest()
