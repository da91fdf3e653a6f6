"""SIGTERM in the RL driver's loop: whenever it lands, an emergency save commits.

The driver runs in-process on the session's Ray instance (one rank per role) and the
signal is sent to this process at a chosen point of a step, through the real handler
(``PreemptionFlag``).  The end-to-end path (``ray job stop`` on a submitted job) runs
with the long tests in test_rl_job.py.
"""

from __future__ import annotations

import os
import signal

import pytest

from raycheckpoint import Storage
from raycheckpoint.protocol.paths import COMMITTED, LATEST

pytestmark = pytest.mark.timeout(300)

STEPS = 6


def run_with_sigterm_in(method: str, at_call: int, root: str) -> tuple[int, dict[int, dict]]:
    """Run the driver; SIGTERM this process during the ``at_call``-th call of ``method``."""
    import ray

    from drivers.config import parse_overrides
    from drivers.main_ppo import Trainer
    from drivers.metrics import read_metrics

    opts = parse_overrides([f"trainer.default_local_dir={root}", f"trainer.total_training_steps={STEPS}",
                            "trainer.save_freq=-1", "trainer.n_gpus_per_node=1",
                            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4"])
    trainer = Trainer(opts)
    original = getattr(trainer, method)
    calls = []

    def hooked(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    setattr(trainer, method, hooked)
    previous = signal.getsignal(signal.SIGTERM)
    trainer.start()
    try:
        code = trainer.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        trainer.manager.close(120)
        for ws in trainer.groups.values():
            for w in ws:
                ray.kill(w)
    return code, read_metrics(f"{root}/metrics.jsonl")


# the window that once lost the save: after the step's save decision, before its record
@pytest.mark.parametrize("method, at_call", [("train_step", 2), ("collect_commits", 2)])
def test_sigterm_anywhere_in_a_step_commits_an_emergency_save(ray_session, tmp_path, method, at_call):
    root = str(tmp_path / "run")
    code, m = run_with_sigterm_in(method, at_call, root)
    assert code == 0
    last = max(m)
    assert last < STEPS, "the driver ran to the end instead of stopping"
    saves = [(s, e) for s, r in m.items() for e in r["ckpt_events"] if "preemption (SIGTERM)" in e]
    # the signal lands in step 2: its own save if it came before the decision, else step 3's
    assert [s for s, _ in saves] == [last] == [2 if method == "train_step" else 3], m
    name = f"step_{last:08d}"
    assert saves[0][1].startswith(f"save {name} full")
    st = Storage(root)
    assert st.exists(f"{name}/{COMMITTED}")
    assert st.read_bytes(LATEST).decode().strip() == name
