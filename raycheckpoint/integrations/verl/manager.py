"""A drop-in for verl's ``FSDPCheckpointManager`` (verl 0.9): same constructor, same
``save_checkpoint`` / ``load_checkpoint`` calls, raycheckpoint underneath.

verl's FSDP engine builds one manager per rank of a role and calls it on every rank at
once, with ``local_path = <trainer.default_local_dir>/global_step_<N>/<role>``::

    manager = FSDPCheckpointManager(model=module, optimizer=optimizer,
                                    lr_scheduler=lr_scheduler, processing_class=tokenizer,
                                    checkpoint_config=checkpoint_config)
    manager.save_checkpoint(local_path, global_step=N, max_ckpt_to_keep=K)
    manager.load_checkpoint(local_path)

Where verl writes ``model_world_size_{W}_rank_{r}.pt`` files with ``torch.save`` (no
fsync, no checksum, no commit, readable only at the same ``W``), this manager saves the
role into a raycheckpoint root, one per role: ``<trainer.default_local_dir>/raycheckpoint/<role>``
unless ``save_dir`` says otherwise (a directory or ``s3://``; the role is appended).
Each rank stages its shard and persists it through torch DCP with a checksum per file;
the role's coordinator (a Ray actor started by rank 0) commits the checkpoint
atomically once every rank has written, and applies retention (``max_ckpt_to_keep``,
across restarts).  ``local_path`` gets ``raycheckpoint.json`` naming the committed
checkpoint.  A load verifies every byte it reads and reshards to the job's world size.

**When a save returns.**  By default, once the role's checkpoint is committed: verl's
trainer writes its ``latest_checkpointed_iteration.txt`` and ``data.pt`` as soon as the
managers return, and a save returning earlier would let a crash leave the tracker naming
a step whose checkpoint never committed.  With verl's own ``async_save`` option
(``actor_rollout_ref.actor.checkpoint.async_save=true``) a save returns once every rank
has its host copy, and persists and commits in the background.  That needs the switch
(:mod:`~raycheckpoint.integrations.verl.patch`): verl's trainer then writes no tracker,
and the switch's resume (:mod:`~raycheckpoint.integrations.verl.trainer`) takes the
newest step every role committed, and waits for the last step's commits before training
ends.  A background save that fails is logged (and warned) at the role's next save.
Retention keeps one checkpoint more than ``max_ckpt_to_keep``: between the commit of step
``N`` and the trainer's tracker naming it, the tracker still names the one before.

Options (``raycheckpoint.config.CheckpointConfig`` names: ``save_dir``,
``storage_options``, ``encryption_key``, ``enable_checksum``, timeouts, ...) come from
the environment variable ``RAYCHECKPOINT_VERL_OPTIONS`` (a JSON object; Ray's
``runtime_env`` carries it to every worker) and the ``options`` argument, which wins.
Not yet supported here, each refused with a clear error: ``save_contents`` with
``hf_model`` (use ``raycheckpoint export --format hf``), ``save_lora_only``, and the
tiers (``local_dir``, ``memory_replicas``).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raycheckpoint._internal import exit as process_exit
from raycheckpoint.integrations.verl._ranks import Collectives, RankState
from raycheckpoint.integrations.verl._root import RoleRoot, keep_last_n, write_pointer

__all__ = ["OPTIONS_ENV", "FSDPCheckpointManager", "absolute", "read_options", "role_root", "where"]

logger = logging.getLogger(__name__)

OPTIONS_ENV = "RAYCHECKPOINT_VERL_OPTIONS"
DEFAULT_CONTENTS = ("model", "optimizer", "extra")
KNOWN_CONTENTS = {"model", "optimizer", "extra", "hf_model"}
NOT_HERE = ("local_dir", "memory_replicas", "local_dir_per_node")  # tiers: not yet
_STEP_DIR = re.compile(r"global_step_(\d+)")


def _setting(config: Any, key: str, default: Any = None) -> Any:
    """``key`` of verl's checkpoint config: a DictConfig or dict, or its dataclass."""
    if config is None:
        return default
    return config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)


def _contents(config: Any, key: str, default: tuple[str, ...]) -> list[str]:
    value = _setting(config, key)
    out = list(default if value is None else value)
    unknown = sorted(set(out) - KNOWN_CONTENTS)
    if unknown:
        raise ValueError(f"checkpoint {key} {unknown}: verl knows {sorted(KNOWN_CONTENTS)}")
    return out


