"""On-disk format: the metadata schemas and their encodings (names and paths: paths.py).

Invariants:

* ``COMMITTED`` (a :class:`Marker`) is written last; it holds the manifest's size and
  sha256, so a committed checkpoint's manifest, and through it every listed file, can be
  verified.
* The :class:`Manifest` lists every file of the checkpoint except itself and
  ``COMMITTED``, with size and checksum (:mod:`raycheckpoint.integrity.digest`:
  ``"blake3:<hex>"``, or bare sha256 hex); paths are relative to the job root, so an
  entry may refer to bytes stored under another step directory (deduplicated frozen
  weights).  ``version.json``'s checksum is always sha256, which every release reads.
* Metadata is JSON or msgpack, never pickle.  DCP's own ``.metadata`` (a pickle) is
  listed in the manifest and verified before DCP reads it.

Format versions: 1 hashed every file with sha256; 2 adds BLAKE3 digests.  A checkpoint
records in ``version.json`` the oldest format whose readers can read it
(``compatible_since``): 1 when every file is sha256, 2 once any is BLAKE3, so an older
release refuses it with its upgrade path instead of calling it corrupt.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from raycheckpoint._version import __version__
from raycheckpoint.errors import IntegrityError
from raycheckpoint.integrity.digest import READABLE_SINCE
from raycheckpoint.storage import FileEntry

FORMAT_VERSION = 2
COMPATIBLE_SINCE = 1  # the oldest format this library reads
BREAKING_CHANGES: list[str] = []

KINDS = ("full", "light")


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def check_relative_path(path: Any, source: str) -> str:
    """``path`` as a manifest may name it: a string relative to the job root, ``/``
    separated, with no empty, ``.`` or ``..`` segment, no leading ``/`` or ``~``, no
    backslash, drive letter, control character or URL scheme; else an IntegrityError
    naming ``source`` (the manifest is corrupt or forged)."""
    segments = path.split("/") if isinstance(path, str) else []
    if (not isinstance(path, str) or not path or "\\" in path or ":" in path
            or path.startswith("~") or any(ord(c) < 32 or ord(c) == 127 for c in path)
            or any(s in ("", ".", "..") for s in segments)):
        raise IntegrityError(f"{source}: corrupt manifest: it lists {path!r}, which is not a "
                             "plain path relative to the checkpoint root", path=source)
    return path


def version_info(files: Iterable[FileEntry] = ()) -> dict[str, Any]:
    """``version.json`` of a checkpoint holding ``files``: readable from the oldest format
    whose readers know every checksum algorithm among them."""
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
    def from_bytes(cls, data: bytes, source: str = "manifest") -> Manifest:
        """Decode a manifest; anything malformed, or a path that could leave the root (see
        :func:`check_relative_path`), is an IntegrityError naming ``source`` before any
        path is opened."""
        try:
            d = unpack(data)
            manifest = cls(
                name=d["name"], step=d["step"], kind=d["kind"], created_at=d["created_at"],
                format_version=d["format_version"],
                files={p: FileEntry(p, s, h) for p, s, h in d["files"]},
                roles={r: RoleLayout(world_size=v["world_size"], dcp_dir=v["dcp_dir"],
                                     ranks={int(k): list(f) for k, f in v["ranks"].items()},
                                     identity=v.get("identity"))
                       for r, v in d["roles"].items()},
                encryption=d.get("encryption"),
            )
        except (ValueError, KeyError, TypeError, AttributeError,
                msgpack.exceptions.ExtraData) as e:
            raise IntegrityError(f"{source}: corrupt manifest ({type(e).__name__}: {e})",
                                 path=source) from None
        for path in [*manifest.files, *(layout.dcp_dir for layout in manifest.roles.values()),
                     *(f for layout in manifest.roles.values() for f in layout.files)]:
            check_relative_path(path, source)
        return manifest


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
    # an encrypted root's: HMAC of the other fields with a key derived from the job's key
    # (integrity/crypto.py); absent elsewhere
    mac: str | None = None

    def to_bytes(self) -> bytes:
        d = asdict(self)
        if d["mac"] is None:
            del d["mac"]
        return json_bytes(d)

    @classmethod
    def from_bytes(cls, data: bytes) -> Marker:
        d = json.loads(data)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def to_catalog_entry(self) -> dict[str, Any]:
        d = asdict(self)
        del d["mac"]
        return d


@dataclass
class Quarantine:
    """Content of ``QUARANTINED``: a committed checkpoint set aside (paths.py), its marker
    kept as it was, with why and when."""

    marker: Marker
    reason: str
    quarantined_at: float = field(default_factory=time.time)

    @property
    def name(self) -> str:
        return self.marker.name

    @property
    def step(self) -> int:
        return self.marker.step

    def to_bytes(self) -> bytes:
        return json_bytes({"marker": asdict(self.marker), "reason": self.reason,
                           "quarantined_at": self.quarantined_at})

    @classmethod
    def from_bytes(cls, data: bytes) -> Quarantine:
        d = json.loads(data)
        marker = Marker.from_bytes(json_bytes(d["marker"]))
        return cls(marker=marker, reason=str(d["reason"]),
                   quarantined_at=float(d["quarantined_at"]))

    def to_catalog_entry(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "kind": self.marker.kind,
                "reason": self.reason, "quarantined_at": self.quarantined_at}
