"""One save round of the driver: ``begin``, the workers' snapshots, the persists' start.

:class:`SaveRound` is what :meth:`CheckpointManager.save_checkpoint
<raycheckpoint.manager.CheckpointManager.save_checkpoint>` runs at once, and what a save
requested with a training step (:meth:`CheckpointManager.step_save
<raycheckpoint.manager.CheckpointManager.step_save>`) runs in three parts:

1. :meth:`SaveRound.__init__` captures the trainer state and sends the coordinator's
   ``begin``; a save riding on a step asks it to hold the commit until :meth:`finish`
   hands over what only the step's end knows (its metrics, the triggers' state);
2. :meth:`SaveRound.send_snapshots` sends each trainable role's workers their snapshot
   (``ckpt_snapshot_begun``: they copy, then read ``begin``'s answer).  Sent while a
   step's training calls are queued on the workers, it runs right after them, before
   anything the driver sends once it has their answers;
3. :meth:`SaveRound.finish` reads ``begin``'s answer, snapshots the frozen roles whose
   weights are not reused (a save riding on a step sends those at step 2 already where
   ``begin`` has answered by then: they copy beside the step), waits for every
   snapshot (each rank starts its persist as it answers) and hands the coordinator's
   ``await_save`` to a :class:`~raycheckpoint.save_handle.SaveHandle`.

:func:`settle` waits for snapshots whose save ended before it was named (``begin``
failed, or reused an existing checkpoint); :func:`fail_staged` aborts a named save after
its snapshots, so that no rank waits for a peer that will never write.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from raycheckpoint._internal.breakdown import save_breakdown
from raycheckpoint._internal.rpc import get as _get
from raycheckpoint.errors import CheckpointSaveError
from raycheckpoint.policy.retention import RetentionPolicy
from raycheckpoint.save_handle import SaveHandle
from raycheckpoint.state import capture_rng, encode_loader_state

logger = logging.getLogger(__name__)


class SaveRound:
    """One save of a :class:`~raycheckpoint.manager.CheckpointManager` (see the module doc)."""

    def __init__(self, manager: Any, *, step: int, kind: str, tag: str | None,
                 metrics: dict[str, Any], replicate: bool, held: bool = False) -> None:
        m = self.manager = manager
        self.step, self.kind, self.held = step, kind, held
        self.t0 = time.perf_counter()
        self.marks = {"start": time.time()}  # when each of the driver's phases ended
        m._stepper.triggers.saved()  # save_every_minutes counts from any save
        trainer_state: dict[str, Any] = {
            "epoch": m.epoch, "config_fingerprint": m.fingerprint,
            "world_sizes": m.world_sizes, "saved_at": time.time(),
            # the job's retention rules, so `raycheckpoint gc` can apply them without the job
            "retention": RetentionPolicy.from_config(m.config).retention_rules(),
            "triggers": m._stepper.triggers.state_dict()}
        if kind == "full":
            trainer_state["rng"] = capture_rng()
            if m.dataloader is not None:
                trainer_state["dataloader"] = encode_loader_state(m.dataloader.state_dict())
        rollout_state = (encode_loader_state(m.rollout_state.state_dict(), "rollout state")
                         if kind == "full" and m.rollout_state is not None else None)
        expected = [(role, rank) for role, ws in m.groups.items() for rank in range(len(ws))]
        self.marks["trainer_state"] = time.time()
        self.rpc = m.config.rpc_timeout_s
        self.wait_s = m.config.save_wait_timeout_s
        self.begin_ref = m._coordinator.begin.remote(
            step=step, kind=kind, tag=tag, metrics=metrics, trainer_state=trainer_state,
            expected=expected, world_sizes=m.world_sizes, frozen=m._identities,
            replicate=replicate, held=held, rollout_state=rollout_state)
        self.marks["begin_sent"] = time.time()
        self.writers: list[tuple[str, Any]] = []
        self.snap_refs: list[Any] = []
        self.sent = self.frozen_sent = False
        self.beside: set[str] = set()  # writers whose snapshot ran beside the step

    def send_snapshots(self) -> None:
        """Each trainable role's workers snapshot once the calls sent to them before have
        run (a trainable role is never reused: they copy while ``begin`` runs, and read
        its answer, the reference in a list, unresolved, once copied)."""
        if self.sent:
            return
        m = self.manager
        self.sent = True
        self.marks["send_start"] = time.time()
        early = [(f"{role}/{rank}", w) for role, ws in m.groups.items()
                 if role not in m.frozen_roles for rank, w in enumerate(ws)]
        self.writers += early
        self.snap_refs += [w.ckpt_snapshot_begun.remote([self.begin_ref], self.kind, self.wait_s,
                                                        m.config.overlap_copy,
                                                        self.wait_s + self.rpc)
                           for _, w in early]
        if self.held and ray.wait([self.begin_ref], timeout=0)[0]:
            try:  # `begin` answered while the step ran: the frozen roles copy beside it too
                self.beside = set(self._send_frozen(ray.get(self.begin_ref, timeout=self.rpc)))
            except Exception:  # finish() reads the same answer and raises its error
                logger.debug("begin failed; finish() raises it", exc_info=True)
        self.marks["sent"] = time.time()

    def _send_frozen(self, begun: dict[str, Any]) -> list[str]:
        """The frozen roles' snapshots, where ``begun`` names a save that does not reuse
        their weights (sent once); returns who was sent one."""
        if self.frozen_sent or "existing" in begun:
            return []
        m = self.manager
        self.frozen_sent = True
        late = [(f"{role}/{rank}", w) for role in m.frozen_roles if role not in begun["reused"]
                for rank, w in enumerate(m.groups[role])]
        self.writers += late
        self.snap_refs += [w.ckpt_snapshot_begun.remote(begun, self.kind, self.wait_s,
                                                        m.config.overlap_copy)
                           for _, w in late]
        return [who for who, _ in late]

    def finish(self, late: dict[str, Any] | None = None) -> SaveHandle:
        """Complete the save (see the module doc); ``late``: what a held save commits with
        (``metrics``, ``trainer_state`` entries).  Returns once every worker has its copy;
        the handle of a save in flight is the manager's until observed."""
        m, wait_s, rpc = self.manager, self.wait_s, self.rpc
        self.send_snapshots()
        self.marks["finish"] = time.time()
        try:
            begun = _get(self.begin_ref, wait_s + rpc)
            self.marks["begun"] = time.time()
        except Exception as e:
            settle(self.snap_refs, wait_s + rpc)  # each drops its copy: nothing was named
            if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, PermissionError)):
                # storage failed (after its retries) before any worker wrote
                return m._saves.failed_before_start(self.step, self.kind, self.stall_s(), e)
            raise  # the root is gone or not ours to write: not a failure of this one save
        if "existing" in begun:
            settle(self.snap_refs, wait_s + rpc)
            e = begun["existing"]
            return SaveHandle(m._record, save_id=None, name=e["name"], step=e["step"],
                              kind=e["kind"], stall_s=self.stall_s(), worker_stall_s=0.0,
                              existing={**e, "existing": True})
        save_id, name = begun["save_id"], begun["name"]
        self._send_frozen(begun)  # once `begin` said whether their weights are reused
        writers = self.writers
        try:  # the workers report to the coordinator they were set up with
            snaps = _get(self.snap_refs, wait_s + rpc)
            self.marks["snapped"] = time.time()
        except BaseException as e:
            fail_staged(m._coordinator, save_id, name, self.kind, writers,
                        f"snapshot failed: {type(e).__name__}: {e}", wait_s)
            raise CheckpointSaveError(f"snapshot for {name} failed: {type(e).__name__}: {e}",
                                      failures={"snapshot": repr(e)}) from e
        # a rank that could not read `begin`'s answer (its wait for it failed, where the
        # driver's did not) staged nothing: it joins the save only to fail it
        lost = {who: s["dropped"] for (who, _), s in zip(writers, snaps, strict=True)
                if s.get("dropped")}
        if lost:
            reason = "; ".join(f"{who}: {why}" for who, why in lost.items())
            fail_staged(m._coordinator, save_id, name, self.kind, writers,
                        f"snapshot failed: {reason}", wait_s, refusing=lost)
            raise CheckpointSaveError(f"snapshot for {name} failed: {reason}", failures=lost)
        # each rank started its own persist as it answered (no call per rank from here);
        # a failed persist reports to the coordinator, which `await_save` then raises
        finished = m._coordinator.await_save.remote(save_id, late if self.held else None)
        # frozen roles sent their snapshot while the step ran (idle there, no step's call
        # behind it): beside the step, not in its blocked time
        answers = [(who, s) for (who, _), s in zip(writers, snaps, strict=True)]
        on_path = [(who, s) for who, s in answers if who not in self.beside]
        worker_stall = max((s["stall_s"] for _, s in on_path), default=0.0)
        stall_s = self.stall_s(worker_stall)
        self.marks["end"] = time.time()
        breakdown = save_breakdown(self.marks, on_path, queued=self.held)
        if self.beside and breakdown:
            breakdown["frozen_beside"] = round(1e3 * max(
                s["stall_s"] for who, s in answers if who in self.beside), 3)
        handle = SaveHandle(m._record, save_id=save_id, name=name, step=self.step,
                            kind=self.kind, stall_s=stall_s, worker_stall_s=worker_stall,
                            finished=finished, snapshots=snaps, breakdown=breakdown)
        m._saves.handles.append(handle)  # in flight until observed
        return handle

    def abandon(self, reason: str) -> None:
        """Abort this save, never to be completed: nothing of it commits, and no rank that
        staged it waits for the others."""
        m, wait_s = self.manager, self.wait_s
        try:
            begun = _get(self.begin_ref, wait_s + self.rpc)
        except Exception:  # noqa: BLE001 - nothing was named: nothing to abort
            begun = {}
        settle(self.snap_refs, wait_s + self.rpc)
        if "save_id" in begun:  # not a step saved already ("existing")
            fail_staged(m._coordinator, begun["save_id"], begun["name"], self.kind,
                        self.writers, reason, wait_s)

    def stall_s(self, worker_stall_s: float = 0.0) -> float:
        """The time this save blocked training: from its start, or for a save riding on a
        step, the driver's request (before the step's calls), then the longer of the
        slowest rank's snapshot (which ran on the worker between the step's calls and the
        driver's next ones) and the driver's wait for the answers (which runs beside it
        when the driver finishes the save right after the step), then the driver's finish
        after the answers.  The snapshot calls are sent while the step's calls run, not
        counted (``breakdown_ms``'s ``send_snapshots_beside``)."""
        if not self.held:
            return time.perf_counter() - self.t0
        marks, now = self.marks, time.time()
        answered = marks.get("snapped", now)  # not there: the save ended before the answers
        return (marks["begin_sent"] - marks["start"]) + max(
            worker_stall_s, answered - marks["finish"]) + (now - answered)


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

    The ranks that staged started their persist as they answered, and meet a failed
    rank's refusal in their first agreement: they end at once, not when the next save
    finds them waiting.  A rank whose staging failed refused by itself; one in
    ``refusing`` (``"role/rank"`` -> why) staged nothing and is told to refuse.
    """
    coordinator.abort.remote(save_id, reason)
    for who, w in writers:
        if refusing and who in refusing:
            w.ckpt_refuse.remote(save_id, name, kind, refusing[who], wait_timeout_s)
