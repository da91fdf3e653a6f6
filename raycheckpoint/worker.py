"""CheckpointableWorker: the worker half of the protocol, as a mixin for Ray actors.

A worker class (any Ray actor holding a role's shard) inherits this mixin and
implements four hooks:

* ``ckpt_state_dict(kind)``: the tensors to save (``{"model": ..., "optim": ...}`` for
  ``full``, ``{"model": ...}`` for ``light``); DTensors from FSDP2 are fine.  Build the
  optimizer part with :func:`optimizer_state_dict`: torch's own function counts an extra
  optimizer step when called before the first one, which would change training
  (:class:`StateDictCache` builds both parts and reuses them from save to save);
* ``ckpt_load_state_dict(state, kind)``: apply a loaded state (same structure);
* ``ckpt_extra_state()`` / ``ckpt_load_extra_state(extra)``: small msgpack-safe state
  (LR scheduler, counters) saved per rank next to the rank's RNG;
* ``ckpt_assets()`` (optional): files describing the model, ``{file name: bytes}``,
  written by rank 0 into ``assets/<role>/`` of every checkpoint.  A Hugging Face
  ``config.json`` (plus tokenizer files) there lets ``raycheckpoint export --format hf``
  rebuild a ``from_pretrained`` directory from the ``"model"`` part of the state.

The driver-side :class:`~raycheckpoint.manager.CheckpointManager` calls the
``ckpt_*`` remote methods below; a worker never decides what is committed.
Call order: ``ckpt_setup`` once, then per save ``ckpt_snapshot_begun`` (returns after
the host copy; a trainable role's copy runs while the coordinator's ``begin`` does; the
rank starts its persist as the last thing before it answers, so that the driver sends
no call per rank after the answers and no persist thread holds the answer back), and
per resume ``ckpt_load`` (``_internal/rank_load.py``).
A save riding on a training step (``CheckpointManager.step_save``) sends the same
``ckpt_snapshot_begun``, queued behind the step's calls to the worker: nothing to
implement for it.  ``ckpt_snapshot`` stages for
a save already named, for callers driving the protocol themselves.  A rank whose state
cannot be staged refuses the save (its persist takes part in the ranks' first agreement
with the error), so that the ranks persisting it fail at once instead of waiting for it;
one that never read ``begin``'s answer, which the driver did, is told to
(``ckpt_refuse``).

Overlapped copy (``checkpoint.overlap_copy``): a worker that calls
``self.ckpt_guard(optimizer)`` lets ``ckpt_snapshot`` return before its host copy is
made; the copy runs while the next step's forward and backward do (they read the
parameters and optimizer state, they do not change them), and the optimizer's step
waits for what is left of it.  Anything else that changes the saved tensors in place
(loading weights, an EMA update) must call ``self.ckpt_wait_copy()`` first.  Workers
that guard no optimizer copy before answering, as without the option.
"""

from __future__ import annotations

import gc
import hashlib
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raycheckpoint._internal import exit as process_exit
from raycheckpoint._internal import faults, rpc
from raycheckpoint._internal.persist import SaveTarget, Snapshot
from raycheckpoint._internal.rank_load import RankLoading
from raycheckpoint._internal.shard_saver import ShardSaver
from raycheckpoint.errors import CheckpointSaveError
from raycheckpoint.state import capture_rng
from raycheckpoint.state_dict_cache import StateDictCache, optimizer_state_dict
from raycheckpoint.storage import StorageSpec

__all__ = ["CheckpointableWorker", "StateDictCache", "local_tensors", "optimizer_state_dict"]


