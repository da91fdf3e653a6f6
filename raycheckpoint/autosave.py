"""What :meth:`CheckpointManager.step <raycheckpoint.manager.CheckpointManager.step>` does
once per training step, so a training loop holds no save logic of its own.

In this order, at most one save of each kind per step:

1. saves requested from outside the job (``python -m raycheckpoint.request``, each
   with its kind and tag);
2. the configured triggers (:class:`~raycheckpoint.policy.triggers.SaveTriggers`:
   light and full step intervals, minutes since the last save, a loss drop or reward
   gain, the train end), unless a save of that kind (or a full one) was just made;
3. preemption: once SIGTERM has arrived (``ray job stop``, a preemption notice) and
   ``save_on_preemption`` is set, a full save (unless one was just made); every save in
   flight is then waited for, and ``manager.should_stop`` turns True: the loop ends.

A save due by the step's number or the clock (an interval, minutes, the train end) can
ride on the step instead (:meth:`StepSaver.begin_step`, the manager's ``step_save``):
begun before the step's training calls end, each worker snapshots right after its
calls, and ``step()`` completes it with the step's metrics.  A trigger on the metrics
(loss, reward) is known only after the step; it saves in ``step()`` as above.

The SIGTERM handler is installed by the first ``step()`` call, or earlier by
``manager.watch_preemption()`` (not when the manager is built: a script that never calls
``step()`` keeps its own SIGTERM behaviour).  The
triggers' state (loss and reward baselines) is saved in every checkpoint's trainer
state and restored by a load.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from raycheckpoint._internal.save_round import SaveRound
from raycheckpoint.policy.triggers import PreemptionFlag, SaveTriggers
from raycheckpoint.save_handle import SaveHandle

logger = logging.getLogger(__name__)


class StepSave:
    """A save of one step, begun with the step (``CheckpointManager.step_save``).

    ``snapshot()`` sends the workers their snapshots, queued behind the calls already
    sent to them: call it right after the step's last training calls.  Not called, the
    snapshots are sent when ``CheckpointManager.step`` completes the save.
    """

    def __init__(self, round_: SaveRound, reason: str, replicate: bool) -> None:
        self._round, self.reason, self.replicate = round_, reason, replicate
        self.step, self.kind = round_.step, round_.kind

    def snapshot(self) -> None:
        self._round.send_snapshots()


class StepSaver:
    """The per-step save policy of one manager (see the module doc)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.config = manager.config
        self.triggers = SaveTriggers(self.config)
        self.preemption: PreemptionFlag | None = None
        self.stop_requested = False
        self.saves: list[SaveHandle] = []  # the last step's saves
        self.riding: StepSave | None = None  # the save begun with the step in progress

    def arm(self) -> None:
        if self.preemption is not None or not self.config.save_on_preemption:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("save_on_preemption: step() runs outside the main thread, where no "
                           "signal handler can be installed; SIGTERM will not save")
            self.config = self.config.replace(save_on_preemption=False)
            return
        self.preemption = PreemptionFlag()

    def _save(self, kind: str, tag: str | None, reason: str, *,
              replicate: bool = False) -> SaveHandle:
        handle = self.manager.save_checkpoint(tag=tag, kind=kind, replicate=replicate)
        handle.tag, handle.reason = tag, reason
        self.saves.append(handle)
        logger.info("save %s (%s%s): %s", handle.name, kind, f", tag {tag}" if tag else "", reason)
        return handle

    def begin_step(self, step: int, *, epoch: int | None, is_last: bool) -> StepSave | None:
        """The save due at ``step`` by its number or the clock, begun now (module doc)."""
        m = self.manager
        if self.riding is not None:
            raise RuntimeError(f"step_save({step}): the save begun with step "
                               f"{self.riding.step} was not completed by step()")
        m.update(step=step, epoch=epoch)
        self.arm()
        decision = self.triggers.check(step, is_last=is_last, scheduled_only=True)
        if decision is None:
            return None
        m._saves.poll()
        # the train-end save goes to a tiered job's durable tier whatever the interval
        self.riding = StepSave(SaveRound(m, step=step, kind=decision.kind, tag=None,
                                         metrics={}, replicate=is_last, held=True),
                               "; ".join(decision.reasons), is_last)
        return self.riding

    def _finish_riding(self, step: int, metrics: dict[str, Any]) -> None:
        riding, self.riding = self.riding, None
        if riding.step != step:
            reason = (f"step({step}) after step_save({riding.step}): a save begun with a step "
                      "is completed by that step's step() call")
            riding._round.abandon(reason)
            raise RuntimeError(reason)
        handle = riding._round.finish({"metrics": dict(metrics),
                                       "trainer_state": {"triggers": self.triggers.state_dict()}})
        handle.reason = riding.reason
        self.saves.append(handle)
        logger.info("save %s (%s, with the step): %s", handle.name, riding.kind, riding.reason)

    def step(self, step: int, *, epoch: int | None, metrics: dict[str, Any] | None,
             is_last: bool) -> SaveHandle | None:
        m = self.manager
        m.update(step=step, epoch=epoch, metrics=metrics)
        self.arm()
        self.saves = []
        values = metrics or {}
        # the triggers see every step's metrics, a save riding on it or not
        decision = self.triggers.check(step, loss=_number(values.get("loss")),
                                       reward=_number(values.get("reward")), is_last=is_last)
        if self.riding is not None:
            self._finish_riding(step, dict(values))
        for req in m.poll_requests():
            self._save(req["kind"], req["tag"], "requested from outside the job")
        saved = {h.kind for h in self.saves}
        if decision is not None and decision.kind not in saved and "full" not in saved:
            # a tiered job copies the train-end save to the durable tier whatever the interval
            self._save(decision.kind, None, "; ".join(decision.reasons), replicate=is_last)
            saved.add(decision.kind)
        # read once: a signal that lands later is acted on at the next step, never dropped
        if self.preemption is not None and self.preemption.requested and not self.stop_requested:
            self.stop_requested = True
            if "full" not in saved:
                self._save("full", None, f"preemption ({_signal_name(self.preemption.signum)})",
                           replicate=True)
            m.wait_for_saves(self.config.save_wait_timeout_s + self.config.rpc_timeout_s)
        full = [h for h in self.saves if h.kind == "full"]
        return (full or self.saves or [None])[-1]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _signal_name(signum: int | None) -> str:
    try:
        return signal.Signals(signum).name
    except (TypeError, ValueError):
        return f"signal {signum}"
