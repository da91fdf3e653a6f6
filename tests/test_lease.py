"""Job isolation: the LEASE of a checkpoint root, on local disk and on the S3 server."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from raycheckpoint import CheckpointSaveError, LeaseHeldError, LeaseLostError, Storage
from raycheckpoint.protocol.lease import Lease, LeaseInfo, boot_id, pid_namespace, read_lease
from raycheckpoint.protocol.paths import COMMITTED, LATEST, LEASE
from tests.helpers import REPORTS, manager, train

pytestmark = pytest.mark.timeout(300)

BACKENDS = ["local", pytest.param("s3", marks=pytest.mark.s3)]


@pytest.fixture
def storage(request, local_root):
    if request.param == "local":
        return Storage(local_root)
    uri, options = request.getfixturevalue("s3_root")
    return Storage(uri, options)


def plant(storage: Storage, **fields) -> LeaseInfo:
    """A lease written by some other job (as it would be on another machine)."""
    now = time.time()
    info = LeaseInfo(**{"job_id": "0123456789abcdef", "job_name": "elsewhere", "host": "other-host",
                        "pid": 4242, "started_at": now, "heartbeat_at": now, "ttl_s": 30.0,
                        **fields})
    storage.write_pointer(LEASE, info.to_bytes())
    return info


def here(**fields) -> dict:
    """This process's host, boot and PID namespace: a pid in a lease with them is one of
    this namespace's pids."""
    return {"host": socket.gethostname(), "boot_id": boot_id(), "pid_ns": pid_namespace(),
            **fields}


def gone_pid() -> int:
    """A pid no process of this namespace has (a process that ran and was reaped)."""
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


@pytest.mark.parametrize("storage", BACKENDS, indirect=True)
def test_a_second_job_is_refused_naming_the_holder(storage):
    a = Lease(storage, job_name="job-a", ttl_s=30).acquire()
    try:
        with pytest.raises(LeaseHeldError) as e:
            Lease(storage, job_name="job-b", ttl_s=30, wait_s=0).acquire()
        assert "job 'job-a'" in str(e.value) and socket.gethostname() in str(e.value)
        assert f"pid {a.info.pid}" in str(e.value) and e.value.holder == "job-a"
        first = read_lease(storage).heartbeat_at
        a.heartbeat()
        assert read_lease(storage).heartbeat_at >= first
    finally:
        a.release()
    assert read_lease(storage) is None  # released: the next job gets it at once
    b = Lease(storage, job_name="job-b", wait_s=0).acquire()
    assert read_lease(storage).job_id == b.job_id and b.took_over is None
    b.release()


