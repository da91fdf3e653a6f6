"""CheckpointCoordinator: one per job; owns commit, LATEST, the catalog and retention.

It is a plain class, run as a threaded Ray actor by the manager
(``ray.remote(CheckpointCoordinator).options(max_concurrency=...)``).  Protocol:

1. ``begin(step, kind, ...)`` reserves a step directory and the set of expected
   (role, rank) reports; a save still in flight is waited for first (bounded), so two
   saves of a job never interleave their commits.
2. The driver calls ``await_save(save_id)`` once every worker holds its host copy: the
   commit timeout counts from then, and the call answers when the save has finished, as
   ``wait`` does (it is the driver's handle on the save).  Workers call
   ``report(save_id, role, rank, files, error)`` from their persist threads.
3. A commit thread per save waits for every report (timeout: ``commit_timeout_s``; the
   error names the missing pairs), then writes, in this order: ``trainer_state.json``,
   ``version.json``, ``manifest.msgpack``, ``COMMITTED``, ``LATEST`` (full only) and the
   ``latest`` link, the tag pointer, ``catalog.json``.  The save is then committed:
   ``wait(save_id)`` returns and ``ckpt_on_committed`` is broadcast to the registered
   workers.  Clean-up follows, still under the commit lock (the next ``begin``,
   ``catalog()`` and ``gc()`` wait for it): retention deletes, then the leftovers of
   aborted saves are collected.  It is kept off the durable path because deleting a
   checkpoint costs as much as a large part of a commit (about 0.45 s for 2 GB on local
   disk); ``wait_cleanup()`` waits for it and says what it deleted.
4. Any failure aborts: no marker, ``LATEST`` unchanged, partial files left to GC; the
   error is delivered by ``wait(save_id)``.

State lives on storage: on start the coordinator rebuilds the catalog and ``LATEST``
from the markers if they disagree and collects uncommitted leftovers.  Deleting a
checkpoint removes its marker first, so a half-deleted directory is mere garbage.
The coordinator never looks inside tensors.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from raycheckpoint import catalog
from raycheckpoint._internal import faults
from raycheckpoint.config import CheckpointConfig
from raycheckpoint.errors import CheckpointSaveError, CommitTimeoutError
from raycheckpoint.format import (
    CATALOG,
    COMMITTED,
    LATEST,
    LATEST_LINK,
    MANIFEST,
    TAGS_DIR,
    TRAINER_STATE,
    VERSION,
    Manifest,
    Marker,
    RoleLayout,
    json_bytes,
    step_dir_name,
    validate_tag,
    version_info,
)
from raycheckpoint.lease import check_held
from raycheckpoint.retention import RetentionPolicy
from raycheckpoint.storage import FileEntry, StorageSpec

logger = logging.getLogger(__name__)


@dataclass
class _Save:
    save_id: str
    name: str
    step: int
    kind: str
    tag: str | None
    metrics: dict[str, float]
    trainer_state: dict[str, Any]
    world_sizes: dict[str, int]
    expected: set[tuple[str, int]]
    deadline: float
    frozen: dict[str, str] = field(default_factory=dict)  # role -> identity
    reused: dict[str, str] = field(default_factory=dict)  # role -> checkpoint holding its bytes
    started: float = field(default_factory=time.time)
    reports: dict[tuple[str, int], list[FileEntry]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    persist_s: dict[str, float] = field(default_factory=dict)
    status: str = "pending"  # pending | committed | aborted
    result: dict[str, Any] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    cleanup: dict[str, Any] | None = None  # what the clean-up after the commit did
    cleaned: threading.Event = field(default_factory=threading.Event)  # set after done, always


class CheckpointCoordinator:
    def __init__(self, storage: StorageSpec, config: CheckpointConfig, *, recover: bool = True,
                 lease_job_id: str | None = None) -> None:
        self.spec = storage
        self.lease_job_id = lease_job_id  # the job lease this coordinator writes under
        self.storage = storage.open()
        self.config = config
        self.policy = RetentionPolicy.from_config(config)
        self._cond = threading.Condition()
        self._commit_lock = threading.Lock()
        self._saves: dict[str, _Save] = {}
        self._last: _Save | None = None
        self._workers: list[Any] = []
        self._requests: list[dict[str, Any]] = []
        self._manifests: dict[str, Manifest] = {}
        # caches of what storage holds, loaded by _sync() and kept current by this actor
        # (the only writer of checkpoints under the root), so a commit costs few metadata reads
        self._markers: dict[str, Marker] = {}
        self._tags: dict[str, str] = {}
        # step directories that may hold files but no marker (an aborted save, a deletion
        # cut short), from this actor's own listings and what it wrote and deleted since:
        # begin() clears such a directory before a save writes there, and lists storage
        # (a LIST request on an object store, in training's blocked time) only for those.
        # None until the first listing: begin() then lists every time
        self._unmarked: set[str] | None = None
        self.recovery = self._recover() if recover else {}

    # ---- recovery and catalog ---------------------------------------------------------------

    def _sync(self) -> list[str]:
        """Reload the markers and tags from storage; return the uncommitted step dirs."""
        markers, uncommitted = catalog.scan(self.storage)
        self._markers = {m.name: m for m in markers}
        self._tags = catalog.read_tags(self.storage)
        return uncommitted

    def _sorted_markers(self) -> list[Marker]:
        return sorted(self._markers.values(), key=catalog.order_key)

    def _recover(self, *, dry_run: bool = False, leftover_grace_s: float = 0.0) -> dict[str, Any]:
        """Make the caches agree with the markers; collect leftovers; apply retention.

        ``dry_run``: report what would change, change nothing.  ``leftover_grace_s``:
        keep uncommitted directories written to more recently than this (a save of a job
        this coordinator does not know may still be writing them).
        """
        with self._commit_lock:
            uncommitted = self._sync()
            markers, tags = self._sorted_markers(), dict(self._tags)
            report: dict[str, Any] = {"committed": [m.name for m in markers],
                                      "rebuilt_catalog": False, "fixed_latest": False}
            want_latest = catalog.expected_latest(markers)
            if catalog.read_latest(self.storage) != want_latest and want_latest is not None:
                if not dry_run:
                    self._write_latest(want_latest)
                report["fixed_latest"] = True
            doc = catalog.catalog_doc(markers, tags)
            if catalog.read_catalog(self.storage) != doc:
                if not dry_run:
                    self.storage.write_pointer(CATALOG, json_bytes(doc))
                report["rebuilt_catalog"] = True
            if not dry_run:  # what collecting deletes leaves the set
                self._unmarked = set(uncommitted) | self._in_flight()
            report["collected"], report["kept_recent"] = self._collect_leftovers(
                uncommitted, dry_run=dry_run, grace_s=leftover_grace_s)
            report["deleted"] = self._apply_retention(markers, tags, dry_run=dry_run)
            return report

    def _check_lease(self) -> None:
        """Before anything irreversible: is the root still this job's? (see lease.py)"""
        if self.lease_job_id is not None:
            check_held(self.storage, self.lease_job_id, f"lease {self.lease_job_id}")

    def _write_latest(self, name: str) -> None:
        self.storage.write_pointer(LATEST, (name + "\n").encode())
        self.storage.symlink(LATEST_LINK, name)

    def _in_flight(self) -> set[str]:
        with self._cond:
            return {s.name for s in self._saves.values() if s.status == "pending"}

    def _collect_leftovers(self, uncommitted: list[str], *, dry_run: bool = False,
                           grace_s: float = 0.0) -> tuple[list[str], list[str]]:
        """(collected, kept because written to within ``grace_s``) uncommitted step dirs."""
        busy = self._in_flight()
        referenced = self._referenced(self._markers)
        collected, recent = [], []
        now = time.time()
        for name in uncommitted:
            if name in busy:
                continue
            if grace_s > 0:
                modified = self.storage.modified(name)
                if modified is not None and now - modified < grace_s:
                    recent.append(name)
                    continue
            if not dry_run:
                self._check_lease()
                self._delete_step(name, referenced)
            collected.append(name)
        return collected, recent

    def _referenced(self, names) -> set[str]:
        """Files under other step directories that the manifests of ``names`` list."""
        referenced: set[str] = set()
        for name in names:
            manifest = self._manifest(name)
            if manifest is not None:
                referenced |= {p for p in manifest.files if not p.startswith(name + "/")}
        return referenced

    def _delete_step(self, name: str, referenced: set[str]) -> None:
        """Delete a step directory, marker first, keeping files other manifests reference."""
        if self._unmarked is not None:
            self._unmarked.add(name)  # until the deletion is complete
        self.storage.delete(f"{name}/{COMMITTED}")
        keep = any(p.startswith(name + "/") for p in referenced)
        if keep:
            for path in self.storage.list_files(name):
                if path not in referenced:
                    self.storage.delete(path)
        else:
            self.storage.delete_tree(name)
        self._manifests.pop(name, None)
        if self._unmarked is not None and not keep:  # kept files stay without a marker
            self._unmarked.discard(name)

    def _manifest(self, name: str) -> Manifest | None:
        if name not in self._manifests:
            try:
                self._manifests[name] = Manifest.from_bytes(
                    self.storage.read_bytes(f"{name}/{MANIFEST}"))
            except (FileNotFoundError, ValueError) as e:
                logger.warning("cannot read manifest of %s: %s", name, e)
                return None
        return self._manifests[name]

    def _apply_retention(self, markers: list[Marker], tags: dict[str, str], *,
                         dry_run: bool = False, protect: tuple[str, ...] = ()) -> list[str]:
        entries = [m.to_catalog_entry() for m in markers]
        protected = set(tags.values()) | self._in_flight() | set(protect)
        latest = catalog.read_latest(self.storage)
        if latest:
            protected.add(latest)
        doomed = self.policy.to_delete(entries, protected=protected)
        if not doomed or dry_run:
            return doomed
        self._check_lease()
        kept = [m for m in markers if m.name not in doomed]
        for name in doomed:
            self._markers.pop(name, None)
        # catalog first: a crash after this leaves committed-but-uncatalogued dirs, which
        # recovery re-adds and retention deletes again (collection is idempotent)
        self.storage.write_pointer(CATALOG, json_bytes(catalog.catalog_doc(kept, tags)))
        referenced = self._referenced(m.name for m in kept)
        for name in doomed:
            faults.check("coordinator.retention_delete", path=name)
            self._delete_step(name, referenced)
        return doomed

    # ---- driver API ---------------------------------------------------------------------------

    def register_workers(self, workers: list[Any]) -> None:
        self._workers = list(workers)

    def request_save(self, tag: str | None = None, kind: str = "full") -> None:
        """Ask the running job's driver to save at its next step (from outside the job)."""
        if kind not in ("full", "light"):
            raise ValueError(f"kind must be 'full' or 'light', got {kind!r}")
        if tag is not None:
            validate_tag(tag)
        with self._cond:
            self._requests.append({"tag": tag, "kind": kind, "at": time.time()})

    def take_requests(self) -> list[dict[str, Any]]:
        with self._cond:
            taken, self._requests = self._requests, []
        return taken

    def catalog(self) -> dict[str, Any]:
        with self._commit_lock:
            return catalog.catalog_doc(self._sorted_markers(), self._tags)

    def begin(self, *, step: int, kind: str, tag: str | None, metrics: dict[str, float],
              trainer_state: dict[str, Any], expected: list[tuple[str, int]],
              world_sizes: dict[str, int], frozen: dict[str, str] | None = None) -> dict[str, Any]:
        """Reserve a save.

        Returns ``{"save_id", "name", "reused"}`` or ``{"existing": entry}``.  ``frozen``
        maps frozen roles to the identity of their weights; a role whose identical weights
        (same identity and world size) are in a committed checkpoint is not written again:
        it is listed in ``reused``, expects no reports, and the manifest references the
        earlier bytes.
        """
        if kind not in ("full", "light"):
            raise ValueError(f"kind must be 'full' or 'light', got {kind!r}")
        if tag is not None:
            validate_tag(tag)
        previous = self._last
        if previous is not None and not previous.done.wait(self.config.save_wait_timeout_s):
            raise TimeoutError(f"save {previous.name} is still in flight after "
                               f"{self.config.save_wait_timeout_s}s; not starting another")
        with self._commit_lock:
            name = step_dir_name(step)
            existing = self._markers.get(name)
            if existing is not None and (existing.kind == "full" or kind == "light"):
                if tag is not None:
                    self._tags = catalog.read_tags(self.storage)
                    self._write_tag(tag, name)
                    self.storage.write_pointer(CATALOG, json_bytes(
                        catalog.catalog_doc(self._sorted_markers(), self._tags)))
                return {"existing": existing.to_catalog_entry()}
            if existing is not None:  # a light checkpoint holds this step; a full one is asked
                name = step_dir_name(step, upgraded=True)
                upgraded = self._markers.get(name)
                if upgraded is not None:
                    return {"existing": upgraded.to_catalog_entry()}
            if ((self._unmarked is None or name in self._unmarked)
                    and self.storage.list_dir(name)):  # leftover of an aborted attempt
                self._delete_step(name, self._referenced(self._markers))
            if self._unmarked is not None:
                self._unmarked.add(name)  # until its marker is written
            frozen = dict(frozen or {})
            reused = self._find_reusable(frozen, world_sizes)
            expected = [e for e in expected if e[0] not in reused]
            save = _Save(save_id=uuid.uuid4().hex[:12], name=name, step=step, kind=kind, tag=tag,
                         metrics=dict(metrics), trainer_state=dict(trainer_state),
                         world_sizes=dict(world_sizes), expected={tuple(e) for e in expected},
                         frozen=frozen, reused=reused,
                         # until the driver says every snapshot is taken (snapshotted()),
                         # the snapshots themselves may wait for a previous persist
                         deadline=time.time() + self.config.save_wait_timeout_s
                         + self.config.commit_timeout_s)
            with self._cond:
                self._saves[save.save_id] = save
                self._last = save
        threading.Thread(target=self._run, args=(save,), daemon=True,
                         name=f"raycheckpoint-commit-{name}").start()
        return {"save_id": save.save_id, "name": name, "reused": sorted(reused)}

    def _find_reusable(self, frozen: dict[str, str], world_sizes: dict[str, int]) -> dict[str, str]:
        reused: dict[str, str] = {}
        newest_first = sorted(self._markers.values(), key=catalog.order_key, reverse=True)
        for role, identity in frozen.items():
            for marker in newest_first:
                manifest = self._manifest(marker.name)
                layout = None if manifest is None else manifest.roles.get(role)
                if (layout is not None and layout.identity == identity
                        and layout.world_size == world_sizes.get(role)
                        and _key_id(manifest.encryption) == _key_id(self._encryption())):
                    reused[role] = marker.name
                    break
        return reused

    def snapshotted(self, save_id: str) -> None:
        """Every worker has its host copy: the persist/commit timeout starts now."""
        with self._cond:
            save = self._saves.get(save_id)
            if save is not None and save.status == "pending":
                save.deadline = time.time() + self.config.commit_timeout_s
                self._cond.notify_all()

    def await_save(self, save_id: str) -> dict[str, Any]:
        """:meth:`snapshotted`, then answer as :meth:`wait` does once the save has finished:
        the driver holds this call's answer as its handle on the save."""
        self.snapshotted(save_id)
        return self.wait(save_id)

    def report(self, save_id: str, role: str, rank: int, files: list[dict[str, Any]],
               error: str | None, persist_s: float | None = None) -> None:
        with self._cond:
            save = self._saves.get(save_id)
            if save is None or save.status != "pending":
                logger.warning("report for unknown or finished save %s from %s/%s", save_id, role,
                               rank)
                return
            key = (role, int(rank))
            if key not in save.expected:
                save.failures[f"{role}/{rank}"] = f"unexpected reporter (expected {sorted(save.expected)})"
            elif error is not None:
                save.failures[f"{role}/{rank}"] = error
            else:
                save.reports[key] = [FileEntry.from_dict(f) for f in files]
                if persist_s is not None:
                    save.persist_s[f"{role}/{rank}"] = float(persist_s)
            self._cond.notify_all()

    def abort(self, save_id: str, reason: str) -> None:
        with self._cond:
            save = self._saves.get(save_id)
            if save is not None and save.status == "pending":
                save.failures["driver"] = f"aborted: {reason}"
                self._cond.notify_all()

    def wait(self, save_id: str, timeout: float | None = None) -> dict[str, Any]:
        save = self._saves[save_id]
        if not save.done.wait(timeout):
            raise TimeoutError(f"save {save.name} ({save_id}) not finished after {timeout}s")
        if save.error is not None:
            raise save.error
        return dict(save.result or {})

    def wait_cleanup(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Wait for the clean-up after the newest save; return what it did.

        ``{"name", "deleted", "collected", "error", "cleanup_s"}``, or None when there
        was no save yet or the newest one did not commit (it has no clean-up).
        """
        save = self._last
        if save is None:
            return None
        if not save.cleaned.wait(timeout):
            raise TimeoutError(f"clean-up after {save.name} not finished after {timeout}s")
        return None if save.cleanup is None else dict(save.cleanup)

    def gc(self, *, dry_run: bool = False, leftover_grace_s: float = 0.0) -> dict[str, Any]:
        """Re-read storage, repair LATEST/catalog, collect leftovers, apply retention (idempotent).

        Also what ``raycheckpoint gc`` runs, on a coordinator made with ``recover=False``.
        """
        return self._recover(dry_run=dry_run, leftover_grace_s=leftover_grace_s)

    # ---- commit --------------------------------------------------------------------------------

    def _run(self, save: _Save) -> None:
        try:
            self._await_reports_and_commit(save)
        finally:
            save.cleaned.set()

    def _await_reports_and_commit(self, save: _Save) -> None:
        with self._cond:
            while (save.status == "pending" and not save.failures
                   and set(save.reports) != save.expected and time.time() < save.deadline):
                self._cond.wait(min(1.0, max(0.0, save.deadline - time.time())))
            failures = dict(save.failures)
            missing = sorted(save.expected - set(save.reports))
        if failures:
            self._finish(save, CheckpointSaveError(
                f"save of {save.name} aborted; failures: "
                + "; ".join(f"{who}: {msg.splitlines()[0] if msg else msg}"
                            for who, msg in sorted(failures.items())),
                failures=failures))
            return
        if missing:
            self._finish(save, CommitTimeoutError(
                f"save of {save.name} aborted: no report within {self.config.commit_timeout_s}s "
                f"from (role, rank) {missing}", missing=missing))
            return
        self._commit_and_clean_up(save)

    def _commit_and_clean_up(self, save: _Save) -> None:
        t0 = time.perf_counter()
        with self._commit_lock:
            try:
                result = self._commit(save)
            except Exception as e:
                logger.exception("commit of %s failed", save.name)
                self._finish(save, CheckpointSaveError(
                    f"commit of {save.name} failed: {type(e).__name__}: {e}",
                    failures={"coordinator": repr(e)}))
                return
            result["commit_s"] = time.perf_counter() - t0  # all reports in -> committed
            self._finish(save, None, result)  # durable and visible: waiters go on now
            for w in self._workers:
                try:
                    w.ckpt_on_committed.remote(save.name, save.step)
                except Exception as e:  # noqa: BLE001 - a dead worker must not fail a commit
                    logger.warning("broadcast of %s to a worker failed: %s", save.name, e)
            save.cleanup = self._clean_up(save)

    def _clean_up(self, save: _Save) -> dict[str, Any]:
        """Retention, then the leftovers of aborted saves, after ``save`` committed.

        A failure here leaves the committed save as it is: what was not deleted is
        deleted by the next clean-up (the next commit, a restart, ``raycheckpoint gc``).
        """
        t0 = time.perf_counter()
        report: dict[str, Any] = {"name": save.name, "deleted": [], "collected": [], "error": None}
        try:
            report["deleted"] = self._apply_retention(self._sorted_markers(), dict(self._tags),
                                                      protect=(save.name,))
            uncommitted = [n for n in catalog.step_dirs(self.storage) if n not in self._markers]
            self._unmarked = set(uncommitted) | self._in_flight()
            report["collected"], _ = self._collect_leftovers(uncommitted)
        except Exception as e:  # logged, and reported by wait_cleanup()
            logger.exception("clean-up after %s failed; the next one retries it", save.name)
            report["error"] = f"{type(e).__name__}: {e}"
        report["cleanup_s"] = time.perf_counter() - t0
        return report

    def _finish(self, save: _Save, error: BaseException | None,
                result: dict[str, Any] | None = None) -> None:
        with self._cond:
            save.status = "aborted" if error is not None else "committed"
            save.error, save.result = error, result
            self._cond.notify_all()
        if error is not None:
            logger.error("%s", error)
        save.done.set()

    def _commit(self, save: _Save) -> dict[str, Any]:
        s, name = self.storage, save.name
        files: dict[str, FileEntry] = {}
        roles: dict[str, RoleLayout] = {}
        for (role, rank), entries in sorted(save.reports.items()):
            layout = roles.setdefault(role, RoleLayout(world_size=save.world_sizes[role],
                                                       dcp_dir=f"{name}/{role}",
                                                       identity=save.frozen.get(role)))
            layout.ranks[rank] = [e.path for e in entries]
            for e in entries:
                files[e.path] = e
        for role, source in sorted(save.reused.items()):
            src = self._manifest(source)
            if src is None:
                raise RuntimeError(f"cannot reuse {role} from {source}: its manifest is unreadable")
            roles[role] = src.roles[role]
            for path in src.roles[role].files:
                files[path] = src.files[path]
        trainer_state = {**save.trainer_state, "global_step": save.step, "kind": save.kind,
                         "tag": save.tag, "metrics": save.metrics, "name": name}
        faults.check("coordinator.trainer_state", path=name)
        entry = s.write_bytes(f"{name}/{TRAINER_STATE}", json_bytes(trainer_state))
        files[entry.path] = entry
        # version.json is hashed with sha256 whatever the job's algorithm, so every release
        # can verify it and then say whether it reads the rest (format.version_info)
        entry = s.write_bytes(f"{name}/{VERSION}", json_bytes(version_info(files.values())),
                              checksum="sha256")
        files[entry.path] = entry
        manifest = Manifest(name=name, step=save.step, kind=save.kind, files=files, roles=roles,
                            encryption=self._encryption())
        faults.check("coordinator.manifest", path=name)
        manifest_bytes = manifest.to_bytes()
        m_entry = s.write_bytes(f"{name}/{MANIFEST}", manifest_bytes)
        marker = Marker(name=name, step=save.step, kind=save.kind, manifest_size=m_entry.size,
                        manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest(),
                        bytes=manifest.total_bytes + m_entry.size, metrics=save.metrics,
                        tag=save.tag)
        faults.check("coordinator.before_marker", path=name)
        self._check_lease()
        s.create_marker(f"{name}/{COMMITTED}", marker.to_bytes())
        self._manifests[name] = manifest
        self._markers[name] = marker
        if self._unmarked is not None:
            self._unmarked.discard(name)
        faults.check("coordinator.after_marker", path=name)
        markers = self._sorted_markers()
        if save.kind == "full" and catalog.expected_latest(markers) == name:
            self._write_latest(name)
        self._tags = catalog.read_tags(s)  # tags set or removed by `raycheckpoint tag/untag`
        if save.tag is not None:
            self._write_tag(save.tag, name)
        tags = dict(self._tags)
        faults.check("coordinator.catalog", path=name)
        s.write_pointer(CATALOG, json_bytes(catalog.catalog_doc(markers, tags)))
        committed_at = time.time()
        return {"name": name, "step": save.step, "kind": save.kind, "tag": save.tag,
                "bytes": marker.bytes, "files": len(files),
                "persist_s": max(save.persist_s.values(), default=0.0),
                "total_s": committed_at - save.started}

    def _encryption(self) -> dict[str, Any] | None:
        cipher = self.storage.cipher
        return None if cipher is None else cipher.describe()

    def _write_tag(self, tag: str, name: str) -> None:
        self.storage.write_pointer(f"{TAGS_DIR}/{tag}", (name + "\n").encode())
        self._tags[tag] = name


def _key_id(encryption: dict[str, Any] | None) -> str | None:
    """Frozen bytes are reused only under the same key (or both unencrypted)."""
    return None if not encryption else encryption.get("key_id")
