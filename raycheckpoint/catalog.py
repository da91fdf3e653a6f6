"""Reading what a root holds: committed markers, the catalog cache, LATEST and tags.

Truth is on storage: the set of step directories holding ``COMMITTED``.
``catalog.json`` and ``LATEST`` are caches of it; :func:`scan` reads the markers
themselves, and :func:`expected_latest` / :func:`catalog_doc` say what the caches
should hold.  Used by the coordinator (recovery, retention) and by resume (resolving a
reference); writes happen only in the coordinator.
"""

from __future__ import annotations

import json
from typing import Any

from raycheckpoint.errors import IntegrityError
from raycheckpoint.format import (
    CATALOG,
    COMMITTED,
    FORMAT_VERSION,
    LATEST,
    TAGS_DIR,
    Marker,
    parse_step_dir,
)
from raycheckpoint.storage import Storage


def order_key(m: Marker | dict[str, Any]) -> tuple[int, float]:
    if isinstance(m, Marker):
        return (m.step, m.committed_at)
    return (m["step"], m.get("committed_at", 0.0))


def step_dirs(storage: Storage) -> list[str]:
    return [n for n in storage.list_dir("") if parse_step_dir(n) is not None]


def read_marker(storage: Storage, name: str) -> Marker | None:
    """The marker of ``name``; None when absent; IntegrityError when unreadable."""
    rel = f"{name}/{COMMITTED}"
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError:
        return None
    try:
        marker = Marker.from_bytes(data)
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"{rel}: unreadable commit marker ({type(e).__name__}: {e})",
                             path=rel) from None
    if marker.name != name:
        raise IntegrityError(f"{rel}: marker names {marker.name!r}, not {name!r}", path=rel)
    return marker


def scan_all(storage: Storage) -> tuple[list[Marker], list[str], dict[str, IntegrityError]]:
    """(committed markers oldest first, step dirs without a marker, dirs whose marker is
    unreadable -> the error).  A corrupt marker is neither committed nor garbage: such a
    directory is never read and never collected; `raycheckpoint verify` reports it."""
    committed, uncommitted, corrupt = [], [], {}
    for name in step_dirs(storage):
        try:
            marker = read_marker(storage, name)
        except IntegrityError as e:
            corrupt[name] = e
            continue
        if marker is None:
            uncommitted.append(name)
        else:
            committed.append(marker)
    committed.sort(key=order_key)
    return committed, uncommitted, corrupt


def scan(storage: Storage) -> tuple[list[Marker], list[str]]:
    """(committed markers oldest first, step directories without a marker)."""
    committed, uncommitted, _ = scan_all(storage)
    return committed, uncommitted


def read_pointer(storage: Storage, rel: str) -> str | None:
    try:
        return storage.read_bytes(rel).decode().strip() or None
    except FileNotFoundError:
        return None


def read_latest(storage: Storage) -> str | None:
    return read_pointer(storage, LATEST)


def read_tags(storage: Storage) -> dict[str, str]:
    tags = {}
    for tag in storage.list_dir(TAGS_DIR):
        if tag.startswith(".tmp-"):
            continue
        target = read_pointer(storage, f"{TAGS_DIR}/{tag}")
        if target:
            tags[tag] = target
    return tags


def expected_latest(markers: list[Marker]) -> str | None:
    full = [m for m in markers if m.kind == "full"]
    return max(full, key=order_key).name if full else None


def catalog_doc(markers: list[Marker], tags: dict[str, str]) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "latest": expected_latest(markers),
        "tags": dict(sorted(tags.items())),
        "checkpoints": [m.to_catalog_entry() for m in sorted(markers, key=order_key)],
    }


def read_catalog(storage: Storage) -> dict[str, Any] | None:
    try:
        return json.loads(storage.read_bytes(CATALOG))
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # a torn or corrupt cache is rebuilt from the markers
