"""Ask a running job to save a checkpoint, from outside it, without stopping it.

    python -m raycheckpoint.request ROOT [--tag NAME] [--kind full|light] [--address ADDR]

Connects to the Ray cluster (``--address`` or ``RAY_ADDRESS``; default ``auto``), finds
the coordinator of the job writing to ROOT and queues the request; the job's driver
saves at the end of its current step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import ray

from raycheckpoint.protocol.coordinator_actor import NAMESPACE, actor_name
from raycheckpoint.storage import Storage


def request_save(root: str, *, tag: str | None = None, kind: str = "full",
                 storage_options: dict[str, Any] | None = None, timeout_s: float = 60.0) -> None:
    """Queue a save request with the coordinator of ``root`` (Ray must be initialized)."""
    name = actor_name(Storage(root, storage_options or {}))
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError as e:
        raise LookupError(f"no running job checkpoints to {root} on this Ray cluster") from e
    ray.get(actor.request_save.remote(tag=tag, kind=kind), timeout=timeout_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", help="the job's checkpoint root (path or URI)")
    p.add_argument("--tag", default=None)
    p.add_argument("--kind", default="full", choices=["full", "light"])
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"))
    p.add_argument("--storage-options", default="{}", help="JSON of fsspec storage options")
    args = p.parse_args(argv)
    ray.init(address=args.address, log_to_driver=False)
    try:
        request_save(args.root, tag=args.tag, kind=args.kind,
                     storage_options=json.loads(args.storage_options))
    except (LookupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"save requested for {args.root}" + (f" (tag {args.tag})" if args.tag else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