def _flag(config: Any, key: str) -> bool:
    return bool(_setting(config, key, False))


def where(local_path: str) -> tuple[str, str, int | None]:
    """``(base, role, step)`` of verl's ``<base>/global_step_<N>/<role>``; for a path of
    another form (``<base>/<role>``, as verl's own tests save) the step is None."""
    path = local_path.rstrip("/")
    role, parent = posixpath.basename(path), posixpath.dirname(path)
    if not role or not parent:
        raise ValueError(f"{local_path!r}: expected <checkpoint dir>/global_step_<N>/<role>")
    m = _STEP_DIR.fullmatch(posixpath.basename(parent))
    if m is None:
        return parent, role, None
    return posixpath.dirname(parent), role, int(m.group(1))


def absolute(path: str) -> str:
    """``path`` made absolute (against the working directory, as verl does); a URL as is."""
    return path if "://" in path else os.path.abspath(path)


def role_root(base: str, role: str, options: dict[str, Any]) -> str:
    """The raycheckpoint root of ``role`` for verl's checkpoint directory ``base``
    (``trainer.default_local_dir``): ``<base>/raycheckpoint/<role>``, or
    ``<save_dir>/<role>`` where the options name a ``save_dir``."""
    save_dir = options.get("save_dir") or options.get("checkpoint.save_dir")
    top = absolute(save_dir) if save_dir else posixpath.join(absolute(base), "raycheckpoint")
    return posixpath.join(top.rstrip("/"), role)


def read_options(options: dict[str, Any] | None = None) -> dict[str, Any]:
    """raycheckpoint's options for verl's jobs: ``RAYCHECKPOINT_VERL_OPTIONS`` (JSON), then
    ``options``, which win."""
    out: dict[str, Any] = {}
    env = os.environ.get(OPTIONS_ENV)
    if env:
        try:
            out.update(json.loads(env))
        except json.JSONDecodeError as e:
            raise ValueError(f"{OPTIONS_ENV} is not a JSON object: {e}") from None
    out.update(options or {})
    bad = sorted(k for k in out if k.removeprefix("checkpoint.") in NOT_HERE)
    if bad:
        raise ValueError(f"{bad}: the verl manager does not run raycheckpoint's tiers yet; "
                         "give save_dir the root (a directory or s3://)")
    return out


