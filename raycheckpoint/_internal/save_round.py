"""What the driver tells the workers of a save round that will not be persisted.

:func:`settle` waits for snapshots whose save ended before it was named (``begin``
failed, or reused an existing checkpoint); :func:`fail_staged` aborts a named save after
its snapshots, so that no rank waits for a peer that will never write.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

logger = logging.getLogger(__name__)


def settle(refs: list[Any], timeout: float) -> None:
    """Wait for snapshots that will not be persisted (their errors are the save's own)."""
    try:
        ray.get(refs, timeout=timeout)
    except Exception:  # the caller raises or records the save's failure
        logger.debug("a dropped snapshot failed", exc_info=True)


def fail_staged(coordinator: Any, save_id: str, name: str, kind: str,
                writers: list[tuple[str, Any]], reason: str, wait_timeout_s: float,
                refusing: dict[str, str] | None = None) -> None:
    """Abort save ``save_id`` (step directory ``name``) after its snapshots; wait for no one.

    The ranks that staged persist too, and meet a failed rank's refusal in their first
    agreement: they end at once, not when the next save finds them waiting.  A rank
    whose staging failed refused by itself; one in ``refusing`` (``"role/rank"`` -> why)
    staged nothing and is told to refuse first.
    """
    coordinator.abort.remote(save_id, reason)
    for who, w in writers:
        if refusing and who in refusing:
            w.ckpt_refuse.remote(save_id, name, kind, refusing[who], wait_timeout_s)
        w.ckpt_start_persist.remote(save_id, if_staged=True)
