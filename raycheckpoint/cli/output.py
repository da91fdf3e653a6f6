"""What the ``raycheckpoint`` command prints: consoles, sizes, ages, progress, JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def make_console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # a pipe or a log file gets wide tables instead of rich's 80-column default
    width = None if stream.isatty() else 160
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def metrics_text(metrics: dict[str, Any]) -> str:
    parts = []
    for k, v in sorted(metrics.items()):
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


@contextmanager
def progress_bar(description: str, enabled: bool) -> Iterator[tuple[Callable[[int], None],
                                                                    Callable[[int], None]]]:
    """(set_total(bytes), advance(bytes)) callbacks driving a rich progress bar on stderr."""
    if not enabled:
        yield (lambda n: None), (lambda n: None)
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=make_console(stderr=True),
                  transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield (lambda n: bar.update(task, total=n)), (lambda n: bar.advance(task, n))


def emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
