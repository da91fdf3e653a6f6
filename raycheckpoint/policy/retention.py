"""Retention: which committed checkpoints to keep, as small composable policies.

:class:`RetentionRules` is the one definition of the retention options (``keep_last_n``,
``keep_last_n_light``, ``keep_best_n``, ``best_metric``, ``best_mode``):
:class:`~raycheckpoint.config.CheckpointConfig` has them as its own fields,
:class:`RetentionPolicy` applies them, and every checkpoint records them in its trainer
state, so ``raycheckpoint gc`` applies the job's own rules.

A policy looks at the catalog entries (dicts of
:class:`~raycheckpoint.protocol.format.Marker` fields) and returns the names it keeps.
A checkpoint is deleted only when

* it is governed: a full one when ``keep_last_n`` or ``keep_best_n`` is set, a light one
  always (``keep_last_n_light`` defaults to :data:`DEFAULT_KEEP_LAST_N_LIGHT`: light
  checkpoints are frequent and superseded by the next, so they are bounded even when
  no rule names them), and
* no policy keeps it, and
* it is not protected: ``LATEST`` points at it, a tag points at it, it is the newest
  checkpoint whose background verification passed, or a save for it is in flight.

The newest committed full checkpoint is always kept.  :meth:`RetentionPolicy.explain`
says, for every checkpoint, which rules keep it (what ``raycheckpoint gc --dry-run``
prints).  Collection writes the catalog
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

# light checkpoints kept when no keep_last_n_light is given
DEFAULT_KEEP_LAST_N_LIGHT = 3


@dataclass(frozen=True, kw_only=True)
class RetentionRules:
    """The retention options, validated: which committed checkpoints a job keeps."""

    keep_last_n: int | None = None  # full checkpoints
    keep_last_n_light: int | None = None  # None: DEFAULT_KEEP_LAST_N_LIGHT
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

    rule: str = "keep_last_n"

    def describe(self) -> str:
        return f"one of the newest {self.n} {self.kind} ({self.rule}={self.n})"

    def keep(self, entries: Sequence[Entry]) -> set[str]:
        return {e["name"] for e in _newest_first(e for e in entries if e["kind"] == self.kind)[:self.n]}


@dataclass(frozen=True)
class BestN:
    """Keep the ``n`` checkpoints with the best ``metric`` (``mode`` max or min)."""

    metric: str
    mode: str
    n: int

    def describe(self) -> str:
        return f"one of the {self.n} best by {self.metric} ({self.mode}; keep_best_n={self.n})"

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

    def describe(self) -> str:
        return "the newest full checkpoint (always kept)"

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

    @property
    def light_limit(self) -> int:
        return DEFAULT_KEEP_LAST_N_LIGHT if self.keep_last_n_light is None else self.keep_last_n_light

    def _policies(self) -> list[Any]:
        policies: list[Any] = [NewestFull()]
        if self.keep_last_n is not None:
            policies.append(LatestN("full", self.keep_last_n))
        policies.append(LatestN("light", self.light_limit, rule="keep_last_n_light"
                                + ("" if self.keep_last_n_light is not None else " default")))
        if self.keep_best_n is not None:
            policies.append(BestN(self.best_metric, self.best_mode, self.keep_best_n))
        return policies

    def _governed(self, kind: str) -> bool:
        if kind == "full":
            return self.keep_last_n is not None or self.keep_best_n is not None
        return True

    def explain(self, entries: Sequence[Entry], *, protected: dict[str, str]) -> dict[str, list[str]]:
        """Every entry's name -> why it is kept (empty: it is deleted).

        ``protected``: names kept whatever the rules say -> why (``LATEST``, a tag, ...).
        """
        reasons: dict[str, list[str]] = {e["name"]: [] for e in entries}
        for name, why in protected.items():
            if name in reasons:
                reasons[name].append(why)
        for policy in self._policies():
            for name in policy.keep(entries):
                reasons[name].append(policy.describe())
        for e in entries:
            if not self._governed(e["kind"]) and not reasons[e["name"]]:
                reasons[e["name"]].append("no rule limits full checkpoints "
                                          "(neither keep_last_n nor keep_best_n is set)")
        return reasons

    def to_delete(self, entries: Sequence[Entry], *, protected: set[str] | dict[str, str]) -> list[str]:
        """Names of the entries to collect, oldest first."""
        if not isinstance(protected, dict):
            protected = dict.fromkeys(protected, "protected")
        reasons = self.explain(entries, protected=protected)
        doomed = [e for e in entries if not reasons[e["name"]]]
        return [e["name"] for e in reversed(_newest_first(doomed))]
