"""RootState: what the coordinator knows of its root, and the writes that keep it true.

The coordinator is the only writer of checkpoints under its root, so it keeps caches of
what storage holds and a commit costs few metadata reads:

* the committed markers and the tags (reloaded by :meth:`RootState.sync`);
* the manifests it has read or written;
* the step directories that may hold files but no marker (an aborted save, a deletion
  cut short): ``begin`` clears such a directory before a save writes there, and lists
  storage (a LIST request on an object store, in training's blocked time) only for
  those.  ``None`` until the first listing: every step directory is listed then.

Deleting a checkpoint removes its marker first, so a half-deleted directory is mere
garbage; files another manifest references (deduplicated frozen weights) are kept.
Before every write to the root's shared state (``LATEST``, a tag, the catalog,
verification results) and every delete the lease is checked
(:meth:`RootState.check_lease`): a job that lost its lease writes nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.format import Manifest, Marker
from raycheckpoint.protocol.lease import check_held
from raycheckpoint.protocol.paths import CheckpointPaths
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
        self.unmarked: set[str] | None = None
        self._manifests: dict[str, Manifest] = {}

    # ---- reading ------------------------------------------------------------------------

    def sync(self) -> list[str]:
        """Reload the markers and tags from storage; return the uncommitted step dirs."""
        markers, uncommitted = catalog.scan(self.storage)
        self.markers = {m.name: m for m in markers}
        self.tags = catalog.read_tags(self.storage)
        self.verified = catalog.read_verification(self.storage)
        return uncommitted

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
        return catalog.catalog_doc(markers, self.tags, self._verified_of(markers))

    def _verified_of(self, markers: list[Marker]) -> dict[str, dict[str, Any]]:
        names = {m.name for m in markers}
        return {n: r for n, r in self.verified.items() if n in names}

    def manifest(self, name: str) -> Manifest | None:
        """The manifest of ``name`` (read once); None when unreadable (logged)."""
        if name not in self._manifests:
            try:
                self._manifests[name] = Manifest.from_bytes(
                    self.storage.read_bytes(CheckpointPaths(name).manifest))
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
        catalog.write_catalog(self.storage, markers, self.tags, self._verified_of(markers))

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

    def delete_step(self, name: str, referenced: set[str]) -> None:
        """Delete a step directory, marker first, keeping files other manifests reference."""
        self.check_lease()
        if self.unmarked is not None:
            self.unmarked.add(name)  # until the deletion is complete
        paths = CheckpointPaths(name)
        self.storage.delete(paths.committed)
        keep = any(paths.holds(p) for p in referenced)
        if keep:
            for path in self.storage.list_files(name):
                if path not in referenced:
                    self.storage.delete(path)
        else:
            self.storage.delete_tree(name)
        self._manifests.pop(name, None)
        if self.unmarked is not None and not keep:  # kept files stay without a marker
            self.unmarked.discard(name)


def _key_id(encryption: dict[str, Any] | None) -> str | None:
    """Frozen bytes are reused only under the same key (or both unencrypted)."""
    return None if not encryption else encryption.get("key_id")
