"""Every name and path of a job's root: nothing else spells them.

Layout of one job root (DESIGN section 3), paths relative to the root as
:class:`~raycheckpoint.storage.Storage` takes them::

    LEASE  LATEST  latest  catalog.json  verification.json  tags/<tag>
    step_00001000/ CLAIM COMMITTED version.json manifest.msgpack trainer_state.json
                   [rollout_state.json: an asynchronous job's, encrypted like the data]
                   rng/<role>/rank_<r>.msgpack  <role>/  (DCP directory per role)
                   assets/<role>/<file>  (e.g. a Hugging Face config.json and tokenizer
                                          files, written by rank 0 for export)
    step_00001000.3f9a0c2b71de/   a later save of the same step (see below)

One directory per save attempt.  A save's first choice of name is ``step_<step>``
(``step_<step>_full`` where a light checkpoint of the same state holds that name); it
takes it only by creating its ``CLAIM`` exclusively.  Where that name was ever handed
to another attempt (committed, quarantined, aborted, or a tombstone of one: see
:mod:`~raycheckpoint.protocol.collect`), the save takes ``<first choice>.<save id>``,
a name no other attempt ever had.  So every file a save writes lies under a directory
that belongs to that save alone: a writer of a dead job still inside a write can never
change a checkpoint another save commits.

A committed checkpoint that a job passed over (damaged, failed verification) or
superseded (a new save of its step after a resume from an older one) is quarantined:
its ``COMMITTED`` is replaced by ``QUARANTINED`` (the marker, the reason and when), so
nothing reads it as committed any more, and ``raycheckpoint gc`` removes it once a
newer checkpoint holds its step or a later one.

The root-level names are constants; a checkpoint's paths come from one
:class:`CheckpointPaths` (step directory name, role, rank -> path).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

LEASE = "LEASE"
IDENTITY = "IDENTITY"  # a root's random identity, made once: a wiped root gets a new one
LATEST = "LATEST"
LATEST_LINK = "latest"
CATALOG = "catalog.json"
VERIFICATION = "verification.json"  # background verification results, by checkpoint
TAGS_DIR = "tags"
COMMITTED = "COMMITTED"
CLAIM = "CLAIM"  # created exclusively by the save that takes a step directory's name
QUARANTINED = "QUARANTINED"  # a committed checkpoint set aside: its marker, and why
VERSION = "version.json"
MANIFEST = "manifest.msgpack"
TRAINER_STATE = "trainer_state.json"
ROLLOUT_STATE = "rollout_state.json"  # an asynchronous job's rollout side, encrypted
RNG_DIR = "rng"
ASSETS_DIR = "assets"
DCP_METADATA = ".metadata"  # torch DCP's own metadata file in a role's directory

_STEP_DIR = re.compile(r"^step_(\d{8,})(_full)?(\.[0-9a-f]{12})?$")
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def step_dir_name(step: int, *, upgraded: bool = False) -> str:
    """``step_00001000``; ``step_00001000_full`` when a light one already holds that step."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}" + ("_full" if upgraded else "")


def attempt_dir_name(first_choice: str, save_id: str) -> str:
    """The name a save takes when its first choice was ever another attempt's."""
    name = f"{first_choice}.{save_id}"
    if parse_step_dir(name) is None:
        raise ValueError(f"not a step directory name with a save id: {name!r}")
    return name


def first_choice(name: str) -> str:
    """``step_00000008`` of ``step_00000008.<save id>`` (a name that is its own first
    choice is returned as it is)."""
    m = _STEP_DIR.match(name)
    return name if m is None or m.group(3) is None else name[:m.start(3)]


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def validate_tag(tag: str) -> str:
    if not _TAG.match(tag) or parse_step_dir(tag) is not None or tag in ("latest", "auto"):
        raise ValueError(
            f"invalid tag {tag!r}: use 1-128 characters of letters, digits, '.', '_', '+', '-', "
            "starting with a letter or digit, and not 'latest', 'auto' or a step directory name")
    return tag


def tag_path(tag: str) -> str:
    """The pointer file of ``tag``."""
    return f"{TAGS_DIR}/{tag}"


def rng_file(role: str, rank: int) -> str:
    """A rank's extra-state file (RNG, scheduler), relative to its step directory."""
    return f"{RNG_DIR}/{role}/rank_{rank:05d}.msgpack"


def asset_file(role: str, name: str) -> str:
    """A role's asset file, relative to its step directory."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"asset names are plain file names, got {name!r}")
    return f"{ASSETS_DIR}/{role}/{name}"


def _in_step(file_name: str) -> property:
    """A property: ``file_name`` in the checkpoint's step directory."""
    return property(lambda self: f"{self.name}/{file_name}",
                    doc=f"``<step directory>/{file_name}``")


@dataclass(frozen=True)
class CheckpointPaths:
    """The paths of the checkpoint in step directory ``name``, relative to the root."""

    name: str

    committed = _in_step(COMMITTED)
    claim = _in_step(CLAIM)
    quarantined = _in_step(QUARANTINED)
    manifest = _in_step(MANIFEST)
    version = _in_step(VERSION)
    trainer_state = _in_step(TRAINER_STATE)
    rollout_state = _in_step(ROLLOUT_STATE)

    def role_dir(self, role: str) -> str:
        """The role's DCP directory."""
        return f"{self.name}/{role}"

    def rng(self, role: str, rank: int) -> str:
        return f"{self.name}/{rng_file(role, rank)}"

    def asset(self, role: str, file_name: str) -> str:
        return f"{self.name}/{asset_file(role, file_name)}"

    def assets_prefix(self, role: str) -> str:
        return f"{self.name}/{ASSETS_DIR}/{role}/"

    def holds(self, path: str) -> bool:
        """Whether ``path`` lies in this step directory (not in another one it references)."""
        return path.startswith(self.name + "/")


def dcp_metadata(dcp_dir: str) -> str:
    """DCP's ``.metadata`` in the DCP directory ``dcp_dir``."""
    return f"{dcp_dir}/{DCP_METADATA}"


def root_id(url: str) -> str:
    """A short stable id of the root at ``url``: what the job's named actors (its
    coordinator, memory holders, node agents) are called after."""
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
