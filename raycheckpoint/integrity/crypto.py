"""Encryption at rest: AES-256-GCM per file, streamed in chunks (``cryptography``).

The key comes from ``checkpoint.encryption_key``: ``env:NAME`` (a variable holding the key
as 64 hex digits or base64) or ``file:PATH`` (32 raw bytes, or the same text forms); a
literal key in a config is refused.  Only a key id (a hash of the key) is stored: in the
manifest's ``encryption`` entry, next to the algorithm and chunk size.

What is encrypted: the tensor files of every role (DCP shards and their ``.metadata``)
and the per-rank state (RNG, scheduler).  Left in the clear so a root can be listed,
verified and resumed-checked without the key: markers, manifest, version, trainer state,
catalog, pointers and assets.  The manifest's checksum is over the stored (encrypted)
bytes, so ``raycheckpoint verify`` needs no key.

File format (``.enc`` framing inside the usual file names)::

    magic "RCKPTENC1" | chunk size (u32 BE) | 8-byte random file nonce
    chunk 0 ciphertext + 16-byte tag | chunk 1 ... | last chunk (maybe empty)

Chunk ``i`` is encrypted with nonce = file nonce || i (u32 BE) and associated data =
path || i || last-flag, so a chunk cannot be moved, reordered, dropped or the file
truncated or renamed without the authentication failing.

Authenticity (DESIGN section 8).  Encryption alone would not stop someone who can write
the root but has no key from publishing a checkpoint: plaintext shards, a manifest
without ``encryption``, a trainer state of their choosing, each re-sealed with fresh
checksums.  So with a key, ``COMMITTED`` carries ``mac``: HMAC-SHA256, keyed with
``HKDF-SHA256(key, info=`` :data:`MAC_INFO` ``)`` (never the encryption key itself), over
the canonical JSON of the marker's fields :data:`MARKER_MAC_FIELDS` (sorted keys, no
spaces, after a JSON round trip; prefixed with :data:`MAC_INFO`).  Those fields hold the
checkpoint's name (a marker cannot be moved to another step directory) and the
manifest's size and sha256, and the manifest lists every file with its checksum and the
key id: the whole checkpoint is authenticated through the marker.  The tag is not
covered: it is a label (the tag pointers, not the markers, resolve tags), and the memory
tier drops it from the markers it holds; so a marker stays valid when replicated, byte
for byte or without its tag.

With a key configured, a reader (:func:`check_marker`, from ``open_verified``: resume,
``auto``, explicit loads, ``raycheckpoint verify --encryption-key``) refuses, with an
:class:`AuthenticationError` (an IntegrityError: ``auto`` passes the checkpoint over)
naming the file: a manifest without ``encryption`` or with another key id, a marker
without ``mac`` (also one written before markers were authenticated: ``raycheckpoint
reseal`` vouches for such a checkpoint, :mod:`~raycheckpoint.protocol.reseal`) or with a
wrong one; and
:meth:`~raycheckpoint.storage.base.Storage.decrypted` refuses a data file read without
the header.  Without a key an encrypted root is read as before: checksums catch
accidents, not forgery, and ``raycheckpoint verify`` says authenticity was not checked.
Unencrypted roots have no ``mac``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raycheckpoint.errors import IntegrityError, RayCheckpointError

ALGORITHM = "AES-256-GCM"
MAGIC = b"RCKPTENC1"
CHUNK_BYTES = 4 << 20
TAG_BYTES = 16
HEADER = struct.Struct(">9sI8s")
# the HKDF info of the marker's MAC key, and the prefix of what the MAC covers
MAC_INFO = b"raycheckpoint COMMITTED hmac-sha256 v1"
# the fields of COMMITTED the MAC covers (all but ``tag`` and ``mac`` itself)
MARKER_MAC_FIELDS = ("name", "step", "kind", "manifest_size", "manifest_sha256", "bytes",
                     "metrics", "committed_at")
# what to do with an encrypted checkpoint whose marker has no MAC (written before markers
# were authenticated)
RESEAL = ("vouch for it with `raycheckpoint reseal ROOT/{name} --encryption-key KEY`, which "
          "checks every encrypted file of it against the key and then seals its marker")


class EncryptionKeyError(RayCheckpointError, ValueError):
    """The key is missing, malformed, or not the one a checkpoint was encrypted with."""


class AuthenticationError(EncryptionKeyError, IntegrityError):
    """With a key configured: a checkpoint or file that the key does not vouch for (a
    plaintext data file, a manifest without the key's id, a marker without or with a
    wrong MAC).  An IntegrityError, so ``auto`` passes the checkpoint over; ``path``
    names the file."""


def load_key(reference: str) -> bytes:
    """The 32-byte key an ``env:NAME`` or ``file:PATH`` reference points to."""
    kind, _, where = reference.partition(":")
    if kind == "env":
        if where not in os.environ:
            raise EncryptionKeyError(f"encryption_key {reference!r}: environment variable {where} "
                                     "is not set")
        raw = os.environ[where].encode()
    elif kind == "file":
        try:
            with open(os.path.expanduser(where), "rb") as f:
                raw = f.read()
        except OSError as e:
            raise EncryptionKeyError(f"encryption_key {reference!r}: cannot read {where}: "
                                     f"{e.strerror}") from None
    else:
        raise EncryptionKeyError("encryption_key must be 'env:NAME' or 'file:PATH'; a literal "
                                 "secret in a config is refused")
    if len(raw) == 32:
        return raw
    text = raw.strip()
    for decode in (binascii.unhexlify, base64.b64decode):
        try:
            key = decode(text)
        except (binascii.Error, ValueError):
            continue
        if len(key) == 32:
            return key
    raise EncryptionKeyError(f"encryption_key {reference!r}: expected a 256-bit key (32 raw "
                             "bytes, 64 hex digits or base64), got something else")


def key_id(key: bytes) -> str:
    return hashlib.sha256(b"raycheckpoint key id\0" + key).hexdigest()[:16]


@dataclass(frozen=True)
class FileCipher:
    """Encrypts and decrypts checkpoint files with one key."""

    key: bytes = field(repr=False)
    chunk_bytes: int = CHUNK_BYTES

    @property
    def key_id(self) -> str:
        return key_id(self.key)

    def describe(self) -> dict[str, Any]:
        return {"algorithm": ALGORITHM, "key_id": self.key_id, "chunk_bytes": self.chunk_bytes}

    def _mac_key(self) -> bytes:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=MAC_INFO).derive(self.key)

    def marker_mac(self, marker: Mapping[str, Any]) -> str:
        """The ``mac`` of a ``COMMITTED`` marker (its fields as a mapping; see the module doc)."""
        return hmac.new(self._mac_key(), _marker_message(marker), hashlib.sha256).hexdigest()

    def authentic(self, marker: Mapping[str, Any]) -> bool:
        """Whether ``marker`` (its fields, ``mac`` among them) was sealed with this key."""
        mac = marker.get("mac")
        if not isinstance(mac, str):
            return False
        try:
            expected = self.marker_mac(marker)
        except (KeyError, TypeError, ValueError):
            return False
        return hmac.compare_digest(mac, expected)

    def _aead(self):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        return AESGCM(self.key)

    @staticmethod
    def _aad(rel: str, index: int, last: bool) -> bytes:
        return rel.encode() + struct.pack(">I?", index, last)

    def encryptor(self, rel: str) -> ChunkEncryptor:
        return ChunkEncryptor(self, rel)

    def decrypt(self, rel: str, data: bytes | memoryview) -> bytes:
        """The plaintext of a whole encrypted file; IntegrityError if it was altered."""
        nonce, chunk, body = self._header(rel, data)
        aead = self._aead()
        step = chunk + TAG_BYTES
        count = max(1, -(-len(body) // step))
        out = []
        for i in range(count):
            piece = bytes(body[i * step:(i + 1) * step])
            out.append(self._open(aead, rel, nonce, i, piece, last=i == count - 1))
        return b"".join(out)

    def decrypt_range(self, rel: str, read: Any, size: int, start: int, end: int) -> bytes:
        """Plaintext bytes ``[start, end)`` of the encrypted file of ``size`` stored bytes,
        reading only the chunks that hold them (``read(a, b)`` returns stored bytes a..b)."""
        head = bytes(read(0, HEADER.size))
        nonce, chunk, _ = self._header(rel, head)
        step = chunk + TAG_BYTES
        count = max(1, -(-(size - HEADER.size) // step))
        first, last = start // chunk, max(start, end - 1) // chunk
        blob = bytes(read(HEADER.size + first * step, min(size, HEADER.size + (last + 1) * step)))
        aead = self._aead()
        plain = b"".join(self._open(aead, rel, nonce, i, blob[(i - first) * step:(i - first + 1) * step],
                                    last=i == count - 1) for i in range(first, last + 1))
        return plain[start - first * chunk:end - first * chunk]

    def _header(self, rel: str, data: bytes | memoryview) -> tuple[bytes, int, memoryview]:
        if len(data) < HEADER.size:
            raise IntegrityError(f"{rel}: too short to be an encrypted file", path=rel)
        magic, chunk, nonce = HEADER.unpack(bytes(data[:HEADER.size]))
        if magic != MAGIC or chunk <= 0:
            raise IntegrityError(f"{rel}: not a raycheckpoint encrypted file", path=rel)
        return nonce, chunk, memoryview(data)[HEADER.size:]

    def _open(self, aead, rel: str, nonce: bytes, index: int, piece: bytes, *, last: bool) -> bytes:
        from cryptography.exceptions import InvalidTag

        try:
            return aead.decrypt(nonce + struct.pack(">I", index), piece, self._aad(rel, index, last))
        except InvalidTag:
            raise IntegrityError(
                f"{rel}: authentication failed (chunk {index}): the file was altered, truncated "
                "or moved, or the key is wrong", path=rel) from None


class ChunkEncryptor:
    """Turns a plaintext stream into the encrypted file format, chunk by chunk."""

    def __init__(self, cipher: FileCipher, rel: str) -> None:
        self.cipher, self.rel = cipher, rel
        self._aead = cipher._aead()
        self._nonce = os.urandom(8)
        self._buf = bytearray()
        self._index = 0
        self.header = HEADER.pack(MAGIC, cipher.chunk_bytes, self._nonce)

    def _seal(self, data: bytes, last: bool) -> bytes:
        out = self._aead.encrypt(self._nonce + struct.pack(">I", self._index), data,
                                 FileCipher._aad(self.rel, self._index, last))
        self._index += 1
        return out

    def update(self, data: bytes | memoryview) -> list[bytes]:
        """Ciphertext of every chunk completed by ``data`` (the last chunk is kept back)."""
        self._buf += data
        out = []
        size = self.cipher.chunk_bytes
        # keep at least one byte back: the final chunk must be sealed with the last flag
        while len(self._buf) > size:
            out.append(self._seal(bytes(self._buf[:size]), last=False))
            del self._buf[:size]
        return out

    def finish(self) -> bytes:
        return self._seal(bytes(self._buf), last=True)


def _marker_message(marker: Mapping[str, Any]) -> bytes:
    """What a marker's MAC covers: :data:`MARKER_MAC_FIELDS`, canonical JSON."""
    doc = json.loads(json.dumps({k: marker[k] for k in MARKER_MAC_FIELDS}))
    return MAC_INFO + b"\0" + json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def check_key(encryption: dict[str, Any] | None, cipher: FileCipher | None, name: str,
              *, path: str | None = None) -> None:
    """Refuse, before reading a tensor, a checkpoint this key cannot decrypt, or (with a
    key) one not encrypted with it.  ``path``: the manifest, for the errors to name."""
    where = f"{path}: " if path else ""
    path = path or name
    if cipher is None:
        if encryption:
            raise EncryptionKeyError(
                f"{name} is encrypted ({encryption.get('algorithm')}, key id "
                f"{encryption.get('key_id')}): set checkpoint.encryption_key (or "
                "--encryption-key) to the key it was written with", name=name)
        return
    if not encryption:
        raise AuthenticationError(
            f"{where}{name} is not encrypted (its manifest has no 'encryption' entry), and "
            f"this job has an encryption key (key id {cipher.key_id}): with a key, only "
            "checkpoints encrypted and authenticated with it are read, as anyone who can write "
            "the root could have written this one. If you trust it, read it without the key",
            path=path, name=name)
    if encryption.get("key_id") != cipher.key_id:
        # not an IntegrityError: `auto` stops here rather than pass over (and quarantine)
        # every checkpoint written under another key; the person configures the right one
        raise EncryptionKeyError(
            f"{where}{name} was encrypted with key id {encryption.get('key_id')}; the "
            f"configured key has id {cipher.key_id} (wrong key): set the key it was written "
            "with", name=name)


def check_marker(cipher: FileCipher, marker: Mapping[str, Any],
                 encryption: dict[str, Any] | None, name: str, *, marker_path: str,
                 manifest_path: str) -> None:
    """With a key: refuse checkpoint ``name`` unless its manifest records this key
    (:func:`check_key`) and its marker (``marker``: the fields of ``COMMITTED``, read
    from ``marker_path``) carries this key's MAC.  AuthenticationError naming the file."""
    check_key(encryption, cipher, name, path=manifest_path)
    if not marker.get("mac"):
        raise AuthenticationError(
            f"{marker_path}: carries no authentication code, but {name} is encrypted: it was "
            "written by a raycheckpoint release that did not authenticate checkpoints, or by "
            f"someone without the key. If you trust it, {RESEAL.format(name=name)}",
            path=marker_path, name=name)
    if not cipher.authentic(marker):
        raise AuthenticationError(
            f"{marker_path}: its authentication code does not match (key id {cipher.key_id}): "
            "the marker or the manifest it vouches for was altered, re-sealed or copied from "
            "another checkpoint by someone without the key; refusing to read it",
            path=marker_path, name=name)
