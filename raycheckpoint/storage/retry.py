"""Which storage errors are worth retrying (used by
:meth:`Storage.retrying <raycheckpoint.storage.base.Storage.retrying>`)."""

from __future__ import annotations

import errno

_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                     errno.ENOENT, errno.EEXIST, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG}
_RETRYABLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                    "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
                    "RequestLimitExceeded", "TooManyRequests"}


def is_transient(e: BaseException) -> bool:
    """Whether retrying the operation that raised ``e`` may succeed."""
    from raycheckpoint.errors import RayCheckpointError

    if isinstance(e, (RayCheckpointError, FileNotFoundError, FileExistsError, PermissionError,
                      IsADirectoryError, NotADirectoryError, ValueError, TypeError, KeyError)):
        return False  # a fault injected on purpose, a real answer, or a bug: not transient
    response = getattr(e, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return code in _RETRYABLE_CODES or int(status) >= 500 or int(status) == 429
    if isinstance(e, OSError):
        return e.errno not in _PERMANENT_ERRNOS
    name = type(e).__name__
    return any(word in name for word in ("Connection", "Timeout", "Endpoint", "ClientPayload",
                                         "ServerDisconnected", "IncompleteRead", "ProtocolError"))