class CheckpointableWorker(RankLoading):
    """Mixin giving a Ray actor the remote methods the checkpoint manager calls."""

    ckpt_role: str
    ckpt_rank: int
    ckpt_world_size: int
    _ckpt_saver: ShardSaver | None = None
    _ckpt_guards: list[Any] | None = None
    _ckpt_coordinator: Any = None

    # ---- hooks a worker implements ------------------------------------------------------

    def ckpt_state_dict(self, kind: str) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement ckpt_state_dict(kind)")

    def ckpt_load_state_dict(self, state: dict[str, Any], kind: str) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} must implement ckpt_load_state_dict(state, kind)")

    def ckpt_extra_state(self) -> dict[str, Any]:
        return {}

    def ckpt_load_extra_state(self, extra: dict[str, Any]) -> None:
        return None

    def ckpt_assets(self) -> dict[str, bytes]:
        return {}

    # ---- remote methods -----------------------------------------------------------------

    def ckpt_setup(self, *, role: str, rank: int, world_size: int, storage: StorageSpec,
                   process_group: dist.ProcessGroup | None = None,
                   report_timeout_s: float = 300.0, persist_nice: int = 0,
                   freeze_gc: bool = False, coordinator: Any = None,
                   write_ahead: bool = True, probe: str | None = None,
                   host_buffer_bytes: int | None = None) -> bool:
        """Set up this rank's saver; ``freeze_gc``, ``write_ahead``, ``host_buffer_bytes``: see
        ``CheckpointConfig``.  Returns whether ``storage`` holds ``probe`` (True if None:
        the driver's proof that every rank sees one local tier, ``roots.py``).

        ``coordinator``: the handle snapshots report to unless they are given one (kept
        here so that each save's calls need not carry it).
        """
        self.ckpt_role, self.ckpt_rank, self.ckpt_world_size = role, rank, world_size
        self._ckpt_coordinator = coordinator
        if freeze_gc:
            gc.collect()  # garbage now would never be collected once frozen
            gc.freeze()
        sees = probe is None or storage.open().exists(probe)
        if self._ckpt_saver is None or self._ckpt_saver.storage_spec != storage:
            if process_group is None and dist.is_initialized():
                # DCP runs collectives from the persist thread: give it a group of its own so
                # they never interleave with the training collectives on the default group
                if getattr(self, "_ckpt_pg", None) is None:
                    self._ckpt_pg = dist.new_group(backend="gloo",
                                                   timeout=timedelta(seconds=report_timeout_s))
                process_group = self._ckpt_pg
            if self._ckpt_saver is not None:  # its last persist still runs, then its threads end
                self._ckpt_saver.retire()
            self._ckpt_saver = ShardSaver(role=role, rank=rank, world_size=world_size,
                                          storage=storage, process_group=process_group,
                                          report_timeout_s=report_timeout_s,
                                          persist_nice=persist_nice)
            if not getattr(self, "_ckpt_exit_hooked", False):
                # this process ends by os._exit once its persist is over (_internal/exit.py)
                process_exit.install()
                process_exit.on_exit(self._ckpt_close)
                self._ckpt_exit_hooked = True
        saver = self._ckpt_saver
        saver.persist_nice, saver.writes_ahead = persist_nice, write_ahead
        saver.host_buffer_bytes = host_buffer_bytes
        return sees

    def _ckpt_close(self, timeout: float) -> None:
        if self._ckpt_saver is not None:
            self._ckpt_saver.close(timeout)

    def _saver(self) -> ShardSaver:
        if self._ckpt_saver is None:
            raise RuntimeError(f"{type(self).__name__}: ckpt_setup() was not called")
        return self._ckpt_saver

    def ckpt_prepare(self, kind: str = "full") -> int:
        """Allocate and touch the staging buffers for ``kind`` now; returns their bytes."""
        return self._saver().prepare(kind, self.ckpt_state_dict(kind))

    def ckpt_guard(self, *optimizers: torch.optim.Optimizer) -> None:
        """Make each optimizer's ``step`` first wait for an overlapped host copy.

        Call once after building the optimizers; it is what allows
        ``checkpoint.overlap_copy`` on this worker.
        """
        def wait_copy(*_: Any) -> None:  # a step pre-hook returns None (arguments unchanged)
            self.ckpt_wait_copy()

        guards = self._ckpt_guards = self._ckpt_guards or []
        for optim in optimizers:
            guards.append(optim.register_step_pre_hook(wait_copy))

    def ckpt_wait_copy(self, timeout: float = 1800.0) -> float:
        """Wait for an overlapped save's host copy; returns the seconds this blocked."""
        saver = self._ckpt_saver
        return 0.0 if saver is None else saver.wait_copied(timeout)

    def ckpt_snapshot(self, save_id: str, step_dir: str, kind: str, coordinator: Any,
                      wait_timeout_s: float = 1800.0, defer_persist: bool = False,
                      overlap: bool = False) -> dict[str, Any]:
        """Stage this rank's state; the persist starts now, or with ``defer_persist`` on
        ``ckpt_start_persist``.
        ``coordinator``: where the persist reports; None for the one from ``ckpt_setup``.

        ``overlap``: on a worker with a guarded optimizer (:meth:`ckpt_guard`), return
        before the host copy, which then overlaps training up to the optimizer step.
        """
        target = SaveTarget(self._ckpt_coordinator if coordinator is None else coordinator,
                            save_id, step_dir)
        return self._snapshot(kind, target, wait_timeout_s, overlap, start=not defer_persist)

    def ckpt_snapshot_begun(self, begun: Any, kind: str, wait_timeout_s: float = 1800.0,
                            overlap: bool = False, begin_timeout_s: float = 1800.0
                            ) -> dict[str, Any]:
        """Stage this rank's state for the save ``coordinator.begin`` answered ``begun``,
        and start its persist as the last thing before answering.

        ``begun`` is that answer, or a one-item list holding the reference to it, not yet
        resolved: the host copy is then made while ``begin`` runs, and the answer is read
        (waiting up to ``begin_timeout_s``) once the copy is made.  A save this rank is
        not to write (the step was saved already, this role's weights are reused, or
        ``begin`` failed, which the driver raises) persists nothing, and the answer has
        ``"dropped"`` with the reason.

        The persist starts here, not on a call from the driver once every rank has
        answered: those calls cost the driver about 0.1 ms each after the answers, in
        the time a save blocks training (26 ms at 256 ranks).  Started after this rank's
        copy, its thread (niced; its hashing waits for this start) takes nothing from
        it; it does hold the GIL while the answer is sent, 1-2.5 ms more in the RL job
        between steps (per rank, in parallel), hidden when the save rides on a step
        (bench/README.md).  A rank whose peer fails this save persists into the ranks'
        first agreement, which fails at once with the peer's refusal.
        """
        reason = ""

        def named() -> tuple[str, str] | None:
            nonlocal reason
            answer = begun
            if isinstance(answer, list):
                try:
                    faults.check("worker.begin_answer", path=f"{self.ckpt_role}/{self.ckpt_rank}")
                    answer = rpc.get(answer[0], begin_timeout_s)
                except Exception as e:  # noqa: BLE001 - the driver gets the same error
                    reason = f"begin failed: {type(e).__name__}"
                    return None
            if "existing" in answer:
                reason = "saved already"
                return None
            if self.ckpt_role in answer["reused"]:
                reason = "reused"
                return None
            return answer["save_id"], answer["name"]

        out = self._snapshot(kind, SaveTarget(self._ckpt_coordinator, named=named),
                             wait_timeout_s, overlap, start=False)
        if out.get("dropped"):
            out["dropped"] = reason
        else:
            self._saver().pending.start()
        return out

    def _snapshot(self, kind: str, target: SaveTarget, wait_timeout_s: float, overlap: bool, *,
                  start: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        marks = {"received": time.time()}  # when each phase ended: the save's breakdown
        saver = self._saver()
        saver.wait_previous(wait_timeout_s)  # the host buffers are reused: never overwrite a
        marks["previous"] = time.time()      # copy that is still being written
        try:
            with torch.no_grad():
                state = self.ckpt_state_dict(kind)
            marks["state_dict"] = time.time()
            extra = None
            if kind == "full":
                extra = {"rng": capture_rng(), "state": self.ckpt_extra_state()}
            assets = self.ckpt_assets() if self.ckpt_rank == 0 else None
            marks["extra"] = time.time()
        except BaseException as e:  # the peers persisting this save must not wait for it
            saver.refuse(kind, e, target)
            raise
        overlap = overlap and bool(self._ckpt_guards)
        out = saver.snapshot(Snapshot(kind, state, extra, assets or {}), target,
                             wait_timeout_s=wait_timeout_s, start=start, overlap=overlap,
                             marks=marks)
        out["overlap"] = overlap
        out["copy_s"] = out["stall_s"]
        out["stall_s"] = time.perf_counter() - t0  # with building the state dict
        marks["answered"] = time.time()
        out["marks"] = marks
        return out

    def ckpt_refuse(self, save_id: str, name: str, kind: str, reason: str,
                    wait_timeout_s: float = 1800.0) -> None:
        """Fail save ``save_id`` (step directory ``name``) from this rank, which staged
        nothing for it: its snapshot never read ``begin``'s answer, which the driver did.

        The peers that staged it meet this rank's refusal in their first agreement and
        end at once, instead of waiting there for it until the process group's timeout.
        """
        saver = self._saver()
        saver.wait_previous(wait_timeout_s)
        saver.refuse(kind, CheckpointSaveError(f"{self.ckpt_role}/{self.ckpt_rank}: {reason}"),
                     SaveTarget(self._ckpt_coordinator, save_id, name))

    def ckpt_start_persist(self, save_id: str, if_staged: bool = False) -> None:
        """Start the persist of staged save ``save_id``; ``if_staged``: where this rank
        staged none (its snapshot failed or dropped the save), do nothing."""
        self._saver().start_persist(save_id, if_staged=if_staged)

    def ckpt_wait(self, timeout: float = 1800.0) -> list[dict[str, Any]]:
        """Wait for this worker's last persist; re-raise its error if it failed."""
        saver = self._saver()
        if saver.pending is None:
            return []
        return [f.to_dict() for f in saver.pending.wait(timeout)]

    def ckpt_on_committed(self, name: str, step: int) -> None:
        """Broadcast from the coordinator after a commit; subclasses may extend it."""
        self.ckpt_last_committed = (name, step)

    def ckpt_identity(self) -> str:
        """sha256 of this rank's tensors (light state): what "unchanged weights" means.

        The manager combines the ranks' identities of a frozen role; a checkpoint whose
        role has the same identity and world size is referenced instead of written again.
        """
        h = hashlib.sha256()
        for path, tensor in sorted(local_tensors(self.ckpt_state_dict("light")).items()):
            h.update(path.encode())
            h.update(str((tuple(tensor.shape), tensor.dtype)).encode())
            h.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def ckpt_status(self) -> dict[str, Any]:
        """The last commit this worker was told of, and whether a persist is running."""
        saver = self._ckpt_saver
        pending = None if saver is None else saver.pending
        return {"last_committed": getattr(self, "ckpt_last_committed", None),
                "persisting": pending is not None and not pending.done(),
                "copying": pending is not None and not pending.copied.is_set(),
                "last_copy_s": None if pending is None else pending.copy_s,
                "copy_wait_s": 0.0 if saver is None else saver.copy_wait_s}


def install_clean_exit() -> None:
    """Make this Ray actor's process end by ``os._exit`` once its own cleanups ran, never in
    Ray's C++ worker teardown, and end it when its raylet is gone (see
    ``raycheckpoint/_internal/exit.py``).  ``ckpt_setup`` does this; an actor calls it in
    its constructor to have it from the start.  Outside a Ray actor it does nothing."""
    process_exit.install()


def local_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """This rank's tensors of a (possibly DTensor) state dict, by path."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(local_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, DTensor):
        out[prefix] = obj.to_local()
    elif isinstance(obj, torch.Tensor):
        out[prefix] = obj
    return out
