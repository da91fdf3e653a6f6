"""A driver that joins a running Ray cluster, trains, and dies while a save persists.

    python -m tests.crash_driver GCS_ADDRESS ROOT OPTIONS_JSON CONFIG_JSON

Used by tests/test_crash_matrix.py for the "driver killed mid-save" row: full saves at
steps 2, 3 and 4, then at step 5 the save returns after the host copy and the driver
SIGKILLs itself while the workers are still writing.  Its workers and coordinator die
with it, as when a real driver is killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import ray


def main() -> None:
    gcs, root, options, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    ray.init(address=gcs, log_to_driver=False, configure_logging=False)
    from tests.helpers import manager, train
    from workers import FSDPTrainWorker, create_worker_group

    group = create_worker_group(FSDPTrainWorker, role="actor", world_size=2, timeout_s=120)
    m = manager(root, {"actor": group}, options, config=config)
    for step in (1, 2, 3, 4):
        train(group, [step])
        if step >= 2:
            m.update(step=step)
            m.save_checkpoint().wait(120)
    # make the next persist slow, so the kill lands while every rank is writing
    ray.get([w.arm_fault.remote("storage.write@actor/__", "hang:5") for w in group], timeout=60)
    train(group, [5])
    m.update(step=5)
    pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in [*group, m.coordinator]],
                   timeout=60)
    print("job processes:", json.dumps(pids), flush=True)
    m.save_checkpoint()  # returns after the host copy; the workers are writing now
    print("saving step 5; killing the driver", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
