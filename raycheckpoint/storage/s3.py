"""S3Storage: a root in an S3 bucket (``s3://bucket/prefix``), through s3fs.

No renames (S3's rename is a copy and a delete): a pointer (``LATEST``, the catalog, a
tag) is replaced by one PUT, which S3 makes visible whole; an exclusive create
(``COMMITTED``, the lease) is one conditional PUT (``If-None-Match: *``), which the
store refuses with 412 when the key exists: recognised by the answer's code or status
(:func:`~raycheckpoint.storage.retry.is_precondition_failed`), since servers differ in
what else they send (Ceph's RADOS Gateway: no ``Condition``, an empty message).  A store
that ignores the condition (and overwrites) is refused for a job's root when the job
starts: :meth:`S3Storage._prove_atomic_create` makes a probe key twice.  An
error raised to the caller names the operation, the object's URL and the answer's
status (:meth:`S3Storage._failure`).  A file's whole body is streamed into the
caller's buffer (:meth:`S3Storage.read_into`), a retry asking for the bytes not received.
"""

from __future__ import annotations

import errno
import uuid
from typing import Any

from fsspec.asyn import sync

from raycheckpoint.storage import atomic, base
from raycheckpoint.storage.base import Received, Storage
from raycheckpoint.storage.retry import http_answer, is_precondition_failed
from raycheckpoint.storage.spec import Capabilities

# botocore's own retries of one request, when the options name none: one retry.  s3fs
# retries a dropped connection or a SlowDown itself (5 tries, 2 s of pauses in all) and
# Storage.retrying retries the whole operation; botocore's default (legacy mode, 5 tries,
# pauses doubling from up to 1 s) multiplied by both made one read of a store that is
# down take 90 s and 100 requests with storage_retries=1.
BOTOCORE_RETRIES = {"mode": "standard", "max_attempts": 2}
_ERRNO = {FileNotFoundError: errno.ENOENT, PermissionError: errno.EACCES}
PROBE_PREFIX = ".create-probe-"  # the key _prove_atomic_create makes twice, then deletes


class S3Storage(Storage):
    """A root on S3 (or a store speaking its API)."""

    caps = Capabilities(atomic_create=True)

    def _fs_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options``, with botocore's retries bounded (:data:`BOTOCORE_RETRIES`) unless
        ``config_kwargs`` names its own."""
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", BOTOCORE_RETRIES)
        return {**options, "config_kwargs": config}

    def _create_once(self, full: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(full, data, mode="create")
        except FileExistsError:
            raise
        except OSError as e:
            if is_precondition_failed(e):  # final: the key exists (ours, if a retry)
                raise FileExistsError(errno.EEXIST, f"s3://{full} exists (HTTP 412 to a "
                                      "conditional PUT)") from e
            raise

    def _prove_atomic_create(self, what: str) -> None:
        """Create a probe key with a conditional PUT, then again: a store that honours
        ``If-None-Match: *`` refuses the second (412).  One that writes it over the first
        is refused for ``what``: there two jobs could both create ``LEASE``, and a
        ``COMMITTED`` be overwritten.  The probe is deleted either way."""
        rel = f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
        full = self.full_path(rel)
        self._create_exclusive(rel, b"first " + rel.encode())
        try:
            try:
                self.retrying("create", rel, lambda: self._create_once(full, b"second"))
            except FileExistsError:
                return
            raise atomic.refusal(
                self, what, why=f"this store wrote a second conditional PUT (If-None-Match: "
                f"*) of {self.url(rel)} over the first instead of refusing it with HTTP 412: "
                "it ignores conditional writes")
        finally:
            self.retrying("delete", rel, lambda: self.fs.rm_file(full))

    def _failure(self, op: str, rel: str, e: Exception) -> Exception:
        """``e`` reworded to name the operation, the object and the store's answer: s3fs's
        message is the server's, which some servers leave empty ("PermissionError:
        None"), or only the key.  Same type and errno, so callers' ``except
        FileNotFoundError`` still hold; an error no server answered keeps its own words
        and gets a note naming the operation."""
        answer = http_answer(e)
        if isinstance(e, FileExistsError) or not isinstance(e, OSError):
            answer = None
        elif answer is None and isinstance(e, FileNotFoundError):
            answer = "not found (HTTP 404)"  # s3fs's own answer to a 404 HEAD
        if answer is None:
            e.add_note(f"S3 {op} {self.url(rel)}")
            return e
        text = f"S3 {op} {self.url(rel)} failed: {answer}"
        code = e.errno if e.errno is not None else _ERRNO.get(type(e), errno.EIO)
        try:
            failure = type(e)(code, text)
        except TypeError:  # an OSError subclass with a constructor of its own
            failure = OSError(code, text)
        failure.__notes__ = list(getattr(e, "__notes__", []))
        return failure

    def _read_into_once(self, rel: str, out: memoryview, progress: Received) -> int:
        """A GET whose body streams into ``out``: for a 60 MB object against a local S3
        server 90 ms, where ``cat_file`` (which gathers the body into one ``bytes``) took
        370 ms and ``open().readinto`` in 8 MB pieces 250 ms."""
        return sync(self.fs.loop, _read_into, self.fs, self.full_path(rel), out, progress)


async def _read_into(fs: Any, full: str, out: memoryview, progress: Received) -> int:
    """A GET of ``full`` (s3fs), its body streamed into ``out``; see
    :meth:`Storage.read_into <raycheckpoint.storage.base.Storage.read_into>`.

    Through s3fs's ``_call_s3``, which maps S3's answers to OSErrors (a missing key to
    FileNotFoundError) and retries what s3fs retries.  A body cut short raises here;
    :meth:`Storage.retrying` calls again, and the GET asks for the bytes not received.
    """
    bucket, key, version = fs.split_path(full)
    pos = progress.received
    if pos and pos == len(out):
        return pos
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key,
                             **({"VersionId": version} if version else {}),
                             **({"Range": f"bytes={pos}-"} if pos else {}))
    body = resp["Body"]
    try:
        if pos and "ContentRange" not in resp:  # a server that ignores ranges sent it all
            pos = 0
        # a ranged answer: "bytes 100-199/200"; a whole one: its length
        size = int(resp["ContentRange"].rpartition("/")[2]) if pos else int(resp["ContentLength"])
        if size != len(out):
            return size
        while pos < size:
            piece = await body.read(min(base.READ_STEP, size - pos))
            if not piece:
                raise OSError(errno.EIO, f"{full}: the response ended after {pos} of {size} bytes")
            out[pos:pos + len(piece)] = piece
            pos += len(piece)
            progress.received = pos
        return size
    finally:
        body.close()
