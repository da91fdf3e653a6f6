"""Reading what a job reports: its ``metrics.jsonl``, the checkpoint it resumed from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: str | Path) -> dict[int, dict[str, Any]]:
    """The last record of each step: a resumed run repeats the steps after its checkpoint."""
    out: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            out[record["step"]] = record
    return out


def resumed_at(stdout: str) -> int:
    """The step of the checkpoint a run of ``drivers.main_ppo`` resumed from, read from
    its output (``resumed from step_00000004 at step 4``)."""
    return int(stdout.split("resumed from step_")[1][:8])
