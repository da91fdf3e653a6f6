"""A writer of a dead job can never change a checkpoint another job commits.

Job A's rank 0 is paused in the middle of writing a shard of step 4 (a fault point that
sleeps inside the real writer), then job A dies: its coordinator is killed and its
lease let go, while that worker -- the zombie -- lives on.  Job B takes the root over,
resumes from step 2 and commits its own step 4.  Then the zombie wakes and finishes its
write.  On S3 the last PUT wins: had job B been handed the directory job A was writing,
the zombie's bytes would replace job B's shard under a committed manifest.  Every save
writes under a directory it claimed for itself, so job B's checkpoint still verifies.
"""

from __future__ import annotations

import time

import pytest
import ray

from raycheckpoint import Storage
from raycheckpoint.protocol.checkpoint import verify_checkpoint
from tests.helpers import arm, disarm, manager, train

# ~45 s, most of it the zombie's sleep: the default suite keeps within its 15 minutes on a 2-core machine;
# .ci/run runs the long tests too (and the RGW leg: it is an S3 test)
pytestmark = [pytest.mark.s3, pytest.mark.long, pytest.mark.timeout(300)]

ZOMBIE_S = 35  # how long job A's rank 0 sleeps inside its write


def test_a_zombie_writer_cannot_change_a_checkpoint_committed_after_it(group2, group4, s3_root):
    root, options = s3_root
    a = manager(root, {"actor": group2}, options)
    dead = False
    try:
        train(group2, [1])
        a.update(step=2)
        a.save_checkpoint().wait(120)
        train(group2, [2])
        arm(group2, "storage.write@actor/__0_", f"hang:{ZOMBIE_S}", ranks=[0])
        a.update(step=4)
        a.save_checkpoint()  # rank 0 is now inside its write of a step 4 shard
        t_zombie = time.monotonic()
        # job A dies: its coordinator gone, its lease no longer renewed; its workers live
        ray.kill(a.coordinator)
        a.roots.release()
        dead = True
    finally:
        if not dead:
            a.close(60)

    b = manager(root, {"actor": group4}, options, config={"allow_reshard": True})
    try:
        assert b.load_checkpoint("auto").name == "step_00000002"
        train(group4, [3])
        b.update(step=4)
        committed = b.save_checkpoint().wait(120)["name"]
        b.wait_for_cleanup(60)
        assert time.monotonic() - t_zombie < ZOMBIE_S, "job B was too slow: the zombie woke first"
        # the zombie wakes, finishes its write and reports to a coordinator that is gone
        time.sleep(max(0.0, ZOMBIE_S - (time.monotonic() - t_zombie)))
        st = Storage(root, options)
        deadline = time.monotonic() + 60
        while not st.exists("step_00000004/actor/__0_0.distcp"):  # where job A was writing
            assert time.monotonic() < deadline, "the zombie never finished its write"
            time.sleep(1)
        assert verify_checkpoint(st, committed)["name"] == committed
        assert b.load_checkpoint("auto").name == committed
    finally:
        disarm(group2)
        b.close(60)
