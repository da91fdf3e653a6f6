"""RootState: what the coordinator knows of its root, and the writes that keep it true.

The coordinator is the only writer of checkpoints under its root, so it keeps caches of
what storage holds and a commit costs few metadata reads:

* the committed markers and the tags (reloaded by :meth:`RootState.sync`);
* the manifests it has read or written;
* the quarantined checkpoints (``QUARANTINED``: set aside, never read, see paths.py);
* the step directories that may hold files but no marker (an aborted save, a deletion
  cut short): ``begin`` never hands such a name to a save again, with no listing (a
  LIST request on an object store, in training's blocked time).  ``None`` until the
  first listing: ``begin`` then lists the one step directory it would take.

A save takes its step directory's name by creating its ``CLAIM`` exclusively
(:meth:`RootState.claim`); collecting an aborted save's directory keeps that claim as a
tombstone (:meth:`RootState.delete_step` with ``tombstone=True``), so a writer of a
dead job still inside that directory can never write into a later save's files.

Deleting a checkpoint removes its marker first, so a half-deleted directory is mere
garbage; files another manifest references (deduplicated frozen weights) are kept.
Before every write to the root's shared state (``LATEST``, a tag, the catalog,
verification results) and every delete the lease is checked
(:meth:`RootState.check_lease`): a job that lost its lease writes nothing more.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from raycheckpoint.errors import IntegrityError
from raycheckpoint.integrity.crypto import check_marker
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.format import Manifest, Marker, Quarantine, json_bytes
from raycheckpoint.protocol.lease import check_held
from raycheckpoint.protocol.paths import CheckpointPaths, attempt_dir_name
from raycheckpoint.storage import Storage

logger = logging.getLogger(__name__)


class RootState:
    """The coordinator's view of one root (see the module doc).  Not thread-safe: its
    owner serialises the calls (the coordinator's commit lock)."""

    def __init__(self, storage: Storage, lease_job_id: str | None = None) -> None:
        self.storage = storage
        self.lease_job_id = lease_job_id  # the job lease this state writes under
        self.markers: dict[str, Marker] = {}
        self.tags: dict[str, str] = {}
        self.verified: dict[str, dict[str, Any]] = {}  # background verification results
        self.quarantined: dict[str, Quarantine] = {}
        self.unmarked: set[str] | None = None
        self._manifests: dict[str, Manifest] = {}

    # ---- reading ------------------------------------------------------------------------

    def sync(self) -> list[str]:
        """Reload the markers, quarantines and tags from storage; return the uncommitted
        step dirs."""
        scan = catalog.scan_root(self.storage)
        self.markers = {m.name: m for m in scan.committed}
        self.quarantined = scan.quarantined
        self.tags = catalog.read_tags(self.storage)
        self.verified = catalog.read_verification(self.storage)
        return scan.uncommitted

    def reload_tags(self) -> dict[str, str]:
        """Tags set or removed by ``raycheckpoint tag`` / ``untag`` since the last read."""
        self.tags = catalog.read_tags(self.storage)
        return self.tags

    def sorted_markers(self) -> list[Marker]:
        return sorted(self.markers.values(), key=catalog.order_key)

    def newest_verified(self) -> str | None:
        return catalog.newest_verified(list(self.markers.values()), self.verified)

    def doc(self, markers: list[Marker] | None = None) -> dict[str, Any]:
        """What ``catalog.json`` should hold (of ``markers``, default every committed one)."""
        markers = self.sorted_markers() if markers is None else markers
        return catalog.catalog_doc(markers, self.tags, self._verified_of(markers),
                                   self.quarantined)

    def _verified_of(self, markers: list[Marker]) -> dict[str, dict[str, Any]]:
        names = {m.name for m in markers}
        return {n: r for n, r in self.verified.items() if n in names}

    def manifest(self, name: str) -> Manifest | None:
        """The manifest of ``name`` (read once), checked against its marker (size, sha256
        and, with a key, the marker's MAC: a save never references bytes its key does not
        vouch for); None when unreadable or unchecked (logged)."""
        if name not in self._manifests:
            rel = CheckpointPaths(name).manifest
            try:
                data = self.storage.read_bytes(rel)
                marker = self.markers.get(name)
                if marker is not None and (len(data) != marker.manifest_size or hashlib.sha256(
                        data).hexdigest() != marker.manifest_sha256):
                    raise IntegrityError(f"{rel}: does not match its marker", path=rel)
                manifest = Manifest.from_bytes(data, rel)
                if marker is not None and self.storage.cipher is not None:
                    check_marker(self.storage.cipher, asdict(marker), manifest.encryption, name,
                                 marker_path=CheckpointPaths(name).committed, manifest_path=rel)
                self._manifests[name] = manifest
            except (FileNotFoundError, ValueError) as e:
                logger.warning("cannot read manifest of %s: %s", name, e)
                return None
        return self._manifests[name]

    def referenced(self, names: Iterable[str]) -> set[str]:
        """Files under other step directories that the manifests of ``names`` list."""
        referenced: set[str] = set()
        for name in names:
            manifest = self.manifest(name)
            if manifest is not None:
                paths = CheckpointPaths(name)
                referenced |= {p for p in manifest.files if not paths.holds(p)}
        return referenced

    def encryption(self) -> dict[str, Any] | None:
        """What the manifest records of this root's cipher (None: unencrypted)."""
        cipher = self.storage.cipher
        return None if cipher is None else cipher.describe()

    def reusable(self, frozen: dict[str, str], world_sizes: dict[str, int]) -> dict[str, str]:
        """Frozen role -> the newest committed checkpoint holding its weights (the same
        ``identity`` and world size, under the same encryption key): a save references
        those bytes instead of writing them again."""
        reused: dict[str, str] = {}
        newest_first = sorted(self.markers.values(), key=catalog.order_key, reverse=True)
        for role, identity in frozen.items():
            for marker in newest_first:
                manifest = self.manifest(marker.name)
                layout = None if manifest is None else manifest.roles.get(role)
                if (layout is not None and layout.identity == identity
                        and layout.world_size == world_sizes.get(role)
                        and _key_id(manifest.encryption) == _key_id(self.encryption())):
                    reused[role] = marker.name
                    break
        return reused

    # ---- writing ------------------------------------------------------------------------

    def check_lease(self) -> None:
        """Before every write to the root's shared state and every delete: is the root
        still this job's? LeaseLostError if not (see lease.py)."""
        if self.lease_job_id is not None:
            check_held(self.storage, self.lease_job_id, f"lease {self.lease_job_id}")

    def write_latest(self, name: str) -> None:
        self.check_lease()
        catalog.write_latest(self.storage, name)

    def write_tag(self, tag: str, name: str) -> None:
        self.check_lease()
        catalog.write_tag(self.storage, tag, name)
        self.tags[tag] = name

    def write_catalog(self, markers: list[Marker] | None = None) -> None:
        """``catalog.json`` of ``markers`` (default: every committed one) and the tags."""
        self.check_lease()
        markers = self.sorted_markers() if markers is None else markers
        catalog.write_catalog(self.storage, markers, self.tags, self._verified_of(markers),
                              self.quarantined)

    def record_verification(self, name: str, result: dict[str, Any]) -> bool:
        """Record a background verification of ``name``; False when it is gone meanwhile."""
        if name not in self.markers:
            return False
        self.check_lease()
        self.verified = {**self._verified_of(list(self.markers.values())), name: result}
        catalog.write_verification(self.storage, self.verified)
        self.write_catalog()
        return True

    def committed(self, marker: Marker, manifest: Manifest) -> None:
        """``marker`` was just written: its checkpoint is committed."""
        self._manifests[marker.name] = manifest
        self.markers[marker.name] = marker
        if self.unmarked is not None:
            self.unmarked.discard(marker.name)

    def claim(self, name: str, save_id: str) -> bool:
        """Take step directory ``name`` for save ``save_id``: create its ``CLAIM``
        exclusively.  False when another attempt ever had that name (its claim, or a
        tombstone of it, is there).  No lease check here: a claim is no shared state (the
        commit checks the lease before ``COMMITTED``), and ``begin``, which the driver
        waits for, pays one request for it, not two."""
        record = json_bytes({"save_id": save_id, "job": self.lease_job_id,
                             "claimed_at": time.time()})
        try:
            self.storage.create_marker(CheckpointPaths(name).claim, record)
        except FileExistsError:
            return False
        return True

    def take_dir(self, first: str, save_id: str, also: RootState | None = None) -> str:
        """The step directory save ``save_id`` writes: ``first`` when no attempt ever had
        that name here (nor in ``also``: a tiered job's durable tier, where this name
        goes next) and its claim is taken now, else ``first.<save_id>``, which no other
        attempt ever had: no file of another attempt can lie under the name returned."""
        def seen(root: RootState) -> bool:
            return first in root.markers or first in root.quarantined
        taken = (seen(self) or (also is not None and seen(also))
                 or (first in self.unmarked if self.unmarked is not None
                     else bool(self.storage.list_dir(first))))
        name = first
        if taken or not self.claim(first, save_id):
            name = attempt_dir_name(first, save_id)
            if not self.claim(name, save_id):
                raise FileExistsError(f"{self.storage.url(name)}: claimed by another save")
        if self.unmarked is not None:
            self.unmarked.add(name)  # until its marker is written
        return name

    def claimed_at(self, name: str) -> float | None:
        """When ``name``'s claim was made (None: no readable claim)."""
        try:
            return float(json.loads(self.storage.read_bytes(CheckpointPaths(name).claim))
                         ["claimed_at"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def quarantine(self, name: str, reason: str) -> Quarantine | None:
        """Set committed checkpoint ``name`` aside: ``QUARANTINED`` (its marker, ``reason``)
        written, then its ``COMMITTED`` deleted; ``LATEST`` and the catalog follow.  None
        when ``name`` is not committed here.  Nothing of it is deleted: ``gc`` removes it
        once a newer checkpoint holds its step or a later one."""
        marker = self.markers.get(name)
        if marker is None:
            return None
        self.check_lease()
        paths = CheckpointPaths(name)
        record = Quarantine(marker, reason)
        self.storage.write_pointer(paths.quarantined, record.to_bytes())
        self.storage.delete(paths.committed)
        del self.markers[name]
        self.quarantined[name] = record
        latest = catalog.expected_latest(self.sorted_markers())
        if latest is not None and catalog.read_latest(self.storage) == name:
            self.write_latest(latest)
        self.write_catalog()
        logger.warning("quarantined %s in %s: %s", name, self.storage.url(), reason)
        return record

    def delete_step(self, name: str, referenced: set[str], *, tombstone: bool = False) -> None:
        """Delete a step directory, marker first, keeping files other manifests reference;
        ``tombstone``: keep its ``CLAIM`` too, so its name is never handed out again."""
        self.check_lease()
        if self.unmarked is not None:
            self.unmarked.add(name)  # until the deletion is complete
        paths = CheckpointPaths(name)
        self.storage.delete(paths.committed)
        keep = set(referenced) | ({paths.claim} if tombstone else set())
        kept = any(paths.holds(p) for p in keep)
        if kept:
            for path in self.storage.list_files(name):
                if path not in keep:
                    self.storage.delete(path)
        else:
            self.storage.delete_tree(name)
        self._manifests.pop(name, None)
        self.quarantined.pop(name, None)
        if self.unmarked is not None and not kept:  # kept files stay without a marker
            self.unmarked.discard(name)


def _key_id(encryption: dict[str, Any] | None) -> str | None:
    """Frozen bytes are reused only under the same key (or both unencrypted)."""
    return None if not encryption else encryption.get("key_id")
