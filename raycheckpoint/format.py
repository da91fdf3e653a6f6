"""On-disk format: names of every file and directory, and the metadata schemas.

Layout of one job root (DESIGN section 3)::

    LEASE  LATEST  latest  catalog.json  tags/<tag>
    step_00001000/ COMMITTED version.json manifest.msgpack trainer_state.json
                   rng/<role>/rank_<r>.msgpack  <role>/  (DCP directory per role)
                   assets/<role>/<file>  (e.g. a Hugging Face config.json and tokenizer
                                          files, written by rank 0 for export)

Invariants:

* ``COMMITTED`` is written last; it holds the manifest's size and sha256, so a
  committed checkpoint's manifest, and through it every listed file, can be verified.
* The manifest lists every file of the checkpoint except itself and ``COMMITTED``,
  with size and checksum (:mod:`raycheckpoint.digest`: ``"blake3:<hex>"``, or bare sha256
  hex); paths are relative to the job root, so an entry may refer to bytes stored under
  another step directory (deduplicated frozen weights).  ``version.json``'s checksum is
  always sha256, which every release reads.

Format versions: 1 hashed every file with sha256; 2 adds BLAKE3 digests.  A checkpoint
records in ``version.json`` the oldest format whose readers can read it
(``compatible_since``): 1 when every file is sha256, 2 once any is BLAKE3, so an older
release refuses it with its upgrade path instead of calling it corrupt.
* Metadata is JSON or msgpack, never pickle.  DCP's own ``.metadata`` (a pickle) is
  listed in the manifest and verified before DCP reads it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from raycheckpoint.digest import READABLE_SINCE
from raycheckpoint.storage import FileEntry

FORMAT_VERSION = 2
COMPATIBLE_SINCE = 1  # the oldest format this library reads
BREAKING_CHANGES: list[str] = []

LEASE = "LEASE"
LATEST = "LATEST"
LATEST_LINK = "latest"
CATALOG = "catalog.json"
TAGS_DIR = "tags"
COMMITTED = "COMMITTED"
VERSION = "version.json"
MANIFEST = "manifest.msgpack"
TRAINER_STATE = "trainer_state.json"
RNG_DIR = "rng"
ASSETS_DIR = "assets"
DCP_METADATA = ".metadata"

KINDS = ("full", "light")
_STEP_DIR = re.compile(r"^step_(\d{8,})(_full)?$")
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def step_dir_name(step: int, *, upgraded: bool = False) -> str:
    """``step_00001000``; ``step_00001000_full`` when a light one already holds that step."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}" + ("_full" if upgraded else "")


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def validate_tag(tag: str) -> str:
    if not _TAG.match(tag) or parse_step_dir(tag) is not None or tag in ("latest", "auto"):
        raise ValueError(
            f"invalid tag {tag!r}: use 1-128 characters of letters, digits, '.', '_', '+', '-', "
            "starting with a letter or digit, and not 'latest', 'auto' or a step directory name")
    return tag


def rng_file(role: str, rank: int) -> str:
    return f"{RNG_DIR}/{role}/rank_{rank:05d}.msgpack"


def asset_file(role: str, name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"asset names are plain file names, got {name!r}")
    return f"{ASSETS_DIR}/{role}/{name}"


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def version_info(files: Iterable[FileEntry] = ()) -> dict[str, Any]:
    """``version.json`` of a checkpoint holding ``files``: readable from the oldest format
    whose readers know every checksum algorithm among them."""
    from raycheckpoint import __version__

    since = max((READABLE_SINCE[f.algorithm] for f in files), default=1)
    return {"format_version": FORMAT_VERSION, "compatible_since": since,
            "breaking_changes": list(BREAKING_CHANGES), "library_version": __version__}


@dataclass
class RoleLayout:
    """Where one role's shards live and how they were sharded."""

    world_size: int
    dcp_dir: str  # relative to root
    ranks: dict[int, list[str]] = field(default_factory=dict)  # rank -> files it wrote
    identity: str | None = None  # frozen roles: hash of the weights, for reuse by reference

    @property
    def files(self) -> list[str]:
        return sorted({f for files in self.ranks.values() for f in files})


@dataclass
class Manifest:
    name: str
    step: int
    kind: str
    files: dict[str, FileEntry]
    roles: dict[str, RoleLayout]
    created_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    # None, or {"algorithm", "key_id", "chunk_bytes"}: the data files are encrypted
    encryption: dict[str, Any] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_bytes(self) -> bytes:
        return pack({
            "name": self.name, "step": self.step, "kind": self.kind,
            "created_at": self.created_at, "format_version": self.format_version,
            "files": [[e.path, e.size, e.digest] for e in self.files.values()],
            "roles": {r: asdict(layout) for r, layout in self.roles.items()},
            **({"encryption": self.encryption} if self.encryption else {}),
        })

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        d = unpack(data)
        return cls(
            name=d["name"], step=d["step"], kind=d["kind"], created_at=d["created_at"],
            format_version=d["format_version"],
            files={p: FileEntry(p, s, h) for p, s, h in d["files"]},
            roles={r: RoleLayout(world_size=v["world_size"], dcp_dir=v["dcp_dir"],
                                 ranks={int(k): list(f) for k, f in v["ranks"].items()},
                                 identity=v.get("identity"))
                   for r, v in d["roles"].items()},
            encryption=d.get("encryption"),
        )


@dataclass
class Marker:
    """Content of ``COMMITTED``: enough to rebuild the catalog without other reads."""

    name: str
    step: int
    kind: str
    manifest_size: int
    manifest_sha256: str
    bytes: int
    metrics: dict[str, float] = field(default_factory=dict)
    tag: str | None = None
    committed_at: float = field(default_factory=time.time)

    def to_bytes(self) -> bytes:
        return json_bytes(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> Marker:
        d = json.loads(data)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def to_catalog_entry(self) -> dict[str, Any]:
        return asdict(self)
