"""Which committed checkpoints a resume tries, in which order, and what it passes over.

One list for the job's load (:class:`~raycheckpoint.loader.CheckpointLoader`) and for
the start-up check that runs before any worker starts
(:func:`~raycheckpoint.resume.preflight`): both call :func:`resume_candidates` over the
same tiers and walk the result with :func:`first_that_opens`, so the check refuses
exactly what the load would refuse and takes what ``auto`` would fall back to.

* ``auto``: every committed full checkpoint of any tier, newest first; a checkpoint in
  several tiers comes once per tier, fastest first.  Passed over before anything is
  opened: an unreadable marker, a failed background verification
  (``verification.json``), a copy tier's checkpoint that lost files with a node, and a
  memory-tier checkpoint that no file tier still holds committed (a root wiped or a
  checkpoint deleted is not resurrected from memory).
* a named reference (path, step, tag, ``latest``): resolved in the first tier that
  holds it (:func:`~raycheckpoint.protocol.refs.resolve`), then the same names in the
  tiers after it.

Walking the list, an :class:`~raycheckpoint.errors.IntegrityError` moves ``auto`` on
to the next candidate (a named reference only to another tier's copy of the same
name); any other error (a changed config, a wrong key) stops it.  Free of Ray and torch.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from raycheckpoint.errors import CheckpointNotFoundError, IntegrityError
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.format import Manifest
from raycheckpoint.protocol.paths import CheckpointPaths
from raycheckpoint.protocol.refs import resolve
from raycheckpoint.storage import Storage

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Tier:
    """One place a job reads checkpoints from.  ``label``: "root", "memory tier", "local
    tier", "durable tier"; ``copy``: a tier that may have lost files with a node (its
    checkpoints are taken only where every file is there); ``memory``: served only what
    a file tier still holds committed."""

    storage: Storage
    label: str = "root"
    copy: bool = False
    memory: bool = False


@dataclass
class PassedOver:
    """A checkpoint (in one tier) a resume did not take for its own bytes, and why."""

    name: str
    tier: Tier
    why: str

    def __str__(self) -> str:
        return f"{self.name}{_in(self.tier)}: {self.why}"


@dataclass
class Candidates:
    """The checkpoints a resume tries, in order, and what it passed over on the way."""

    ref: str | int
    tries: list[tuple[str, Tier]]
    passed_over: list[PassedOver] = field(default_factory=list)


def _in(tier: Tier) -> str:
    return "" if tier.label == "root" else f" in the {tier.label}"


def resume_candidates(tiers: list[Tier], ref: str | int) -> Candidates:
    """The candidates for ``ref`` over ``tiers`` (fastest first); see the module doc."""
    if ref == "auto":
        return _auto(tiers)
    return Candidates(ref, _named(tiers, ref))


def _auto(tiers: list[Tier]) -> Candidates:
    out = Candidates("auto", [])
    found: dict[str, tuple[tuple[int, float], list[Tier]]] = {}
    in_files: set[str] = set()  # committed in a file tier: what the memory tier may serve
    scans = []
    for tier in tiers:
        scan = catalog.scan_root(tier.storage)
        scans.append((tier, scan))
        if not tier.memory:
            in_files |= {m.name for m in scan.committed}
    for tier, scan in scans:
        for name, error in sorted(scan.corrupt.items()):
            _pass(out, PassedOver(name, tier, str(error)))
        verification = catalog.read_verification(tier.storage)
        held: dict[str, int] = {}  # the tier's files, listed once when first needed
        for m in scan.committed:
            if m.kind != "full":
                continue
            record = verification.get(m.name) or {}
            if record.get("ok") is False:
                _pass(out, PassedOver(m.name, tier, "it failed background verification: "
                                      f"{record.get('error')}"))
                continue
            if tier.memory and m.name not in in_files:
                logger.info("%s is not read from the memory tier: no file tier holds it "
                            "committed any more", m.name)
                continue
            if tier.copy and not _complete(tier.storage, m.name,
                                           held := held or tier.storage.list_files()):
                logger.info("%s is not read from the %s: files of it went with a node "
                            "(its replica holder or its disk)", m.name, tier.label)
                continue
            found.setdefault(m.name, (catalog.order_key(m), []))[1].append(tier)
    ordered = sorted(found.items(), key=lambda kv: kv[1][0], reverse=True)
    out.tries = [(name, t) for name, (_, held_in) in ordered for t in held_in]
    return out


def _pass(out: Candidates, passed: PassedOver) -> None:
    warnings.warn(f"checkpoint {passed.name}{_in(passed.tier)} is skipped: {passed.why}",
                  RuntimeWarning, stacklevel=4)
    out.passed_over.append(passed)


def _named(tiers: list[Tier], ref: str | int) -> list[tuple[str, Tier]]:
    """``ref`` resolved in the first tier that holds it, then the same names in the
    tiers after it."""
    files = [t for t in tiers if not t.memory]
    for i, tier in enumerate(tiers):
        try:
            names = resolve(tier.storage, ref)
        except CheckpointNotFoundError:
            if i + 1 == len(tiers):
                raise
            continue
        if tier.memory:  # only what a file tier still holds committed
            names = [n for n in names
                     if any(catalog.read_marker(t.storage, n) is not None for t in files)]
            if not names:
                continue
        out = []
        for name in names:
            out += [(name, t) for t in tiers[i:]
                    if t is tier or catalog.read_marker(t.storage, name) is not None]
        return out
    return []


def first_that_opens(candidates: Candidates, attempt: Callable[[str, Tier], T]) -> T | None:
    """``attempt(name, tier)`` on each candidate in order until one returns; None when
    ``auto`` has no candidate at all (a fresh root).  An IntegrityError moves ``auto`` on
    (recorded in ``candidates.passed_over``), and a named reference only to another
    tier's copy of the same name; anything else is raised at once."""
    tries, ref = candidates.tries, candidates.ref
    if not tries and not candidates.passed_over:
        return None
    last: IntegrityError | None = None
    for i, (name, tier) in enumerate(tries):
        try:
            return attempt(name, tier)
        except IntegrityError as e:
            same_next = i + 1 < len(tries) and tries[i + 1][0] == name
            if ref != "auto" and not same_next:
                raise
            warnings.warn(f"checkpoint {name}{_in(tier)} failed verification, trying "
                          + ("its copy in another tier" if same_next else "an older one")
                          + f": {e}", RuntimeWarning, stacklevel=3)
            candidates.passed_over.append(PassedOver(name, tier, str(e)))
            last = e
    if ref != "auto" and last is not None:
        raise last
    raise CheckpointNotFoundError("no committed full checkpoint verifies: "
                                  + "; ".join(map(str, candidates.passed_over)), ref=str(ref))


def bad_copies(candidates: Candidates, taken: str, tier_label: str) -> list[PassedOver]:
    """What a resume that took ``taken`` from the tier labelled ``tier_label`` passed over
    for its own bytes: the copies to quarantine, each once (a damaged copy of ``taken``
    in another tier included: it is not read again)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for p in candidates.passed_over:
        key = (p.name, p.tier.label)
        if key != (taken, tier_label) and key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _complete(storage: Storage, name: str, held: dict[str, int]) -> bool:
    """Whether ``held`` (``storage``'s files and sizes) has every file ``name``'s manifest
    lists, at its size (the checksums are checked as the files are read)."""
    rel = CheckpointPaths(name).manifest
    try:
        manifest = Manifest.from_bytes(storage.read_bytes(rel), rel)
    except (OSError, IntegrityError):  # missing or unreadable: not a complete copy
        return False
    return all(held.get(p) == e.size for p, e in manifest.files.items())
