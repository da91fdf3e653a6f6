"""Collection: recovery, garbage collection and retention over one root.

One :class:`Collector` serves the coordinator (recovery when it starts, the clean-up
after each commit) and ``raycheckpoint gc`` alike.  The rules (DESIGN sections 4 and 5):

* truth is the set of step directories holding ``COMMITTED``: ``LATEST`` and
  ``catalog.json`` are rewritten when they disagree with it;
* a step directory without a marker is garbage once no save is in flight for it (and,
  for ``gc`` beside a job it does not know, once nothing was written there for a grace
  period); a first-choice name's ``CLAIM`` stays as a tombstone for ``TOMBSTONE_S``, so
  that name is never handed to another save while a writer of the dead attempt may live;
* a quarantined checkpoint is never collected as garbage nor counted by retention;
  ``gc`` (``raycheckpoint gc``, :meth:`CheckpointCoordinator.gc`) removes it once a
  checkpoint committed after it holds its step or a later one;
* retention never deletes what ``LATEST`` or a tag points to, nor a save in flight, and
  writes the catalog without the doomed checkpoints *before* deleting them, so a crash
  in between leaves committed-but-uncatalogued directories that the next run re-adds
  and deletes again: collection is idempotent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from raycheckpoint._internal import faults
from raycheckpoint.policy.retention import RetentionPolicy
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.format import Marker
from raycheckpoint.protocol.paths import CheckpointPaths, first_choice
from raycheckpoint.protocol.root import RootState

logger = logging.getLogger(__name__)

# how long the claim of an aborted save's first-choice name outlives its files: longer
# than any writer of a dead job lives (Ray ends a dead job's workers within minutes)
TOMBSTONE_S = 24 * 3600.0


class Collector:
    """Recovery, leftovers and retention over ``root``; ``in_flight()`` names the step
    directories of saves still running (never touched), ``also_protected()`` other
    checkpoints retention keeps (name -> why).  The caller serialises calls."""

    def __init__(self, root: RootState, policy: RetentionPolicy,
                 in_flight: Callable[[], set[str]] = set, *,
                 also_protected: Callable[[], dict[str, str]] = dict) -> None:
        self.root = root
        self.policy = policy
        self.in_flight = in_flight
        self.also_protected = also_protected  # more names never deleted -> why

    def recover(self, *, dry_run: bool = False, grace_s: float = 0.0,
                quarantined: bool = False) -> dict[str, Any]:
        """Make the caches agree with the markers; collect leftovers; apply retention.

        ``dry_run``: report what would change, change nothing.  ``grace_s``: keep
        uncommitted directories written to more recently than this (a save of a job this
        process does not know may still be writing them).  ``quarantined``: also remove
        the quarantined checkpoints a newer one has superseded (what ``gc`` does; a
        coordinator starting up does not).
        """
        root = self.root
        uncommitted = root.sync()
        markers, tags = root.sorted_markers(), dict(root.tags)
        report: dict[str, Any] = {"committed": [m.name for m in markers],
                                  "rebuilt_catalog": False, "fixed_latest": False}
        want_latest = catalog.expected_latest(markers)
        if catalog.read_latest(root.storage) != want_latest and want_latest is not None:
            if not dry_run:
                root.write_latest(want_latest)
            report["fixed_latest"] = True
        if catalog.read_catalog(root.storage) != root.doc(markers):
            if not dry_run:
                root.write_catalog(markers)
            report["rebuilt_catalog"] = True
        if not dry_run:  # what collecting deletes leaves the set
            root.unmarked = set(uncommitted) | self.in_flight()
        report["collected"], report["kept_recent"] = self.collect_leftovers(
            uncommitted, dry_run=dry_run, grace_s=grace_s)
        report["kept"] = {n: why for n, why in self.explain(markers, tags).items() if why}
        report["deleted"] = self.apply_retention(markers, tags, dry_run=dry_run)
        report["quarantined"] = {n: q.reason for n, q in sorted(root.quarantined.items())}
        if quarantined:
            report["removed_quarantined"] = self.remove_superseded(dry_run=dry_run)
        return report

    def remove_superseded(self, *, dry_run: bool = False) -> list[str]:
        """Delete the quarantined checkpoints that a checkpoint committed after their
        quarantine holds the step of, or a later one (``gc``; never automatic)."""
        root = self.root
        gone = []
        for name, q in sorted(root.quarantined.items()):
            if not any(m.step >= q.step and m.committed_at > q.quarantined_at
                       for m in root.markers.values()):
                continue
            if not dry_run:
                root.check_lease()
                root.delete_step(name, root.referenced(root.markers))
                root.write_catalog()
            gone.append(name)
        return gone

    def clean_up_after(self, name: str) -> dict[str, Any]:
        """Retention, then the leftovers of aborted saves, after ``name`` committed.

        A failure here leaves the committed save as it is: what was not deleted is
        deleted by the next clean-up (the next commit, a restart, ``raycheckpoint gc``).
        """
        root = self.root
        t0 = time.perf_counter()
        report: dict[str, Any] = {"name": name, "deleted": [], "collected": [], "error": None}
        try:
            report["deleted"] = self.apply_retention(root.sorted_markers(), dict(root.tags),
                                                     protect=(name,))
            uncommitted = [n for n in catalog.step_dirs(root.storage)
                           if n not in root.markers and n not in root.quarantined]
            root.unmarked = set(uncommitted) | self.in_flight()
            report["collected"], _ = self.collect_leftovers(uncommitted)
        except Exception as e:  # logged, and reported by wait_cleanup()
            logger.exception("clean-up after %s failed; the next one retries it", name)
            report["error"] = f"{type(e).__name__}: {e}"
        report["cleanup_s"] = time.perf_counter() - t0
        return report

    def collect_leftovers(self, uncommitted: list[str], *, dry_run: bool = False,
                          grace_s: float = 0.0) -> tuple[list[str], list[str]]:
        """(collected, kept because written to within ``grace_s``) uncommitted step dirs."""
        root = self.root
        busy = self.in_flight()
        referenced = root.referenced(root.markers)
        collected, recent = [], []
        now = time.time()
        for name in uncommitted:
            if name in busy:
                continue
            claim = CheckpointPaths(name).claim
            files = root.storage.list_files(name)
            if set(files) == {claim}:  # a tombstone: gone once no writer of it can live
                claimed_at = root.claimed_at(name)
                if claimed_at is not None and now - claimed_at < TOMBSTONE_S:
                    continue
            elif grace_s > 0:
                modified = root.storage.modified(name)
                if modified is not None and now - modified < grace_s:
                    recent.append(name)
                    continue
            if not dry_run:
                root.check_lease()
                root.delete_step(name, referenced, tombstone=(
                    claim in files and len(files) > 1 and first_choice(name) == name))
            collected.append(name)
        return collected, recent

    def protected(self, tags: dict[str, str], protect: tuple[str, ...] = ()) -> dict[str, str]:
        """Checkpoints retention never deletes -> why."""
        out: dict[str, str] = {}
        for name in protect:
            out[name] = "just committed"
        for name in self.in_flight():
            out[name] = "a save is in flight"
        out.update(self.also_protected())
        verified = self.root.newest_verified()
        if verified is not None:
            out[verified] = "the newest checkpoint that passed background verification"
        for t, name in sorted(tags.items()):
            out[name] = f"tag {t!r} points here"
        latest = catalog.read_latest(self.root.storage)
        if latest:
            out[latest] = "LATEST points here"
        return out

    def explain(self, markers: list[Marker], tags: dict[str, str]) -> dict[str, list[str]]:
        """Every committed checkpoint -> why retention keeps it (empty: deleted)."""
        return self.policy.explain([m.to_catalog_entry() for m in markers],
                                   protected=self.protected(tags))

    def apply_retention(self, markers: list[Marker], tags: dict[str, str], *,
                        dry_run: bool = False, protect: tuple[str, ...] = ()) -> list[str]:
        """Delete what the policy does not keep (oldest first); returns the names."""
        root = self.root
        entries = [m.to_catalog_entry() for m in markers]
        doomed = self.policy.to_delete(entries, protected=self.protected(tags, protect))
        if not doomed or dry_run:
            return doomed
        root.check_lease()
        kept = [m for m in markers if m.name not in doomed]
        for name in doomed:
            root.markers.pop(name, None)
        # catalog first: a crash after this leaves committed-but-uncatalogued dirs, which
        # recovery re-adds and retention deletes again (collection is idempotent)
        root.write_catalog(kept)
        referenced = root.referenced(m.name for m in kept)
        for name in doomed:
            faults.check("coordinator.retention_delete", path=name)
            root.delete_step(name, referenced)
        return doomed
