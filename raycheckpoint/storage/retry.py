"""Which storage errors are worth retrying (used by
:meth:`Storage.retrying <raycheckpoint.storage.base.Storage.retrying>`), and what an
object store answered (:func:`http_answer`)."""

from __future__ import annotations

import errno
from typing import NamedTuple

_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                     errno.ENOENT, errno.EEXIST, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG,
                     errno.EINVAL}
_RETRYABLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                    "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
                    "RequestLimitExceeded", "TooManyRequests"}
_RETRYABLE_STATUS = {408, 429}


class HttpAnswer(NamedTuple):
    """An object store's error answer: its code (``PreconditionFailed``), HTTP status and
    message; code and message may be empty (some servers send no body)."""

    code: str
    status: int
    message: str

    def __str__(self) -> str:
        text = f"HTTP {self.status or '?'}"
        text += f" {self.code}" if self.code and self.code != str(self.status) else ""
        return text + (f": {self.message}" if self.message else "")


def http_answer(e: BaseException | None) -> HttpAnswer | None:
    """The answer behind ``e``: botocore's ``ClientError`` on ``e`` itself or on its
    ``__cause__`` chain (s3fs raises an ``OSError`` whose cause is the ClientError, its
    message the server's, which may be empty).  None for errors no server answered."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        response = getattr(e, "response", None)
        if isinstance(response, dict) and ("Error" in response or "ResponseMetadata" in response):
            error = response.get("Error") or {}
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return HttpAnswer(str(error.get("Code") or ""), int(status),
                              str(error.get("Message") or ""))
        e = e.__cause__
    return None


def is_precondition_failed(e: BaseException) -> bool:
    """Whether ``e`` is a store's refusal of a conditional write (``If-None-Match: *`` on
    an existing key): code ``PreconditionFailed`` or status 412, whatever the text."""
    answer = http_answer(e)
    return answer is not None and (answer.code == "PreconditionFailed" or answer.status == 412)


def is_transient(e: BaseException) -> bool:
    """Whether retrying the operation that raised ``e`` may succeed.

    An object store's answer decides by its code and status (throttling, timeouts and
    5xx are transient; every other 4xx, a 412 included, is final), never by the text;
    other errors by their type and errno.
    """
    from raycheckpoint.errors import RayCheckpointError

    if isinstance(e, (RayCheckpointError, FileNotFoundError, FileExistsError, PermissionError,
                      IsADirectoryError, NotADirectoryError, ValueError, TypeError, KeyError)):
        return False  # a fault injected on purpose, a real answer, or a bug: not transient
    answer = http_answer(e)
    if answer is not None:
        return (answer.code in _RETRYABLE_CODES or answer.status >= 500
                or answer.status in _RETRYABLE_STATUS)
    if isinstance(e, OSError):
        return e.errno not in _PERMANENT_ERRNOS
    name = type(e).__name__
    return any(word in name for word in ("Connection", "Timeout", "Endpoint", "ClientPayload",
                                         "ServerDisconnected", "IncompleteRead", "ProtocolError"))
