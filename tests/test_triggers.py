"""Save triggers (DESIGN section 5), each on its own, with a controllable clock."""

from __future__ import annotations

import os
import signal

from raycheckpoint import CheckpointConfig
from raycheckpoint.policy.triggers import PreemptionFlag, SaveTriggers


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _triggers(**options):
    clock = Clock()
    return SaveTriggers(CheckpointConfig(save_dir="/x", save_on_train_end=False, **options),
                        clock=clock), clock


def test_step_intervals_light_and_full():
    t, _ = _triggers(save_interval=2, save_full_interval=6)
    kinds = {s: (d.kind if (d := t.check(s)) else None) for s in range(1, 13)}
    assert kinds == {1: None, 2: "light", 3: None, 4: "light", 5: None, 6: "full", 7: None,
                     8: "light", 9: None, 10: "light", 11: None, 12: "full"}


def test_time_based():
    t, clock = _triggers(save_every_minutes=10)
    assert t.check(1) is None
    clock.t = 599
    assert t.check(2) is None
    clock.t = 600
    d = t.check(3)
    assert d.kind == "full" and "10 minutes" in d.reasons[0]
    t.saved()
    clock.t = 900
    assert t.check(4) is None


def test_loss_drop_and_reward_gain():
    t, _ = _triggers(save_on_loss_drop=0.1, save_on_reward_gain=0.05)
    assert t.check(1, loss=2.0, reward=0.5) is None            # baselines
    assert t.check(2, loss=1.85, reward=0.52) is None          # -7.5%, +4%
    d = t.check(3, loss=1.7, reward=0.5)                        # -15% from 2.0
    assert d.kind == "full" and d.reasons == ["loss fell 2 -> 1.7"]
    assert t.check(4, loss=1.6, reward=0.5) is None            # -6% from the new baseline 1.7
    d = t.check(5, loss=1.6, reward=0.53)                       # +6% from 0.5
    assert d.reasons == ["reward rose 0.5 -> 0.53"]
    state = t.state_dict()
    t2, _ = _triggers(save_on_loss_drop=0.1, save_on_reward_gain=0.05)
    t2.load_state_dict(state)
    assert t2.check(6, loss=1.6, reward=0.53) is None


def test_train_end():
    t = SaveTriggers(CheckpointConfig(save_dir="/x"))
    assert t.check(7) is None
    assert t.check(8, is_last=True).reasons == ["train end"]


def test_preemption_flag_set_by_sigterm():
    old = signal.getsignal(signal.SIGTERM)
    try:
        flag = PreemptionFlag()
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.requested and flag.signum == signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, old)
