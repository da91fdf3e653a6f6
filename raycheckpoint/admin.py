"""Operator actions on a checkpoint root, without Ray: what the ``raycheckpoint`` command runs.

Each function takes URIs and storage options, returns plain data (rendered as a table
or JSON by :mod:`raycheckpoint.cli`) and raises a :class:`~raycheckpoint.errors.RayCheckpointError`
(or ``FileNotFoundError`` / ``PermissionError`` / ``ValueError``) for a user mistake.

References (``REF``): a checkpoint directory (``<root>/step_00000010``), or a root with
``step=`` / ``tag=``, or a bare root meaning its ``LATEST``.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from collections.abc import Callable
from typing import Any

from raycheckpoint import hf_export
from raycheckpoint._internal.dcp.safe_pickle import check_role_metadata
from raycheckpoint.errors import CheckpointNotFoundError, LeaseHeldError, RayCheckpointError
from raycheckpoint.integrity.crypto import EncryptionKeyError
from raycheckpoint.integrity.verify import verify_files
from raycheckpoint.policy.retention import RetentionPolicy, RetentionRules
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.checkpoint import VerifiedCheckpoint, open_verified, summary
from raycheckpoint.protocol.collect import Collector
from raycheckpoint.protocol.lease import read_lease
from raycheckpoint.protocol.paths import CATALOG, parse_step_dir, tag_path, validate_tag
from raycheckpoint.protocol.refs import resolve, split_path_ref
from raycheckpoint.protocol.root import RootState
from raycheckpoint.resume import resume_differences
from raycheckpoint.storage import Storage


def open_root(uri: str, options: dict[str, Any] | None = None, *, key: str | None = None
              ) -> Storage:
    """The Storage of an existing root (never creates one); ``key``: an encryption key
    reference (``env:NAME`` / ``file:PATH``) to read encrypted checkpoints with."""
    cipher = None
    if key is not None:
        from raycheckpoint.integrity.crypto import FileCipher, load_key

        cipher = FileCipher(load_key(key))
    if "://" not in uri or uri.startswith("file://"):
        path = uri.removeprefix("file://")
        try:
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{uri}: no such directory", ref=uri) from None
        except PermissionError:
            raise PermissionError(f"{uri}: permission denied") from None
        if not is_dir:
            raise CheckpointNotFoundError(f"{uri}: not a directory", ref=uri)
        if not os.access(path, os.R_OK | os.X_OK):
            raise PermissionError(f"{uri}: permission denied")
        return Storage(uri, dict(options or {}), create=False, cipher=cipher)
    storage = Storage(uri, dict(options or {}), create=False, cipher=cipher)
    if not storage.fs.exists(storage.root):
        raise CheckpointNotFoundError(f"{uri}: nothing stored there (no such bucket or prefix)",
                                      ref=uri)
    return storage


def locate_ref(ref: str, options: dict[str, Any] | None = None, *, step: int | None = None,
               tag: str | None = None, key: str | None = None) -> tuple[Storage, list[str]]:
    """(root storage, candidate checkpoint names best first) for a CLI reference."""
    split = split_path_ref(ref)
    if split is not None:
        if step is not None or tag is not None:
            raise ValueError(f"{ref} names a checkpoint directory; --step/--tag take a root")
        root, name = split
        storage = open_root(root, options, key=key)
        return storage, resolve(storage, name)
    storage = open_root(ref, options, key=key)
    if step is not None and tag is not None:
        raise ValueError("give --step or --tag, not both")
    target: str | int = step if step is not None else (tag if tag is not None else "latest")
    return storage, resolve(storage, target)


def open_ref(ref: str, options: dict[str, Any] | None = None, *, step: int | None = None,
             tag: str | None = None, key: str | None = None) -> VerifiedCheckpoint:
    storage, names = locate_ref(ref, options, step=step, tag=tag, key=key)
    return open_verified(storage, names[0])


def is_checkpoint_dir(ref: str) -> bool:
    return split_path_ref(ref) is not None


# ---- ls ---------------------------------------------------------------------------------------

def list_root(storage: Storage, now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    scan = catalog.scan_root(storage)
    markers, uncommitted, corrupt = scan.committed, scan.uncommitted, scan.corrupt
    latest = catalog.read_latest(storage)
    tags = catalog.read_tags(storage)
    verified = catalog.read_verification(storage)
    by_target: dict[str, list[str]] = {}
    for t, target in sorted(tags.items()):
        by_target.setdefault(target, []).append(t)
    rows = []
    for m in markers:
        rows.append({"name": m.name, "step": m.step, "kind": m.kind, "state": "committed",
                     "tags": by_target.get(m.name, []), "metrics": dict(m.metrics),
                     "bytes": m.bytes, "committed_at": m.committed_at,
                     "age_s": max(0.0, now - m.committed_at), "latest": m.name == latest,
                     "verified": verified.get(m.name)})
    for name in uncommitted:
        files = storage.list_files(name)
        modified = storage.modified(name)
        rows.append({"name": name, "step": parse_step_dir(name), "kind": None,
                     "state": "uncommitted", "tags": by_target.get(name, []), "metrics": {},
                     "bytes": sum(files.values()), "committed_at": None,
                     "age_s": None if modified is None else max(0.0, now - modified),
                     "latest": name == latest})
    for name, q in scan.quarantined.items():
        rows.append({"name": name, "step": q.step, "kind": q.marker.kind, "state": "quarantined",
                     "tags": by_target.get(name, []), "metrics": dict(q.marker.metrics),
                     "bytes": q.marker.bytes, "committed_at": q.marker.committed_at or None,
                     "age_s": max(0.0, now - q.quarantined_at), "latest": name == latest,
                     "reason": q.reason})
    for name, error in corrupt.items():
        rows.append({"name": name, "step": parse_step_dir(name), "kind": None,
                     "state": "corrupt marker", "tags": by_target.get(name, []), "metrics": {},
                     "bytes": sum(storage.list_files(name).values()), "committed_at": None,
                     "age_s": None, "latest": name == latest, "error": str(error)})
    rows.sort(key=lambda r: (r["step"], r["committed_at"] or 0.0))
    dangling = {t: target for t, target in tags.items()
                if target not in {m.name for m in markers}}
    lease = read_lease(storage)
    lease_doc = None if lease is None else {**dataclasses.asdict(lease), "fresh": lease.fresh(now),
                                            "holder": lease.describe()}
    return {"root": storage.url(), "latest": latest, "tags": tags, "dangling_tags": dangling,
            "lease": lease_doc, "checkpoints": rows}


def list_tiers(durable: Storage, local: Storage, now: float | None = None, *,
               memory: Storage | None = None) -> dict[str, Any]:
    """:func:`list_root` of a tiered job's durable root, with the checkpoints of its local
    tier (and ``memory`` tier: needs a Ray connection) merged in: each row's ``tiers``
    says which tiers hold it and in what state (``committed``; ``writing`` in the local
    tier, ``copying`` in the others: a step directory without its marker, a save or a
    copy in flight or cut short)."""
    doc = list_root(durable, now)
    rows = {r["name"]: r for r in doc["checkpoints"]}
    for r in rows.values():
        r["tiers"] = {"durable": "committed" if r["state"] == "committed" else "copying"}
    for tier, storage, partial in (("local", local, "writing"), ("memory", memory, "copying")):
        if storage is None:
            continue
        tier_doc = list_root(storage, now)
        for r in tier_doc["checkpoints"]:
            state = "committed" if r["state"] == "committed" else partial
            if r["name"] in rows:
                rows[r["name"]]["tiers"] = {tier: state, **rows[r["name"]]["tiers"]}
            else:
                rows[r["name"]] = {**r, "latest": False, "tiers": {tier: state}}
                if r["state"] == "committed":
                    rows[r["name"]]["state"] = f"committed ({tier} tier only)"
        doc[tier] = {"root": tier_doc["root"], "latest": tier_doc["latest"]}
    for r in rows.values():  # fastest tier first
        r["tiers"] = {t: r["tiers"][t] for t in ("memory", "local", "durable") if t in r["tiers"]}
    doc["checkpoints"] = sorted(rows.values(), key=lambda r: (r["step"], r["committed_at"] or 0.0))
    return doc


# ---- inspect ----------------------------------------------------------------------------------

def inspect_checkpoint(ck: VerifiedCheckpoint, *, tensors: bool = True) -> dict[str, Any]:
    from raycheckpoint.export import RoleReader  # torch: only when tensors are described

    roles = {}
    for role, layout in sorted(ck.manifest.roles.items()):
        reader = RoleReader(ck, role)
        entry: dict[str, Any] = {
            "world_size": layout.world_size, "dcp_dir": layout.dcp_dir, "files": len(reader.files),
            "bytes": reader.bytes, "identity": layout.identity,
            "stored_in": None if layout.dcp_dir.startswith(ck.name + "/")
            else layout.dcp_dir.split("/")[0],
            "assets": sorted(reader.assets())}
        if tensors and reader.has_tensors:
            try:
                entry["tensors"] = [{"name": t.name, "shape": list(t.shape),
                                     "dtype": str(t.dtype).removeprefix("torch."),
                                     "chunks": t.chunks} for t in reader.tensors()]
                entry["other_items"] = reader.other_items()
            except EncryptionKeyError as e:
                entry["tensors"], entry["note"] = [], f"tensors not listed: {e}"
        roles[role] = entry
    ts = dict(ck.trainer_state)
    if "rng" in ts:
        ts["rng"] = "<saved: " + ", ".join(sorted(ts["rng"])) + ">"
    return {"name": ck.name, "root": ck.storage.url(), "step": ck.step, "kind": ck.kind,
            "tag": ck.marker.tag, "committed_at": ck.marker.committed_at,
            "encryption": ck.manifest.encryption,
            "bytes": ck.marker.bytes, "files": len(ck.manifest.files), "version": ck.version,
            "roles": roles, "trainer_state": ts}


# ---- verify -----------------------------------------------------------------------------------

def verify(ref: str, options: dict[str, Any] | None = None, *, step: int | None = None,
           tag: str | None = None, on_total: Callable[[int], None] | None = None,
           progress: Callable[[int], None] | None = None, key: str | None = None
           ) -> dict[str, Any]:
    """Verify one checkpoint, or (a bare root) every committed checkpoint and the caches.

    ``key`` (an ``env:``/``file:`` reference): an encrypted checkpoint's authenticity is
    checked too (its marker's MAC, crypto.py); without it, checksums only (a note says so).
    Returns ``{"ok": bool, "checkpoints": [{"name", "ok", "error"?...}], "problems": [...]}``;
    never raises for a corrupt checkpoint (that is a result), only for a bad reference.
    """
    whole_root = not is_checkpoint_dir(ref) and step is None and tag is None
    if whole_root:
        storage = open_root(ref, options, key=key)
        markers, _, corrupt = catalog.scan_all(storage)
        if not markers and not corrupt:
            raise CheckpointNotFoundError(f"no committed checkpoint under {storage.url()}", ref=ref)
        names = sorted([m.name for m in markers] + list(corrupt),
                       key=lambda n: (parse_step_dir(n), n))
    else:
        storage, candidates = locate_ref(ref, options, step=step, tag=tag, key=key)
        names = candidates[:1]
    plans = []
    for name in names:
        try:
            ck = open_verified(storage, name)
            plans.append((name, ck, None))
        except RayCheckpointError as e:
            plans.append((name, None, e))
    if on_total is not None:
        on_total(sum(ck.manifest.total_bytes for _, ck, _ in plans if ck is not None))
    results, problems = [], []
    for name, ck, error in plans:
        entry: dict[str, Any] = {"name": name}
        if ck is not None:
            entry.update(summary(ck))
            try:
                verify_files(storage, ck.manifest.files, progress)
                check_role_metadata(storage, ck.manifest.files)  # a re-sealed forgery
                if hf_export.verify_beside(storage, name) is not None:
                    entry["hf_export"] = hf_export.export_dir(name)
            except RayCheckpointError as e:
                error = e
        entry["ok"] = error is None
        if error is not None:
            entry["error"] = str(error)
            entry["path"] = getattr(error, "path", None)
        results.append(entry)
    unchecked = [n for n, ck, _ in plans if ck is not None and ck.manifest.encryption
                 and storage.cipher is None]
    if unchecked:
        problems.append(f"{', '.join(unchecked)}: encrypted; checksums verified, authenticity "
                        "not checked (pass --encryption-key to check it)")
    if whole_root:
        markers, _ = catalog.scan(storage)
        want = catalog.expected_latest(markers)
        have = catalog.read_latest(storage)
        if want != have:
            problems.append(f"LATEST points to {have}, the newest committed full checkpoint is "
                            f"{want} (`raycheckpoint gc` repairs it)")
        doc = catalog.read_catalog(storage)
        if doc != catalog.catalog_doc(markers, catalog.read_tags(storage),
                                      catalog.read_verification(storage)):
            problems.append(f"{CATALOG} is stale or unreadable (`raycheckpoint gc` rebuilds it)")
    ok = all(r["ok"] for r in results)
    return {"root": storage.url(), "ok": ok, "checkpoints": results, "problems": problems}


# ---- gc ---------------------------------------------------------------------------------------

def recorded_retention(storage: Storage) -> dict[str, Any] | None:
    """The retention rules the job recorded in its newest readable checkpoint."""
    markers, _ = catalog.scan(storage)
    for m in sorted(markers, key=catalog.order_key, reverse=True):
        try:
            ck = open_verified(storage, m.name)
        except RayCheckpointError:
            continue
        if isinstance(ck.trainer_state.get("retention"), dict):
            return {k: ck.trainer_state["retention"].get(k) for k in RetentionRules.option_names()}
    return None


def gc(root: str, options: dict[str, Any] | None = None, *, dry_run: bool = False,
       leftover_grace_s: float = 3600.0, overrides: dict[str, Any] | None = None,
       force: bool = False) -> dict[str, Any]:
    """Apply the retention rules (the job's recorded ones, then ``overrides``), collect
    leftovers and remove superseded quarantined checkpoints: the coordinator's own
    :class:`~raycheckpoint.protocol.collect.Collector`.
    Refused while a job holds the root's lease (its coordinator applies retention
    itself) unless ``force``."""
    storage = open_root(root, options)
    lease = read_lease(storage)
    if lease is not None and lease.fresh() and not dry_run and not force:
        raise LeaseHeldError(f"{storage.url()} is in use by {lease.describe()}; its coordinator "
                             "applies retention after every commit. Use --dry-run to look, or "
                             "--force to collect anyway.", holder=lease.job_name)
    recorded = recorded_retention(storage)
    rules = {**(recorded or {}), **{k: v for k, v in (overrides or {}).items() if v is not None}}
    policy = RetentionPolicy(**{k: v for k, v in rules.items() if v is not None})
    report = Collector(RootState(storage), policy).recover(dry_run=dry_run, grace_s=leftover_grace_s,
                                                           quarantined=True)
    report.update(dry_run=dry_run, root=storage.url(), rules=rules,
                  rules_source="recorded by the job" if recorded else "command line only",
                  leftover_grace_s=leftover_grace_s)
    return report


# ---- tags -------------------------------------------------------------------------------------

def _rewrite_catalog(storage: Storage) -> None:
    root = RootState(storage)
    root.sync()
    root.write_catalog()


def tag(ref: str, name: str, options: dict[str, Any] | None = None, *, step: int | None = None,
        source_tag: str | None = None, force: bool = False) -> dict[str, Any]:
    validate_tag(name)
    storage, names = locate_ref(ref, options, step=step, tag=source_tag)
    target = names[0]
    existing = catalog.read_tags(storage).get(name)
    if existing is not None and existing != target and not force:
        raise ValueError(f"tag {name!r} already points to {existing}; pass --force to move it")
    catalog.write_tag(storage, name, target)
    _rewrite_catalog(storage)
    return {"root": storage.url(), "tag": name, "checkpoint": target, "previous": existing}


def untag(root: str, name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    storage = open_root(root, options)
    tags = catalog.read_tags(storage)
    if name not in tags:
        raise CheckpointNotFoundError(
            f"no tag {name!r} under {storage.url()}; tags: "
            + (", ".join(f"{t} -> {n}" for t, n in sorted(tags.items())) or "none"), ref=name)
    storage.delete(tag_path(name))
    _rewrite_catalog(storage)
    return {"root": storage.url(), "tag": name, "checkpoint": tags[name]}


# ---- diff -------------------------------------------------------------------------------------

def diff(ck: VerifiedCheckpoint, job: dict[str, Any], *, allow_reshard: bool | None = None
         ) -> dict[str, Any]:
    """What would block a strict resume of ``ck`` by the job described by ``job``:
    ``{"config_fingerprint": {...}, "world_sizes": {...}?, "allow_reshard": bool?}``."""
    if "config_fingerprint" not in job:
        raise ValueError("the job description has no 'config_fingerprint'")
    reshard = allow_reshard if allow_reshard is not None else bool(job.get("allow_reshard", True))
    world_sizes = dict(job.get("world_sizes") or {})
    diffs = resume_differences(ck, job["config_fingerprint"], world_sizes, allow_reshard=reshard)
    blocking = [{"key": k, "saved": a, "now": b} for k, a, b in diffs]
    if ck.kind == "light":
        blocking.insert(0, {"key": "kind", "saved": "light", "now": "full",
                            "note": "a light checkpoint cannot resume training strictly"})
    missing = sorted(set(world_sizes) - set(ck.manifest.roles))
    for role in missing:
        blocking.append({"key": f"role.{role}", "saved": None, "now": world_sizes[role],
                         "note": "the checkpoint holds no state for this role"})
    return {"checkpoint": ck.name, "step": ck.step, "blocking": blocking,
            "resumable": not blocking, "allow_reshard": reshard}

