"""The rank side of the verl drop-in: one rank's model, optimizer and LR scheduler as a
:class:`~raycheckpoint.worker.CheckpointableWorker`, and the collectives that let rank 0
do what a job's driver does while every rank runs the same code (verl calls its
checkpoint manager on every rank of a role at once).
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raycheckpoint.state_dict_cache import StateDictCache
from raycheckpoint.worker import CheckpointableWorker


class RankState(CheckpointableWorker):
    """What one rank saves and loads: ``model`` (an FSDP2 module, or a plain one), its
    ``optimizer`` and ``lr_scheduler`` (either may be None); ``processing_class`` (a
    tokenizer or processor) and the model's Hugging Face config go into the
    checkpoint's assets, so that ``raycheckpoint export --format hf`` can rebuild a
    ``from_pretrained`` directory."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 lr_scheduler: Any, processing_class: Any) -> None:
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.processing_class = processing_class
        self._state_dicts = StateDictCache(model, optimizer)

    def ckpt_state_dict(self, kind: str) -> dict[str, Any]:
        return self._state_dicts.state_dict(kind)

    def ckpt_load_state_dict(self, state: dict[str, Any], kind: str) -> None:
        self._state_dicts.load_state_dict(state)

    def ckpt_extra_state(self) -> dict[str, Any]:
        if self.lr_scheduler is None:
            return {}
        return {"lr_scheduler": self.lr_scheduler.state_dict()}

    def ckpt_load_extra_state(self, extra: dict[str, Any]) -> None:
        if self.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])

    def ckpt_assets(self) -> dict[str, bytes]:
        return model_assets(self.model, self.processing_class)


def model_assets(model: torch.nn.Module, processing_class: Any) -> dict[str, bytes]:
    """``config.json`` of a Hugging Face model (under FSDP too) and the tokenizer's files."""
    import os
    import tempfile

    out: dict[str, bytes] = {}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        out["config.json"] = config.to_json_string().encode()
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        with tempfile.TemporaryDirectory(prefix="raycheckpoint-tokenizer-") as d:
            processing_class.save_pretrained(d)
            for name in sorted(os.listdir(d)):
                path = os.path.join(d, name)
                if os.path.isfile(path):
                    with open(path, "rb") as f:
                        out[name] = f.read()
    return out


class RemoteFailure(RuntimeError):
    """An error another rank met in a step every rank takes together; names that rank."""


class Collectives:
    """Control messages among a role's ranks on a gloo group of their own: a save's or
    load's plan made on rank 0 and handed to every rank, and the ranks' outcomes.

    The group is not the training group (which may be NCCL) nor the one the persist
    threads' DCP collectives use, so these never interleave with either.  Each call is
    made by every rank, in the same order; an error met by one rank is raised on every
    rank, so that no rank goes on alone or waits for a peer that gave up.
    """

    def __init__(self, timeout_s: float) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def from_rank0(self, fn: Any) -> Any:
        """``fn()`` run on rank 0; its answer on every rank, or its error raised on every
        rank (the same exception where it can be sent)."""
        box: list[Any] = [None]
        error: BaseException | None = None
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except BaseException as e:  # noqa: BLE001 - raised on every rank below
                error = e
                box[0] = ("error", _sendable(e))
        dist.broadcast_object_list(box, src=0, group=self.group)
        status, value = box[0]
        if error is not None:
            raise error
        if status == "error":
            raise _received(value, 0)
        return value

    def outcomes(self, error: BaseException | None) -> None:
        """Every rank says whether its part succeeded; raise on every rank: its own error,
        else the first failing rank's."""
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, None if error is None else _sendable(error),
                               group=self.group)
        if error is not None:
            raise error
        for rank, e in enumerate(everyone):
            if e is not None:
                raise _received(e, rank)

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0 (None elsewhere)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out if self.rank == 0 else None


def _sendable(error: BaseException) -> BaseException | str:
    """The exception itself where it survives pickling, else its text."""
    try:
        pickle.loads(pickle.dumps(error))  # noqa: S301 - this process's own exception
        return error
    except Exception:  # noqa: BLE001 - a custom exception pickle cannot rebuild
        return f"{type(error).__name__}: {error}"


def _received(error: BaseException | str, rank: int) -> BaseException:
    if isinstance(error, str):
        return RemoteFailure(f"rank {rank}: {error}")
    error.add_note(f"(raised on rank {rank} of this role)")
    return error
