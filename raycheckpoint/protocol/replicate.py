"""Replication: a committed checkpoint of one tier copied to another, then committed there.

DESIGN section 7.  :func:`replicate` copies what a committed checkpoint's manifest lists
(its files as stored: encrypted bytes stay encrypted, under the same key), then the
manifest itself, reads every copied byte back from the target and checks it against the
manifest, and only then creates ``COMMITTED`` in the target (the source's marker, byte
for byte), moves its ``LATEST``, writes the tag and the catalog.  The manifest of a
checkpoint is therefore identical in every tier that holds it, and a tier never shows a
partial checkpoint: a copy cut short (a crash, an outage) leaves a step directory
without a marker, which the target's collection removes (:mod:`~raycheckpoint.protocol.collect`).

:class:`Replicator` runs the replications of a job to its durable tier on one
background thread, oldest first.  A failed one (the durable store is down, say) is
retried, with a growing pause, until it succeeds or its checkpoint left the source
tier; saves to the source tier go on meanwhile.  Which checkpoints go where, and when:
:mod:`~raycheckpoint.protocol.tiers`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from raycheckpoint._internal import faults
from raycheckpoint._internal.priority import lower_priority
from raycheckpoint.errors import IntegrityError
from raycheckpoint.integrity.verify import CHUNK_BYTES, verify_files
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.checkpoint import read_committed
from raycheckpoint.protocol.collect import Collector
from raycheckpoint.protocol.commit import mark_committed
from raycheckpoint.protocol.paths import CheckpointPaths, parse_step_dir
from raycheckpoint.protocol.root import RootState
from raycheckpoint.storage import FileEntry, Storage

logger = logging.getLogger(__name__)

KEEP_RESULTS = 100  # replications a Replicator remembers (``results``), newest

def replicate(source: Storage, target: RootState, name: str) -> dict[str, Any]:
    """Copy committed checkpoint ``name`` from ``source`` into ``target`` and commit it
    there (see the module doc).  Returns ``{"name", "bytes", "files", "copied", "s"}``.

    Files the target already holds with the manifest's size (frozen weights an earlier
    replicated checkpoint holds) are not copied again; every file is verified in the
    target all the same.
    """
    t0 = time.perf_counter()
    marker, manifest_bytes, manifest = read_committed(source, name)
    paths = CheckpointPaths(name)
    there = catalog.read_marker(target.storage, name)
    if there is not None:
        if there.manifest_sha256 != marker.manifest_sha256:  # never mix two saves' files
            raise IntegrityError(
                f"{target.storage.url(name)} is another save's checkpoint under the same name "
                f"(its manifest differs from {source.url(name)}'s): not replicated; set it "
                "aside (quarantine) or remove it to replicate this one", path=name)
        return {"name": name, "bytes": 0, "files": len(manifest.files), "copied": 0,
                "s": time.perf_counter() - t0, "already": True}
    if name in target.quarantined:
        raise IntegrityError(f"{target.storage.url(name)} holds a quarantined checkpoint of "
                             "that name: not replicated over it", path=name)
    if target.storage.list_dir(name):  # the leftover of a copy cut short
        target.delete_step(name, target.referenced(target.markers))
    todo = {path: entry for path, entry in sorted(manifest.files.items())
            # not the bytes an earlier checkpoint's copy brought (deduplicated frozen role)
            if paths.holds(path) or not _holds(target.storage, path, entry)}
    # where the source's own servers copy (per-node directories: each node its files),
    # they also read them back; the rest is copied and read back here
    uploaded = source.upload(todo, target.storage.spec)
    copied = sum(todo[p].size for p in uploaded)
    for path, entry in todo.items():
        if path in uploaded:
            continue
        faults.check("replicate.file", path=path)
        copy_file(source, target.storage, path, entry)
        copied += entry.size
    faults.check("replicate.verify", path=name)
    try:  # read back: what the target holds
        verify_files(target.storage, {p: e for p, e in manifest.files.items() if p not in uploaded})
    except IntegrityError as e:  # the source matched as it was read: the copy went wrong
        raise TargetMismatchError(f"{target.storage.url(name)}: read back, {e}") from e
    m_entry = target.storage.write_bytes(paths.manifest, manifest_bytes, checksum="sha256")
    if m_entry.digest != marker.manifest_sha256:
        raise IntegrityError(f"{target.storage.url(paths.manifest)}: written bytes do not match "
                             "the marker", path=paths.manifest)
    faults.check("replicate.before_marker", path=name)
    # the source set aside the other checkpoints of this step when it saved this one
    for other in [m.name for m in target.sorted_markers()
                  if m.step == marker.step and m.committed_at < marker.committed_at]:
        target.quarantine(other, f"superseded by {name}, a newer save of step {marker.step} "
                          f"replicated from {source.url()}")
    mark_committed(target, marker, manifest, point="replicate")
    return {"name": name, "bytes": marker.bytes, "files": len(manifest.files), "copied": copied,
            "uploaded_at_source": len(uploaded), "s": time.perf_counter() - t0}


class TargetMismatchError(OSError):
    """What a target tier holds after a copy does not match the manifest, although the
    source's bytes did as they were read: the copy is retried (an IntegrityError of the
    source copy is not: no retry makes it good)."""


def copy_file(source: Storage, target: Storage, path: str, entry: FileEntry) -> None:
    """Stream ``path``'s stored bytes from ``source`` to ``target`` (no decryption), checking
    them against ``entry`` as they pass; retried whole on a transient error."""
    def once() -> None:
        with source.open_read(path) as f, target.open_write(path, checksum=entry.algorithm) as w:
            while chunk := f.read(CHUNK_BYTES):
                w.write(chunk)
        written = w.close()
        if written.size != entry.size or written.digest != entry.digest:
            raise IntegrityError(f"{source.url(path)}: its bytes do not match the manifest",
                                 path=path)

    target.retrying("copy", path, once)


def _holds(storage: Storage, path: str, entry: FileEntry) -> bool:
    return storage.exists(path) and storage.size(path) == entry.size


class Replicator:
    """Replicates committed checkpoints of ``source`` into ``target`` on one thread.

    ``collector`` applies the target's retention after each replication; ``on_done(name,
    result_or_None, error_or_None)`` is told of every outcome.  :meth:`pending` is what
    the source's retention must keep.
    """

    def __init__(self, source: Storage, target: RootState, collector: Collector, *,
                 lock: threading.Lock, on_done: Callable[..., None] | None = None,
                 retry_s: tuple[float, float] = (0.5, 30.0),
                 copy: Callable[[Storage, RootState, str], dict[str, Any]] | None = None,
                 newest_only: bool = False, name: str = "raycheckpoint-replicate",
                 nice: int = 0) -> None:
        self.source = source
        self._copy = copy or replicate
        self._newest_only = newest_only  # a newer checkpoint replaces any older one waiting
        self._nice = nice  # nice levels below the coordinator: below training on a busy host
        self.target = target
        self.collector = collector
        self._lock = lock  # the target's state is shared with whoever else writes it
        self._on_done = on_done or (lambda *a: None)
        self._retry_s = retry_s
        self._cond = threading.Condition()
        self._queue: list[str] = []  # oldest first
        self._current: str | None = None
        self._finishing: str | None = None  # copied, its on_done still running
        self.results: dict[str, dict[str, Any]] = {}
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def enqueue(self, name: str) -> None:
        with self._cond:
            if name not in self._queue and name != self._current:
                self._queue.append(name)
                self._queue.sort(key=_step_of)
                if self._newest_only:
                    del self._queue[:-1]
            self._cond.notify_all()

    def pending(self) -> list[str]:
        """Checkpoints queued or being copied, oldest first."""
        with self._cond:
            current = [] if self._current is None else [self._current]
            return current + [n for n in self._queue if n != self._current]

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._current is not None or self._finishing is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    def _run(self) -> None:
        lower_priority(self._nice)
        pause = self._retry_s[0]
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                name = self._current = self._queue.pop(0)
            try:
                if catalog.read_marker(self.source, name) is None:
                    logger.warning("replication of %s dropped: the source tier no longer "
                                   "holds it", name)
                    self._done(name, None, "gone from the source tier")
                    continue
                with self._lock:
                    result = self._copy(self.source, self.target, name)
                    result["cleanup"] = self.collector.clean_up_after(name)
                self.last_error, pause = None, self._retry_s[0]
                self._done(name, result, None)
            except (IntegrityError, FileNotFoundError) as e:
                # the source copy is bad or incomplete (a file went with a lost node's disk):
                # no retry makes it good
                self.last_error = f"{type(e).__name__}: {e}"
                logger.error("replication of %s dropped: %s", name, self.last_error)
                self._done(name, None, self.last_error)
            except Exception as e:  # noqa: BLE001 - retried: the durable store may be down
                self.last_error = f"{type(e).__name__}: {e}"
                logger.warning("replication of %s failed (%s); retrying in %.1fs", name,
                               self.last_error, pause)
                with self._cond:
                    if not (self._newest_only and self._queue):  # else a newer one replaces it
                        self._queue.insert(0, name)
                    self._current = None
                    self._cond.wait(pause)
                pause = min(pause * 2, self._retry_s[1])

    def _done(self, name: str, result: dict[str, Any] | None, error: str | None) -> None:
        if result is not None:
            self.results[name] = result
            while len(self.results) > KEEP_RESULTS:  # the oldest first (insertion order)
                del self.results[next(iter(self.results))]
        with self._cond:  # no longer pending: what on_done runs (the source tier's
            self._current = None  # retention) may let it go
            self._finishing = name
        try:  # before the replication counts as over: wait_idle() covers what it does
            self._on_done(name, result, error)
        finally:
            with self._cond:
                self._finishing = None
                self._cond.notify_all()


def _step_of(name: str) -> tuple[int, str]:
    return (parse_step_dir(name) or 0, name)
