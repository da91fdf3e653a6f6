"""Reading a job's ``metrics.jsonl``."""

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
