"""A rank's load: ``dcp.load`` through the verifying reader, with no collective.

:func:`load_verified` is what a worker's ``ckpt_load`` runs for its role's tensors.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException

from raycheckpoint._internal.dcp.load_plan import LayoutCachingLoadPlanner
from raycheckpoint._internal.dcp.reader import VerifyingStorageReader
from raycheckpoint.errors import IntegrityError


def load_verified(state: dict[str, Any], reader: VerifyingStorageReader, *,
                  partial: bool = False) -> list[str]:
    """``dcp.load`` into ``state``, this rank on its own; an IntegrityError is raised as itself.

    No collective runs: DCP's default load planner coordinates nothing (its global plan is
    the ranks' own plans, unchanged), and every rank reads and verifies ``.metadata``
    itself.  Gathering and scattering the pickled plans (one item per tensor) cost DCP
    0.1-0.25 s per load at 788 items a rank, and a rank that failed left its peers
    waiting in the exchange; the manager gathers every rank's answer instead.  DCP wraps
    a failure in a CheckpointException; unwrapping lets callers (and ``"auto"`` resume)
    tell corruption from other failures.  The plan is DCP's default one, worked out once
    per distinct tensor layout (:class:`~raycheckpoint._internal.dcp.load_plan.LayoutCachingLoadPlanner`).

    Keys of ``state`` the checkpoint lacks raise an IntegrityError naming them; with
    ``partial`` they keep their values and are returned instead.
    """
    try:
        metadata = reader.read_metadata()  # verified here, where DCP cannot turn its error
        absent = sorted(set(flatten_state_dict(state)[0]) - set(metadata.state_dict_metadata))
        if absent and not partial:
            raise IntegrityError(
                f"{reader.dcp_dir}: the checkpoint has no {len(absent)} key(s) this state has: "
                f"{_some(absent)} (strict=False loads the rest and leaves these as they are)",
                path=reader.dcp_dir)
        # no_grad: DTensor.to_local() in DCP's planning is then an attribute read; the
        # reader's threads set it for themselves. no_dist is meant: not "distributed is disabled"
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader,
                     planner=LayoutCachingLoadPlanner(allow_partial_load=bool(absent)),
                     no_dist=True)
    except CheckpointException as e:
        for wrapped in e.failures.values():
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            if isinstance(inner, IntegrityError):
                raise inner from e
        raise
    finally:
        reader.stop_prefetch()  # every byte is read, or the load failed
    return absent


def _some(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")