@pytest.mark.parametrize("storage", BACKENDS, indirect=True)
def test_jobs_racing_for_a_root_one_wins_the_others_are_refused_at_once(storage):
    """Four jobs start at the same instant: one conditional create wins, each loser gets
    LeaseHeldError naming the winner within a second (not an I/O error after retries)."""
    import threading

    spec = storage.spec
    start = threading.Barrier(4, timeout=30)
    outcome: dict[str, object] = {}

    def race(name: str) -> None:
        mine = spec.open()
        start.wait()
        t0 = time.monotonic()
        try:
            outcome[name] = Lease(mine, job_name=name, ttl_s=30, wait_s=0).acquire()
        except Exception as e:  # noqa: BLE001 - the outcome is what is tested
            outcome[name] = e
        outcome[name + ".s"] = time.monotonic() - t0

    threads = [threading.Thread(target=race, args=(f"job-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [v for k, v in outcome.items() if isinstance(v, Lease)]
    losers = [v for k, v in outcome.items() if not k.endswith(".s") and not isinstance(v, Lease)]
    try:
        assert len(winners) == 1 and len(losers) == 3, outcome
        assert all(isinstance(e, LeaseHeldError) for e in losers), losers
        assert all(e.holder == winners[0].info.job_name for e in losers)
        assert max(v for k, v in outcome.items() if k.endswith(".s")) < 5, outcome
        REPORTS.append(f"lease race on {storage.protocol}: 1 of 4 won, 3 refused with "
                       f"LeaseHeldError in ≤{max(v for k, v in outcome.items() if k.endswith('.s')):.2f}s")
    finally:
        for w in winners:
            w.release()


@pytest.mark.parametrize("storage", BACKENDS, indirect=True)
def test_a_stale_lease_is_taken_after_its_ttl(storage):
    plant(storage, job_name="crashed", ttl_s=1.5)  # no more heartbeats from it
    t0 = time.monotonic()
    b = Lease(storage, job_name="restarted", ttl_s=30, wait_s=10).acquire()
    try:
        assert 1.0 <= time.monotonic() - t0 < 8
        assert b.took_over.job_name == "crashed" and read_lease(storage).job_name == "restarted"
    finally:
        b.release()


def test_a_dead_holder_on_this_host_is_replaced_at_once(local_root):
    storage = Storage(local_root)
    assert boot_id() and pid_namespace().startswith("pid:[")
    plant(storage, job_name="killed", **here(pid=gone_pid()), ttl_s=300)
    b = Lease(storage, job_name="restarted", wait_s=0).acquire()
    assert b.took_over.job_name == "killed"
    assert (b.info.boot_id, b.info.pid_ns) == (boot_id(), pid_namespace())
    b.release()
    # a live holder on this host is respected
    plant(storage, job_name="alive", **here(pid=os.getpid()), ttl_s=300)
    with pytest.raises(LeaseHeldError, match="alive"):
        Lease(storage, job_name="other", wait_s=0).acquire()


@pytest.mark.parametrize("elsewhere", [
    {"pid_ns": "pid:[1]"},  # another container / PID namespace on a host of the same name
    {"boot_id": "00000000-0000-0000-0000-000000000000"},  # before a reboot
    {"boot_id": "", "pid_ns": ""},  # not known
])
def test_a_holder_whose_pid_is_counted_elsewhere_is_waited_for_until_stale(local_root, elsewhere):
    """The same host name and a pid nobody has here: the holder may be alive where its pid
    means another process, so the lease is taken only once stale."""
    storage = Storage(local_root)
    plant(storage, job_name="contained", **{**here(pid=gone_pid()), **elsewhere}, ttl_s=2.0)
    with pytest.raises(LeaseHeldError, match="contained"):
        Lease(storage, job_name="restarted", wait_s=0).acquire()
    t0 = time.monotonic()
    b = Lease(storage, job_name="restarted", wait_s=10).acquire()
    assert b.took_over.job_name == "contained" and 1.0 <= time.monotonic() - t0 < 8
    b.release()


def test_a_lease_of_an_older_release_is_waited_for_until_stale(local_root):
    """A LEASE without boot id and PID namespace (written by an older release) is read as
    it is, and its holder, on this host with a pid nobody has here, is not taken over
    before it is stale."""
    storage = Storage(local_root)
    now = time.time()
    old = {"job_id": "0123456789abcdef", "job_name": "older", "host": socket.gethostname(),
           "pid": gone_pid(), "started_at": now, "heartbeat_at": now, "ttl_s": 2.0}
    storage.write_pointer(LEASE, json.dumps(old).encode())
    info = read_lease(storage)
    assert (info.job_name, info.boot_id, info.pid_ns) == ("older", "", "")
    with pytest.raises(LeaseHeldError, match="older"):
        Lease(storage, job_name="restarted", wait_s=0).acquire()
    b = Lease(storage, job_name="restarted", wait_s=10).acquire()
    assert b.took_over.job_name == "older"
    b.release()


HOLDER = textwrap.dedent("""
    import sys
    from raycheckpoint.protocol.lease import Lease
    from raycheckpoint.storage import Storage
    lease = Lease(Storage(sys.argv[1]), job_name="contained", ttl_s=float(sys.argv[2])).acquire()
    print("held", lease.info.pid, flush=True)
    sys.stdin.read()  # holds (heartbeating) until killed
""")


def test_a_live_holder_in_another_pid_namespace_is_not_taken_over(local_root):
    """A real job in its own PID namespace (``unshare --pid``) on this host: its pid is
    one no process has here, yet it is alive.  It is refused while it heartbeats, and
    taken over only once stale after it was killed."""
    if subprocess.run(["unshare", "--pid", "--fork", "--map-root-user", "true"],
                      capture_output=True, timeout=30).returncode != 0:
        pytest.skip("this machine allows no PID namespace of our own (unshare --pid)")
    # its pid there: one that no process has here (the namespace starts counting after it)
    pid = next(p for p in range(20000, 300, -1) if not os.path.exists(f"/proc/{p}"))
    ttl = 3.0
    holder = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--map-root-user", "--kill-child", "sh", "-c",
         f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid 2>/dev/null; "$0" -c "$1" "$2" "$3"; true',
         sys.executable, HOLDER, local_root, str(ttl)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    storage = Storage(local_root)
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 60)
        line = holder.stdout.readline() if ready else ""
        assert line.startswith("held"), line
        info = read_lease(storage)
        assert info.job_name == "contained" and info.host == socket.gethostname()
        assert info.boot_id == boot_id() and info.pid_ns != pid_namespace()
        if os.path.exists(f"/proc/{info.pid}"):
            pytest.skip(f"the holder's pid {info.pid} is also one of this namespace's")
        with pytest.raises(LeaseHeldError, match="contained"):
            Lease(storage, job_name="outside", wait_s=0).acquire()
        with pytest.raises(LeaseHeldError, match="contained"):  # alive: it never goes stale
            Lease(storage, job_name="outside", wait_s=ttl + 1).acquire()
    finally:
        holder.kill()  # and with it (--kill-child) the namespace and the holder
        holder.wait(30)
    t0 = time.monotonic()
    b = Lease(storage, job_name="outside", wait_s=ttl + 10).acquire()
    assert b.took_over.job_name == "contained" and time.monotonic() - t0 >= 1.0
    b.release()


@pytest.mark.parametrize("storage", BACKENDS, indirect=True)
def test_explicit_takeover_and_the_old_holder_learns_it(storage):
    a = Lease(storage, job_name="job-a", ttl_s=0.9).acquire()  # heartbeat every 0.3 s
    b = Lease(storage, job_name="job-b", takeover=True, wait_s=0).acquire()
    try:
        assert b.took_over.job_name == "job-a"
        with pytest.raises(LeaseLostError, match="job 'job-b'"):
            a.check()
        time.sleep(1.0)  # a's heartbeat thread stopped at its first beat after the takeover
        assert isinstance(a.lost, LeaseLostError) and read_lease(storage).job_id == b.job_id
        a.release()  # must not remove b's lease
        assert read_lease(storage).job_id == b.job_id
    finally:
        b.release()


def test_an_unreadable_lease_counts_as_stale(local_root):
    storage = Storage(local_root)
    storage.write_pointer(LEASE, b"{not json")
    b = Lease(storage, job_name="fresh", wait_s=0).acquire()
    assert json.loads(storage.read_bytes(LEASE))["job_name"] == "fresh"
    b.release()


def test_manager_refuses_a_held_root_and_a_takeover_stops_the_old_job(group2, local_root):
    storage = Storage(local_root)
    other = Lease(storage, job_name="other-job").acquire()
    with pytest.raises(LeaseHeldError, match="other-job"):
        manager(local_root, {"actor": group2}, config={"lease_wait_s": 0})
    assert read_lease(storage).job_id == other.job_id  # the refused job wrote nothing
    assert storage.list_dir("") == [LEASE]
    other.release()

    m = manager(local_root, {"actor": group2}, config={"job_name": "trainer", "lease_wait_s": 0})
    try:
        assert read_lease(storage).job_name == "trainer"
        train(group2, [1])
        m.update(step=1)
        m.save_checkpoint().wait(120)
        intruder = Lease(storage, job_name="intruder", takeover=True, wait_s=0).acquire()
        train(group2, [2])
        m.update(step=2)
        # refused at its commit (or wherever the job next checks its lease), naming the
        # new holder
        with pytest.raises((LeaseLostError, CheckpointSaveError), match="intruder"):
            m.save_checkpoint().wait(120)
        assert not storage.exists(f"step_00000002/{COMMITTED}")
        assert storage.read_bytes(LATEST).decode().strip() == "step_00000001"
        intruder.release()
    finally:
        m.close(120)


def test_jobs_on_sibling_roots_never_touch_each_other(group2, group3, tmp_path):
    ra, rb = str(tmp_path / "runs" / "a"), str(tmp_path / "runs" / "b")
    ma = manager(ra, {"actor": group2}, config={"job_name": "a", "keep_last_n": 1})
    mb = manager(rb, {"actor": group3}, config={"job_name": "b", "keep_last_n": 2})
    try:
        for step in (1, 2, 3):
            train(group2, [step])
            train(group3, [step])
            ma.update(step=step, metrics={"reward": step})
            mb.update(step=10 + step, metrics={"reward": -step})
            ha = ma.save_checkpoint(tag="a-first" if step == 1 else None)
            hb = mb.save_checkpoint(tag="b-first" if step == 1 else None)
            ha.wait(120)
            hb.wait(120)
        ca, cb = ma.catalog(), mb.catalog()
    finally:
        ma.close(120)
        mb.close(120)
    assert [c["name"] for c in ca["checkpoints"]] == ["step_00000001", "step_00000003"]
    assert [c["name"] for c in cb["checkpoints"]] == ["step_00000011", "step_00000012",
                                                      "step_00000013"]  # 11: tagged
    assert ca["tags"] == {"a-first": "step_00000001"} and cb["tags"] == {"b-first": "step_00000011"}
    sa, sb = Storage(ra), Storage(rb)
    assert sa.read_bytes(LATEST).decode().strip() == "step_00000003"
    assert sb.read_bytes(LATEST).decode().strip() == "step_00000013"
    assert not any(n.startswith("step_0000001") for n in sa.list_dir(""))
    assert not any(n in ("step_00000001", "step_00000002", "step_00000003") for n in sb.list_dir(""))
    assert read_lease(sa) is None and read_lease(sb) is None  # both released on close
