"""Storage: byte-level access to one checkpoint root, and the generic fsspec backend.

``Storage(uri, ...)`` returns the backend for the URI's kind
(:mod:`~raycheckpoint.storage.registry`), as ``pathlib.Path`` returns a ``PosixPath``:
:class:`~raycheckpoint.storage.posix.LocalStorage` for local paths,
:class:`~raycheckpoint.storage.s3.S3Storage` for ``s3://``, and this class itself for any
other fsspec filesystem.  Code outside this package asks a root's
:class:`~raycheckpoint.storage.spec.Capabilities`, never its kind.

Paths are relative to the root (``step_00000010/actor/x``).  What every backend provides:

* writes through a :class:`~raycheckpoint.storage.writer.HashingWriter` (streamed
  checksum, optional encryption; :meth:`open_write`, :meth:`write_bytes`), each file's
  bytes going to a sink the backend opens (:meth:`open_sink`);
* two atomic operations, the only ones the commit protocol relies on:
  :meth:`write_pointer` (replace a small object: readers see old or new, never half) and
  :meth:`create_marker` (create a file that must not exist yet; ``FileExistsError`` if
  it does), the latter only where ``Capabilities.atomic_create`` says it is atomic
  (:mod:`~raycheckpoint.storage.atomic`).  Nothing calls ``fs.mv`` or ``fs.transaction``
  (copy + delete on object stores);
* reads (whole, ranged, streamed into a caller's buffer), listings, deletes;
* retries (:meth:`retrying`: exponential backoff with jitter, ``retries`` attempts more)
  of every operation while it fails transiently (connection drops, throttling, 5xx;
  :func:`~raycheckpoint.storage.retry.is_transient`); a full disk, a permission error or
  a missing file fails at once.  An exclusive create that finds the file recognises
  its own earlier, answered-but-lost write by its content.

This generic backend has no exclusive create: :meth:`create_marker` refuses (a
:class:`~raycheckpoint.errors.StorageCapabilityError` naming the backend), and so does
:meth:`require_atomic_create`, which a job calls before taking its lease.  A backend
with an atomic create declares ``Capabilities.atomic_create`` and overrides
:meth:`_create_once`.  Instances are not meant to cross processes; ship a
:class:`~raycheckpoint.storage.spec.StorageSpec` and ``open()`` it there.
"""

from __future__ import annotations

import errno
import logging
import posixpath
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec

from raycheckpoint._internal import faults
from raycheckpoint.integrity import digest
from raycheckpoint.storage.atomic import ExclusiveCreate
from raycheckpoint.storage.retry import is_transient
from raycheckpoint.storage.spec import Capabilities, FileEntry, StorageSpec
from raycheckpoint.storage.writer import FsspecFile, HashingWriter

logger = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_BASE_S = 0.2
RETRY_MAX_S = 5.0
# Storage.read_into's pieces
READ_STEP = 4 << 20


