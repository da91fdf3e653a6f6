"""Waiting on Ray calls: the error raised is the one the remote call raised."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayTaskError


def unwrap(e: BaseException) -> BaseException:
    """The original exception a Ray task or actor raised."""
    while isinstance(e, RayTaskError) and e.cause is not None:
        e = e.cause
    return e


def get(refs: Any, timeout: float) -> Any:
    """``ray.get`` raising the remote call's own exception."""
    try:
        return ray.get(refs, timeout=timeout)
    except RayTaskError as e:
        raise unwrap(e) from None