class FSDPCheckpointManager:
    """verl's ``FSDPCheckpointManager``, with raycheckpoint's saves and loads (see the
    module doc).  Every rank of the role constructs it and calls it, as verl does; the
    default process group must exist (verl's workers form it first)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Any = None, processing_class: Any = None,
                 checkpoint_config: Any = None, trust_remote_code: bool = False, *,
                 options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if "tokenizer" in kwargs:  # verl's deprecated spelling
            warnings.warn("`tokenizer` is deprecated, use `processing_class`", DeprecationWarning,
                          stacklevel=2)
            processing_class = kwargs.pop("tokenizer")
        if kwargs:
            raise TypeError(f"FSDPCheckpointManager got unexpected arguments {sorted(kwargs)}")
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.processing_class, self.trust_remote_code = processing_class, trust_remote_code
        self.checkpoint_config = checkpoint_config
        self.checkpoint_save_contents = _contents(checkpoint_config, "save_contents", DEFAULT_CONTENTS)
        self.checkpoint_load_contents = _contents(checkpoint_config, "load_contents",
                                                  tuple(self.checkpoint_save_contents))
        if "hf_model" in self.checkpoint_save_contents:
            raise ValueError("save_contents hf_model: this manager does not write verl's "
                             "huggingface/ model directory; the checkpoint keeps the model's "
                             "config and tokenizer, and `raycheckpoint export --format hf "
                             "ROOT CHECKPOINT OUT` writes the from_pretrained directory")
        if _flag(checkpoint_config, "save_lora_only"):
            raise ValueError("save_lora_only is not supported by raycheckpoint's verl manager yet")
        self.async_save = _flag(checkpoint_config, "async_save")
        if self.async_save and "raycheckpoint.integrations.verl.patch" not in sys.modules:
            raise ValueError("checkpoint async_save: verl's trainer then writes no tracker, and only "
                             "the switch's resume finds the steps committed; set "
                             "VERL_USE_EXTERNAL_MODULES=raycheckpoint.integrations.verl.patch")
        self.options = read_options(options)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        rpc = float(self.options.get("rpc_timeout_s", 600.0))
        self._ranks = Collectives(rpc)
        # the persist threads' DCP collectives: a group of their own (made on every rank now,
        # in the same order as the control group)
        self._persist_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=rpc))
        self._state = RankState(model, optimizer, lr_scheduler, processing_class)
        self._roots: dict[str, RoleRoot] = {}  # root URL -> this process's view of it
        self.previous_global_step: int | None = None
        self.previous_saved_paths: list[str] = []
        self._pending: tuple | None = None  # rank 0: the background save not yet settled

    # ---- verl's properties ------------------------------------------------------------------

    should_save_model = property(lambda self: "model" in self.checkpoint_save_contents)
    should_save_optimizer = property(lambda self: "optimizer" in self.checkpoint_save_contents)
    should_save_extra = property(lambda self: "extra" in self.checkpoint_save_contents)
    should_save_hf_model = property(lambda self: "hf_model" in self.checkpoint_save_contents)
    should_load_model = property(lambda self: "model" in self.checkpoint_load_contents)
    should_load_optimizer = property(lambda self: "optimizer" in self.checkpoint_load_contents)
    should_load_extra = property(lambda self: "extra" in self.checkpoint_load_contents)
    should_load_hf_model = property(lambda self: "hf_model" in self.checkpoint_load_contents)
    should_save_lora_only = property(lambda self: _flag(self.checkpoint_config, "save_lora_only"))

    # ---- where ------------------------------------------------------------------------------

    def root_url(self, local_path: str) -> str:
        """The raycheckpoint root of ``local_path``'s role."""
        base, role, _ = where(local_path)
        return role_root(base, role, self.options)

    def _root(self, local_path: str, keep: int | None = None, *, saving: bool = False) -> RoleRoot:
        """The role's root, opened on first use: rank 0 leases it and starts its
        coordinator; every rank sets up its saver for it.  A save whose
        ``max_ckpt_to_keep`` differs from the open root's (a load opened it, or verl
        changed it) reopens it with the new retention."""
        url = self.root_url(local_path)
        root = self._roots.get(url)
        if root is not None and (not saving or keep_last_n(keep, self.options) == root.config.keep_last_n):
            return root
        if root is not None:  # every rank sees the same config: they all reopen together
            del self._roots[url]
            self._ranks.from_rank0(root.close)
        _, role, _ = where(local_path)
        root = self._ranks.from_rank0(lambda: RoleRoot.open(url, self.options, keep, role,
                                                         self.world_size))
        error = None
        try:
            self._state.ckpt_setup(
                role=role, rank=self.rank, world_size=self.world_size, storage=root.write,
                process_group=self._persist_group, report_timeout_s=root.config.rpc_timeout_s,
                persist_nice=root.config.persist_nice, freeze_gc=False,
                coordinator=root.coordinator, write_ahead=root.config.write_ahead,
                host_buffer_bytes=root.config.host_buffer_bytes)
        except BaseException as e:  # noqa: BLE001 - every rank raises it below
            error = e
        self._ranks.outcomes(error)
        if not self._roots and self.rank == 0:  # the first root this rank 0 leases
            process_exit.on_exit(self._close_at_exit)
        self._roots[url] = root
        return root

    # ---- save -------------------------------------------------------------------------------

    def save_checkpoint(self, local_path: str | None, hdfs_path: str | None = None,
                        global_step: int = 0, max_ckpt_to_keep: int | None = None) -> None:
        """Save this role at ``global_step`` and return once it is committed.

        ``hdfs_path`` is unused (as in verl).  ``max_ckpt_to_keep``: None or 0 keeps every
        checkpoint; otherwise one more is kept (see the module doc)."""
        if local_path is None:
            return
        step = where(local_path)[2]
        if step is not None and step != global_step:
            raise ValueError(f"{local_path!r} names step {step}, global_step is {global_step}")
        contents = set(self.checkpoint_save_contents)
        if "model" not in contents:
            raise ValueError("save_contents must include model")
        if contents & {"optimizer", "extra"} and not {"optimizer", "extra"} <= contents:
            raise ValueError(f"save_contents {sorted(contents)}: raycheckpoint saves the model "
                             "alone (a light checkpoint, weights only) or with optimizer and "
                             "extra (a full one, which resumes training)")
        if "optimizer" in contents and self.optimizer is None:
            raise ValueError("save_contents has optimizer, but the manager has no optimizer")
        kind = "full" if "optimizer" in contents else "light"
        root = self._root(local_path, max_ckpt_to_keep, saving=True)
        self._settle(root.config.save_wait_timeout_s)
        t0 = time.perf_counter()
        begun = self._ranks.from_rank0(lambda: root.begin(global_step, kind))
        if "existing" in begun:
            name = begun["existing"]["name"]
        else:
            error = None
            try:  # the persist starts at once and reports to the coordinator
                self._state.ckpt_snapshot(begun["save_id"], begun["name"], kind, root.coordinator,
                                          wait_timeout_s=root.config.save_wait_timeout_s)
            except BaseException as e:  # noqa: BLE001 - the save fails with it below
                error = e
            if self.async_save:  # every rank has its host copy: the rest goes on behind
                self._ranks.outcomes(error)
                if self.rank == 0:
                    root.snapshotted(begun["save_id"])
                    self._pending = (root, begun["save_id"], local_path, global_step, t0)
                self._saved(local_path, global_step)
                return
            result = self._ranks.from_rank0(lambda: root.await_commit(begun["save_id"]))
            if error is not None:  # the coordinator failed the save without this rank
                raise error
            name = result["name"]
        if self.rank == 0:
            write_pointer(local_path, root, name, global_step, time.perf_counter() - t0)
        self._saved(local_path, global_step)

    def _saved(self, local_path: str, global_step: int) -> None:
        self.previous_global_step = global_step
        if local_path not in self.previous_saved_paths:
            self.previous_saved_paths.append(local_path)

    def _settle(self, timeout: float) -> None:
        """Rank 0: the outcome of the background save before this call (``async_save``):
        its pointer written once it committed, its failure logged and warned (the next
        resume takes the newest step every role committed)."""
        if self._pending is None:
            return
        root, save_id, local_path, step, t0 = self._pending
        self._pending = None
        try:
            result = root.await_commit(save_id, timeout)
        except Exception as e:  # noqa: BLE001 - training goes on; the failure is told
            logger.error("checkpoint of step %d (%s) failed: %s", step, root.url, e)
            warnings.warn(f"checkpoint of step {step} ({root.url}) failed in the background: {e}",
                          RuntimeWarning, stacklevel=3)
            return
        write_pointer(local_path, root, result["name"], step, time.perf_counter() - t0)

    # ---- load -------------------------------------------------------------------------------

    def load_checkpoint(self, local_path: str | None, hdfs_path: str | None = None,
                        del_local_after_load: bool = False) -> None:
        """Load this role's checkpoint of the step ``local_path`` names (``global_step_<N>``,
        else the step its ``raycheckpoint.json`` names), verified, into every rank
        (resharded where the world size changed).  ``hdfs_path`` and
        ``del_local_after_load`` are unused: nothing is copied to local disk first."""
        if local_path is None:
            return
        step = where(local_path)[2]
        contents = set(self.checkpoint_load_contents)
        weights_only = not contents & {"optimizer", "extra"}
        root = self._root(local_path)
        self._settle(root.config.save_wait_timeout_s)
        plan = self._ranks.from_rank0(lambda: root.plan_load(
            local_path, step, self.world_size, weights_only=weights_only))
        error, answer = None, None
        try:
            answer = self._state.ckpt_load(plan["requests"][self.rank])
        except BaseException as e:  # noqa: BLE001 - every rank raises it below
            error = e
        self._ranks.outcomes(error)
        answers = self._ranks.gather(answer)
        self._ranks.from_rank0(lambda: root.finish_load(plan, answers))
        for skipped in answer["skipped"]:
            logger.warning("load %s: skipped %s", plan["name"], skipped)

    def close(self, timeout: float | None = None) -> None:
        """Release the roots this process leased and stop their coordinators (rank 0).
        verl never calls it: a worker process that ends normally does it on its way out
        (for a few seconds at most); one that is killed leaves its leases to go stale
        after ``lease_ttl_s``, when the next job takes them over."""
        if self._pending is not None:
            self._settle(self._pending[0].config.save_wait_timeout_s if timeout is None else timeout)
        roots, self._roots = list(self._roots.values()), {}
        for root in roots:
            root.close(timeout)

    def _close_at_exit(self, timeout: float) -> None:
        try:
            self.close(timeout)
        except Exception as e:  # noqa: BLE001 - the process is ending: say why, go on
            logger.warning("raycheckpoint: closing the verl manager's roots at exit: %s", e)
