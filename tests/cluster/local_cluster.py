"""A multi-node Ray cluster on this machine whose every file is under one directory.

:class:`ray.cluster_utils.Cluster` writes the head's address into ``ray_current_cluster``
of Ray's *default* temporary directory (``$RAY_TMPDIR/ray``, else ``$TMPDIR/ray``, else
``/tmp/ray``; Ray 2.60 ``ray._private.utils.write_ray_address`` without a ``temp_dir``), and
removes it on shutdown, whatever ``temp_dir`` the head was given: on a machine without
``/tmp/ray`` it fails, and on one with it, it overwrites what another Ray instance of the
machine wrote there.  :func:`start` points Ray's default at the cluster's own directory
(``RAY_TMPDIR``, for this process and every Ray process it starts) and gives the head that
same directory, so the address file, the ``session_latest`` link and the session (sockets,
logs) are all in ``TEMP/ray``; worker nodes use the head's.
"""

from __future__ import annotations

import os
from typing import Any

from ray.cluster_utils import Cluster


def ray_dir(temp: str) -> str:
    """The Ray temporary directory of a cluster started in ``temp``."""
    return os.path.join(temp, "ray")


def start(temp: str, **head_args: Any) -> Cluster:
    """A cluster with its head started (``head_args``: its ``add_node`` options), every Ray
    file under ``TEMP/ray``.  ``temp`` should be short: Ray's socket paths live there."""
    # Ray's default temporary directory is computed from RAY_TMPDIR at each use: the
    # address file Cluster writes (and removes) lands in the head's own temp dir
    os.environ["RAY_TMPDIR"] = temp
    return Cluster(initialize_head=True,
                   head_node_args={"include_dashboard": False, **head_args, "temp_dir": ray_dir(temp)})
