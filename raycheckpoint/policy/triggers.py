"""Save triggers: when the training loop should save, and what kind.

:class:`SaveTriggers` is asked once per step, after the step's metrics are known:

* ``save_full_interval``: a full checkpoint every N steps;
* ``save_interval``: a light checkpoint every N steps (a step that also gets a full
  one saves once, full);
* ``save_every_minutes``: a full checkpoint when that long has passed since the last
  save of any kind;
* ``save_on_loss_drop``: a full checkpoint when the loss fell by more than this
  fraction below the loss at the last such save (the first step sets the baseline);
* ``save_on_reward_gain``: likewise when the reward rose by more than this fraction of
  ``max(|baseline|, 1e-3)`` above the reward at the last such save;
* ``save_on_train_end``: a full checkpoint at the last step.

Manual saves (``manager.save_checkpoint(tag=...)`` from code, or ``request_save`` from
outside the job) and the preemption save are the driver's, see :class:`PreemptionFlag`.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SaveDecision:
    kind: str  # "full" | "light"
    reasons: list[str] = field(default_factory=list)


class SaveTriggers:
    def __init__(self, config: Any, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.last_save_time = clock()
        self.loss_baseline: float | None = None
        self.reward_baseline: float | None = None

    def check(self, step: int, *, loss: float | None = None, reward: float | None = None,
              is_last: bool = False, scheduled_only: bool = False) -> SaveDecision | None:
        """The save due at ``step``, if any.  ``scheduled_only``: only what the step's
        number and the clock decide (intervals, minutes, train end), before the step's
        metrics exist; the metric triggers and their baselines are left alone."""
        c = self.config
        full: list[str] = []
        light: list[str] = []
        if c.save_full_interval and step % c.save_full_interval == 0:
            full.append(f"every {c.save_full_interval} steps")
        if c.save_interval and step % c.save_interval == 0:
            light.append(f"every {c.save_interval} steps (light)")
        if c.save_every_minutes and self.clock() - self.last_save_time >= c.save_every_minutes * 60:
            full.append(f"{c.save_every_minutes} minutes since the last save")
        if scheduled_only:
            loss = reward = None
        if c.save_on_loss_drop is not None and loss is not None:
            if self.loss_baseline is None:
                self.loss_baseline = loss
            elif loss < self.loss_baseline * (1 - c.save_on_loss_drop):
                full.append(f"loss fell {self.loss_baseline:.4g} -> {loss:.4g}")
                self.loss_baseline = loss
        if c.save_on_reward_gain is not None and reward is not None:
            if self.reward_baseline is None:
                self.reward_baseline = reward
            elif reward - self.reward_baseline > c.save_on_reward_gain * max(
                    abs(self.reward_baseline), 1e-3):
                full.append(f"reward rose {self.reward_baseline:.4g} -> {reward:.4g}")
                self.reward_baseline = reward
        if is_last and c.save_on_train_end:
            full.append("train end")
        if full:
            return SaveDecision("full", full + light)
        if light:
            return SaveDecision("light", light)
        return None

    def saved(self) -> None:
        """Tell the triggers a save (of any kind, from any trigger) just happened."""
        self.last_save_time = self.clock()

    def state_dict(self) -> dict[str, Any]:
        return {"loss_baseline": self.loss_baseline, "reward_baseline": self.reward_baseline}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_baseline = state.get("loss_baseline")
        self.reward_baseline = state.get("reward_baseline")


class PreemptionFlag:
    """Set by SIGTERM (``ray job stop``, a preemption notice); the loop checks ``requested``.

    The handler only sets a flag: the step in progress finishes, then the driver makes
    an emergency full save, waits for it to commit and exits.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self._event = threading.Event()
        self.signum: int | None = None
        for s in signals:
            signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()