class Storage(ExclusiveCreate):
    """Byte-level access to one checkpoint root over fsspec (see the module doc)."""

    caps = Capabilities()  # what this backend can do (a subclass declares its own)

    def __new__(cls, *args: Any, **kwargs: Any) -> Storage:
        if cls is Storage:  # Storage(uri): the backend for the URI's kind
            from raycheckpoint.storage.registry import backend_for

            cls = backend_for(args[0] if args else kwargs["uri"])
        return super().__new__(cls)

    def __init__(self, uri: str, options: dict[str, Any] | None = None, *,
                 create: bool = True, retries: int = 5, cipher: Any = None,
                 checksum: str = digest.DEFAULT, direct_io: bool = True) -> None:
        self.uri = uri
        self.retries = retries
        self.direct_io = direct_io
        self.cipher = cipher
        self.checksum = digest.check_algorithm(checksum)
        self.retried = 0  # transient failures retried so far (for reports and tests)
        self.options = dict(options or {})
        self.fs, root = fsspec.core.url_to_fs(uri, **self._fs_options(self.options))
        self.root = root.rstrip("/") if root != "/" else root
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        if create:
            self._create_root()

    @property
    def writes_direct(self) -> bool:
        """Whether large files are written with ``O_DIRECT`` (possible here, and asked for)."""
        return self.caps.direct_io and self.direct_io

    @property
    def spec(self) -> StorageSpec:
        return StorageSpec(self.uri, self.options, self.retries, self.cipher, self.checksum,
                           self.direct_io)

    def _fs_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The options the fsspec filesystem is made with (a backend adds its defaults)."""
        return options

    def _create_root(self) -> None:
        """Make the root exist where that means anything (object stores have no directories)."""

    def retrying(self, op: str, rel: str, fn: Callable[[], T]) -> T:
        """``fn()`` (operation ``op`` on ``rel``), retried with exponential backoff and
        jitter while it fails transiently.

        Transient: connection errors, throttling and 5xx answers of object stores, and
        other I/O errors; never a missing or existing file, a permission error, a full
        disk or an injected fault.  The last error is raised as :meth:`_failure` words it,
        with a note of the attempts.
        """
        what = f"{op} {rel or '/'}"
        delay = RETRY_BASE_S
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as e:
                if attempt >= self.retries or not is_transient(e):
                    if attempt:
                        e.add_note(f"{what}: failed after {attempt + 1} attempts")
                    failure = self._failure(op, rel, e)
                    if failure is e:
                        raise
                    raise failure from e
                self.retried += 1
                logger.warning("%s: %s: %s; retry %d/%d in %.2fs", what, type(e).__name__, e,
                               attempt + 1, self.retries, delay)
                time.sleep(delay * (0.5 + random.random() / 2))
                delay = min(RETRY_MAX_S, delay * 2)
        raise AssertionError("unreachable")

    def _failure(self, op: str, rel: str, e: Exception) -> Exception:
        """The error raised to the caller when operation ``op`` on ``rel`` failed with
        ``e``: ``e`` itself here; a backend whose errors can be mute rewords them."""
        return e

    def full_path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def url(self, rel: str = "") -> str:
        """A URI other tools (torch's FileSystemReader, fsspec) can open."""
        return f"{self.protocol}://{self.full_path(rel).lstrip('/')}"

    # ---- writes -------------------------------------------------------------------------

    def open_write(self, rel: str, *, encrypt: bool = False, checksum: str | None = None,
                   direct: bool = False) -> HashingWriter:
        """A hashing writer; ``encrypt``: through the storage's cipher, when it has one;
        ``checksum``: an algorithm other than the storage's, for this file; ``direct``: a
        large file, written with ``O_DIRECT`` where allowed (see
        :class:`~raycheckpoint.storage.direct_io.DirectFile`)."""
        return HashingWriter(self, rel, encrypt=encrypt, checksum=checksum, direct=direct)

    def open_sink(self, rel: str, *, direct: bool, hasher: Any) -> Any:
        """Where a :class:`HashingWriter` puts the bytes of ``rel`` (see
        :mod:`~raycheckpoint.storage.writer` for what a sink does); ``direct`` and
        ``hasher`` concern backends that write around the page cache."""
        return FsspecFile(self.fs.open(self.full_path(rel), "wb"))

    def write_bytes(self, rel: str, data: bytes, *, encrypt: bool = False,
                    checksum: str | None = None) -> FileEntry:
        def once() -> FileEntry:
            with self.open_write(rel, encrypt=encrypt, checksum=checksum) as w:
                w.write(data)
            return w.close()

        return self.retrying("write", rel, once)

    def write_pointer(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` atomically with ``data`` (readers see old or new, never half)."""
        faults.check("storage.pointer", path=rel)
        full = self.full_path(rel)
        self.retrying("write", rel, lambda: self._replace(full, data))

    def _replace(self, full: str, data: bytes) -> None:
        self.fs.pipe_file(full, data)  # one PUT replaces an object atomically

    def symlink(self, rel: str, target: str) -> None:
        """Point ``rel`` at ``target`` (relative), replaced atomically, where the backend
        has symlinks (``Capabilities.symlinks``); nothing elsewhere."""

    # ---- reads --------------------------------------------------------------------------

    def read_bytes(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.retrying("read", rel, lambda: self._read_once(rel, start, end))

    def _read_once(self, rel: str, start: int | None, end: int | None) -> bytes:
        full = self.full_path(rel)
        if start is None and end is None:
            return self.fs.cat_file(full)
        return self.fs.cat_file(full, start=start, end=end)

    def read_into(self, rel: str, out: memoryview) -> int:
        """Read all of ``rel`` into ``out``, which is as long as the file should be.

        Returns the file's size: when it differs from ``len(out)``, ``out`` holds nothing
        meaningful and the caller decides (a manifest check raises IntegrityError).  The
        bytes go into ``out`` in :data:`READ_STEP` pieces as they arrive, with no second
        copy of the file in memory.  Retried like every read; a retry goes on from the last
        byte received, so bytes once in place are not read again.
        """
        progress = Received()
        return self.retrying("read", rel, lambda: self._read_into_once(rel, out, progress))

    def _read_into_once(self, rel: str, out: memoryview, progress: Received) -> int:
        with self.open_read(rel) as f:
            size = self._open_size(rel, f)
            if size != len(out):
                return size
            pos = progress.received
            f.seek(pos)
            while pos < size:
                n = f.readinto(out[pos:pos + READ_STEP])
                if not n:  # shorter than its size said: it changed while being read
                    raise OSError(errno.EIO, f"{self.full_path(rel)}: ended after {pos} of "
                                  f"{size} bytes")
                pos += n
                progress.received = pos
            return size

    def _open_size(self, rel: str, f: Any) -> int:
        """The size of ``rel``, open as ``f``."""
        return self.fs.size(self.full_path(rel))

    def decrypted(self, rel: str, data: bytes | bytearray | memoryview
                  ) -> bytes | bytearray | memoryview:
        """``data`` (verified stored bytes of ``rel``, a file written encrypted where the
        root has a key) as plaintext.

        With a cipher, the file must carry the encrypted format's header: a plaintext file
        where an encrypted one belongs is refused (AuthenticationError naming ``rel``), as
        anyone who can write the root could have put it there.  Without one, a plain file
        passes through and an encrypted one raises EncryptionKeyError (set the key).
        """
        from raycheckpoint.integrity.crypto import MAGIC, AuthenticationError, EncryptionKeyError

        if bytes(data[:len(MAGIC)]) != MAGIC:  # memoryview has no startswith
            if self.cipher is None:
                return data
            raise AuthenticationError(
                f"{rel}: stored in the clear, but this root is encrypted (key id "
                f"{self.cipher.key_id}) and every data file must be encrypted with its key: "
                "someone without the key put it there; refusing to read it", path=rel)
        if self.cipher is None:
            raise EncryptionKeyError(f"{rel} is encrypted: set checkpoint.encryption_key (or "
                                     "--encryption-key) to the key it was written with")
        return self.cipher.decrypt(rel, data)

    def open_read(self, rel: str) -> Any:
        return self.fs.open(self.full_path(rel), "rb")

    def exists(self, rel: str) -> bool:
        full = self.full_path(rel)

        def once() -> bool:
            self.fs.invalidate_cache(full)
            return self.fs.exists(full)

        return self.retrying("exists", rel, once)

    def size(self, rel: str) -> int:
        full = self.full_path(rel)

        def once() -> int:
            self.fs.invalidate_cache(full)
            return int(self.fs.info(full)["size"])

        return self.retrying("stat", rel, once)

    def list_dir(self, rel: str = "") -> list[str]:
        """Names of the immediate children of ``rel``; empty if it does not exist."""
        full = self.full_path(rel)

        def once() -> list[str]:
            self.fs.invalidate_cache(full)
            try:
                entries = self.fs.ls(full, detail=False)
            except FileNotFoundError:
                return []
            return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

        return self.retrying("list", rel, once)

    def _find(self, rel: str) -> dict[str, dict[str, Any]]:
        """fsspec ``find`` below ``rel`` with details (fresh on object stores); {} if absent."""
        full = self.full_path(rel)

        def once() -> dict[str, dict[str, Any]]:
            self._forget_listing(full)
            try:
                return self.fs.find(full, detail=True)
            except FileNotFoundError:
                return {}

        return self.retrying("list", rel, once)

    def _forget_listing(self, full: str) -> None:
        """Drop fsspec's cached listing of ``full`` (object stores cache them)."""
        self.fs.invalidate_cache(full)

    def list_files(self, rel: str = "") -> dict[str, int]:
        """Every file below ``rel`` (recursive) as ``{path relative to root: size}``."""
        prefix = self.root.rstrip("/") + "/" if self.root != "/" else "/"
        out = {}
        for path, info in self._find(rel).items():
            if info.get("type") == "directory":
                continue
            p = path if path.startswith("/") or not self.root.startswith("/") else "/" + path
            out[p[len(prefix):] if p.startswith(prefix) else path] = int(info.get("size") or 0)
        return out

    def modified(self, rel: str = "") -> float | None:
        """Newest modification time (epoch seconds) of any file below ``rel``; None if empty."""
        newest = None
        for info in self._find(rel).values():
            t = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
            if hasattr(t, "timestamp"):
                t = t.timestamp()
            if isinstance(t, (int, float)):
                newest = t if newest is None else max(newest, float(t))
        return newest

    def upload(self, files: dict[str, FileEntry], target: StorageSpec) -> set[str]:
        """Copy ``files`` (path -> manifest entry) to ``target`` where this backend's own
        servers can (each from where it lies), and read them back there against their
        entries; the paths so copied.  Here none: the caller copies."""
        return set()

    # ---- deletes ------------------------------------------------------------------------

    def delete(self, rel: str) -> None:
        """Delete one file; a missing file is not an error."""
        faults.check("storage.delete", path=rel)
        full = self.full_path(rel)

        def once() -> None:
            try:
                self.fs.rm_file(full)
            except FileNotFoundError:
                pass

        self.retrying("delete", rel, once)

    def delete_tree(self, rel: str) -> None:
        """Delete ``rel`` and everything below it; missing is not an error."""
        faults.check("storage.delete", path=rel)
        full = self.full_path(rel)

        def once() -> None:
            self.fs.invalidate_cache(full)
            try:
                self.fs.rm(full, recursive=True)
            except FileNotFoundError:
                pass

        self.retrying("delete", rel, once)


class Received:
    """How many bytes of a file :meth:`Storage.read_into` has put in place: where a
    retry goes on from."""

    def __init__(self) -> None:
        self.received = 0
