"""Retention: which committed checkpoints to keep, as small composable policies.

:class:`RetentionRules` is the one definition of the retention options (``keep_last_n``,
``keep_last_n_light``, ``keep_best_n``, ``best_metric``, ``best_mode``):
:class:`~raycheckpoint.config.CheckpointConfig` has them as its own fields,
:class:`RetentionPolicy` applies them, and every checkpoint records them in its trainer
state, so ``raycheckpoint gc`` applies the job's own rules.

A policy looks at the catalog entries (dicts of
:class:`~raycheckpoint.protocol.format.Marker` fields) and returns the names it keeps.
A checkpoint is deleted only when

* it is governed (its kind has a ``keep_last_n`` limit), and
* no policy keeps it, and
* it is not protected: ``LATEST`` points at it, a tag points at it, or a save for it
  is in flight.

The newest committed full checkpoint is always kept.  Collection writes the catalog
without the doomed entries *before* deleting anything
(:mod:`raycheckpoint.protocol.collect`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

Entry = dict[str, Any]
BestMode = Literal["max", "min"]


@dataclass(frozen=True, kw_only=True)
class RetentionRules:
    """The retention options, validated: which committed checkpoints a job keeps."""

    keep_last_n: int | None = None  # full checkpoints
    keep_last_n_light: int | None = None
    keep_best_n: int | None = None
    best_metric: str = "reward"
    best_mode: BestMode = "max"

    def __post_init__(self) -> None:
        for name in ("keep_last_n", "keep_last_n_light", "keep_best_n"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The names of the retention options."""
        return tuple(f.name for f in fields(RetentionRules))

    def retention_rules(self) -> dict[str, Any]:
        """These options as a plain dict (what a checkpoint records)."""
        return {name: getattr(self, name) for name in RetentionRules.option_names()}


def _newest_first(entries: Iterable[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: (e["step"], e.get("committed_at", 0.0)), reverse=True)


@dataclass(frozen=True)
class LatestN:
    """Keep the ``n`` newest checkpoints of ``kind``."""

    kind: str
    n: int

    def keep(self, entries: Sequence[Entry]) -> set[str]:
        return {e["name"] for e in _newest_first(e for e in entries if e["kind"] == self.kind)[:self.n]}


@dataclass(frozen=True)
class BestN:
    """Keep the ``n`` checkpoints with the best ``metric`` (``mode`` max or min)."""

    metric: str
    mode: str
    n: int

    def keep(self, entries: Sequence[Entry]) -> set[str]:
        scored = []
        for e in entries:
            value = (e.get("metrics") or {}).get(self.metric)
            if isinstance(value, (int, float)) and not math.isnan(value):
                scored.append((value, e["step"], e["name"]))
        scored.sort(reverse=self.mode == "max")
        return {name for _, _, name in scored[:self.n]}


@dataclass(frozen=True)
class NewestFull:
    """Always keep the newest committed full checkpoint: the one a crash resumes from."""

    def keep(self, entries: Sequence[Entry]) -> set[str]:
        full = _newest_first(e for e in entries if e["kind"] == "full")
        return {full[0]["name"]} if full else set()


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy(RetentionRules):
    """The retention rules, applied to a root's catalog entries."""

    @classmethod
    def from_config(cls, config: RetentionRules) -> RetentionPolicy:
        """The policy of a config (anything with the retention options)."""
        return cls(**config.retention_rules())

    def _policies(self) -> list[Any]:
        policies: list[Any] = [NewestFull()]
        if self.keep_last_n is not None:
            policies.append(LatestN("full", self.keep_last_n))
        if self.keep_last_n_light is not None:
            policies.append(LatestN("light", self.keep_last_n_light))
        if self.keep_best_n is not None:
            policies.append(BestN(self.best_metric, self.best_mode, self.keep_best_n))
        return policies

    def _governed(self, kind: str) -> bool:
        limit = self.keep_last_n if kind == "full" else self.keep_last_n_light
        return limit is not None

    def to_delete(self, entries: Sequence[Entry], *, protected: set[str]) -> list[str]:
        """Names of the entries to collect, oldest first."""
        kept: set[str] = set(protected)
        for policy in self._policies():
            kept |= policy.keep(entries)
        doomed = [e for e in entries if e["name"] not in kept and self._governed(e["kind"])]
        return [e["name"] for e in reversed(_newest_first(doomed))]
