"""verl's own ``FSDPCheckpointManager`` (not an imitation), run inside a bench rank.

``bench.save_latency --methods verl`` builds, in each rank of the FSDP2 group, verl's
real manager (``verl.utils.checkpoint.fsdp_checkpoint_manager.FSDPCheckpointManager``)
around that rank's model and optimizer, once per group as a trainer does, and calls its
``save_checkpoint(path, global_step=N, max_ckpt_to_keep=None)`` and
``load_checkpoint(path)``.  verl writes per-rank ``torch.save`` files (model, optimizer,
extra state: RNG and LR scheduler), and rank 0 the model's HF config and
``fsdp_config.json``; it never fsyncs.  Measured per save:

* ``stall_s``, ``returned_s``: the save call (training is blocked for all of it), what
  verl counts as saved;
* ``durable_s``: the same save followed by an fsync of every file it wrote and of the
  directories holding them (each rank its own files, rank 0 the rest), as verl would
  have to add for the checkpoint to survive a power loss.

verl is installed in ``.venv-verl`` only (``bash scripts/verl_env.sh``); elsewhere the
bench's ``verl_sync`` method imitates verl's save with a ``torch.save`` per rank.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from typing import Any

import torch.distributed as dist

HINT = ("verl is installed in .venv-verl (build it with `bash scripts/verl_env.sh`): run the "
        "bench with that Python, e.g. `PYTHONPATH=. .venv-verl/bin/python -m "
        "bench.save_latency --methods raycheckpoint,verl ...`")
MANAGER = "verl.utils.checkpoint.fsdp_checkpoint_manager.FSDPCheckpointManager"


def verl_version() -> str | None:
    """verl's installed version where this Python can import it, else None; found
    without importing verl, whose import loads its engines into this process."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("verl") is None:
        return None
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_verl(local_storage: bool) -> str:
    """verl's version, or a clear exit where ``--methods verl`` cannot run."""
    version = verl_version()
    if version is None:
        raise SystemExit(f"--methods verl runs verl's own FSDPCheckpointManager, and verl is "
                         f"not importable by this Python; {HINT}")
    if not local_storage:
        raise SystemExit("--methods verl: verl's FSDPCheckpointManager writes to a local "
                         "directory; give --storage a directory (verl_sync imitates it on "
                         "any fsspec storage)")
    return version


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class VerlManager:
    """verl's real manager around one rank's FSDP2 ``model`` and ``optimizer``.

    verl's save asks the model for an HF-style ``config`` (rank 0 writes it with
    ``save_pretrained``) and whether it ``can_generate``; the bench's model, not an HF
    one, gets a ``transformers.PretrainedConfig`` naming its class and a
    ``can_generate`` that answers False (verl then looks for no generation config).
    """

    def __init__(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> None:
        with warnings.catch_warnings():  # verl's engines it cannot find here, on import
            warnings.simplefilter("ignore")
            import verl
            from transformers import PretrainedConfig
            from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
        cls = f"{FSDPCheckpointManager.__module__}.{FSDPCheckpointManager.__qualname__}"
        if cls != MANAGER:
            raise RuntimeError(f"expected verl's own {MANAGER}, got {cls}")
        if getattr(model, "config", None) is None:
            name = type(model).__name__.removeprefix("FSDP")  # fully_shard's subclass
            model.config = PretrainedConfig(architectures=[name])
        if not hasattr(model, "can_generate"):
            model.can_generate = lambda: False
        self.version, self.manager_class = verl.__version__, cls
        self.manager = FSDPCheckpointManager(model=model, optimizer=optimizer,
                                             lr_scheduler=lr_scheduler, processing_class=None)
        self.rank = dist.get_rank()

    def _written(self, path: str) -> tuple[list[str], list[str]]:
        """The files of the checkpoint at ``path`` that this rank wrote (its own
        ``*_rank_R.pt``; rank 0 also everything of no rank), and the directories to fsync
        (rank 0: every one of the checkpoint and the one holding it)."""
        files, dirs = [], []
        own = re.compile(r".*_rank_(\d+)\.pt$")
        for dirpath, _, names in os.walk(path):
            if self.rank == 0:
                dirs.append(dirpath)
            for name in names:
                m = own.fullmatch(name)
                if (int(m.group(1)) == self.rank) if m else self.rank == 0:
                    files.append(os.path.join(dirpath, name))
        if self.rank == 0:
            dirs.append(os.path.dirname(os.path.abspath(path)))
        return files, dirs

    def save(self, path: str, step: int) -> dict[str, Any]:
        """verl's save, then the fsync it skips; times from a common barrier."""
        dist.barrier()
        t0 = time.perf_counter()
        self.manager.save_checkpoint(path, global_step=step, max_ckpt_to_keep=None)
        returned = time.perf_counter() - t0
        files, dirs = self._written(path)
        for f in files + dirs:
            _fsync(f)
        dist.barrier()
        durable = time.perf_counter() - t0
        return {"stall_s": returned, "returned_s": returned, "durable_s": durable,
                "fsync_s": durable - returned,
                "files": sorted(os.path.relpath(f, path) for f in files)}

    def load(self, path: str) -> None:
        self.manager.load_checkpoint(path)
