"""Crash-consistency matrix: a process dies (``os._exit``, as under SIGKILL) at each named
point of the save protocol, on local disk and on the S3 server.

Each case: a fresh 2-rank FSDP2 group trains and commits full checkpoints at steps 2, 3
and 4 (retention keeps 3), then dies at the armed point while saving step 5.  The "job"
restarts as a crashed job would: new worker processes, a new manager and coordinator on
the same root.  Then, for every point and storage:

* ``LATEST`` resolves to a checkpoint that verifies;
* every checkpoint committed before the crash that retention keeps still verifies;
* no uncommitted leftovers remain once the new coordinator has recovered (an aborted
  attempt's claim stays, a tombstone of its name);
* ``auto`` resumes, and training to step 6 ends bit for bit where a run without a crash
  ends.

The driver case runs a separate driver process (tests/crash_driver.py) on the same Ray
cluster and SIGKILLs it while its workers are writing step 5; its workers and
coordinator die with it.  The table (point x storage -> outcome) is printed at the end
of the pytest run.  The
reference run never had a checkpoint manager, so "exact" also shows that checkpointing
itself does not change training.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import ray

from raycheckpoint import Storage
from raycheckpoint import testing as faults
from raycheckpoint.admin import verify
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.paths import CLAIM
from raycheckpoint.protocol.refs import resolve
from tests.helpers import REPORTS, manager, train, weights_sha

pytestmark = [pytest.mark.crash, pytest.mark.slow, pytest.mark.timeout(300)]

# point -> (process that dies, fault point as armed in it)
POINTS = {
    "worker: during shard write": ("worker", "storage.write@actor/__1_"),
    "worker: after write, before report": ("worker", "worker.before_report@actor/1"),
    "coordinator: before manifest": ("coordinator", "coordinator.manifest"),
    "coordinator: while writing manifest": ("coordinator", "storage.write@manifest.msgpack"),
    "coordinator: between COMMITTED and LATEST": ("coordinator", "coordinator.after_marker"),
    "coordinator: during catalog write": ("coordinator", "storage.pointer@catalog.json"),
    "coordinator: during retention deletes": ("coordinator", "coordinator.retention_delete"),
    "driver: killed while the save persists": ("driver", ""),
}
# deaths after the save committed (during the clean-up that follows it)
AFTER_COMMIT = {"coordinator.retention_delete"}
RESULTS: dict[tuple[str, str], str] = {}
CONFIG = {"keep_last_n": 3, "commit_timeout_s": 20}


def _group():
    from workers import FSDPTrainWorker, create_worker_group

    return create_worker_group(FSDPTrainWorker, role="actor", world_size=2, timeout_s=120)


def _kill(group) -> None:
    for w in group:
        ray.kill(w)


@pytest.fixture(scope="module")
def reference(ray_session):
    """Weights after steps 1..6 of a run that never crashes."""
    group = _group()
    try:
        train(group, range(1, 7))
        return weights_sha(group)
    finally:
        _kill(group)


@pytest.fixture(scope="module", autouse=True)
def print_table():
    yield
    if not RESULTS:
        return
    width = max(len(p) for p, _ in RESULTS)
    lines = ["crash-consistency matrix (process killed at point -> after restart)",
             f"{'point':<{width}}  {'storage':<7}  outcome"]
    lines += [f"{p:<{width}}  {s:<7}  {o}" for (p, s), o in sorted(RESULTS.items())]
    REPORTS.append("\n".join(lines))


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.s3)])
@pytest.mark.parametrize("point", list(POINTS))
def test_crash_at_point_then_restart(point, backend, reference, local_root, request):
    root, options = (local_root, {}) if backend == "local" else request.getfixturevalue("s3_root")
    who, fault = POINTS[point]
    if who == "driver":
        _run_crashing_driver(root, options)
    else:
        _crash_in_this_driver(root, options, who, fault)
    _restart_and_check(point, backend, root, options, reference)


def _run_crashing_driver(root: str, options: dict) -> None:
    import subprocess
    import sys

    gcs = ray.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "tests.crash_driver", gcs, root, json.dumps(options),
                           json.dumps(CONFIG)], capture_output=True, text=True, timeout=240,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == -9, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "killing the driver" in proc.stdout
    # Ray ends the dead driver's actors on its own time; a worker still alive could write a
    # shard of step 5 after the restarted job collected it.  The restart under test is the
    # one that follows the death of the whole job, so wait for every one of its processes.
    line = next(x for x in proc.stdout.splitlines() if x.startswith("job processes:"))
    _wait_gone(json.loads(line.split(":", 1)[1]), timeout_s=60)
    st = Storage(root, options)
    assert not st.exists("step_00000005/COMMITTED")


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _running(p)]
    assert not alive, f"processes of the killed driver still running after {timeout_s}s: {alive}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # an exited child not yet reaped by its parent is gone for this purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False
    return True


def _crash_in_this_driver(root: str, options: dict, who: str, fault: str) -> None:
    group = _group()
    m = manager(root, {"actor": group}, options, config=CONFIG)
    try:
        for step in (1, 2, 3, 4):
            train(group, [step])
            if step >= 2:
                m.update(step=step)
                m.save_checkpoint().wait(120)
        if who == "worker":
            ray.get(group[1].arm_fault.remote(fault, "kill"), timeout=60)
        else:
            ray.get(m.coordinator.__ray_call__.remote(lambda self, f=fault: faults.arm(f, "kill")),
                    timeout=60)
        train(group, [5])
        m.update(step=5)
        if fault in AFTER_COMMIT:
            # the save committed before the clean-up that dies; its wait may still see the
            # death, depending on whether the answer left the coordinator first
            try:
                m.save_checkpoint().wait(120)
            except Exception:  # noqa: BLE001 - either outcome is right here
                pass
            assert Storage(root, options).exists("step_00000005/COMMITTED")
        else:
            with pytest.raises(Exception):  # noqa: B017 - the save fails with whatever the death causes
                m.save_checkpoint().wait(120)
    finally:
        try:
            m.close(30)
        except Exception:  # noqa: BLE001 - the crashed job's last save failed: expected here
            pass
        _kill(group)


def _restart_and_check(point: str, backend: str, root: str, options: dict, reference: str) -> None:
    """The job restarts: new processes, a new coordinator recovering from storage."""
    before = {"step_00000002", "step_00000003", "step_00000004"}  # committed before the crash
    group = _group()
    m = manager(root, {"actor": group}, options, config=CONFIG)
    try:
        st = Storage(root, options)
        committed, leftovers = catalog.scan(st)
        names = {c.name for c in committed}
        latest = resolve(st, "latest")[0]
        doc = verify(root, options)
        assert doc["ok"] and not doc["problems"], doc
        # an aborted attempt's files are collected; its claim stays (a tombstone: no later
        # save is handed a name a writer of the dead job may still write into)
        assert all(set(st.list_files(n)) == {f"{n}/{CLAIM}"} for n in leftovers), {
            n: sorted(st.list_files(n)) for n in leftovers}
        # nothing committed before the crash is lost, except what retention removes once
        # step 5 committed (the oldest of the three)
        lost = before - names
        assert lost <= {"step_00000002"} and (not lost or "step_00000005" in names), (before, names)
        loaded = m.load_checkpoint("auto")
        assert loaded.name == latest
        train(group, range(loaded.step + 1, 7))
        exact = weights_sha(group) == reference
        assert exact, f"resumed from {loaded.name}: weights differ from the run without a crash"
        RESULTS[(point, backend)] = (
            f"LATEST={latest} verifies; {len(names)} committed, all verify; "
            f"{'lost to retention: ' + ','.join(sorted(lost)) if lost else 'none lost'}; "
            f"leftovers collected; resumed from step {loaded.step}, exact")
    finally:
        m.close(60)
        _kill(group)
