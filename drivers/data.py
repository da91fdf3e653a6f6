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


def generate(path: str, options: dict[str, Any], *, num_prompts: int, num_targets: int,
             seed: int) -> None:
    """Write the dataset to ``path`` (any fsspec URI, reached with ``options``)."""
    rng = random.Random(seed)
    targets = TARGETS[:num_targets]
    with fsspec.open(path, "w", auto_mkdir=True, **options) as f:
        for i in range(num_prompts):
            t = rng.choice(targets)
            f.write(json.dumps({"id": i, "prompt": f"{t}{t}{t}:", "target": t}) + "\n")


def load(path: str, options: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The rows and the sha256 of the file's bytes (the dataset fingerprint)."""
    with fsspec.open(path, "rb", **options) as f:
        data = f.read()
    rows = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"error: dataset {path} is empty")
    return rows, hashlib.sha256(data).hexdigest()


def load_or_generate(path: str, options: dict[str, Any], *, num_prompts: int, num_targets: int,
                     seed: int, scratch: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """:func:`load` the dataset at ``path``, generating it there first when it does not
    exist, or into the local directory ``scratch`` when given (``path`` left alone)."""
    fs, fpath = fsspec.core.url_to_fs(path, **options)
    if not fs.exists(fpath):
        if scratch is not None:
            path, options = f"{scratch}/train.jsonl", {}
        generate(path, options, num_prompts=num_prompts, num_targets=num_targets, seed=seed)
    return load(path, options)
