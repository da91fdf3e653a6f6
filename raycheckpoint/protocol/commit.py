"""The commit sequence (DESIGN section 2.4), as one function, and the record of a save.

Once every expected (role, rank) has reported its files, :func:`commit` writes, in this
order: ``trainer_state.json`` (and an asynchronous job's ``rollout_state.json``),
``version.json``, ``manifest.msgpack``, ``COMMITTED``, ``LATEST`` (full only) and the
``latest`` link, the tag pointer, ``catalog.json``.  ``COMMITTED`` present means
complete: a failure before it leaves no marker and ``LATEST`` unchanged, and the partial
files are collected later.  The lease is checked
just before the marker, and again before each write after it (``LATEST``, the tag, the
catalog: :class:`~raycheckpoint.protocol.root.RootState`), so a job that lost its lease
in between writes none of them.  Named fault points (``coordinator.*``) sit between the steps.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from raycheckpoint._internal import faults
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.format import Manifest, Marker, RoleLayout, json_bytes, version_info
from raycheckpoint.protocol.paths import CheckpointPaths
from raycheckpoint.protocol.root import RootState
from raycheckpoint.storage import FileEntry


@dataclass
class SaveRecord:
    """One save the coordinator tracks, from ``begin`` to its clean-up."""

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
    replicate: bool = False  # a tiered job copies it to the durable tier whatever the interval
    held: bool = False  # begun with a step: committed once the driver completes it (await_save)
    rollout_state: Any = None  # JSON-safe: written encrypted as rollout_state.json
    # when the save began; a held save's time is counted from its release (the step's
    # end; its ranks started their persists as they answered, just before), so that its
    # commit time does not include the step's own calls
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


def commit(root: RootState, save: SaveRecord) -> dict[str, Any]:
    """Commit ``save``, every report in: see the module doc.  Returns the save's result."""
    s, name = root.storage, save.name
    paths = CheckpointPaths(name)
    files: dict[str, FileEntry] = {}
    roles: dict[str, RoleLayout] = {}
    for (role, rank), entries in sorted(save.reports.items()):
        layout = roles.setdefault(role, RoleLayout(world_size=save.world_sizes[role],
                                                   dcp_dir=paths.role_dir(role),
                                                   identity=save.frozen.get(role)))
        layout.ranks[rank] = [e.path for e in entries]
        for e in entries:
            files[e.path] = e
    for role, source in sorted(save.reused.items()):
        src = root.manifest(source)
        if src is None:
            raise RuntimeError(f"cannot reuse {role} from {source}: its manifest is unreadable")
        roles[role] = src.roles[role]
        for path in src.roles[role].files:
            files[path] = src.files[path]
    trainer_state = {**save.trainer_state, "global_step": save.step, "kind": save.kind,
                     "tag": save.tag, "metrics": save.metrics, "name": name}
    faults.check("coordinator.trainer_state", path=name)
    entry = s.write_bytes(paths.trainer_state, json_bytes(trainer_state))
    files[entry.path] = entry
    if save.rollout_state is not None:  # training data (prompts, tokens): a data file
        entry = s.write_bytes(paths.rollout_state, json_bytes(save.rollout_state), encrypt=True)
        files[entry.path] = entry
    # version.json is hashed with sha256 whatever the job's algorithm, so every release
    # can verify it and then say whether it reads the rest (format.version_info)
    entry = s.write_bytes(paths.version, json_bytes(version_info(files.values())),
                          checksum="sha256")
    files[entry.path] = entry
    manifest = Manifest(name=name, step=save.step, kind=save.kind, files=files, roles=roles,
                        encryption=root.encryption())
    faults.check("coordinator.manifest", path=name)
    manifest_bytes = manifest.to_bytes()
    m_entry = s.write_bytes(paths.manifest, manifest_bytes)
    marker = Marker(name=name, step=save.step, kind=save.kind, manifest_size=m_entry.size,
                    manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest(),
                    bytes=manifest.total_bytes + m_entry.size, metrics=save.metrics,
                    tag=save.tag)
    if s.cipher is not None:  # only the key's holder can publish a checkpoint (DESIGN 8)
        marker.mac = s.cipher.marker_mac(asdict(marker))
    faults.check("coordinator.before_marker", path=name)
    mark_committed(root, marker, manifest, point="coordinator")
    committed_at = time.time()
    return {"name": name, "step": save.step, "kind": save.kind, "tag": save.tag,
            "bytes": marker.bytes, "files": len(files),
            "persist_s": max(save.persist_s.values(), default=0.0),
            "total_s": committed_at - save.started}


def mark_committed(root: RootState, marker: Marker, manifest: Manifest, *, point: str) -> None:
    """Everything else of ``marker``'s checkpoint is written: check the lease, create
    ``COMMITTED``, then move ``LATEST`` (full, and the newest), write the tag and the
    catalog, each after its own check of the lease (LeaseLostError: nothing more is
    written).  Fault points ``<point>.after_marker`` and ``<point>.catalog`` sit between."""
    name = marker.name
    root.check_lease()
    root.storage.create_marker(CheckpointPaths(name).committed, marker.to_bytes())
    root.committed(marker, manifest)
    faults.check(f"{point}.after_marker", path=name)
    markers = root.sorted_markers()
    if marker.kind == "full" and catalog.expected_latest(markers) == name:
        root.write_latest(name)
    root.reload_tags()
    if marker.tag is not None:
        root.write_tag(marker.tag, name)
    faults.check(f"{point}.catalog", path=name)
    root.write_catalog(markers)
