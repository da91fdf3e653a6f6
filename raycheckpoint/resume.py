"""Whether a job may resume a checkpoint: its config fingerprint and world sizes compared.

A checkpoint's ``trainer_state.json`` records the job's config fingerprint (model path,
algorithm, GRPO group size, KL settings, dataset fingerprint: whatever the driver puts
in it) and the world size of each role.  :func:`resume_differences` lists everything
that blocks a strict resume by another job; :func:`preflight` runs that check before any
worker starts (the RL driver calls it, ``raycheckpoint diff`` shows it).
:class:`ResumeReport` collects what a load checked, loaded and skipped (what
``CheckpointConfig.debug`` prints).  Free of Ray and torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from raycheckpoint.errors import ConfigMismatchError, IntegrityError, LightCheckpointError
from raycheckpoint.integrity.crypto import check_key
from raycheckpoint.protocol.candidates import Tier, first_that_opens, resume_candidates
from raycheckpoint.protocol.checkpoint import VerifiedCheckpoint, open_verified
from raycheckpoint.protocol.refs import locate
from raycheckpoint.storage import Storage


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# A fingerprint's entry naming, for keys a job added in a later release, the value their
# absence stands for: a checkpoint written before a key existed compares as if it held that
# value (``{ABSENT: {"async.enable": False}}``), so adding a key does not refuse it.
ABSENT = "absent_means"


def config_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every key whose value differs, as ``(key, saved, current)``; missing shows as None,
    and compares as the value either fingerprint's :data:`ABSENT` entry gives it."""
    absent = {**(saved.get(ABSENT) or {}), **(current.get(ABSENT) or {})}
    a = flatten({k: v for k, v in saved.items() if k != ABSENT})
    b = flatten({k: v for k, v in current.items() if k != ABSENT})
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
            if a.get(k, absent.get(k)) != b.get(k, absent.get(k))]


def resume_differences(ck: VerifiedCheckpoint, fingerprint: dict[str, Any],
                       world_sizes: dict[str, int], *, allow_reshard: bool) -> list[tuple[str, Any, Any]]:
    """Everything that blocks a strict resume of ``ck`` by a job with this fingerprint."""
    diffs = config_diff(ck.trainer_state.get("config_fingerprint") or {}, fingerprint)
    if not allow_reshard:
        diffs += [(f"world_size.{role}", layout.world_size, world_sizes[role])
                  for role, layout in sorted(ck.manifest.roles.items())
                  if role in world_sizes and layout.world_size != world_sizes[role]]
    return diffs


def format_differences(name: str, diffs: list[tuple[str, Any, Any]]) -> str:
    text = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, a, b in diffs)
    return (f"config of {name} differs from this job's in {len(diffs)} key(s): {text}. "
            "Resume with the same config, or pass strict=False to load anyway.")


def preflight(tiers: list[Tier] | Storage, ref: str | int, fingerprint: dict[str, Any],
              world_sizes: dict[str, int], *, allow_reshard: bool,
              cipher: Any = None) -> str | None:
    """Before any worker starts: refuse a strict resume that ``load_checkpoint`` would refuse.

    ``tiers``: where the job reads checkpoints, fastest first (a single root may be given
    as its Storage).  It walks exactly the candidates the load walks
    (:mod:`~raycheckpoint.protocol.candidates`: for ``"auto"``, every committed full
    checkpoint of every tier, newest first, passing over what fails background
    verification, has an unreadable marker, or fails to open verified), and checks the
    first that opens as the load would before any worker reads it: its key, that it is
    full (named references), that it holds every role, its config and world sizes.
    Returns its name, or None when ``"auto"`` finds nothing.  Raises
    ConfigMismatchError listing every difference; CheckpointNotFoundError when no
    candidate verifies.
    """
    if isinstance(tiers, Storage):
        tiers = [Tier(tiers)]
    # as the load does: a path is resolved against the root the job commits to (a tiered
    # job's local tier), with the job's storage options (its durable root's, the last)
    home = next((t for t in tiers if t.label == "local tier"), tiers[-1])
    storage, ref = locate(home.storage, ref, tiers[-1].storage.options)
    if storage is not home.storage:  # a path into another root
        tiers = [Tier(storage, "root of the path given")]

    def attempt(name: str, tier: Tier) -> str:
        ck = open_verified(tier.storage, name)
        check_key(ck.manifest.encryption, cipher, name)
        if ck.kind == "light":
            raise LightCheckpointError(f"{name} is a light checkpoint: it cannot resume "
                                       "training (no optimizer, data-loader or RNG state)",
                                       name=name)
        diffs = resume_differences(ck, fingerprint, world_sizes, allow_reshard=allow_reshard)
        if diffs:  # before the roles, as the load: a changed config says why a role is missing
            raise ConfigMismatchError(format_differences(ck.name, diffs), differences=diffs)
        missing_roles = sorted(set(world_sizes) - set(ck.manifest.roles))
        if missing_roles:
            raise IntegrityError(f"{name} holds no state for role(s) {missing_roles} (it has "
                                 f"{sorted(ck.manifest.roles)})", path=name)
        return ck.name

    return first_that_opens(resume_candidates(tiers, ref), attempt)


class ResumeReport:
    """What one load of checkpoint ``ck`` checked, loaded and skipped, as printable lines.

    ``passed_over``: newer checkpoints ``auto`` did not take, with the reason.
    """

    def __init__(self, ck: VerifiedCheckpoint, passed_over: Iterable[str] = ()) -> None:
        self.ck = ck
        self.passed_over = list(passed_over)
        self.checks = ["COMMITTED marker, manifest and version.json read and checked"]
        if ck.manifest.encryption:
            self.checks.append("the job's key is the checkpoint's (key id matches)")
        self.notes: list[str] = []

    def check(self, text: str) -> None:
        self.checks.append(text)

    def verified(self, how: str, files: Mapping[str, Any]) -> None:
        if files:
            size = sum(e.size for e in files.values())
            self.checks.append(f"{len(files)} file(s), {size / 1e6:.2f} MB, verified {how}")

    def loaded(self, text: str) -> None:
        self.notes.append(text)

    def lines(self, groups: Mapping[str, list[Any]], *, weights_only: bool, result: Any) -> list[str]:
        ck = self.ck
        out = [f"[raycheckpoint] resume report: {ck.name} (step {ck.step}, {ck.kind}, epoch "
               f"{result.epoch}) from {ck.storage.url()}"]
        out += [f"  passed over: {p}" for p in self.passed_over]
        out += [f"  check: {c}" for c in self.checks]
        what = "model weights" if weights_only else "model, optimizer and rank state"
        for role, workers in groups.items():
            layout = ck.manifest.roles.get(role)
            if layout is None:
                out.append(f"  loaded {role}: nothing (the checkpoint has no such role)")
                continue
            note = " (resharded)" if layout.world_size != len(workers) else ""
            out.append(f"  loaded {role}: {what} into {len(workers)} rank(s) from "
                       f"{layout.world_size} saved{note}")
        if not weights_only:
            out.append("  loaded driver: RNG state")
        out += [f"  loaded {n}" for n in self.notes]
        out += [f"  skipped: {s}" for s in result.skipped] or ["  skipped: nothing"]
        return out
